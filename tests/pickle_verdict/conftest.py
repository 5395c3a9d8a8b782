"""Fixtures shared by the pickle-judging tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ckptdoctor.pickle_verdict import policy as pickle_policy


@pytest.fixture
def fresh_policy_caches() -> Iterator[None]:
    """Source facts are cached per process; tests that add or remove packages start and end clean."""
    pickle_policy.clear_caches()
    yield
    pickle_policy.clear_caches()
