"""The source interface: what the walker (``ckptdoctor.discover``) asks of a scan root's storage, and gets back.

A ``Source`` gives the root, a folder's listing, one listed entry's stat and a file's read; ``sources.local`` and
``sources.fsspec`` implement it (as pip-audit's dependency sources implement its ``DependencySource``).
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from ckptdoctor.limits import Limits
    from ckptdoctor.model import DcpItem, FileFacts, PathProblem

# The fixer's own folder (quarantine, journal): never part of what is scanned, by any source.
OWN_DIR = ".ckptdoctor"


def display(name: str) -> str:
    """``name`` made printable: bytes that are not UTF-8 (surrogate-escaped by os) shown as ``\\xNN``."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(name).decode("utf-8", "backslashreplace")
    return name


M = TypeVar("M")  # what a source keeps about an entry to read it: an os.stat_result, a listing's info dict


@dataclass(slots=True)  # not frozen: a frozen __init__ costs a microsecond per entry on the walk's hot path
class Entry(Generic[M]):
    """One listed entry, stat'ed: what the walker needs to place it and what its source needs to read it."""

    name: str  # the raw name (may hold surrogate escapes), as os.listdir would give it
    path: str  # where the source opens or lists it (for a followed link: its resolved target)
    is_dir: bool
    mtime: float
    key: Hashable  # the same for two paths to one folder (a loop), else different
    meta: M
    is_link: bool = False
    followed: bool = True  # False for a link out of the root: listed (and counted as a folder), never read


class Named(Protocol):
    """What the walker needs of a listed entry before its stat: its raw name."""

    @property
    def name(self) -> str:
        """The raw name."""
        ...


L = TypeVar("L", bound=Named)


class Source(Protocol[L, M]):
    """A scan root's storage, as the walker uses it. Every method records what it could not do in ``problems``
    (or returns it) instead of raising: bad input is a finding."""

    limits: Limits  # the limits reads apply (a source may relax one it cannot afford; see sources.fsspec)
    abs_root: str  # the root as ``Tree.abs_root`` for this source, or "" (the scanner fills in the local path)
    stopped: bool  # set when the listing hit ``limits.dir_entries``: the walk stops where it is
    where: str  # the root's one name across scans (its real path, or its URL): what the verdict cache files by

    def root(self, problems: list[PathProblem]) -> Entry[M] | PathProblem:
        """The root itself (a folder or one file), or why it cannot be scanned."""
        ...

    def listdir(self, folder: Entry[M], rel: str, problems: list[PathProblem]) -> list[L] | None:
        """The entries of ``folder`` (at ``rel``) in any order, or None when it cannot be listed."""
        ...

    def entry(self, listed: L, rel: str, problems: list[PathProblem]) -> Entry[M] | None:
        """``listed`` stat'ed (``rel`` its shown path), or None when it cannot be (recorded in ``problems``)."""
        ...

    def read(self, entry: Entry[M], rel: str, in_dcp: bool) -> FileFacts:
        """The facts of the file ``entry``, reported at ``rel``; never raises."""
        ...

    def read_dcp_items(self, path: str, facts: FileFacts, items: list[DcpItem] | None) -> FileFacts:
        """``facts`` of the `.distcp` file at ``path`` completed with its items' pickles (see readers); never
        raises."""
        ...

    def shown_target(self, path: str) -> str:
        """Where the folder at ``path`` really is, printable (the target of a link loop)."""
        ...

    def key(self, path: str) -> Hashable:
        """The ``Entry.key`` of the folder at ``path`` as this process sees it: a process on another machine (a
        fan-out's worker) keys a shared file system's folders by device numbers of its own."""
        ...

    def part(self, path: str) -> Source[L, M]:
        """A copy of this source that walks the folder at ``path`` (an entry's ``path``) and below only, in this
        process or another (a fan-out pickles it): its own count of entries listed, and no more of the root's
        listing than that folder's."""
        ...

    def identity(self, entry: Entry[M]) -> list[Any] | None:
        """What proves the file ``entry`` holds the same bytes as when it was last read (a JSON list the verdict
        cache compares, ``ckptdoctor.cache``), or None when nothing this source knows can prove it."""
        ...

    def settled(self, entry: Entry[M], facts: FileFacts, before_ns: int) -> bool:
        """Whether ``facts`` (just read from ``entry``) are of the bytes ``identity(entry)`` names: the file did not
        change since it was listed, and did not change after ``before_ns`` (``time.time_ns()``), when it may still
        be being written within one tick of its timestamps."""
        ...
