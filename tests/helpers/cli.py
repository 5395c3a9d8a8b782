"""Helpers shared by several test files (moved from tests/cli/test_adversarial.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

from click.testing import CliRunner

from ckptdoctor.cli import main
from tests.helpers.paths import REPO

FIXTURES = REPO / "fixtures"


def invoke(*args: str) -> tuple[int, str, str]:
    """Run the CLI in-process; a traceback (any exception but SystemExit) fails the test."""
    result = CliRunner().invoke(main, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def copy_fixture(name: str, dest: Path) -> Path:
    shutil.copytree(FIXTURES / name, dest)
    return dest
