"""Build something costly once per test session, however many pytest-xdist workers ask for it."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def once_per_session(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Any]) -> Any:
    """``build(folder)``'s JSON result, ``folder`` being ``name`` under the session's temporary root.

    pytest-xdist workers share that root (each worker's base is its ``popen-gwN`` child): the first worker to take
    the lock builds, the others wait for it and read its result, so a real training run a module fixture needs is
    written once, not once per worker."""
    shared = factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # popen-gwN's parent: this session's root, the same for every worker
    folder, done = shared / name, shared / f"{name}.json"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            folder.mkdir(exist_ok=True)
            done.write_text(json.dumps(build(folder)))
        return json.loads(done.read_text())
