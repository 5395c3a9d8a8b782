"""What every test shares: no test reads or writes the user's real verdict cache, and none sees the readers' memos
another test filled.

Each test gets a cache folder of its own (``XDG_CACHE_HOME`` in a temporary folder beside the test's ``tmp_path``,
never inside it), which the commands a test runs in another process inherit, and no ``CKPTDOCTOR_CACHE``: the
cache is on, as it is by default, except where a test turns it off, and a test never sees an entry another test
(or the developer's own scans) left.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _fresh_memos() -> None:
    """The readers' memos start empty, as in a fresh process: a test that expects a parse to be remembered between
    its reads cannot fail because earlier tests in the same worker filled the memo (cleared when full) meanwhile."""
    from ckptdoctor.readers.seen import forget_all

    forget_all()


@pytest.fixture(autouse=True)
def _private_cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    # Not through ``monkeypatch``: a test's own ``monkeypatch`` would then be undone only after the teardown of the
    # folders' fixtures (which may need their patches gone first).
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    switch = os.environ.pop("CKPTDOCTOR_CACHE", None)  # the default, unless a test says otherwise
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = old
        if switch is not None:
            os.environ["CKPTDOCTOR_CACHE"] = switch
