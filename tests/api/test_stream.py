"""``ckptdoctor.iter_scan``: a scan as a stream of runs (issue 27 §1, the API for a fleet). The parts hold the
findings of ``scan`` under the same settings, in the order ``scan --format jsonl`` writes them; the stream's report
is ``scan``'s (findings, order, settings, exit code); each run's facts are released once the next one is asked for;
leaving early stops the scan's thread. (Dask and S3 roots: tests/fanout/test_fanout.py.)"""

from __future__ import annotations

import gc
import json
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptdoctor
from ckptdoctor.cli import main
from ckptdoctor.errors import UsageError
from ckptdoctor.findings import Finding, finding_json
from ckptdoctor.model import FileFacts, Tree
from tests.helpers.builders import make_run
from tests.helpers.paths import REPO, TESTS

FIXTURES = REPO / "fixtures"
ROOTS = [FIXTURES, TESTS / "data"]  # every shipped fixture, and the real samples of the other stacks
pytestmark = pytest.mark.filterwarnings("ignore:ckptdoctor.*may not turn off:UserWarning")


def _streamed(roots: list[Path], **kw: object) -> tuple[list[ckptdoctor.ScannedPart], ckptdoctor.Report]:
    with ckptdoctor.iter_scan(roots, **kw) as stream:  # type: ignore[arg-type]
        parts = list(stream)
    return parts, stream.report


@pytest.fixture(scope="module")
def streamed() -> tuple[list[ckptdoctor.ScannedPart], ckptdoctor.Report]:
    return _streamed(ROOTS)


def test_the_stream_gives_the_serial_report(
    streamed: tuple[list[ckptdoctor.ScannedPart], ckptdoctor.Report],
) -> None:
    serial = ckptdoctor.scan(ROOTS)
    parts, report = streamed
    assert report.findings == serial.findings  # the same findings, in the same order
    assert report.exit_code() == serial.exit_code() == 1  # the fixtures hold errors
    assert report.settings == serial.settings
    assert [t.root for t in report.trees] == [t.root for t in serial.trees]
    assert [t.files_seen for t in report.trees] == [t.files_seen for t in serial.trees]
    assert report.files == serial.files
    assert not any(t.runs for t in report.trees)  # the runs' facts went out with the parts
    # every run of the fixtures was handed out, each once, in the serial scan's order
    assert [r.path for p in parts if p.index == 0 for r in p.tree.runs] == [r.path for r in serial.trees[0].runs]
    for index, tree in enumerate(serial.trees):  # each part's findings are its root's, by the root's parts
        mine = [f for p in parts if p.index == index for f in p.findings]
        assert all(p.root == tree.root for p in parts if p.index == index)
        assert sorted(mine, key=Finding.sort_key) == [f for f in serial.findings if f.root == tree.root]


def test_the_parts_are_the_lines_scan_jsonl_writes(
    streamed: tuple[list[ckptdoctor.ScannedPart], ckptdoctor.Report],
) -> None:
    """The stream is the command's streaming path: ``--format jsonl`` writes each part's findings as it is judged."""
    result = CliRunner().invoke(main, ["scan", "--format", "jsonl", *map(str, ROOTS)])
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    parts, report = streamed
    assert [{k: v for k, v in line.items() if k != "schema"} for line in lines[:-1]] == [
        finding_json(f) for p in parts for f in p.findings
    ]
    assert result.exit_code == report.exit_code()


def test_settings_files_govern_the_parts_they_are_above(tmp_path: Path) -> None:
    """A run's own settings file and its team's apply to the run's part as they do in ``scan``."""
    root = tmp_path / "fleet"
    make_run(root / "team-a" / "run-1", (2, 4))
    (root / "team-a" / ".ckptdoctor.toml").write_text('ignore = ["CKD401"]\nfail-on = "never"\n')
    make_run(root / "run-b", (2, 4, 6))
    (root / "run-b" / ".ckptdoctor.toml").write_text('[severity]\nCKD102 = "warning"\n')
    (root / "run-b" / "checkpoint-6" / "trainer_state.json").unlink()  # an interrupted save
    serial = ckptdoctor.scan(root)
    parts, report = _streamed([root])
    assert report.findings == serial.findings and report.settings == serial.settings
    assert report.exit_code() == serial.exit_code()
    (run_b,) = [p for p in parts if [r.path for r in p.tree.runs] == ["run-b"]]
    assert [(f.rule, f.severity.value) for f in run_b.findings if f.rule == "CKD102"] == [("CKD102", "warning")]
    assert ckptdoctor.iter_scan(root, fail_on="info", no_config=True)  # the keywords are scan_many's
    strict = _streamed([root], fail_on="info", no_config=True)[1]
    assert strict.findings == ckptdoctor.scan(root, fail_on="info", no_config=True).findings


def _live() -> tuple[int, int]:
    """The trees and file facts alive in this process (both are tracked by the garbage collector)."""
    objs = gc.get_objects()
    return sum(type(o) is Tree for o in objs), sum(type(o) is FileFacts for o in objs)


def test_each_runs_facts_are_released_when_the_next_is_asked_for(tmp_path: Path) -> None:
    """The facts of the parts handed out before are gone by the next part (freed by reference counting: the scan
    pauses the cyclic collector, and nothing here calls it), so a fleet's scan holds one run at a time."""
    root = tmp_path / "fleet"
    for r in range(12):
        make_run(root / f"run-{r:02d}", (2, 4, 6))
    gc.collect()
    trees, facts = _live()
    files_of_a_run = 0
    seen = []
    for part in ckptdoctor.iter_scan(root):
        files_of_a_run = max(files_of_a_run, len(part.tree.all_files()))
        seen.append(_live())
    del part
    assert len(seen) == 13  # the runs, then the rest of the root (nothing)
    # at each part: the part's own tree (and its one judged view), never the trees of the parts before it
    assert max(t for t, _ in seen) - trees <= 3
    assert max(f for _, f in seen) - facts <= 2 * files_of_a_run  # one run's facts, not twelve
    assert seen[-1][1] - facts <= 2 * files_of_a_run


def test_the_loop_runs_with_the_callers_garbage_collector(tmp_path: Path) -> None:
    """A scan pauses the cyclic collector while it reads; the caller's code between two parts runs with it on (its
    cycles are collected as usual), and it is on again after the stream."""
    make_run(tmp_path / "run-a", (2,))
    make_run(tmp_path / "run-b", (2,))
    assert gc.isenabled()
    states = [gc.isenabled() for _ in ckptdoctor.iter_scan(tmp_path)]
    assert states == [True, True, True]  # the two runs, then the rest of the root
    assert gc.isenabled()


def _scan_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ckptdoctor-iter-scan"]


def test_leaving_early_stops_the_scan(tmp_path: Path) -> None:
    for r in range(3):
        make_run(tmp_path / f"run-{r}", (2,))
    with ckptdoctor.iter_scan(tmp_path) as stream:
        first = next(stream)
        assert len(_scan_threads()) == 1
    assert [r.path for r in first.tree.runs] == ["run-0"]
    assert _scan_threads() == []
    with pytest.raises(RuntimeError, match="exhausted"):
        _ = stream.report
    assert list(stream) == []  # closed: nothing more
    dropped = ckptdoctor.iter_scan(tmp_path)
    next(dropped)
    del dropped  # a stream let go of stops its scan too
    gc.collect()
    assert _scan_threads() == []


def test_usage_errors_are_raised_at_the_call_and_scan_errors_at_next(tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        ckptdoctor.iter_scan(FIXTURES, select="CKD999")
    with pytest.raises(FileNotFoundError):
        ckptdoctor.iter_scan(tmp_path / "missing")
    root = tmp_path / "runs"
    make_run(root / "run-a", (2,))
    (root / ".ckptdoctor.toml").write_text('select = ["CKD999"]\n')  # read when the scan starts
    stream = ckptdoctor.iter_scan(root)
    with pytest.raises(UsageError, match="CKD999"):
        next(stream)
    assert _scan_threads() == []
    with pytest.raises(RuntimeError):
        _ = stream.report
