"""Test hook: kill the fixer with SIGKILL at a named point (never set in normal use)."""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence

from ckptdoctor.findings import OpKind

CRASH_ENV = "CKPTDOCTOR_TEST_CRASH"
CRASH_AFTER_OP_ENV = "CKPTDOCTOR_TEST_CRASH_AFTER_OP"


def crash_points(kinds: Sequence[OpKind]) -> list[str]:
    """Every point where ``CKPTDOCTOR_TEST_CRASH`` can kill a fix whose operations have these kinds, in order.

    A rewrite also has ``op:<k>:exchanged`` (after the atomic exchange, before its check), reached only where the
    exchange is available, so it is not listed here.
    """
    points = ["journal"]
    for k, kind in enumerate(kinds, 1):
        if kind != OpKind.QUARANTINE:
            points += [f"op:{k}:temp", f"op:{k}:saved"]
        points += [f"op:{k}:moved", f"op:{k}"]
    return points


def crash_point(name: str) -> None:
    """Test hook: die here, as a SIGKILL would, when the environment names this point."""
    if os.environ.get(CRASH_ENV) == name or (
        name.startswith("op:") and name.count(":") == 1 and os.environ.get(CRASH_AFTER_OP_ENV) == name[3:]
    ):
        os.kill(os.getpid(), signal.SIGKILL)
