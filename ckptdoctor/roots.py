"""The roots a command is asked about, built once at the door: each named once, each decided URL or path once.

``Roots.of`` takes what the caller gave (one ``str``/``os.PathLike`` or a sequence of them), names each folder once
(``X``, ``X`` and ``./X/`` are one root, the first spelling kept, as ruff does) and asks ``sources.is_remote`` once
per root whether it is a URL; every layer below reads ``Roots.url`` instead of asking again. The command's own check
(``scanner.check_roots`` for a scan, ``fixer.run.check_fix_roots`` for a fix) marks the value ``checked``, so a
lower call handed it does not check again.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import replace

from ckptdoctor.model import frozen
from ckptdoctor.sources import is_remote

PathArg = str | os.PathLike[str]


@frozen
class Roots:
    """Roots as given (``paths``, each once), which of them are URLs (``urls``, as ``sources.is_remote`` decided
    when the value was built), and whether the command's root check has passed (``checked``)."""

    paths: tuple[str, ...]
    urls: frozenset[str] = frozenset()
    checked: bool = False

    @classmethod
    def of(cls, paths: Sequence[PathArg] | PathArg | Roots) -> Roots:
        """``paths`` as ``Roots`` (a ``Roots`` is returned as it is).

        Raises ``TypeError`` for anything but ``str``/``os.PathLike`` of ``str`` (bytes paths included) and
        ``ValueError`` for no path at all (an unset variable in a script must not pass as a clean scan).
        """
        if isinstance(paths, Roots):
            return paths
        items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        if not items:
            raise ValueError("no root to scan")
        given: list[str] = []
        for p in items:
            s = os.fspath(p) if isinstance(p, (str, os.PathLike)) else p
            if not isinstance(s, str):
                raise TypeError(f"a root must be a str or os.PathLike of str, not {type(p).__name__}: {p!r}")
            given.append(s)
        urls = frozenset(p for p in given if is_remote(p))
        return cls(tuple(unique_roots(given, urls)), urls)

    def url(self, path: str) -> bool:
        """True when ``path`` (one of these roots) is a URL read through fsspec."""
        return path in self.urls

    def only(self, paths: Sequence[str]) -> Roots:
        """These roots narrowed to ``paths`` (some of them), checked as they were."""
        return replace(self, paths=tuple(paths), urls=frozenset(p for p in paths if p in self.urls))

    def passed(self) -> Roots:
        """These roots, marked as having passed the command's root check."""
        return replace(self, checked=True)

    def __iter__(self) -> Iterator[str]:
        return iter(self.paths)

    def __len__(self) -> int:
        return len(self.paths)


def unique_roots(paths: Sequence[str], urls: frozenset[str] | None = None) -> list[str]:
    """``paths`` with each folder once (the first spelling kept): ``X``, ``X`` and ``./X/`` name one root. A URL
    (one of ``urls``; default: as ``sources.is_remote`` decides) is compared as written."""
    if urls is None:
        urls = frozenset(p for p in paths if is_remote(p))
    seen: set[str] = set()
    out: list[str] = []
    for p in paths:
        key = p if p in urls else os.path.realpath(p)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out
