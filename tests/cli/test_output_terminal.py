"""Output for humans and pipelines, through the console entry (`python -m ckptdoctor`, what the installed
`ckptdoctor` script runs): pipes and every --format print today's bytes; a terminal gets every line fitted to its
width; -q/-s, --output-file, --statistics, grouped repeats, and the gate document's version and counts."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers import console
from tests.helpers.paths import REPO

GOLDEN = REPO / "tests" / "data" / "output_golden"
ANSI = re.compile(r"\x1b\[[0-9;]*m")

# (golden file, arguments): captured through a pipe before the terminal work (commit e587bad)
GOLDEN_CASES = [
    ("scan.txt", ["scan", "fixtures/"]),
    ("scan.json", ["scan", "--format", "json", "fixtures/"]),
    ("scan.sarif", ["scan", "--format", "sarif", "fixtures/"]),
    ("scan.github", ["scan", "--format", "github", "fixtures/"]),
    ("gate.txt", ["gate", "fixtures/lr-finished", "--max-steps", "16"]),
    ("gate-stale.txt", ["gate", "fixtures/stale-higher"]),
    ("gate.sarif", ["gate", "fixtures/stale-higher", "--format", "sarif"]),
    ("gate.github", ["gate", "fixtures/stale-higher", "--format", "github"]),
    ("inspect.txt", ["inspect", "fixtures/stub-shadow/checkpoint-4/pytorch_model.bin"]),
]


def ckptdoctor(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return console.run(*args, cwd=cwd, env=env)


def on_terminal(*args: str, columns: int = 80, cwd: Path = REPO) -> str:
    """What the command prints when its stdout is a real terminal (a pseudo-terminal) ``columns`` wide."""
    leader, follower = pty.openpty()
    env = console.environ({"COLUMNS": str(columns), "TERM": "xterm"})
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([*console.command(), *args], cwd=cwd, stdout=follower,
                            stderr=subprocess.DEVNULL, env=env)  # fmt: skip
    os.close(follower)
    chunks = []
    while True:
        ready, _, _ = select.select([leader], [], [], 60)
        if not ready:
            break
        try:
            data = os.read(leader, 65536)
        except OSError:  # the follower closed: all is read
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=60)
    os.close(leader)
    return ANSI.sub("", b"".join(chunks).decode()).replace("\r\n", "\n")


def _timeless(text: str) -> str:
    text = re.sub(r"\(\d+\.\d+ s\)", "(N s)", text)
    text = re.sub(r"(  transformers +)\S+ \(installed\)", r"\1X (installed)", text)  # the gate follows it
    return re.sub(r'"seconds": [0-9.e-]+', '"seconds": N', text)


@pytest.mark.parametrize(("golden", "args"), GOLDEN_CASES, ids=[c[0] for c in GOLDEN_CASES])
def test_pipes_and_formats_print_todays_bytes(golden: str, args: list[str]) -> None:
    """Through a pipe, text and every --format are what they were before the terminal work, byte for byte (but
    the time a scan took)."""
    proc = ckptdoctor(*args)
    assert _timeless(proc.stdout) == _timeless((GOLDEN / golden).read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    "args",
    [
        ["scan", "fixtures/"],
        ["gate", "fixtures/stale-higher"],
        ["gate", "fixtures/lr-finished", "--max-steps", "16"],
        ["scan", "--statistics", "fixtures/"],
        ["inspect", "fixtures/sharded-truncated-shard/checkpoint-8/model-00005-of-00005.safetensors"],
    ],
    ids=lambda a: " ".join(a)[:40],
)
def test_a_terminal_gets_no_line_over_its_width(args: list[str]) -> None:
    """On an 80-column terminal every line fits (colours aside), each finding is a header line
    (`path: CODE [severity] name`) with its message wrapped below."""
    text = on_terminal(*args)
    assert text.strip(), "nothing printed on the terminal"
    too_long = [ln for ln in text.splitlines() if len(ln) > 80]
    assert not too_long, too_long
    if args[:2] == ["scan", "fixtures/"]:
        assert "fixtures/lr-finished/checkpoint-8: CKD401 [info] lr-schedule-finished\n  schedule finished:" in text


def test_a_narrow_terminal_still_fits() -> None:
    """At 50 columns the tables lose columns (a step that repeats the folder's number first, the LR last) and long
    headers wrap: still no line over the width."""
    text = on_terminal("scan", "fixtures/stub-shadow", "fixtures/sharded-wrong-index", columns=50)
    assert not [ln for ln in text.splitlines() if len(ln) > 50]
    assert "checkpoint" in text and "CKD205" in text


def test_an_80_column_table_keeps_the_lr_a_finished_schedule_is_about() -> None:
    """`fixtures/lr-finished` on 80 columns: the table drops the step (the folder's name says it) and keeps `lr`,
    whose 0 is the point; through a pipe every column is there."""
    text = on_terminal("scan", "fixtures/lr-finished", columns=80)
    header = next(ln for ln in text.splitlines() if ln.startswith("checkpoint "))
    assert header.split() == ["checkpoint", "weights", "tensors", "size", "lr", "status"]
    row = next(ln for ln in text.splitlines() if ln.startswith("checkpoint-8 "))
    assert row.split()[5] == "0"  # checkpoint-8, full, 21, 81.3, KB, 0
    assert not [ln for ln in text.splitlines() if len(ln) > 80]
    piped = ckptdoctor("scan", "fixtures/lr-finished").stdout
    assert next(ln for ln in piped.splitlines() if ln.startswith("checkpoint ")).split() == [
        "checkpoint", "step", "weights", "tensors", "size", "lr", "status"
    ]


@pytest.mark.parametrize("args", [["rules"], ["explain", "CKD102"], ["explain", "CKD201"]], ids=" ".join)
def test_rules_and_explain_fit_a_terminal_and_pipe_whole_lines(args: list[str]) -> None:
    """`rules` (its table is over 200 columns) and `explain` fit an 80-column terminal: a rule per header line
    with its summary wrapped below, a document's paragraphs rewrapped; through a pipe the lines stay whole."""
    text = on_terminal(*args)
    assert not [ln for ln in text.splitlines() if len(ln) > 80]
    piped = ckptdoctor(*args).stdout
    assert max(map(len, piped.splitlines())) > 80  # today's lines: whole through a pipe
    words = [w for w in piped.split() if set(w) != {"-"}]  # the table's rule line is the one thing dropped
    assert [w for w in text.split() if set(w) != {"-"}] == words or args[0] == "rules"
    if args[0] == "rules":
        assert "CKD102 incomplete-checkpoint [warning] (safe fix)" in text
        assert "  (error when it is the checkpoint the resume picks" in text


def test_every_help_fits_80_columns() -> None:
    """`--help` of the group and of every command fits an 80-column terminal (click wraps to COLUMNS; epilog
    examples too wide for it show their comment above)."""
    env = {**os.environ, "COLUMNS": "80"}
    for command in ["", "scan", "fix", "undo", "gate", "inspect", "rules", "explain"]:
        proc = ckptdoctor(*([command] if command else []), "--help", env=env)
        assert proc.returncode == 0, proc.stderr
        too_long = [ln for ln in proc.stdout.splitlines() if len(ln) > 80]
        assert not too_long, (command, too_long)


def _copies(tmp_path: Path, n: int) -> Path:
    """A run of ``n`` copies of one checkpoint folder under other names (each a CKD104 step mismatch)."""
    run = tmp_path / "run"
    run.mkdir(parents=True)
    for i in range(100, 100 + n):
        shutil.copytree(REPO / "fixtures" / "clean-full" / "checkpoint-8", run / f"checkpoint-{i}")
    return run


def test_repeated_findings_are_one_entry_in_text_and_all_in_json(tmp_path: Path) -> None:
    """Findings of one rule whose messages differ only by their own path are one text entry with a count and
    example paths; JSON keeps each of them."""
    run = _copies(tmp_path, 12)
    text = ckptdoctor("scan", str(run)).stdout
    assert text.count("CKD104") == 2, text  # the first finding, and the group's count line
    assert "and 11 more CKD104 findings like it: " in text and f"{run}/checkpoint-101" in text
    doc = json.loads(ckptdoctor("scan", "--format", "json", str(run)).stdout)
    assert [f["rule"] for f in doc["findings"]] == ["CKD104"] * 12
    few = _copies(tmp_path / "few", 3)  # fewer than five: listed one by one
    assert ckptdoctor("scan", str(few)).stdout.count("CKD104") == 3


STEPS = (1, 2, 10, 100, 1000)


def test_findings_like_it_and_fix_plans_are_in_step_order(tmp_path: Path) -> None:
    """`checkpoint-2` comes before `checkpoint-10` and `checkpoint-100`, wherever paths are listed: the findings
    (text, JSON, SARIF), the "like it" examples of a group, and a fix plan (not `-1, -10, -100, -1000, -2`)."""
    run = tmp_path / "run"
    run.mkdir()
    for step in STEPS:  # each a CKD104 step mismatch (all hold step 8), and each beside a staging folder (CKD103)
        shutil.copytree(REPO / "fixtures" / "clean-full" / "checkpoint-8", run / f"checkpoint-{step}")
        shutil.copytree(REPO / "fixtures" / "clean-full" / "checkpoint-8", run / f"tmp-checkpoint-{step}")
    doc = json.loads(ckptdoctor("scan", "--format", "json", str(run)).stdout)
    for code, name in (("CKD103", "tmp-checkpoint"), ("CKD104", "checkpoint")):
        assert [f["path"] for f in doc["findings"] if f["rule"] == code] == [f"{name}-{n}" for n in STEPS]
    assert [c["path"] for c in doc["runs"][0]["checkpoints"] if c["step"] is not None] == [
        f"checkpoint-{n}" for n in STEPS
    ]
    text = ckptdoctor("scan", str(run)).stdout
    like = next(ln for ln in text.splitlines() if "more CKD104 findings like it" in ln)
    examples = ", ".join(f"{run}/checkpoint-{n}" for n in STEPS[1:4])
    assert like.endswith(f": {examples}, ... (--format json lists each)")
    plan = ckptdoctor("fix", "--dry-run", "--force", str(run)).stdout
    moved = re.findall(r"would move `(tmp-checkpoint-\d+)/`", plan)
    assert moved == [f"tmp-checkpoint-{n}" for n in STEPS], plan


def test_quiet_and_silent(tmp_path: Path) -> None:
    """-q prints the findings only; -s nothing (any format); the exit code is unchanged."""
    stub = "fixtures/stub-shadow"
    quiet = ckptdoctor("scan", "-q", stub)
    assert quiet.returncode == 1
    assert quiet.stdout.splitlines()[0].startswith("fixtures/stub-shadow/checkpoint-4/pytorch_model.bin: CKD201")
    assert "checkpoint    step" not in quiet.stdout and "Found" not in quiet.stdout
    assert ckptdoctor("scan", "-q", "fixtures/clean-full").stdout == ""
    for fmt in ("text", "json", "sarif", "github"):
        silent = ckptdoctor("scan", "-s", "--format", fmt, stub)
        assert (silent.returncode, silent.stdout) == (1, "")
    gate = ckptdoctor("gate", "-q", "fixtures/stale-higher")
    assert gate.returncode == 1 and gate.stdout.startswith("fixtures/stale-higher/") and "Verdict" not in gate.stdout
    assert ckptdoctor("gate", "-s", "fixtures/stale-higher").stdout == ""


def test_output_file_takes_every_format(tmp_path: Path) -> None:
    """--output-file writes what stdout would get (text whole, without colour), in every format; stdout is empty;
    a file that cannot be written is exit 2."""
    for fmt in ("text", "json", "sarif", "github"):
        out = tmp_path / f"report.{fmt}"
        proc = ckptdoctor("scan", "--format", fmt, "-o", str(out), "fixtures/stub-shadow")
        assert (proc.returncode, proc.stdout) == (1, "")
        piped = ckptdoctor("scan", "--format", fmt, "fixtures/stub-shadow").stdout
        assert _timeless(out.read_text(encoding="utf-8")) == _timeless(piped)
    gate = tmp_path / "gate.json"
    assert ckptdoctor("gate", "--format", "json", "--output-file", str(gate), "fixtures/stale-higher").stdout == ""
    assert json.loads(gate.read_text())["schema"] == "ckptdoctor.gate/1"
    fix = tmp_path / "fix.txt"
    assert ckptdoctor("fix", "--dry-run", "-o", str(fix), "fixtures/clean-full").stdout == ""
    assert fix.read_text().strip()
    bad = ckptdoctor("scan", "-o", str(tmp_path / "no" / "such" / "dir" / "r.txt"), "fixtures/stub-shadow")
    assert bad.returncode == 2 and "r.txt" in bad.stderr


def test_statistics_count_per_rule_in_text_and_json() -> None:
    """--statistics: one line per rule, most frequent first, and the summary; in JSON a statistics document
    whose counts add up to the report's findings; not with sarif or github (exit 2)."""
    text = ckptdoctor("scan", "--statistics", "fixtures/").stdout.splitlines()
    assert text[0].split() == ["4", "CKD207", "[warning]", "prefixed-state-dict-keys"]
    assert text[-1].startswith("Found 10 errors, 4 warnings, 3 infos")
    doc = json.loads(ckptdoctor("scan", "--statistics", "--format", "json", "fixtures/").stdout)
    report = json.loads(ckptdoctor("scan", "--format", "json", "fixtures/").stdout)
    assert doc["schema"] == "ckptdoctor.statistics/1" and doc["version"] == report["version"]
    counts: dict[str, int] = {}
    for f in report["findings"]:
        counts[f["rule"]] = counts.get(f["rule"], 0) + 1
    assert {s["code"]: s["count"] for s in doc["statistics"]} == counts
    assert ckptdoctor("scan", "--statistics", "--format", "sarif", "fixtures/").returncode == 2


def test_gate_json_has_version_and_summary_counts() -> None:
    """The gate document names ckptdoctor's version and counts its findings by severity, as scan's report does."""
    doc = json.loads(ckptdoctor("gate", "--format", "json", "fixtures/stale-higher").stdout)
    scan = json.loads(ckptdoctor("scan", "--format", "json", "fixtures/stub-shadow").stdout)
    assert list(doc)[:2] == ["schema", "version"] and doc["version"] == scan["version"]
    severities = [f["severity"] for f in doc["findings"]]
    assert doc["summary"] == {s: severities.count(s) for s in ("error", "warning", "info")}


def test_the_readme_terminal_example_is_real() -> None:
    """The README's 80-column example is what a terminal shows (colours aside)."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = readme.split("# on an 80-column terminal", 1)[1].split("```", 1)[0]
    command, _, expected = block.split("\n", 1)[1].partition("\n")
    assert command.startswith("$ ckptdoctor ")
    shown = on_terminal(*command.split()[2:])
    assert _timeless(shown).rstrip("\n") == _timeless(expected).rstrip("\n")


def test_any_width_fits_in_process() -> None:
    """Every width from 30 to 130 columns: no line of the scan or gate text is over it (tables, headers, messages,
    fix lines, the prediction)."""
    from ckptdoctor import gate, scan
    from ckptdoctor.render import gate as gate_text
    from ckptdoctor.render.report import render_text

    report = scan([str(REPO / "fixtures")])
    result = gate(str(REPO / "fixtures" / "lr-finished"), max_steps=16)
    for width in range(30, 131, 7):
        text = render_text(report, width=width) + "\n" + gate_text.render_text(result, width=width)
        lines = text.splitlines()
        assert not [ln for ln in lines if len(ln) > width], width


def test_the_reported_time_is_the_whole_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """The summary's time runs from the command's start through the rendering of the last line above it (a long
    table took longer to print than the scan took), and a document's from the start to its rendering: a command
    begun 1000 s ago says so, whatever the scan alone took."""
    import time

    from click.testing import CliRunner

    import ckptdoctor.cli
    from ckptdoctor.cli import main

    begun = time.monotonic() - 1000
    monkeypatch.setattr(ckptdoctor.cli, "started", lambda: begun)
    text = CliRunner().invoke(main, ["scan", "fixtures/lr-finished"]).output
    seconds = float(re.findall(r"\((\d+\.\d+) s\)", text)[-1])
    assert 1000 <= seconds < 1e6
    doc = json.loads(CliRunner().invoke(main, ["scan", "--format", "json", "fixtures/lr-finished"]).output)
    assert doc["summary"]["seconds"] >= 1000


def test_the_summary_time_is_asked_after_the_report_is_rendered() -> None:
    """``render_text(clock=...)`` asks the clock once, when every line above the summary is rendered."""
    from ckptdoctor import api
    from ckptdoctor.render.report import render_text

    report = api.scan(str(REPO / "fixtures" / "lr-finished"))
    asked: list[int] = []

    def clock() -> float:
        asked.append(1)
        return 12.345

    text = render_text(report, clock=clock)
    assert asked == [1] and text.endswith("in 14 files (12.35 s).")
    assert render_text(report).endswith(f"({report.seconds:.2f} s).")


def test_a_long_table_is_summarised_on_a_terminal_and_whole_through_a_pipe(tmp_path: Path) -> None:
    """A run of 40 checkpoints (steps 2..80; `checkpoint-30` cut, an interrupted save): a terminal shows the first
    and last few rows, the one with a finding and the resume's pick, each run of rows left out as one counting
    line; a pipe prints every row, in step order."""
    from ckptdoctor.render.report import TABLE_MAX

    run = tmp_path / "run"
    for step in range(2, 82, 2):
        make = REPO / "fixtures" / "clean-full" / "checkpoint-8"
        shutil.copytree(make, run / f"checkpoint-{step}")
        state = json.loads((make / "trainer_state.json").read_text())
        state["global_step"] = step
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps(state))
    (run / "checkpoint-30" / "trainer_state.json").unlink()
    piped = ckptdoctor("scan", str(run)).stdout
    assert [ln.split()[0] for ln in piped.splitlines() if ln.startswith("checkpoint-")] == [
        f"checkpoint-{s}" for s in range(2, 82, 2)
    ]
    text = on_terminal("scan", str(run), columns=100)
    rows = [ln.split()[0] for ln in text.splitlines() if ln.startswith("checkpoint-")]
    assert rows == ["checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-30",
                    "checkpoint-76", "checkpoint-78", "checkpoint-80"]  # fmt: skip
    assert len(rows) <= TABLE_MAX
    gaps = [ln for ln in text.splitlines() if ln.startswith("... ")]
    assert gaps == ["... 11 more checkpoints (11 ok; --format json lists each)",
                    "... 22 more checkpoints (22 ok; --format json lists each)"]  # fmt: skip
    assert "checkpoint-80" in text.split("<- resume picks")[0].splitlines()[-1]
