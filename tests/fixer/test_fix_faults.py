"""The fixer under faults: ENOSPC, EIO or EROFS from the k-th write call (for every k) leaves the tree exactly as
before or exactly as planned, and `undo` restores the original afterwards; a disk that stays full from call k on,
and faults during an undo, are recovered by running `undo` (again) once the disk is healthy."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptdoctor import fixer as fixmod
from ckptdoctor.fixer import calls as fixcalls
from tests.helpers.fixing import age, clone, mixed_run, run_cli, tree_state


class Faults:
    """A ``WriteCalls`` whose calls are counted; from call ``fail_at`` on (once, or every call when
    ``persistent``) they raise ``OSError(err)`` instead of running."""

    # A full disk refuses what allocates space; renames, unlinks and timestamps still work.
    ALLOCATING = frozenset({"open", "write", "mkdir", "link", "fsync"})

    def __init__(self, fail_at: int, err: int = errno.ENOSPC, persistent: bool = False) -> None:
        self.fail_at, self.err, self.persistent = fail_at, err, persistent
        self.calls: list[str] = []
        self.failed = False

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            self.calls.append(name)
            n = len(self.calls)
            if n == self.fail_at or (self.persistent and n > self.fail_at and name in self.ALLOCATING):
                self.failed = True
                raise OSError(self.err, os.strerror(self.err))
            return fn(*args)

        return call

    def calls_obj(self) -> fixmod.WriteCalls:
        base = fixmod.WriteCalls()
        return fixmod.WriteCalls(**{n: self._wrap(n, getattr(base, n)) for n in fixmod.WriteCalls.NAMES})


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Faults | None], None]]:
    def install(f: Faults | None) -> None:
        monkeypatch.setattr(fixcalls, "CALLS", f.calls_obj() if f else fixmod.WriteCalls())

    yield install


@pytest.fixture(scope="module")
def faults_mixed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("faults")
    (base / "src").mkdir()
    src = age(mixed_run(base / "src"))
    done = clone(src, base / "done")
    counter = Faults(10**9)
    saved = fixcalls.CALLS
    fixcalls.CALLS = counter.calls_obj()
    try:
        run_cli("fix", str(done))
    finally:
        fixcalls.CALLS = saved
    return {"src": src, "before": tree_state(src), "planned": tree_state(done), "calls": counter.calls}


def test_the_seam_sees_every_kind_of_write(faults_mixed: dict[str, Any]) -> None:
    assert {"open", "write", "fsync", "replace", "rename", "link", "mkdir", "utime"} <= set(faults_mixed["calls"])


def test_single_fault_at_every_call(faults_mixed: dict[str, Any], tmp_path: Path, faults: Any) -> None:
    errs = (errno.ENOSPC, errno.EIO, errno.EROFS)
    outcomes: set[str] = set()
    for k in range(1, len(faults_mixed["calls"]) + 1):
        root = clone(faults_mixed["src"], tmp_path / f"k{k}")
        f = Faults(k, errs[k % 3])
        faults(f)
        code, out = run_cli("fix", str(root))
        faults(None)
        assert f.failed, k
        state = tree_state(root)
        assert state in (faults_mixed["before"], faults_mixed["planned"]), (k, faults_mixed["calls"][k - 1], out)
        if code == 2:
            assert "failed" in out or "cannot lock" in out, out
        code, out = run_cli("undo", str(root))
        if state == faults_mixed["planned"]:
            assert code == 0, (k, out)
        else:
            assert (code == 2 and "no fix transaction to undo" in out) or "restored 0 operations" in out, (k, out)
        assert tree_state(root) == faults_mixed["before"], (k, faults_mixed["calls"][k - 1])
        outcomes.add("planned" if state == faults_mixed["planned"] else "before")
    assert outcomes == {"planned", "before"}


def test_persistent_fault_then_undo(faults_mixed: dict[str, Any], tmp_path: Path, faults: Any) -> None:
    outcomes: set[str] = set()
    for k in range(1, len(faults_mixed["calls"]) + 1, 3):
        root = clone(faults_mixed["src"], tmp_path / f"p{k}")
        faults(Faults(k, errno.ENOSPC, persistent=True))
        code, out = run_cli("fix", str(root))
        faults(None)
        if tree_state(root) != faults_mixed["before"]:
            outcomes.add("partial")
            assert "ckptdoctor undo" in out, (k, out)  # the message says how to recover
            code, out = run_cli("undo", str(root))
            assert code == 0, (k, out)
        else:
            outcomes.add("rolled back")
        assert tree_state(root) == faults_mixed["before"], (k, faults_mixed["calls"][k - 1], out)
    assert outcomes == {"partial", "rolled back"}


def test_fault_during_undo_then_undo_again(faults_mixed: dict[str, Any], tmp_path: Path, faults: Any) -> None:
    probe = clone(faults_mixed["src"], tmp_path / "probe")
    run_cli("fix", str(probe))
    counter = Faults(10**9)
    faults(counter)
    assert run_cli("undo", str(probe))[0] == 0
    faults(None)
    for k in range(1, len(counter.calls) + 1, 2):
        root = clone(faults_mixed["src"], tmp_path / f"u{k}")
        run_cli("fix", str(root))
        faults(Faults(k, errno.EIO))
        code, out = run_cli("undo", str(root))
        faults(None)
        if code != 0:
            assert "undo" in out, out
            code, out = run_cli("undo", str(root))
        assert code == 0 or "no fix transaction" in out, (k, out)
        assert tree_state(root) == faults_mixed["before"], (k, counter.calls[k - 1])
