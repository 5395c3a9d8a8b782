"""Fixtures shared by the discovery tests."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


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
