"""A mistyped, unmounted or empty root must not pass a CI gate: "No problems found in 0 files" with exit 0 let a typo
in `$OUTPUT_DIR` through. A root that does not exist is a usage error (2); a root holding no checkpoint at all is
CKD002, an error (1); `--allow-empty` (``allow_empty=True``) accepts it for a launcher gating before the first save.
Driven through the installed console script (`tests/helpers/console.py`) and the Python API alike."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

import ckptdoctor
from tests.helpers import console
from tests.helpers.paths import REPO


def cli(*args: str) -> tuple[int, str, str]:
    p = console.run(*args)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture
def roots(tmp_path: Path) -> dict[str, Path]:
    """An empty folder, a folder of logs only, a folder with one weights file, and a real run."""
    empty = tmp_path / "empty"
    empty.mkdir()
    logs = tmp_path / "logs"
    (logs / "runs").mkdir(parents=True)
    (logs / "runs" / "events.txt").write_text("step 1\n")
    (logs / "README.md").write_text("notes\n")
    (logs / "config.json").write_text("{}")
    weights = tmp_path / "weights"
    weights.mkdir()
    shutil.copy(REPO / "fixtures" / "clean-full" / "checkpoint-8" / "model.safetensors", weights)
    run = shutil.copytree(REPO / "fixtures" / "clean-full", tmp_path / "run")
    return {"empty": empty, "logs": logs, "weights": weights, "run": run}


def _rules(out: str) -> list[tuple[str, str, str]]:
    return [(f["rule"], f["severity"], f["path"]) for f in json.loads(out)["findings"]]


def test_a_root_that_does_not_exist_is_a_usage_error(tmp_path: Path) -> None:
    for command in ("scan", "gate"):
        code, out, err = cli(command, str(tmp_path / "typo"))
        assert code == 2 and out == "" and "does not exist" in err, (command, err)
    with pytest.raises(FileNotFoundError):
        ckptdoctor.scan(tmp_path / "typo")


@pytest.mark.parametrize("name", ["empty", "logs"])
def test_a_root_without_a_checkpoint_fails_the_scan_unless_allowed(roots: dict[str, Path], name: str) -> None:
    code, out, _ = cli("scan", "--format", "json", str(roots[name]))
    assert code == 1 and _rules(out) == [("CKD002", "error", ".")]
    code, out, _ = cli("scan", str(roots[name]))
    assert code == 1 and "CKD002 [error] no checkpoint here" in out and "--allow-empty" in out
    code, out, _ = cli("scan", "--format", "json", "--allow-empty", str(roots[name]))
    assert code == 0 and _rules(out) == []
    code, _, _ = cli("scan", "--ignore", "CKD002", str(roots[name]))
    assert code == 0
    report = ckptdoctor.scan(roots[name])
    assert [f.rule for f in report.findings] == ["CKD002"] and report.exit_code() == 1
    assert ckptdoctor.scan(roots[name], allow_empty=True).exit_code() == 0


def test_a_checkpoint_or_a_weights_file_is_not_empty(roots: dict[str, Path]) -> None:
    for name in ("weights", "run"):
        code, out, _ = cli("scan", "--format", "json", str(roots[name]))
        assert code == 0 and "CKD002" not in {r for r, _, _ in _rules(out)}, name
    code, _, _ = cli("scan", str(roots["weights"] / "model.safetensors"))
    assert code == 0


def test_with_several_roots_the_empty_one_is_named(roots: dict[str, Path]) -> None:
    code, out, _ = cli("scan", "--format", "json", str(roots["run"]), str(roots["empty"]))
    doc = json.loads(out)
    assert code == 1
    assert [(f["rule"], f["root"]) for f in doc["findings"]] == [("CKD002", str(roots["empty"]))]


def test_the_gate_fails_an_empty_run_dir_unless_allowed(roots: dict[str, Path]) -> None:
    # what `gate --help` says of --allow-empty is what the gate reports (it said CKD002, the scan's code)
    code, out, _ = cli("gate", "--help")
    option = " ".join(out.split("--allow-empty", 1)[1].split("\n  -", 1)[0].split())
    assert code == 0 and "is CKD413" in option and "CKD002" not in option, option
    code, out, _ = cli("gate", "--format", "json", str(roots["empty"]))
    assert code == 1 and [f["rule"] for f in json.loads(out)["findings"]] == ["CKD413"]
    assert json.loads(out)["starts_afresh"] is False
    code, out, _ = cli("gate", "--format", "json", "--allow-empty", str(roots["empty"]))
    doc = json.loads(out)
    assert code == 0 and doc["findings"] == [] and doc["starts_afresh"] is True
    code, out, _ = cli("gate", "--allow-empty", str(roots["empty"]))  # the text says why it passes
    assert code == 0 and "  checkpoint       none found (allowed: the run starts afresh)" in out.splitlines()
    assert ckptdoctor.gate(roots["empty"]).failed
    allowed = ckptdoctor.gate(roots["empty"], allow_empty=True)
    assert not allowed.failed and allowed.starts_afresh
    # --allow-empty accepts nothing saved yet, never a run whose checkpoint a resume cannot use
    torn = shutil.copytree(REPO / "fixtures" / "interrupted-save", roots["empty"].parent / "torn")
    code, _, _ = cli("gate", "--allow-empty", str(torn))
    assert code == 1


def test_a_fix_that_leaves_a_run_empty_says_so_unless_allowed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "tmp-checkpoint-4").mkdir(parents=True)  # a staging folder only (CKD103): the fix quarantines it
    (run / "tmp-checkpoint-4" / "config.json").write_text("{}")
    old = time.time() - 3600
    for p in (run / "tmp-checkpoint-4" / "config.json", run / "tmp-checkpoint-4", run):
        os.utime(p, (old, old))
    code, out, _ = cli("fix", "--dry-run", "--allow-empty", "--format", "json", str(run))
    assert code == 1 and json.loads(out)["remaining"] == []  # dry run: 1, it would change something
    code, out, _ = cli("fix", "--format", "json", str(run))
    assert code == 1 and [f["rule"] for f in json.loads(out)["remaining"]] == ["CKD002"]
    assert cli("undo", str(run))[0] == 0
    code, out, _ = cli("fix", "--allow-empty", "--format", "json", str(run))
    assert code == 0 and json.loads(out)["remaining"] == []


def test_readme_documents_the_empty_root() -> None:
    readme = (REPO / "README.md").read_text()
    exit_codes = readme.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    assert "CKD002" in exit_codes and "--allow-empty" in exit_codes


def test_no_select_lets_an_empty_root_pass(roots: dict[str, Path]) -> None:
    """`--select CKD6` (security only) on a mistyped path still fails: CKD002 runs whatever a select says, and only
    an ignore (or --allow-empty) turns it off."""
    code, out, _ = cli("scan", "--format", "json", "--select", "CKD6", str(roots["empty"]))
    assert code == 1 and _rules(out) == [("CKD002", "error", ".")]
    assert ckptdoctor.scan(roots["empty"], select="CKD6").exit_code() == 1
    code, out, _ = cli("scan", "--format", "json", "--select", "CKD6", "--ignore", "CKD002", str(roots["empty"]))
    assert code == 0 and _rules(out) == []
    code, _, _ = cli("gate", "--select", "CKD6", str(roots["empty"]))
    assert code == 1
    code, out, _ = cli("scan", "--format", "json", "--select", "CKD6", str(roots["run"]))
    assert code == 0 and _rules(out) == []
