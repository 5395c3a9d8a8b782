"""A small bounded memo for parses that repeat across a run's checkpoints (by bytes or by layout)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Generic, TypeVar

__all__ = ["Seen", "forget_all"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Seen(Generic[K, V]):
    """What was made before, by key, up to ``size`` entries: cleared when full (a run repeats only a few).

    Shared by the threads of one scan (``discover``'s ``jobs``) without a lock: a dict's get and set are atomic, a
    lost race costs one parse, and clearing never meets an iteration. The caller checks that a hit still fits what
    it reads (the key need not hold every byte the value depends on).
    """

    __slots__ = ("_items", "_size", "get")

    def __init__(self, size: int) -> None:
        self._items: dict[K, V] = {}
        self._size = size
        self.get = self._items.get  # the hot call: a bound dict method, not a Python frame
        _ALL.append(self)

    def clear(self) -> None:
        """Forget everything kept (as a fresh process starts)."""
        self._items.clear()

    def put(self, key: K, value: V) -> None:
        """Keep ``value`` under ``key``; all earlier entries go when ``size`` are kept."""
        items = self._items
        if len(items) >= self._size:
            items.clear()
        items[key] = value


_ALL: list[Seen[Any, Any]] = []  # every memo made (module-level ones: they live as long as the process)


def forget_all() -> None:
    """Empty every memo, as a fresh process starts: each test starts from it (what one test read cannot decide
    whether another's reads hit), and a long-lived process may call it between scans to release what they kept."""
    for seen in _ALL:
        seen.clear()
