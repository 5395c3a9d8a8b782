"""Fixtures shared by the gate's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.builders import make_run


@pytest.fixture(scope="module")
def midway(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """checkpoint-2 and checkpoint-4 of an 8-step linear run (1 epoch of 8 steps), no training_args.bin."""
    return make_run(tmp_path_factory.mktemp("midway") / "out")
