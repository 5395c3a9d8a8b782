"""Regular expressions compiled when first used.

Compiling a pattern costs about half a million instructions, at import: of the 36 patterns the modules of a scan
compile, 22 are never used by a rescan that takes its facts from the verdict cache (nor by most scans: DeepSpeed's,
accelerate's, Lightning's and torchtitan's names, a text report's escapes), and they were 1 % of that rescan.
``lazy(pattern)`` stands for ``re.compile(pattern)`` and compiles it at its first use.
"""

from __future__ import annotations

import re
from typing import Any, cast

# What a pattern offers that the package calls on one (each becomes the compiled pattern's own at the first use)
_OWN = ("match", "fullmatch", "search", "sub", "subn", "split", "findall", "finditer", "pattern", "flags", "groups",
        "groupindex")  # fmt: skip


class _Lazy:
    """A pattern not compiled yet: the first attribute asked of it compiles it and puts the compiled pattern's
    methods and attributes on this object, so every later call finds them directly (``__getattr__`` runs only for
    a name an object lacks)."""

    def __init__(self, pattern: str, flags: int) -> None:
        self._source = (pattern, flags)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_source":  # not a pattern's (a copy made without __init__ asks these)
            raise AttributeError(name)
        compiled = re.compile(*self._source)
        for own in _OWN:  # two threads may both compile it: they set the same values
            setattr(self, own, getattr(compiled, own))
        return getattr(compiled, name)

    def __repr__(self) -> str:
        return f"lazy({self._source[0]!r})"


def lazy(pattern: str, flags: int = 0) -> re.Pattern[str]:
    """``re.compile(pattern, flags)``, compiled when first used (a module-level pattern that a scan may never use).
    Only its methods and attributes are the compiled pattern's: pass it to nothing that asks for a ``re.Pattern``
    (``re.sub(lazy(...), ...)``, ``isinstance``)."""
    return cast("re.Pattern[str]", _Lazy(pattern, flags))
