"""Where the suite finds the repository and its own data, for test files at any depth."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
