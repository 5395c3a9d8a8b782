"""Task functions for the fan-out tests (``ckptdoctor.fanout``): they run on Dask workers, so they live in a module
the workers import by name. Each wraps the real task and adds one failure."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

from ckptdoctor.fanout import Done


def killed_once(marker: str, run: Callable[..., Done], *args: Any) -> Done:
    """``run(*args)``, except for the first task of all to get here: it kills its own worker process (SIGKILL, as
    the kernel's OOM killer or a lost machine would) and leaves ``marker`` behind to say so."""
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return run(*args)
    os.close(fd)
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: the process is gone")


def fails_at(rel: str, run: Callable[..., Done], *args: Any) -> Done:
    """``run(*args)``, except that the task of the folder ``rel`` raises every time (a folder task's third argument
    is its ``FolderTask``, of six; a root task's first is the opened root, whose folder is ".")."""
    folder = args[2].rel if len(args) == 6 else "."
    if folder == rel:
        raise OSError(f"injected: the worker cannot read {rel}")
    return run(*args)


def other_version(run: Callable[..., Done], *args: Any) -> Done:
    """``run(*args)`` as a worker running another ckptdoctor would answer it."""
    return Done("0.0.1", run(*args).value)


def cache_home(path: str | None) -> str | None:
    """Point this process's verdict cache at ``path`` (``XDG_CACHE_HOME``; None: unset it) and return what it was:
    ``client.run`` calls it on each worker, whose environment is the one the cluster started with."""
    old = os.environ.get("XDG_CACHE_HOME")
    if path is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = path
    return old
