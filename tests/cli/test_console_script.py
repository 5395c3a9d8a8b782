"""The tests of the command line run the installed console script (``tests/helpers/console.py``); in CI, where the
README's command installs it, its absence is a failure rather than a silent fall-back to ``python -m``."""

from __future__ import annotations

import pytest

import ckptdoctor
from tests.helpers.console import IN_CI, SCRIPT, command, run


def test_the_installed_console_script_runs_this_checkout() -> None:
    if not SCRIPT.exists():
        if IN_CI:
            pytest.fail(f"{SCRIPT} is missing: the README's `pip install -e .` installs the console script")
        pytest.skip(f"{SCRIPT} is not installed (`pip install -e .` makes it); the tests run `python -m ckptdoctor`")
    assert command() == [str(SCRIPT)]
    proc = run("--version")
    assert (proc.returncode, proc.stdout.strip()) == (0, f"ckptdoctor, version {ckptdoctor.__version__}")
