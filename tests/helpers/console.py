"""The installed ``ckptdoctor`` console script, as users and CI run it: one helper for the tests that go through it.

``pip install -e .`` writes the script next to the interpreter (``Path(sys.executable).parent / "ckptdoctor"``);
with this checkout first on ``PYTHONPATH`` it imports this checkout. Where the script is absent (the package not
installed) the tests fall back to ``python -m ckptdoctor``, and ``tests/cli/test_console_script.py`` fails in CI
(``.ci/run``'s ``.ci-venv``), where the README's command installs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from tests.helpers.paths import REPO

SCRIPT = Path(sys.executable).parent / "ckptdoctor"
IN_CI = ".ci-venv" in Path(sys.prefix).parts  # .ci/run's fresh venv, where `pip install -e .` made the script
# Seconds after which a test gives up on a command or a scan: a hang guard, never a timing (only what never ends
# reaches it on a loaded machine). A test that bounds cost counts work instead (bytes read, files opened, calls);
# timings live in bench/.
HANG_GUARD = 600.0


def command() -> list[str]:
    """The argv prefix that runs the installed script, else ``python -m ckptdoctor`` when it is absent."""
    return [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "ckptdoctor"]


def environ(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``os.environ`` plus ``env``, with this checkout first on ``PYTHONPATH`` (the script imports it, not the
    installed copy)."""
    out = {**os.environ, **(env or {})}
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), out.get("PYTHONPATH", "")) if p)
    return out


def run(
    *args: str,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = HANG_GUARD,
) -> subprocess.CompletedProcess[str]:
    """``ckptdoctor ARGS...`` through the installed console script; stdout and stderr captured as text."""
    return subprocess.run(
        [*command(), *args], cwd=cwd, env=environ(env), capture_output=True, text=True, timeout=timeout, check=False
    )
