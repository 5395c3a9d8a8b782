"""Hostile folder trees: the scan finishes, reports each oddity as a finding, never opens special files, never hangs."""

from __future__ import annotations

import errno
import os
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptdoctor.findings import Finding
from ckptdoctor.scanner import Report, scan


def _scan(root: Path, timeout: float = 60.0) -> Report:
    """Scan in a thread and fail (instead of hanging the suite) when it does not finish in ``timeout``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["report"] = scan(str(root))
        except BaseException as exc:  # reported below with the traceback
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"scan of {root} did not finish in {timeout} s"
    if "error" in box:
        raise box["error"]
    return box["report"]  # type: ignore[no-any-return]


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


def test_sparse_files_with_absurd_sizes(tmp_path: Path) -> None:
    ck = tmp_path / "checkpoint-1"
    (ck / "optimizer_0").mkdir(parents=True)
    for name in ("model.safetensors", "pytorch_model.bin", "optimizer.pt", "optimizer_0/__0_0.distcp"):
        with open(ck / name, "wb") as f:
            f.truncate(1 << 40)  # 1 TiB of hole
    (ck / "optimizer_0" / ".metadata").write_bytes(b"")
    with open(ck / "model.safetensors", "r+b") as f:
        f.write((1 << 40).to_bytes(8, "little") + b'{"w": ')  # a header length far past any limit
    t0 = time.monotonic()
    report = _scan(tmp_path)
    assert time.monotonic() - t0 < 20
    assert _at(report, "model.safetensors")


def test_100k_empty_files(tmp_path: Path) -> None:
    ck = tmp_path / "checkpoint-1"
    ck.mkdir()
    for i in range(100_000):
        (ck / f"f{i}.bin").touch()
    t0 = time.monotonic()
    report = _scan(tmp_path, timeout=120)
    took = time.monotonic() - t0
    assert report.files >= 100_000
    assert took < 60, took


def test_deep_nesting(tmp_path: Path) -> None:
    d = tmp_path
    for _ in range(300):
        d = d / "d"
    d.mkdir(parents=True)
    (d / "optimizer.pt").write_bytes(b"\x80\x02}.")
    report = _scan(tmp_path)
    assert any(f.rule == "CKD001" for f in report.findings)


@pytest.fixture
def deny(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Path], None]]:
    """Emulate permission-denied paths (the suite may run as root, for whom mode 000 changes nothing)."""
    denied: set[str] = set()
    real_open, real_scandir = os.open, os.scandir

    def fake_open(path: Any, *args: Any, **kwargs: Any) -> int:
        if os.fsdecode(path) in denied:
            raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(path))
        return real_open(path, *args, **kwargs)

    def fake_scandir(path: Any = ".") -> Any:
        if os.fsdecode(path) in denied:
            raise PermissionError(errno.EACCES, "Permission denied", os.fsdecode(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "scandir", fake_scandir)

    def add(p: Path) -> None:
        denied.add(str(p))
        p.chmod(0)

    yield add
    for p in denied:
        os.chmod(p, 0o700)


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
