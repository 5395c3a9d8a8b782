"""A scan that keeps one run in memory at a time (issue 27, part 1): discovery hands each run folder on as it
finishes it, the parts together are exactly the root judged whole, the command's outputs are byte for byte those
of the whole report, ``--format jsonl`` streams, and a run's facts are gone once it is judged."""

from __future__ import annotations

import dataclasses
import gc
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckptdoctor.api import scan_roots
from ckptdoctor.cli import main
from ckptdoctor.discover import discover
from ckptdoctor.findings import Finding, finding_json
from ckptdoctor.model import FileFacts, Tree
from ckptdoctor.render.report import RunPieces, render_json, render_text
from ckptdoctor.roots import Roots
from ckptdoctor.rules import Selection
from ckptdoctor.scanner import Part, checked_selection, merged, part_findings, scan, scan_root
from ckptdoctor.settings.selection import Options
from tests.helpers.builders import make_checkpoint, make_run
from tests.helpers.paths import TESTS

HERE = TESTS
FIXTURES = HERE.parent / "fixtures"
DATA = HERE / "data"  # real MindNLP and TensorFlow/Keras samples


def _fleet(root: Path) -> Path:
    """A folder of teams and runs: runs side by side, a team folder of runs with its own settings file, a run
    with a final model beside its checkpoints, a checkpoint holding a nested folder, loose logs, the real
    TensorFlow and MindNLP samples, and a damaged save."""
    make_run(root / "team-a" / "run-1", (2, 4))
    make_run(root / "team-a" / "run-2", (2,))
    (root / "team-a" / ".ckptdoctor.toml").write_text('ignore = ["CKD401"]\n')
    make_run(root / "run-b", (2, 4, 6))
    make_checkpoint(root / "run-b", 8)  # save_model's final files at the run's top level
    (root / "run-b" / "checkpoint-4" / "extra").mkdir()
    make_run(root / "run-b" / "checkpoint-4" / "extra", (1,))  # inside a checkpoint: taken with it, not apart
    (root / "run-b" / "checkpoint-6" / "trainer_state.json").unlink()  # an interrupted save
    (root / "logs").mkdir()
    (root / "logs" / "train.log").write_text("step 1\n")
    shutil.copytree(DATA / "tf", root / "tf")
    shutil.copytree(DATA / "mindnlp-run", root / "zz-mindnlp")
    for p in root.rglob("*"):
        p.chmod(0o644 if p.is_file() else 0o755)
    return root


def _roots(tmp_path: Path) -> list[Path]:
    return [FIXTURES, DATA, _fleet(tmp_path / "fleet")]


def _parts(root: Path, jobs: int = 1) -> tuple[list[Tree], Tree]:
    parts: list[Tree] = []
    rest = discover(str(root), jobs=jobs, on_part=lambda tree, above: parts.append(tree))
    return parts, rest


@pytest.mark.parametrize("jobs", [1, 4])
def test_parts_together_are_the_root_discovered_whole(tmp_path: Path, jobs: int) -> None:
    for root in _roots(tmp_path):
        parts, rest = _parts(root, jobs)
        assert len(parts) > 2
        assert merged([*parts, rest]) == discover(str(root), jobs=jobs), root
        # each part holds whole runs: no run path is split between parts
        paths = [r.path for t in [*parts, rest] for r in t.runs]
        assert len(paths) == len(set(paths))


def test_nothing_inside_a_checkpoint_is_handed_on_apart(tmp_path: Path) -> None:
    parts, _ = _parts(_fleet(tmp_path / "fleet"))
    assert all(not r.path.startswith("run-b/checkpoint-4") for t in parts for r in t.runs)
    run_b = next(r for t in parts for r in t.runs if r.path == "run-b")
    ck4 = next(ck for ck in run_b.checkpoints if ck.path == "run-b/checkpoint-4")
    assert any(f.path.startswith("run-b/checkpoint-4/extra/checkpoint-1/") for f in ck4.files)


def test_tf_and_keras_runs_are_kept_with_jobs(tmp_path: Path) -> None:
    """With --jobs > 1 a TensorFlow or Keras folder (no checkpoint-N around it) was judged before its pooled reads
    finished, so it was no run: `scan --jobs 4` of the real samples listed no run."""
    one = discover(str(DATA / "tf"), jobs=1)
    assert {"tf-trainer", "tf-trainer/checkpoint", "keras-weights"} <= {r.path for r in one.runs}
    for jobs in (2, 4, 8):
        assert discover(str(DATA / "tf"), jobs=jobs) == one
    result = CliRunner().invoke(main, ["scan", "--jobs", "4", "--format", "json", "--no-config", str(DATA / "tf")])
    assert result.exit_code == 0
    assert {r["path"] for r in json.loads(result.output)["runs"]} == {r.path for r in one.runs}


def _whole_findings(root: Path, selection: Selection) -> tuple[Tree, list[Finding]]:
    """The root judged in one part, as scans did before parts."""
    kept: list[Part] = []
    scan_root(str(root), False, selection, kept.append, split=False)
    (part,) = kept
    return part.tree, part_findings(part, selection)


@pytest.mark.parametrize(
    "selection", [Selection(), Selection(ignore=("CKD002",)), Selection(select=("CKD1",))], ids=str
)
def test_parts_give_the_findings_of_the_root_judged_whole(tmp_path: Path, selection: Selection) -> None:
    sel = checked_selection(selection)
    for root in [*_roots(tmp_path), tmp_path / "fleet" / "logs"]:
        tree, findings = _whole_findings(root, sel)
        report = scan(str(root), selection=selection)
        assert report.trees == (tree,)
        assert list(report.findings) == findings, root


def test_a_root_of_runs_without_a_checkpoint_is_still_ckd002(tmp_path: Path) -> None:
    """CKD002 is judged on the whole root, on its last part: runs whose checkpoint-N folders are links that are
    not followed hold no checkpoint, and their files count in its message."""
    (tmp_path / "elsewhere").mkdir()
    for name in ("a", "b"):
        run = tmp_path / "root" / name
        run.mkdir(parents=True)
        (run / "notes.txt").write_text("x")
        (run / "checkpoint-1").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    parts, _ = _parts(tmp_path / "root")
    assert len(parts) == 2
    report = scan(str(tmp_path / "root"))
    (ckd002,) = [f for f in report.findings if f.rule == "CKD002"]
    assert "none of its 2 files" in ckd002.message


def _cli(*args: str) -> Any:
    return CliRunner().invoke(main, ["scan", *args])


def _timeless(text: str) -> str:
    text = re.sub(r"\([0-9.]+ s\)", "(T s)", text)
    return re.sub(r'"seconds": [0-9.e-]+', '"seconds": T', text)


@pytest.mark.parametrize("fmt", ["text", "json", "sarif", "github"])
def test_command_outputs_are_those_of_the_whole_report(tmp_path: Path, fmt: str) -> None:
    """The command keeps only each run's table or JSON entry; its output is the report's, rendered whole."""
    from ckptdoctor.render.report import summary_line
    from ckptdoctor.render.sarif import render_github, render_sarif

    for root in _roots(tmp_path):
        for extra in ((), ("--no-config",)):
            result = _cli(str(root), "--format", fmt, *extra)
            options = Options.build(no_config=bool(extra))
            report = scan_roots(Roots.of([str(root)]), options)  # every tree kept whole
            if fmt == "text":
                expected = render_text(report)
            elif fmt == "json":
                expected = render_json(report)
            elif fmt == "sarif":
                expected = render_sarif(report.findings)
            else:
                expected = render_github(report.findings, notice=summary_line(report))
            assert _timeless(result.output) == _timeless(expected + "\n"), (root, extra)
            assert result.exit_code == report.exit_code()


def test_nested_settings_apply_per_part(tmp_path: Path) -> None:
    root = _fleet(tmp_path / "fleet")
    doc = json.loads(_cli(str(root), "--format", "json").output)
    rules_in_team = {f["rule"] for f in doc["findings"] if f["path"].startswith("team-a/")}
    assert "CKD401" not in rules_in_team
    assert [s["path"] for s in doc["settings"]] == [str(root / "team-a" / ".ckptdoctor.toml")]
    assert "team-a/run-1/checkpoint-4" in doc["settings"][0]["folders"][1:] or any(
        "checkpoint-4" in f for f in doc["settings"][0]["folders"]
    )


def test_jsonl_streams_each_finding_then_the_summary(tmp_path: Path) -> None:
    root = _fleet(tmp_path / "fleet")
    out = tmp_path / "out.jsonl"
    result = _cli(str(root), "--format", "jsonl", "-o", str(out))
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    *findings, summary = lines
    doc = json.loads(_cli(str(root), "--format", "json").output)
    assert all(f.pop("schema") == "ckptdoctor.finding/1" for f in findings)
    # every finding of the JSON report, each once; in the order runs were judged (each run's in report order)
    assert sorted(map(json.dumps, findings)) == sorted(map(json.dumps, doc["findings"]))
    assert summary["schema"] == "ckptdoctor.summary/1"
    summary["summary"].pop("seconds")
    doc["summary"].pop("seconds")
    assert summary == {k: v for k, v in doc.items() if k not in ("runs", "findings")} | {"schema": summary["schema"]}
    assert result.exit_code == 1 and result.output == ""
    stdout = _cli(str(root), "--format", "jsonl").output.splitlines()
    assert len(stdout) == len(lines) and json.loads(stdout[0]) == {"schema": "ckptdoctor.finding/1"} | findings[0]
    assert _cli(str(root), "--format", "jsonl", "--statistics").exit_code == 2


def test_jsonl_of_a_clean_root_is_one_summary_line() -> None:
    result = _cli(str(FIXTURES / "clean-full"), "--format", "jsonl", "--no-config")
    (line,) = result.output.splitlines()
    doc = json.loads(line)
    assert doc["schema"] == "ckptdoctor.summary/1" and doc["summary"]["error"] == 0 and result.exit_code == 0


def test_a_judged_part_is_released(tmp_path: Path) -> None:
    """Memory holds one run at a time: when a part is handed on, no file of an earlier part is alive (the views
    the rules built of it, cached by identity, are emptied too)."""
    root = tmp_path / "runs"
    for i in range(4):
        make_run(root / f"run-{i}", (2, 4))
    alive: list[set[str]] = []

    def sink(index: int, tree: Tree, findings: list[Finding]) -> None:
        gc.collect()
        alive.append({o.path.split("/")[0] for o in gc.get_objects() if isinstance(o, FileFacts)})

    scan_roots(Roots.of([str(root)]), Options.build(no_config=True), on_part=sink)
    for i in range(4):  # (another test's files may be alive in this process: only these runs' names count)
        assert f"run-{i}" in alive[i] and not {f"run-{j}" for j in range(i)} & alive[i]


def test_pieces_keep_no_facts(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    make_run(root / "run-0", (2, 4))
    report = scan(str(root))
    pieces = RunPieces.of(report, "json")
    assert dataclasses.asdict(report.trees[0].runs[0])  # the facts are in the report, not in the pieces
    assert all(type(v) in (str, type(None), list) for entry in pieces.runs() for v in entry.values())
    assert [f["rule"] for f in map(finding_json, report.findings)] == [f.rule for f in report.findings]


def test_jsonl_with_deep_judges_each_root_whole_and_writes_the_manifest(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    shutil.copytree(FIXTURES / "interrupted-save", root)
    result = _cli(str(root), "--deep", "--checksums", "write", "--format", "jsonl", "--no-config")
    *findings, summary = (json.loads(line) for line in result.output.splitlines() if line.startswith("{"))
    assert (root / ".ckptdoctor" / "manifest.json").is_file()
    doc = json.loads(_cli(str(root), "--deep", "--format", "json", "--no-config").output)
    assert [{k: v for k, v in f.items() if k != "schema"} for f in findings] == doc["findings"]
    assert summary["summary"]["error"] == doc["summary"]["error"] and result.exit_code == 1
