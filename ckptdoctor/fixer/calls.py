"""The write calls (the fault-injection seam), and the durable writes built on them."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptdoctor.fixer.errors import FixRefused
from ckptdoctor.fixer.paths import CHUNK, CLOEXEC, NOFOLLOW


def _link(src: str, dst: str) -> None:
    os.link(src, dst, follow_symlinks=False)


def _utime(path: str, times_ns: tuple[int, int]) -> None:
    os.utime(path, ns=times_ns, follow_symlinks=False)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# errnos meaning "no atomic exchange here" (a kernel before 3.15, a filesystem without it): fall back to replacing.
NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP}


def _load_renameat2() -> Any:
    """Linux's ``renameat2`` from the C library, or None (another system, or a C library without it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _load_renameat2()


def rename_exchange(a: str, b: str) -> None:
    """Swap the names ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``): both must exist.

    Raises ``OSError(ENOSYS)`` where the call does not exist and whatever the kernel returns otherwise (``EINVAL``
    from a filesystem that cannot exchange); the caller falls back to ``os.replace`` for ``NO_EXCHANGE``.
    """
    if _RENAMEAT2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available", a, None, b)
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), a, None, b)


@dataclass
class WriteCalls:
    """Every system call through which the fixer changes the disk (reads go straight to ``os``).

    Tests replace the module's ``CALLS`` with an instance whose functions fail with ``ENOSPC``/``EIO`` at the
    k-th call, and check the tree is left as before or as planned, and that ``undo`` still works.
    """

    open: Callable[[str, int, int], int] = os.open
    write: Callable[[int, bytes], int] = os.write
    fsync: Callable[[int], None] = os.fsync
    fchmod: Callable[[int, int], None] = os.fchmod
    replace: Callable[[str, str], None] = os.replace
    rename: Callable[[str, str], None] = os.rename
    link: Callable[[str, str], None] = _link
    mkdir: Callable[[str, int], None] = os.mkdir
    unlink: Callable[[str], None] = os.unlink
    rmdir: Callable[[str], None] = os.rmdir
    utime: Callable[[str, tuple[int, int]], None] = _utime
    exchange: Callable[[str, str], None] = rename_exchange

    NAMES = (
        "open", "write", "fsync", "fchmod", "replace", "rename", "link", "mkdir", "unlink", "rmdir", "utime", "exchange"
    )  # fmt: skip


CALLS = WriteCalls()


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to ``fd`` in chunks, through the injectable calls."""
    view = memoryview(data)
    while view:
        n = CALLS.write(fd, bytes(view[:CHUNK]))
        view = view[n:]


def fsync_dir(path: str) -> None:
    """fsync the folder ``path``, so a rename or a new name in it is durable."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | CLOEXEC)
    try:
        CALLS.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` through a fsynced temp file and ``os.replace``; the folder is fsynced too."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = CALLS.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, mode)
    try:
        try:
            write_all(fd, data)
            CALLS.fsync(fd)
        finally:
            os.close(fd)
        CALLS.replace(tmp, path)
    except OSError:
        quietly(CALLS.unlink, tmp)
        raise
    fsync_dir(os.path.dirname(path))


def quietly(fn: Callable[[str], None], path: str) -> None:
    """Best-effort cleanup of the fixer's own temp files and empty folders."""
    with contextlib.suppress(OSError):
        fn(path)


def ensure_dir(abs_root: str, rel: str) -> None:
    """Create ``rel`` (and its parents) below the root; an existing link or file in the way is a refusal."""
    cur = abs_root
    for part in rel.split("/"):
        cur = os.path.join(cur, part)
        try:
            CALLS.mkdir(cur, 0o755)
        except FileExistsError:
            st = os.lstat(cur)
            if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
                raise FixRefused(f"{cur} is not a plain folder; the fixer never writes through links") from None
