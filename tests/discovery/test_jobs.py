"""``--jobs``: concurrent header reads give exactly the Tree and the report of the sequential walk."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from ckptdoctor.cli import main
from ckptdoctor.discover import default_jobs, discover
from ckptdoctor.model import FileKind, ProblemKind
from ckptdoctor.scanner import scan
from ckptdoctor.sources.local import _file_system_type
from tests.helpers.builders import make_checkpoint, make_run
from tests.helpers.payloads import save_dcp


@pytest.fixture(scope="module")
def jobs_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two runs of real checkpoints plus every kind of entry the walk must survive."""
    base = tmp_path_factory.mktemp("jobs")
    root = base / "root"
    make_run(root / "run-a", steps=(2, 4, 6))
    make_run(root / "nested" / "run-b", steps=(1, 3))
    ck = root / "run-a" / "checkpoint-6"
    # Truncated and bit-flipped copies of real files.
    data = (ck / "model.safetensors").read_bytes()
    (ck / "model-00002-of-00002.safetensors").write_bytes(data[: len(data) // 2])
    opt = bytearray((ck / "optimizer.pt").read_bytes())
    opt[len(opt) // 3] ^= 0xFF
    (root / "run-a" / "checkpoint-4" / "optimizer.pt").write_bytes(bytes(opt))
    (ck / "trainer_state.json").write_text('{"global_step": 6, "log_history": [')  # crashed writer
    (ck / "empty.bin").write_bytes(b"")
    # An adapter subfolder and a DCP folder.
    sub = ck / "second"
    sub.mkdir()
    save_file({"base_model.model.l.lora_A.weight": torch.ones(2, 3)}, str(sub / "adapter_model.safetensors"))
    (sub / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))
    save_dcp(root / "run-a" / "checkpoint-2" / "pytorch_model_fsdp_0")
    # Links: a loop, one leaving the root, a broken one, one inside the root.
    outside = base / "outside.safetensors"
    outside.write_bytes(data)
    (ck / "loop").symlink_to("..")
    (ck / "escape.safetensors").symlink_to(outside)
    (ck / "broken.safetensors").symlink_to("missing")
    (root / "nested" / "run-b" / "checkpoint-9").symlink_to("checkpoint-3")
    # A FIFO (never opened), a name that is not UTF-8, many small loose files.
    os.mkfifo(ck / "pytorch_model.bin")
    with open(os.fsencode(str(ck)) + b"/odd-\xff.json", "wb") as f:
        f.write(b"{}")
    logs = root / "logs"
    logs.mkdir()
    for i in range(40):
        (logs / f"metrics-{i:03d}.json").write_text(json.dumps({"i": i}))
    return root


@pytest.mark.parametrize("jobs", [2, 3, 8, 32])
def test_tree_is_identical_for_any_jobs(jobs_tree: Path, jobs: int) -> None:
    # repr, not ==: NaN values parsed from JSON never compare equal to themselves.
    sequential = discover(str(jobs_tree), jobs=1)
    assert repr(discover(str(jobs_tree), jobs=jobs)) == repr(sequential)


def test_hostile_entries_are_all_there(jobs_tree: Path) -> None:
    tree = discover(str(jobs_tree), jobs=8)
    kinds = {p.problem.kind for p in tree.path_problems}
    assert {ProblemKind.SYMLINK_LOOP, ProblemKind.LINK_ESCAPES_ROOT, ProblemKind.UNREADABLE} <= kinds
    assert ProblemKind.BAD_NAME in kinds
    files = {f.path: f for f in tree.all_files()}
    assert files["run-a/checkpoint-6/pytorch_model.bin"].kind is FileKind.SPECIAL
    assert files["run-a/checkpoint-6/model-00002-of-00002.safetensors"].problems
    assert tree.files_seen == len(files)


def test_report_is_identical_for_any_jobs(jobs_tree: Path) -> None:
    one = scan(str(jobs_tree), jobs=1)
    many = scan(str(jobs_tree), jobs=6)
    assert one.findings == many.findings and one.findings
    assert repr(one.trees) == repr(many.trees)


def test_single_file_root_and_missing_root(tmp_path: Path) -> None:
    ck = make_checkpoint(tmp_path / "checkpoint-2", 2)
    for jobs in (1, 4):
        tree = discover(str(ck / "optimizer.pt"), jobs=jobs)
        assert [f.kind for f in tree.loose_files] == [FileKind.TORCH_ZIP]
        assert discover(str(tmp_path / "nope"), jobs=jobs).path_problems[0].problem.kind is ProblemKind.UNREADABLE


def test_cli_jobs_option(jobs_tree: Path, tmp_path: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(jobs_tree / "run-a" / "checkpoint-4", root / "checkpoint-4")
    outs = []
    for jobs in ("1", "5"):
        result = CliRunner().invoke(main, ["scan", "--format", "json", "--jobs", jobs, str(root)])
        doc = json.loads(result.output)
        outs.append((result.exit_code, doc["findings"]))
    assert outs[0] == outs[1]
    bad = CliRunner().invoke(main, ["scan", "--jobs", "0", str(root)])
    assert bad.exit_code == 2


def test_default_jobs_is_bounded() -> None:
    assert 1 <= default_jobs() <= 8


_MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 252:1 / / rw,relatime - ext4 /dev/vda1 rw
40 27 0:45 / /mnt/shared\\040data rw,relatime - nfs4 server:/export rw,vers=4.2
41 40 0:46 / /mnt/shared\\040data/scratch rw,relatime - tmpfs tmpfs rw
42 27 0:47 / /mnt/bucket rw,relatime - fuse.s3fs s3fs rw
"""


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/home/me/run", "ext4"),
        ("/mnt/shared data/run/checkpoint-5", "nfs4"),
        ("/mnt/shared data/scratch/run", "tmpfs"),
        ("/mnt/shared datax/run", "ext4"),  # a longer name is not inside the mount point
        ("/mnt/bucket/run", "fuse.s3fs"),
    ],
)
def test_file_system_type_is_the_longest_mount_point_above(tmp_path: Path, path: str, kind: str) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(_MOUNTINFO)
    assert _file_system_type(path, str(info)) == kind


def test_default_jobs_by_file_system(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptdoctor.sources.local as local_source

    threads = max(1, min(8, (os.cpu_count() or 1) * 2))
    monkeypatch.setattr(local_source, "_file_system_type", lambda path: "ext4")
    assert default_jobs(str(tmp_path)) == 1  # local disk: parsing holds the GIL, threads only contend
    monkeypatch.setattr(local_source, "_file_system_type", lambda path: "nfs4")
    assert default_jobs(str(tmp_path)) == threads
    monkeypatch.setattr(local_source, "_file_system_type", lambda path: None)  # unknown: assume it waits
    assert default_jobs(str(tmp_path)) == threads
    assert default_jobs("s3://bucket/run/") == threads
    assert default_jobs() == threads  # --deep: numpy and hashing release the GIL


def test_this_machines_scratch_is_a_known_local_file_system(tmp_path: Path) -> None:
    if not os.path.exists("/proc/self/mountinfo"):
        pytest.skip("no /proc/self/mountinfo")
    assert _file_system_type(str(tmp_path)) is not None


@pytest.mark.parametrize("jobs", [1, 3])
def test_a_long_scan_shows_a_file_counter_then_erases_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, jobs: int
) -> None:
    import io

    from ckptdoctor import progress

    clock = iter(range(10_000))
    lock = threading.Lock()

    def tick_tock() -> float:  # one second per call: every tick redraws
        with lock:
            return float(next(clock))

    monkeypatch.setattr(progress, "_clock", tick_tock)
    monkeypatch.setattr(progress, "DELAY", 0.0)
    run = make_run(tmp_path / "run", steps=(2, 4, 6))
    stream = io.StringIO()
    report = scan(str(run), jobs=jobs, progress=stream)
    text = stream.getvalue()
    files = report.files
    assert f"ckptdoctor: read {files:,} files" in text  # the last count drawn is every file
    assert text.endswith("\r") and text.rstrip("\r").endswith(" ")  # erased: the report starts on a clean line


def test_a_quick_scan_draws_nothing(tmp_path: Path) -> None:
    import io

    stream = io.StringIO()
    scan(str(make_run(tmp_path / "run")), progress=stream)
    assert stream.getvalue() == ""


@pytest.mark.parametrize(("wait", "shown"), [(0.3, True), (0.0, False)])
def test_a_slow_listing_says_what_it_waits_for(monkeypatch: pytest.MonkeyPatch, wait: float, shown: bool) -> None:
    """Offline, gcsfs retries for ~50 s before `scan gs://...` can answer: a terminal is told what it waits for."""
    import io
    import time

    from ckptdoctor import progress

    monkeypatch.setattr(progress, "DELAY", 0.1)
    stream = io.StringIO()
    with progress.Waiting(stream, "listing gs://bucket/run"):
        time.sleep(wait)
    time.sleep(0.2)  # a cancelled timer never fires late
    assert stream.getvalue() == ("ckptdoctor: listing gs://bucket/run ...\n" if shown else "")
    with progress.Waiting(None, "listing"):  # not a terminal: nothing, no thread
        pass
