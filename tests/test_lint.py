"""ruff and mypy (strict, configured in pyproject.toml) stay clean: CI runs them through the test command."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(),
                    reason="ruff not installed")
def test_ruff_is_clean() -> None:
    p = subprocess.run([sys.executable, "-m", "ruff", "check", "ckptdoctor", "tests", "bench", "fixtures"],
                       cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_mypy_is_clean() -> None:
    pytest.importorskip("mypy")
    p = subprocess.run([sys.executable, "-m", "mypy"], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
