"""The verdict cache at work: a source that answers reads from the cache when the file is provably the same.

``FactsCache`` wraps the ``Source`` discovery walks (``discover(cache=)``): a file whose identity (its source's
``identity``: size, mtime, ctime, inode and device on disk; the version id or ETag, size and time of an object) and
name match an entry, written by this code under the same limits, gets that entry's facts without being opened; any
other file is read as always and its facts stored. The pickle judge asks it for each file's verdict under the
user's allowances (``known``) and tells it the verdicts it made (``learn``) when they depend on the file alone (no
installed package's source was read for them: a ``pip install`` may change those).

What it keeps of a file read: its facts (``fill``: ``--cache``), or, by default, at first only its identity (a
sighting), and its facts when a later scan reads it unchanged since that sighting. A scan of a tree seen once (a
check before one resume) then pays next to nothing for the cache, and a tree scanned again and again (nightly, or
before every resume) has its facts kept from the second scan on and taken from the cache from the third.

Entries are kept per folder that is no checkpoint of a run (a run's folder holds the entries of all its
checkpoints): one cache file per run, read when the walk first reads a file of it, written when the run has been
walked and judged (``left``), so memory holds one run's entries at a time, as the scan holds one run. The file is
named after the folder's real path or URL, so scanning a run on its own or the folder of runs around it use one file.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from ckptdoctor.cache import CodecError
from ckptdoctor.cache.store import Store, digest
from ckptdoctor.model import DcpItem, FileFacts, FileKind, PickleVerdict, ProblemKind
from ckptdoctor.readers.seen import Seen
from ckptdoctor.sources.interface import Entry, L, M, Source
from ckptdoctor.version import __version__

if TYPE_CHECKING:  # the codec is imported when a table is read or written: a first scan only sights files
    from ckptdoctor.cache.codec import Decoder, Encoder

__all__ = ["FactsCache"]

_V = TypeVar("_V")

# 2: inline scalar containers, z pairs; 3: inline dicts as JSON objects, packed integers; 4: the body is marshal's,
# its table grouped (``cache.codec.pack``); 5: a group's children, lengths and bases in bytes (``cache.codec._indices``)
FORMAT = 5
# A file whose metadata changed this recently before the scan began may still be being written, within one tick of
# its timestamps (stat's times move in ticks of a few milliseconds): its facts are not stored (as git treats an
# index entry as "racily clean").
RACY_NS = 2_000_000_000
# Facts of these kinds depend on more than the file's bytes (HDF5: whether h5py is installed), so are never stored.
_UNCACHED_KINDS = frozenset({FileKind.HDF5})
_BUG = "internal error"


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A digest of ckptdoctor's own code and data files (their names, sizes and modification times) and version:
    any change to the readers, the pickle policy or its allowlist makes every entry a stranger."""
    lines = [__version__]
    todo = [(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")]
    while todo:  # one scandir per folder: its entries' stats come with the listing (no os.walk, no relpath)
        folder, rel = todo.pop()
        try:
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError:  # as os.walk: a folder that cannot be listed adds nothing
            continue
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                if e.name != "__pycache__":
                    todo.append((e.path, f"{rel}{e.name}/"))
            elif e.name.endswith((".py", ".json")):
                st = e.stat()
                lines.append(f"{rel}{e.name}\0{st.st_size}\0{st.st_mtime_ns}")
    return digest("\n".join(lines).encode("utf-8", "surrogatepass"))


def _digest(value: Any) -> str:
    import json

    return digest(json.dumps(value, separators=(",", ":")).encode("utf-8", "surrogatepass"))


def allow_key(allow: tuple[Any, ...]) -> str:
    """The key of a verdict judged under ``allow`` (``Allowance`` values: pattern and origin)."""
    key = [[a.pattern, a.origin] for a in allow]
    text = repr(key)
    digest = _ALLOW_KEYS.get(text)
    if digest is None:  # a scan judges every pickle under the same few allowances: one digest each
        digest = _digest(key)
        _ALLOW_KEYS.put(text, digest)
    return digest


_ALLOW_KEYS: Seen[str, str] = Seen(64)


class _Segment:
    """One cache file's entries: those read from it (still to be seen in this walk) and those of this walk."""

    __slots__ = ("decoder", "dirty", "doc", "found", "live", "name", "stale")

    def __init__(self, name: str) -> None:
        self.name = name
        self.doc: dict[str, Any] | None = None  # the document read (None: none, or not trusted)
        self.decoder: Decoder | None = None
        self.found: dict[str, Any] = {}  # key in the folder -> the stored entry (a dict), not yet seen
        self.live: dict[str, dict[str, Any]] = {}  # key -> entry of this walk: identity, flags, and the values
        self.dirty = False  # an entry was added or changed, or one stored was not seen again
        self.stale = 0  # entries replaced or dropped since the table was last written from scratch


class FactsCache:
    """The cache for one scan of one root (see the module doc). Not for two roots at once."""

    def __init__(self, store: Store | Callable[[], Store | None], fill: bool = True) -> None:
        # the cache folder, or what opens it when the walk first needs it (a root with no file to read opens none)
        self._store: Store | Callable[[], Store | None] | None = store
        self.fill = fill  # keep the facts of every file read; else of a file sighted before, unchanged since
        self._again: set[str] = set()  # root-relative paths of files sighted before and unchanged, being read
        self.started = time.time_ns()
        self._lock = threading.Lock()
        self._segments: dict[str, _Segment] = {}
        self._expected: dict[str, Any] | None = None
        self._limits = ""
        self._where = ""
        # root-relative path -> (the facts handed out, its segment's name, its key in the segment)
        self._handed: dict[str, tuple[FileFacts, str, str]] = {}
        self.hits = 0
        self.misses = 0

    @property
    def store(self) -> Store | None:
        """The cache folder; None when it cannot be used (then nothing is taken from it or kept)."""
        if self._store is not None and not isinstance(self._store, Store):
            self._store = self._store()
        return self._store

    def source(self, inner: Source[L, M]) -> Source[L, M]:
        """``inner`` (the root's source) with its reads answered from the cache where the file is the same."""
        self._where = inner.where
        self._limits = repr(inner.limits)
        return _CachedSource(self, inner)

    @property
    def _expect(self) -> dict[str, Any]:
        """What a cache file must say it was written under (made on first use: a root with no file to read costs
        no walk of the package's files)."""
        if self._expected is None:
            self._expected = {"format": FORMAT, "version": __version__, "code": code_fingerprint(),
                              "limits": _digest(self._limits)}
        return self._expected

    # -- the walk ---------------------------------------------------------------------------------------------

    def lookup(self, source: Source[L, M], entry: Entry[M], rel: str, in_dcp: bool) -> FileFacts | None:
        """The stored facts of the file ``entry`` at ``rel``, when an entry proves it the same; else None."""
        identity = source.identity(entry)
        if identity is None:
            return None
        seg, key = _segment_of(rel)
        with self._lock:
            segment = self._segment(seg)
            stored = segment.found.pop(key, None)
            if stored is None:
                return None
            same = stored.get("id") == [*identity, in_dcp]
            if "facts" not in stored:  # a sighting: its facts are kept this time when it is still the same file
                segment.dirty = True
                if same:
                    self._again.add(rel)
                return None
            segment.stale += 1  # until it proves good below
            if not same or segment.decoder is None:
                segment.dirty = True
                return None
            try:
                facts: FileFacts = segment.decoder.value(stored.get("facts"), FileFacts)
            except CodecError:
                segment.dirty = True
                return None
            segment.stale -= 1
            if facts.path != rel:  # stored under its path in the segment's folder (a root that is the run: the same)
                facts = dataclasses.replace(facts, path=rel)
                assert isinstance(facts, FileFacts)
            stored["obj"] = facts  # the entry read is taken over, not copied (a warm rescan: once a file)
            segment.live[key] = stored
            self._handed[rel] = (facts, seg, key)
            self.hits += 1
            return facts

    def store_read(self, source: Source[L, M], entry: Entry[M], rel: str, in_dcp: bool, facts: FileFacts) -> None:
        """Keep ``facts`` (just read) for the next scan, when they can be trusted to stay true of this file (unless
        ``fill`` is off and the file was not sighted before: then its identity alone, a sighting)."""
        self.misses += 1
        with self._lock:
            again = rel in self._again
            self._again.discard(rel)
        identity = source.identity(entry)
        if identity is None or not _storable(facts) or not source.settled(entry, facts, self.started - RACY_NS):
            return
        seg, key = _segment_of(rel)
        with self._lock:
            segment = self._segment(seg)
            segment.dirty = True
            if not (self.fill or again):
                segment.live[key] = {"id": [*identity, in_dcp]}
                return
            segment.live[key] = {"id": [*identity, in_dcp], "obj": facts}
            self._handed[rel] = (facts, seg, key)

    def lookup_items(self, facts: FileFacts, items: list[DcpItem] | None) -> FileFacts | None:
        """The stored completion of the `.distcp` file ``facts`` (handed out by this cache) with ``items``."""
        with self._lock:
            done = self._stored(facts, "items", _items_key(items), "done", FileFacts)
            if done is None:
                return None
            done = dataclasses.replace(done, path=facts.path)
            assert isinstance(done, FileFacts)
            self._entry_of(facts)["done_obj"] = done  # type: ignore[index]
            self._handed[facts.path] = (done, *self._handed[facts.path][1:])
            return done

    def store_items(self, facts: FileFacts, items: list[DcpItem] | None, done: FileFacts) -> None:
        """Keep the completion ``done`` of the `.distcp` file ``facts`` with ``items``."""
        with self._lock:
            entry = self._entry_of(facts)
            if entry is None:
                return
            if not _storable(done):
                entry["uncached"] = True  # its first facts alone would not be the file's
            entry.pop("done", None)
            entry["items"], entry["done_obj"] = _items_key(items), done
            seg, key = self._handed[facts.path][1:]
            self._segments[seg].dirty = True
            self._handed[facts.path] = (done, seg, key)

    def left(self, rel: str) -> None:
        """The folder ``rel`` was walked and judged as a part of its own: write the cache files of it and of the
        folders in it."""
        inside = rel + "/"
        for seg in [s for s in self._segments if s == rel or s.startswith(inside)]:
            self._flush(seg)

    def close(self) -> None:
        """Write every cache file still open."""
        for seg in list(self._segments):
            self._flush(seg)

    # -- verdicts (``pickle_verdict.judge.VerdictMemo``) ----------------------------------------------------------

    def known(self, f: FileFacts, allow: tuple[Any, ...]) -> PickleVerdict | None:
        """The stored verdict of ``f`` (facts this cache handed out) under ``allow``, or None."""
        with self._lock:
            verdict = self._stored(f, "vkey", allow_key(allow), "verdict", PickleVerdict)
            if verdict is not None:
                self._entry_of(f)["verdict_obj"] = verdict  # type: ignore[index]
            return verdict

    def learn(self, f: FileFacts, allow: tuple[Any, ...], verdict: PickleVerdict) -> None:
        """Keep ``verdict``, judged from ``f`` alone under ``allow``."""
        with self._lock:
            entry = self._entry_of(f)
            if entry is None:
                return
            entry.pop("verdict", None)
            entry["vkey"], entry["verdict_obj"] = allow_key(allow), verdict
            self._segments[self._handed[f.path][1]].dirty = True

    # -- inside ---------------------------------------------------------------------------------------------------

    def _stored(self, f: FileFacts, key: str, expect: Any, field: str, kind: type[_V]) -> _V | None:
        """The ``kind`` value stored in the entry of ``f`` (facts this cache handed out) at ``field``, when the
        entry's ``key`` is ``expect`` (the `.distcp` items, the allowances) and the value decodes."""
        entry = self._entry_of(f)
        if entry is None or entry.get(key) != expect or field not in entry:
            return None
        decoder = self._segments[self._handed[f.path][1]].decoder
        if decoder is None:
            return None
        try:
            value = decoder.value(entry[field], kind)
        except CodecError:
            return None
        assert isinstance(value, kind)
        return value

    def _entry_of(self, f: FileFacts) -> dict[str, Any] | None:
        handed = self._handed.get(f.path)
        if handed is None or handed[0] is not f:
            return None
        segment = self._segments.get(handed[1])
        return None if segment is None else segment.live.get(handed[2])

    def _segment(self, seg: str) -> _Segment:
        segment = self._segments.get(seg)
        if segment is None:
            segment = self._segments[seg] = _Segment(self._name(seg))
            store = self.store
            doc = None if store is None else store.read(segment.name, self._expect)
            entries = None if doc is None else doc.get("entries")
            if doc is not None and type(entries) is dict:
                from ckptdoctor.cache.codec import Decoder

                try:
                    segment.decoder = Decoder(doc.get("table"))
                except CodecError:
                    segment.decoder = None
                if segment.decoder is not None:
                    segment.doc, segment.found = doc, entries
                    stale = doc.get("stale")
                    segment.stale = stale if type(stale) is int and stale >= 0 else 0
        return segment

    def _name(self, seg: str) -> str:
        return self._where if not seg else f"{self._where}/{seg}"

    def _flush(self, seg: str) -> None:
        segment = self._segments.pop(seg)
        for rel in [r for r, h in self._handed.items() if h[1] == seg]:
            del self._handed[rel]
        if segment.found:  # stored entries this walk did not meet: gone, or not reached
            segment.dirty = True
            segment.stale += len(segment.found)
        if not segment.dirty:
            return
        doc = _document(segment)
        if doc is None:
            return
        if self.store is not None:
            self.store.write(segment.name, {**self._expect, **doc})


def _document(segment: _Segment) -> dict[str, Any] | None:
    """The cache file of ``segment``: its live entries, the new ones encoded onto the table read (so unchanged
    entries cost nothing to write), or the whole table encoded again once a quarter of its entries went stale;
    None when a value cannot be encoded. A segment of sightings only (a first scan) has no table: the codec is not
    even imported."""
    old = segment.decoder if segment.doc is not None else None
    fresh = old is None or segment.stale * 4 > len(segment.live)
    encoder: Encoder | None = None
    entries: dict[str, Any] = {}
    for key, entry in segment.live.items():
        if entry.get("uncached"):
            continue
        if "obj" not in entry and "facts" not in entry:
            entries[key] = {"id": entry["id"]}  # a sighting
            continue
        if encoder is None:
            from ckptdoctor.cache.codec import Encoder

            encoder = Encoder() if fresh or old is None else Encoder.seeded(segment.doc["table"], old)  # type: ignore[index]
        try:
            out: dict[str, Any] = {"id": entry["id"], "facts": _stored(encoder, old, entry, "facts", key)}
            if "items" in entry:
                done = _stored(encoder, old, entry, "done", key)
                if done is not None:
                    out["items"], out["done"] = entry["items"], done
            if "vkey" in entry:
                verdict = _stored(encoder, old, entry, "verdict", None)
                if verdict is not None:
                    out["vkey"], out["verdict"] = entry["vkey"], verdict
        except (CodecError, RecursionError):
            return None
        entries[key] = out
    if encoder is None:
        return {"table": [[], []], "entries": entries, "stale": 0}
    from ckptdoctor.cache.codec import pack

    table, where = pack(encoder.nodes)
    for out in entries.values():  # the entries name their nodes by their places in the table as stored
        for field in ("facts", "done", "verdict"):
            if out.get(field) is not None:
                out[field] = where[out[field]]
    return {"table": table, "entries": entries, "stale": 0 if fresh else segment.stale}


_OBJ = {"facts": "obj", "done": "done_obj", "verdict": "verdict_obj"}


def _stored(encoder: Encoder, old: Decoder | None, entry: dict[str, Any], field: str, key: str | None) -> Any:
    """The node of an entry's ``field`` (its facts, stored under the path ``key`` in its folder, its `.distcp`
    completion, or its verdict): the node it had in the table read when the encoder goes on with that table, else
    its value encoded (the value handed out, or the one read); None when it has none."""
    index = entry.get(field)
    if index is not None and old is not None:
        if encoder.seeded_from is old:
            return index
        value = entry.get(_OBJ[field])
        if value is None:
            value = old.value(index)
    else:
        value = entry.get(_OBJ[field])
    if value is None:
        return None
    if key is not None:
        value = dataclasses.replace(value, path=key)
    return encoder.encode(value)


def _storable(facts: FileFacts) -> bool:
    """Facts that are a function of the file's bytes alone: no read error (which may pass), no reader bug, no kind
    that depends on installed packages."""
    if facts.kind in _UNCACHED_KINDS:
        return False
    return not any(
        p.kind is ProblemKind.UNREADABLE or p.message.startswith(_BUG) for p in facts.problems
    )


def _items_key(items: list[DcpItem] | None) -> Any:
    return None if items is None else [list(i) for i in items]


def _segment_of(rel: str) -> tuple[str, str]:
    """The folder whose cache file holds ``rel`` (the path up to its first folder a run may take as a checkpoint),
    and ``rel`` inside it."""
    folder = rel.rpartition("/")[0]
    seg = _SEGMENTS.get(folder)
    if seg is None:  # a folder's files are met one after another: one look at its path for all of them
        seg = _segment_of_folder(folder)
        _SEGMENTS.put(folder, seg)
    return seg, rel[len(seg) + 1 :] if seg else rel


_SEGMENTS: Seen[str, str] = Seen(4096)  # folder -> its segment


def _segment_of_folder(folder: str) -> str:
    from ckptdoctor.discover import absorbable

    parts = folder.split("/") if folder else []
    for i, part in enumerate(parts):
        if absorbable(part):
            return "/".join(parts[:i])
    return folder


class _CachedSource(Generic[L, M]):
    """A source whose reads go through a ``FactsCache``; everything else is the wrapped source's."""

    def __init__(self, cache: FactsCache, inner: Source[L, M]) -> None:
        self._cache = cache
        self._inner = inner
        self.limits = inner.limits
        self.abs_root = inner.abs_root
        self.where = inner.where

    @property
    def stopped(self) -> bool:
        return self._inner.stopped

    @stopped.setter
    def stopped(self, value: bool) -> None:
        self._inner.stopped = value

    def root(self, problems: Any) -> Any:
        return self._inner.root(problems)

    def listdir(self, folder: Entry[M], rel: str, problems: Any) -> list[L] | None:
        return self._inner.listdir(folder, rel, problems)

    def entry(self, listed: L, rel: str, problems: Any) -> Entry[M] | None:
        return self._inner.entry(listed, rel, problems)

    def read(self, entry: Entry[M], rel: str, in_dcp: bool) -> FileFacts:
        facts = self._cache.lookup(self._inner, entry, rel, in_dcp)
        if facts is not None:
            return facts
        facts = self._inner.read(entry, rel, in_dcp)
        self._cache.store_read(self._inner, entry, rel, in_dcp, facts)
        return facts

    def read_dcp_items(self, path: str, facts: FileFacts, items: list[DcpItem] | None) -> FileFacts:
        done = self._cache.lookup_items(facts, items)
        if done is not None:
            return done
        done = self._inner.read_dcp_items(path, facts, items)
        self._cache.store_items(facts, items, done)
        return done

    def shown_target(self, path: str) -> str:
        return self._inner.shown_target(path)

    def key(self, path: str) -> Hashable:
        return self._inner.key(path)

    def part(self, path: str) -> Source[L, M]:
        return _CachedSource(self._cache, self._inner.part(path))

    def identity(self, entry: Entry[M]) -> list[Any] | None:
        return self._inner.identity(entry)

    def settled(self, entry: Entry[M], facts: FileFacts, before_ns: int) -> bool:
        return self._inner.settled(entry, facts, before_ns)
