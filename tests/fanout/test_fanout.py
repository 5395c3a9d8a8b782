"""A scan fanned out over Dask (issue 27, part 3): ``ckptdoctor scan --dask ADDRESS`` and
``ckptdoctor.scan_many(roots, client=...)`` give the serial scan's report byte for byte (local and S3 roots, settings
files per run, the sibling-run rule CKD422), a worker killed mid-scan loses no run, and a run whose task keeps
failing is CKD001, an error, never left out."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import ckptdoctor
from ckptdoctor.api import scan_roots
from ckptdoctor.cli import main
from ckptdoctor.fanout import DaskFanOut, walk_one_folder, walk_root
from ckptdoctor.findings import Severity
from ckptdoctor.roots import Roots
from ckptdoctor.scanner import Report
from ckptdoctor.settings.selection import Options
from tests.helpers.builders import make_run
from tests.helpers.cache_files import cache_document
from tests.helpers.fanout import cache_home, fails_at, killed_once, other_version
from tests.helpers.paths import REPO, TESTS
from tests.helpers.remote import fsspec_setting

FIXTURES = REPO / "fixtures"
DATA = TESTS / "data"  # real samples of the other stacks


def _fleet(root: Path) -> Path:
    """Runs side by side and in team folders, each team and one run with a settings file of its own, two sibling
    runs where one started from the other's weights (CKD422 compares them), a damaged save and loose logs."""
    make_run(root / "team-a" / "run-1", (2, 4))
    make_run(root / "team-a" / "run-2", (2,))
    (root / "team-a" / ".ckptdoctor.toml").write_text('ignore = ["CKD401"]\n')
    make_run(root / "run-b", (2, 4, 6))
    (root / "run-b" / ".ckptdoctor.toml").write_text('[severity]\nCKD102 = "warning"\n')
    (root / "run-b" / "checkpoint-6" / "trainer_state.json").unlink()  # an interrupted save
    make_run(root / "sib" / "run-a", (8,))
    make_run(root / "sib" / "run-b", (8,))
    state = root / "sib" / "run-b" / "checkpoint-8" / "trainer_state.json"
    doc = json.loads(state.read_text())
    for entry in doc["log_history"]:  # run-b's first loss starts where run-a's ended: it began from its weights
        entry["loss"] = round(2.92 - 0.01 * entry["step"], 4)
    state.write_text(json.dumps(doc))
    for p in [*(root / "sib" / "run-a").rglob("*"), root / "sib" / "run-a"]:
        os.utime(p, (1e9, 1e9))  # run-a is the older run
    (root / "logs").mkdir()
    (root / "logs" / "train.log").write_text("step 1\n")
    return root


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _fleet(tmp_path_factory.mktemp("fanout") / "fleet")


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["scan", *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    out = re.sub(r'"seconds": [0-9.e-]+', '"seconds": 0', result.stdout)  # how long it took: nothing else differs
    return result.exit_code, re.sub(r"\([0-9.]+ s\)", "(T s)", out)


def test_the_fleet_holds_what_the_tests_need(fleet: Path) -> None:
    report = ckptdoctor.scan(fleet)
    rules = {(f.rule, f.path) for f in report.findings}
    assert ("CKD422", "sib/run-b/checkpoint-8/config.json") in rules  # judged against its sibling run
    assert not any(r == "CKD401" and p.startswith("team-a/") for r, p in rules)  # the team's file ignores it
    assert [f.severity for f in report.findings if f.rule == "CKD102"] == [Severity.WARNING]  # run-b's file
    assert len(report.settings) == 2  # the team's file and run-b's


@pytest.mark.parametrize("fmt", ["json", "jsonl", "text"])
def test_the_command_gives_the_serial_report_byte_for_byte(dask_client: Any, fleet: Path, fmt: str) -> None:
    address = dask_client.scheduler.address
    roots = [str(fleet)] if fmt != "json" else [str(FIXTURES), str(fleet)]
    serial = _cli("--format", fmt, *roots)
    fanned = _cli("--format", fmt, "--dask", address, *roots)
    assert fanned == serial


# The folders of the fleet read on workers: one task per run (the rest of the root, `logs/`, is read here).
FLEET_TASKS = 5


def test_each_run_is_a_task_of_its_own(dask_client: Any, fleet: Path) -> None:
    fanout = DaskFanOut(dask_client)
    report = _report(fanout, fleet)
    assert (fanout.taken, fanout.lost) == (FLEET_TASKS, 0)
    assert report.findings == ckptdoctor.scan(fleet).findings


def test_scan_many_returns_the_serial_report(dask_client: Any, fleet: Path) -> None:
    """The shipped fixtures, the fleet, and the real samples of every stack (Lightning, TensorFlow and Keras,
    torchtitan, MindNLP, accelerate: runs known by their files' content as well as by their folders' names)."""
    roots = [FIXTURES, DATA, fleet]
    serial = ckptdoctor.scan(roots)
    fanned = ckptdoctor.scan_many(roots, client=dask_client)
    assert fanned.findings == serial.findings
    assert fanned.trees == serial.trees
    assert fanned.settings == serial.settings
    assert fanned.exit_code() == serial.exit_code() == 1  # the fixtures hold errors
    assert ckptdoctor.scan_many([fleet]).findings == ckptdoctor.scan(fleet).findings  # no client: serial


def test_a_root_that_is_one_run_is_one_task(dask_client: Any, fleet: Path) -> None:
    for root in (fleet / "sib" / "run-b", FIXTURES / "clean-full", FIXTURES / "clean-full" / "checkpoint-4"):
        assert ckptdoctor.scan_many([root], client=dask_client).findings == ckptdoctor.scan(root).findings


def test_hostile_trees_give_the_serial_report(dask_client: Any, tmp_path: Path) -> None:
    """What a worker's walk meets is reported as the walk here reports it: a run folder whose name is not UTF-8 (its
    parent's listing finds that), links that loop back above the run or lead out of the root, a FIFO."""
    root = tmp_path / "hostile"
    make_run(root / "run-1", (2,))
    bad = os.path.join(os.fsencode(root), b"run-\xff")
    os.makedirs(os.path.join(bad, b"checkpoint-2"))
    for name in os.listdir(root / "run-1" / "checkpoint-2"):
        with open(root / "run-1" / "checkpoint-2" / name, "rb") as src, open(
            os.path.join(bad, b"checkpoint-2", os.fsencode(name)), "wb"
        ) as dst:
            dst.write(src.read())
    (root / "run-1" / "checkpoint-2" / "up").symlink_to(root, target_is_directory=True)  # a loop above the run
    (root / "run-1" / "out").symlink_to(tmp_path, target_is_directory=True)  # out of the root
    os.mkfifo(root / "run-1" / "checkpoint-2" / "pipe")
    fanout = DaskFanOut(dask_client)
    fanned = _report(fanout, root)
    serial = ckptdoctor.scan(root)
    assert fanout.taken == 2 and fanout.lost == 0
    assert fanned.findings == serial.findings
    assert {"CKD001", "CKD604"} <= {f.rule for f in serial.findings}
    assert any("\\xff" in f.path for f in serial.findings)


def _report(fanout: DaskFanOut, *roots: Path | str) -> Report:
    return scan_roots(Roots.of(list(roots)), Options.build(), fanout=fanout)


def test_a_killed_worker_loses_no_run(dask_client: Any, fleet: Path, tmp_path: Path) -> None:
    """The first task kills its worker (SIGKILL, as an out-of-memory kill would): Dask runs it again elsewhere and
    the report is the serial one."""
    marker = tmp_path / "killed"

    class Killing(DaskFanOut):
        folder_task = staticmethod(partial(killed_once, str(marker), walk_one_folder))

    fanout = Killing(dask_client)
    fanned = _report(fanout, fleet)
    assert marker.exists()  # a worker did die
    assert (fanout.taken, fanout.lost) == (FLEET_TASKS, 0)
    serial = ckptdoctor.scan(fleet)
    assert fanned.findings == serial.findings
    assert fanned.settings == serial.settings


def test_a_run_whose_task_keeps_failing_is_not_checked_an_error(dask_client: Any, fleet: Path) -> None:
    class Failing(DaskFanOut):
        folder_task = staticmethod(partial(fails_at, "team-a/run-1", walk_one_folder))

    report = _report(Failing(dask_client, retries=1), fleet)
    (lost,) = [f for f in report.findings if f.path == "team-a/run-1"]
    assert lost.rule == "CKD001" and lost.severity is Severity.ERROR
    assert lost.message.startswith("not checked: the Dask task that reads this folder failed (1 retries): ")
    assert "injected: the worker cannot read team-a/run-1" in lost.message
    assert report.exit_code() == 1
    serial = [f for f in ckptdoctor.scan(fleet).findings if not f.path.startswith("team-a/run-1/")]
    assert [f for f in report.findings if f is not lost] == serial  # every other run is judged as ever


def test_a_root_whose_task_keeps_failing_is_not_checked_and_not_called_empty(dask_client: Any) -> None:
    class Failing(DaskFanOut):
        root_task = staticmethod(partial(fails_at, ".", walk_root))

    report = _report(Failing(dask_client, retries=0), FIXTURES / "clean-full")
    assert [(f.rule, f.path, f.severity) for f in report.findings] == [("CKD001", ".", Severity.ERROR)]
    assert report.exit_code() == 1


def test_a_worker_running_another_version_is_not_trusted(dask_client: Any, fleet: Path) -> None:
    class Other(DaskFanOut):
        folder_task = staticmethod(partial(other_version, walk_one_folder))

    report = _report(Other(dask_client), fleet / "team-a")
    lost = [f for f in report.findings if f.rule == "CKD001"]
    assert [f.path for f in lost] == ["run-1", "run-2"]
    assert "a Dask worker runs ckptdoctor 0.0.1" in lost[0].message


def test_the_command_refuses_deep_and_a_scheduler_it_cannot_reach(fleet: Path) -> None:
    import dask

    code, _ = _cli("--dask", "tcp://127.0.0.1:9", "--deep", str(fleet))
    assert code == 2
    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        result = CliRunner().invoke(main, ["scan", "--dask", "tcp://127.0.0.1:9", str(fleet)])
    assert result.exit_code == 2
    assert "cannot reach the Dask scheduler" in result.stderr


def test_a_serial_scan_imports_no_dask(tmp_path: Path) -> None:
    """Start-up is a benchmark: the scan path imports Dask only for --dask."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ckptdoctor", "scan", "--allow-empty", str(tmp_path)],
        capture_output=True, text=True, env=env, check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    imported = {line.split("|")[-1].strip().split(".")[0] for line in out.stderr.splitlines() if "|" in line}
    assert "ckptdoctor" in imported
    assert not imported & {"dask", "distributed", "cloudpickle", "tornado", "msgpack"}


# ---- an S3 root (moto's server on loopback) ----


@pytest.fixture
def s3_fleet(fleet: Path) -> Iterator[str]:
    """``fleet`` uploaded to a moto S3 server on 127.0.0.1. Its endpoint and dummy credentials are fsspec settings,
    not environment variables: the workers started before this fixture get them inside the file system the client
    sends them (fsspec pickles its options)."""
    pytest.importorskip("s3fs")
    server = pytest.importorskip("moto.server")
    import fsspec
    import s3fs

    srv = server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    settings = {"client_kwargs": {"endpoint_url": f"http://{host}:{port}"}, "key": "testing", "secret": "testing"}
    try:
        with fsspec_setting("s3", settings, s3fs.S3FileSystem):
            fs = fsspec.filesystem("s3")
            fs.mkdir("fanout-ckpts")
            fs.put(str(fleet) + "/", "fanout-ckpts/fleet/", recursive=True)
            fs.invalidate_cache()
            yield "s3://fanout-ckpts/fleet/"
    finally:
        # moto keeps its buckets per process, not per server: drop them, or a later server in this test worker
        # (tests/sources/test_remote.py) finds its bucket already made
        urllib.request.urlopen(urllib.request.Request(f"http://{host}:{port}/moto-api/reset", method="POST")).close()
        srv.stop()


def test_an_s3_root_gives_the_serial_report_byte_for_byte(dask_client: Any, s3_fleet: str) -> None:
    serial = _cli("--format", "json", s3_fleet)
    fanned = _cli("--format", "json", "--dask", dask_client.scheduler.address, s3_fleet)
    assert fanned == serial
    doc = json.loads(serial[1])
    assert {r["path"] for r in doc["runs"]} >= {"team-a/run-1", "run-b", "sib/run-a", "sib/run-b"}
    assert "CKD001" not in {f["rule"] for f in doc["findings"]}
    fanout = DaskFanOut(dask_client)  # and the runs were read on the workers, one task each
    report = _report(fanout, s3_fleet)
    assert (fanout.taken, fanout.lost) == (FLEET_TASKS, 0)
    assert [f.rule for f in report.findings] == [f["rule"] for f in doc["findings"]]


def _kept_facts(path: Path) -> bool:
    """Whether the cache file at ``path`` keeps any file's facts (not only sightings)."""
    return any("facts" in entry for entry in cache_document(path)["entries"].values())


@pytest.mark.parametrize("where", ["local", "s3"])
def test_with_the_cache_the_workers_keep_and_take_the_runs_they_read(
    dask_client: Any, fleet: Path, tmp_path: Path, where: str, request: pytest.FixtureRequest
) -> None:
    """serial == cached == Dask: each worker reads through its own user's cache folder (a scan with --no-cache
    leaves it alone; by default a first scan notes the files, with --cache it keeps their facts), and the scan that
    fills it and the one that takes from it give the serial report byte for byte, as does a serial scan with the
    cache."""
    root = str(fleet) if where == "local" else request.getfixturevalue("s3_fleet")
    if where == "local":
        time.sleep(2.1)  # past the cache's racy window: the fleet's files were written a moment ago
    home = tmp_path / "worker-cache"
    old = dask_client.run(cache_home, str(home))
    try:
        address = dask_client.scheduler.address
        serial = _cli("--format", "json", "--no-cache", root)
        assert _cli("--format", "json", "--no-cache", "--dask", address, root) == serial
        assert not home.exists()  # --no-cache leaves it alone
        assert _cli("--format", "json", "--dask", address, root) == serial
        noted = list((home / "ckptdoctor" / "facts").glob("*.bin"))
        assert noted and all(not _kept_facts(p) for p in noted)  # by default: sightings only
        shutil.rmtree(home)
        assert _cli("--format", "json", "--cache", "--dask", address, root) == serial
        kept = {p: p.stat().st_mtime_ns for p in (home / "ckptdoctor" / "facts").glob("*.bin")}
        assert kept  # the workers kept what they read
        assert _cli("--format", "json", "--cache", "--dask", address, root) == serial
        # each file was taken from the cache: an entry missed or changed would have had its run's file rewritten
        assert {p: p.stat().st_mtime_ns for p in (home / "ckptdoctor" / "facts").glob("*.bin")} == kept
        assert _cli("--format", "json", "--cache", root) == serial
        assert _cli("--format", "json", "--cache", root) == serial
        one_run = root.rstrip("/") + "/sib/run-b"  # a root that is one run: one task for the whole root
        alone = _cli("--format", "json", "--no-cache", one_run)
        for _ in range(2):
            assert _cli("--format", "json", "--cache", "--dask", address, one_run) == alone
    finally:
        for worker, value in old.items():
            dask_client.run(cache_home, value, workers=[worker])


# ---- the streaming form: ckptdoctor.iter_scan(roots, client=...) ----


def _stream(roots: list[Any], client: Any = None) -> tuple[list[tuple[int, str, list[str], list[Any]]], Report]:
    """What ``iter_scan`` hands out (each part's root index, root, runs and findings) and its report."""
    with ckptdoctor.iter_scan(roots, client=client) as stream:
        parts = [(p.index, p.root, [r.path for r in p.tree.runs], list(p.findings)) for p in stream]
    return parts, stream.report


@pytest.mark.parametrize("where", ["local", "s3"])
def test_serial_scan_equals_the_stream_equals_the_dask_stream(
    dask_client: Any, fleet: Path, where: str, request: pytest.FixtureRequest
) -> None:
    """serial ``scan`` == ``iter_scan`` == ``iter_scan`` on Dask: the same parts in the same order, the serial
    report's findings (order, severities under each run's settings files, CKD422 across sibling runs), settings,
    file counts and exit code, on a local and an S3 root; the runs were read on the workers."""
    roots = [str(fleet), str(FIXTURES)] if where == "local" else [request.getfixturevalue("s3_fleet")]
    serial = ckptdoctor.scan(roots)
    parts, report = _stream(roots)
    fanned_parts, fanned = _stream(roots, dask_client)
    assert fanned_parts == parts
    for r in (report, fanned):
        assert r.findings == serial.findings
        assert r.settings == serial.settings
        assert [(t.root, t.files_seen) for t in r.trees] == [(t.root, t.files_seen) for t in serial.trees]
        assert r.exit_code() == serial.exit_code()
    assert ("CKD422", "sib/run-b/checkpoint-8/config.json") in {(f.rule, f.path) for f in fanned.findings}
    runs = [run for _, _, found, _ in parts for run in found]
    assert {"team-a/run-1", "team-a/run-2", "run-b", "sib/run-a", "sib/run-b"} <= set(runs)
    assert len(runs) == len(set(runs))  # each run handed out once
    if where == "local":
        assert report.exit_code() == 1  # the fixtures hold errors


def test_the_dask_stream_releases_each_run_and_stops_its_tasks(dask_client: Any, fleet: Path) -> None:
    """On Dask too each part's facts are gone by the next part, and leaving early cancels the tasks in flight."""
    import gc

    from ckptdoctor.model import FileFacts

    def live() -> int:
        return sum(type(o) is FileFacts for o in gc.get_objects())

    gc.collect()
    before = live()
    seen = []
    most = 0
    for part in ckptdoctor.iter_scan([fleet], client=dask_client):
        most = max(most, len(part.tree.all_files()))
        seen.append(live() - before)
    del part
    assert len(seen) >= FLEET_TASKS
    assert max(seen) <= 2 * most  # one part's facts (and its judged view), never the fleet's
    with ckptdoctor.iter_scan([fleet, FIXTURES], client=dask_client) as stream:
        next(stream)
    assert not [t for t in threading.enumerate() if t.name == "ckptdoctor-iter-scan"]
    assert ckptdoctor.scan_many([fleet], client=dask_client).findings == ckptdoctor.scan(fleet).findings
