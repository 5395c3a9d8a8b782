"""Hostile folder trees: the scan finishes, reports each oddity as a finding, never opens special files, never hangs."""

from __future__ import annotations

import os
import socket
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptdoctor.findings import Finding
from ckptdoctor.scanner import Report, scan
from tests.helpers.console import HANG_GUARD


def _scan(root: Path) -> Report:
    """Scan in a thread and fail (instead of hanging the suite) when it never finishes."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["report"] = scan(str(root))
        except BaseException as exc:  # reported below with the traceback
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(HANG_GUARD)
    assert not t.is_alive(), f"scan of {root} hangs"
    if "error" in box:
        raise box["error"]
    return box["report"]  # type: ignore[no-any-return]


class _Work:
    """What a scan costs the process, as counts: bytes through ``read()`` (``/proc/self/io`` ``rchar``, every thread)
    and the paths ``os.open`` was asked for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        if not os.path.exists("/proc/self/io"):
            pytest.skip("no /proc/self/io to count the bytes read")
        self.opened: list[str] = []
        real_open = os.open

        def counting_open(path: Any, *args: Any, **kwargs: Any) -> int:
            self.opened.append(os.fsdecode(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(os, "open", counting_open)
        self.start = self._rchar()

    @staticmethod
    def _rchar() -> int:
        with open("/proc/self/io", encoding="ascii") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))

    @property
    def bytes_read(self) -> int:
        """Bytes the process read since the start (the scan's, plus a few of pytest's own: a loose upper bound)."""
        return self._rchar() - self.start


def _at(report: Report, suffix: str) -> list[Finding]:
    return [f for f in report.findings if f.path.endswith(suffix)]


def test_symlink_loops_and_links_out_of_the_root(tmp_path: Path) -> None:
    ck = tmp_path / "run" / "checkpoint-1"
    ck.mkdir(parents=True)
    (ck / "config.json").write_text("{}")
    os.symlink("b", ck / "a")
    os.symlink("a", ck / "b")  # a <-> b
    os.symlink("..", ck / "up")  # a folder link back to its parent
    os.symlink("/etc/hostname", ck / "outside.bin")
    os.symlink(tmp_path.parent, ck / "outside-dir")
    os.symlink("missing", ck / "broken.pt")
    report = _scan(tmp_path / "run")
    assert any(f.rule == "CKD001" for f in _at(report, "/a") + _at(report, "/b"))
    assert any(f.rule == "CKD604" for f in _at(report, "outside.bin"))
    assert any(f.rule == "CKD604" for f in _at(report, "outside-dir"))
    assert _at(report, "/up") and _at(report, "broken.pt")


def test_fifos_sockets_and_devices_are_reported_never_opened(tmp_path: Path) -> None:
    ck = tmp_path / "checkpoint-1"
    ck.mkdir()
    os.mkfifo(ck / "optimizer.pt")  # opening it for reading would block forever
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(ck / "rng_state.pth"))
    names = ["optimizer.pt", "rng_state.pth"]
    try:
        os.mknod(ck / "model.safetensors", stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero: reads forever
        names.append("model.safetensors")
    except (PermissionError, OSError):
        pass  # no CAP_MKNOD here: FIFO and socket still cover "never opened"
    try:
        report = _scan(tmp_path)
    finally:
        sock.close()
    for name in names:
        assert any(f.rule == "CKD001" and "never opened" in f.message for f in _at(report, name)), name


def test_sparse_files_with_absurd_sizes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four 1 TiB files (holes) cost what their headers, directories and tails cost: a few reads each, never the
    terabyte (issue 26: this asserted a wall time, which a loaded machine broke)."""
    ck = tmp_path / "checkpoint-1"
    (ck / "optimizer_0").mkdir(parents=True)
    for name in ("model.safetensors", "pytorch_model.bin", "optimizer.pt", "optimizer_0/__0_0.distcp"):
        with open(ck / name, "wb") as f:
            f.truncate(1 << 40)  # 1 TiB of hole
    (ck / "optimizer_0" / ".metadata").write_bytes(b"")
    with open(ck / "model.safetensors", "r+b") as f:
        f.write((1 << 40).to_bytes(8, "little") + b'{"w": ')  # a header length far past any limit
    work = _Work(monkeypatch)
    report = _scan(tmp_path)
    assert work.bytes_read < 8 << 20, work.bytes_read  # 1 TiB x 4 on disk
    opened = [Path(p).name for p in work.opened if p.startswith(str(tmp_path))]
    # each file opened, the .distcp once more for the items its .metadata names, nothing else
    assert sorted(opened) == sorted(
        ["model.safetensors", "pytorch_model.bin", "optimizer.pt", "__0_0.distcp", "__0_0.distcp", ".metadata"])
    assert _at(report, "model.safetensors")


def test_100k_empty_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """100,000 empty files: each listed once and opened at most once; nothing else is read."""
    ck = tmp_path / "checkpoint-1"
    ck.mkdir()
    for i in range(100_000):
        (ck / f"f{i}.bin").touch()
    work = _Work(monkeypatch)
    report = _scan(tmp_path)
    assert report.files >= 100_000
    opened = [p for p in work.opened if p.startswith(str(tmp_path))]
    assert len(opened) == len(set(opened)) <= 100_000
    assert work.bytes_read < 8 << 20, work.bytes_read


def test_deep_nesting(tmp_path: Path) -> None:
    d = tmp_path
    for _ in range(300):
        d = d / "d"
    d.mkdir(parents=True)
    (d / "optimizer.pt").write_bytes(b"\x80\x02}.")
    report = _scan(tmp_path)
    assert any(f.rule == "CKD001" for f in report.findings)


def test_permission_denied_files_and_folders(tmp_path: Path, deny: Callable[[Path], None]) -> None:
    ck = tmp_path / "run" / "checkpoint-1"
    (ck / "sub").mkdir(parents=True)
    (ck / "optimizer.pt").write_bytes(b"\x80\x02}.")
    (ck / "sub" / "x.bin").write_bytes(b"\x80\x02}.")
    deny(ck / "optimizer.pt")
    deny(ck / "sub")
    report = _scan(tmp_path / "run")
    assert any(f.rule == "CKD001" and "ermission" in f.message for f in _at(report, "optimizer.pt"))
    assert any(f.rule == "CKD001" and "ermission" in f.message for f in _at(report, "sub"))


def test_non_utf8_names(tmp_path: Path) -> None:
    ck = tmp_path / "checkpoint-1"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    bad = os.path.join(os.fsencode(ck), b"opt\xff\xfe.pt")
    with open(bad, "wb") as f:
        f.write(b"\x80\x02}.")
    os.mkdir(os.path.join(os.fsencode(ck), b"dir\xff"))
    report = _scan(tmp_path)
    assert sum(1 for f in report.findings if f.rule == "CKD001" and "UTF-8" in f.message) >= 2
