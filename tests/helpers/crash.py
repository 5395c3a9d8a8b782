"""Helpers shared by several test files (moved from tests/fixer/test_fix_crash.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ckptdoctor import fixer as fixmod
from ckptdoctor.findings import OpKind
from tests.helpers.fixing import run_cli, tree_state


def _kill_at(root: Path, point: str, *args: str, env_name: str = fixmod.CRASH_ENV) -> None:
    env = {**os.environ, env_name: point}
    proc = subprocess.run(
        [sys.executable, "-m", "ckptdoctor", *args, str(root)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, (point, proc.returncode, proc.stdout, proc.stderr)


def _points(kinds: list[OpKind]) -> list[str]:
    from tests.helpers.crash import EXCHANGE  # here: that module imports this one

    points = fixmod.crash_points(kinds)
    if EXCHANGE:  # where the atomic exchange works, a rewrite also passes `op:<k>:exchanged`
        for k, kind in enumerate(kinds, 1):
            if kind != OpKind.QUARANTINE:
                points.insert(points.index(f"op:{k}:saved") + 1, f"op:{k}:exchanged")
    return points


def recover_either_way(root: Path, txid: str, direction: str, mixed: dict[str, Any], point: object) -> None:
    """After a kill: `undo` restores the tree as it was, or `fix` completes the transaction, which then undoes."""
    if direction == "undo":
        code, out = run_cli("undo", str(root))
        assert code == 0, (point, out)
        assert tree_state(root) == mixed["before"], point
    else:
        code, out = run_cli("fix", str(root))
        assert f"completed interrupted transaction {txid}" in out, (point, out)
        assert tree_state(root) == mixed["planned"], point
        # the completed transaction is undoable like any other
        assert run_cli("undo", "--txid", txid, str(root))[0] == 0
        assert tree_state(root) == mixed["before"], point


def _can_exchange() -> bool:
    """Whether ``renameat2(RENAME_EXCHANGE)`` works here (Linux 3.15+, a filesystem that supports it)."""
    with tempfile.TemporaryDirectory() as d:
        a, b = os.path.join(d, "a"), os.path.join(d, "b")
        for p in (a, b):
            Path(p).write_bytes(p.encode())
        try:
            fixmod.rename_exchange(a, b)
        except OSError:
            return False
        return Path(a).read_bytes() == b.encode()


EXCHANGE = _can_exchange()
