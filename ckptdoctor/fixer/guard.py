"""Refusals before anything is written: the root lock (one fixer per root) and the preflight."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import stat
import time

from ckptdoctor.findings import OpKind
from ckptdoctor.fixer import calls
from ckptdoctor.fixer.calls import ensure_dir, quietly, write_all
from ckptdoctor.fixer.errors import FixRefused
from ckptdoctor.fixer.paths import CLOEXEC, NOFOLLOW, OWN_DIR, abs_path, is_under, own_path, parent_rel
from ckptdoctor.fixer.plan import RootPlan

BUSY_SECONDS = 60.0  # a checkpoint touched more recently than this may still be being written

_HELD: set[str] = set()  # lock files this process holds (a lock with our pid that is not here is stale)


class RootLock:
    """``<root>/.ckptdoctor/lock``, created with O_CREAT|O_EXCL and holding ``pid host time``: one fixer per root.

    A lock whose process is gone (same host, pid not alive) is stale and is taken over; a lock from another host
    is never judged stale (remove it by hand when you know no fixer runs there).
    """

    def __init__(self, abs_root: str) -> None:
        self.abs_root = abs_root
        self.path = own_path(abs_root, "lock")
        self.held = False
        self.created: tuple[int, int] | None = None  # the root's times, when this lock creates `.ckptdoctor/`

    def __enter__(self) -> RootLock:
        try:
            if not os.path.lexists(own_path(self.abs_root)):
                st = os.lstat(self.abs_root)
                self.created = (st.st_atime_ns, st.st_mtime_ns)
            ensure_dir(self.abs_root, OWN_DIR)
            for _ in range(3):
                try:
                    fd = calls.CALLS.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o644)
                except FileExistsError:
                    self._take_over_stale()
                    continue
                self.held = True
                _HELD.add(self.path)
                try:
                    write_all(fd, f"{os.getpid()} {socket.gethostname()} {time.time():.0f}\n".encode())
                    calls.CALLS.fsync(fd)
                finally:
                    os.close(fd)
                return self
        except OSError as e:
            self.__exit__()
            raise FixRefused(f"cannot lock {self.abs_root}: {e.strerror or e}; nothing was changed") from None
        except BaseException:  # a refusal, or Ctrl-C: `with` calls no __exit__ when __enter__ raises
            self.__exit__()
            raise
        raise FixRefused(f"cannot lock {self.abs_root}: the lock keeps changing hands; nothing was changed")

    def __exit__(self, *exc: object) -> None:
        if self.held:
            self.held = False
            _HELD.discard(self.path)
            quietly(calls.CALLS.unlink, self.path)
        if self.created is not None:
            # A refusal leaves no trace: the folder goes when empty, and the root keeps its mtime either way.
            quietly(calls.CALLS.rmdir, own_path(self.abs_root, "journal"))
            quietly(calls.CALLS.rmdir, own_path(self.abs_root))
            with contextlib.suppress(OSError):
                calls.CALLS.utime(self.abs_root, self.created)
            self.created = None

    def _holder(self, path: str) -> tuple[int, str] | None:
        """The lock's ``(pid, host)``; None when it cannot be read as one. Never through a link, never blocking on
        a FIFO: the lock file may come with a downloaded folder."""
        try:
            fd = os.open(path, os.O_RDONLY | NOFOLLOW | CLOEXEC | getattr(os, "O_NONBLOCK", 0))
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return None
                pid, host = os.read(fd, 200).decode("utf-8", "replace").split()[:2]
            finally:
                os.close(fd)
            return int(pid), host
        except (OSError, ValueError):
            return None

    def _take_over_stale(self) -> None:
        holder = self._holder(self.path)
        if holder is None:
            try:
                age = time.time() - os.lstat(self.path).st_mtime
            except FileNotFoundError:
                return
            if age < BUSY_SECONDS:  # being written by a starting fixer
                raise FixRefused(f"another ckptdoctor is starting on {self.abs_root} ({self.path}); try again")
        else:
            pid, host = holder
            mine = pid == os.getpid() and self.path not in _HELD  # left by an earlier call in this process
            if host != socket.gethostname() or (_alive(pid) and not mine):
                raise FixRefused(
                    f"another ckptdoctor (pid {pid} on {host}) is working on {self.abs_root}; if it is not, "
                    f"remove {self.path}"
                )
        # Move the stale lock aside under a name of our own, then check it is still the one we judged stale.
        aside = f"{self.path}.stale-{os.getpid()}-{secrets.token_hex(3)}"
        try:
            calls.CALLS.rename(self.path, aside)
        except FileNotFoundError:
            return
        if self._holder(aside) != holder:  # a live fixer replaced it meanwhile: give it back
            with contextlib.suppress(OSError):
                calls.CALLS.link(aside, self.path)
            quietly(calls.CALLS.unlink, aside)
            raise FixRefused(f"another ckptdoctor took the lock on {self.abs_root}; try again")
        quietly(calls.CALLS.unlink, aside)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_only_fd(path: str) -> bool:
    """True for a folder or file nobody may write: a read-only mount, no access, or no write bit at all (the
    last one matters when running as root, which the permission bits do not stop)."""
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return True
        st = os.stat(path)
    except OSError:
        return True
    need = os.W_OK | (os.X_OK if stat.S_ISDIR(st.st_mode) else 0)
    return not os.access(path, need) or not st.st_mode & 0o222


def preflight(plan: RootPlan, *, force: bool = False, now: float | None = None) -> None:
    """Refuse (``FixRefused``) a read-only tree, accelerate's ``checkpoints/`` folder as the root, or, unless
    ``force``, a run written in the last 60 seconds."""
    root = plan.abs_root
    if any(run.entries and run.path in ("", ".") for run in plan.tree.runs):
        # `Accelerator.load_state()` sorts every entry there by the number in its name: our own folder has none
        raise FixRefused(
            f"{plan.root} is accelerate's automatic `checkpoints/` folder: the fixer's `{OWN_DIR}/` folder there "
            "would make `Accelerator.load_state()` raise IndexError; fix the project folder above it; nothing was "
            "changed"
        )
    places = {"."} | {parent_rel(op.path) for op in plan.ops}
    places |= {op.path for op in plan.ops if op.is_dir or op.kind != OpKind.QUARANTINE}
    if os.path.isdir(own_path(root)):
        places.add(OWN_DIR)
    locked = sorted(p for p in places if read_only_fd(abs_path(root, p) if p != "." else root))
    if locked:
        shown = ", ".join(f"`{p}`" for p in locked[:5])
        raise FixRefused(f"{plan.root} is read-only ({shown} cannot be written); nothing was changed")
    if force:
        return
    now = time.time() if now is None else now
    fresh: list[str] = []
    for run in plan.tree.runs:
        if not any(is_under(op.path, run.path) or is_under(run.path, op.path) for op in plan.ops):
            continue
        for ck in run.checkpoints:
            try:
                mtime = max(ck.mtime, os.lstat(abs_path(root, ck.path) if ck.path != "." else root).st_mtime)
            except OSError:
                mtime = ck.mtime
            if now - mtime < BUSY_SECONDS:
                fresh.append(f"`{ck.path}` ({max(0.0, now - mtime):.0f} s ago)")
    if fresh:
        raise FixRefused(
            f"{plan.root} looks like a run being written: {', '.join(fresh[:5])} modified within the last "
            f"{BUSY_SECONDS:.0f} s. Wait for the save to finish, or pass --force; nothing was changed"
        )
