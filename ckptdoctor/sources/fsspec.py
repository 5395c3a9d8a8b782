"""The fsspec source: a URL root (``s3://``, ``gs://``, ``hf://``...), listed, then read with ranged requests.

An endpoint that cannot be reached fails in seconds, not after a backend's minute of retries: each connection
attempt may take ``CKPTDOCTOR_CONNECT_TIMEOUT`` seconds (default 3) and an unreachable endpoint is tried
``CKPTDOCTOR_CONNECT_ATTEMPTS`` times (default 3). Only connecting is bounded; a slow server that answers keeps its
backend's read timeouts. Per backend:

- ``s3://``: botocore's ``connect_timeout`` and ``retries={"mode": "standard", "total_max_attempts": N}``, each
  unless already chosen: in fsspec's settings (``FSSPEC_S3='{"config_kwargs": {...}}'``) or, for retries, with
  ``AWS_MAX_ATTEMPTS`` / ``AWS_RETRY_MODE``.
- ``gs://``: gcsfs retries a refused connection six times over about 35 s and cannot be told otherwise, so one TCP
  connection to its endpoint (``STORAGE_EMULATOR_HOST`` or Google's) is opened first; skipped when its
  ``session_kwargs`` route requests through a proxy or a connector of their own.
- ``hf://``: unchanged; huggingface_hub tries once and gives up after ``HF_HUB_ETAG_TIMEOUT`` (10 s).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import importlib
import itertools
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar, cast
from urllib.parse import urlsplit

from ckptdoctor.limits import Limits
from ckptdoctor.model import DcpItem, FileFacts, FileKind, PathProblem, ProblemKind, ReadProblem
from ckptdoctor.readers import read_dcp_items_from, read_open_file
from ckptdoctor.sources.interface import OWN_DIR, Entry

if TYPE_CHECKING:  # fsspec is optional (the `remote` extra) and imported only for a URL root
    from fsspec import AbstractFileSystem

# Bytes fetched past each read that misses the cache ("readahead": one window, reads inside it are free). Readers
# read a record's fixed part, then its variable part (a zip local header's 30 bytes, then its name and padding):
# 1 KB turns that pair into one request without pulling tensor data. Measured on a sharded checkpoint against
# 256 B .. 16 KB and fsspec's block cache (bench/RESULTS.md, "Remote"): fewest bytes for about the fewest requests.
READAHEAD = 1024
# Objects up to this size are fetched whole, in one request: a zip's end record alone is searched for in its last
# 64 KB, and a round trip costs more than the bytes, so reading a small file piecemeal would only add requests.
WHOLE_FILE = 64 * 1024
INSTALL_HINT = 'remote roots need fsspec and its backend: pip install "ckptdoctor[remote]" (s3fs) or gcsfs, ...'
# Seconds one connection attempt may take, and attempts at an endpoint that does not answer (see the module doc).
# 3 s lets a SYN be resent twice; 3 x 3 s plus short pauses keeps an unreachable endpoint near 10 s in all.
CONNECT_TIMEOUT = 3.0
CONNECT_ATTEMPTS = 3


_N = TypeVar("_N", int, float)


class EndpointUnreachable(ConnectionError):
    """No connection to a storage endpoint could be opened (refused, no such host, timed out)."""


class BadSetting(ValueError):
    """An environment variable ckptdoctor reads holds something it cannot use."""


def check_remote_root(url: str) -> str | None:
    """Why ``url`` cannot be scanned (fsspec or its backend missing, nothing at that prefix), or None when it can.

    The command line's stand-in for ``click.Path(exists=True)``: costs one listing request.
    """
    try:
        fs, path = _filesystem(url)
        if not fs.exists(path):
            # Some backends answer False for any error (hf:// on a 403): ask again, for the reason.
            fs.info(path)
    except FileNotFoundError:
        return f"{url}: no such object or prefix"
    except ImportError as e:
        return f"{url}: {e}; {INSTALL_HINT}"
    except Exception as e:  # any backend error (credentials, endpoint, bucket): a usage problem, not a traceback
        return f"{url}: {_listing_error(e)}"
    return None


class FsspecSource:
    """A URL root through fsspec: everything under the prefix is listed (prefixes are folders, as
    get_last_checkpoint would see them on a mounted bucket), then each file's header is read with ranged requests
    (``READAHEAD`` past each read). Nothing is ever written. A missing backend or a listing error is the root's
    problem; a read error is the file's.

    The listing arrives flat, so its bounds apply as it is indexed: ``limits.dir_entries`` counts the whole listing
    and ``limits.dir_depth`` drops (and reports once) every folder below it. An S3 root is indexed as the walk goes
    (``_S3Stream``): the index holds the folders the walk has not listed yet, about one page of the listing and the
    run being walked, whatever the number of objects under the root; other backends are listed and indexed whole.
    A folder listed a level at a time (one with more than ``HELD_ENTRIES`` objects below it) shows a console's
    folder marker in it (a key ``folder/name/``) as the folder ``name`` alone, as a mounted bucket does; a folder
    indexed from the whole listing shows it as that folder and an empty file of that name (as ``find`` lists it).
    """

    def __init__(self, root: str, limits: Limits) -> None:
        self.url = root
        self.limits = remote_limits(limits)
        self.abs_root = root.rstrip("/")
        self.where = self.abs_root
        self.stopped = False  # the entry limit ends the indexing of the listing, not the walk
        self._fs: AbstractFileSystem  # set by root()
        self._folders: dict[str, _Folder] = {}  # folder path -> what the listing put in it (not listed yet)
        self._stream: _S3Stream | None = None  # an S3 listing still being read (None: the index is whole)
        self._root = ""  # the root's path (``root``)
        self._problems: list[PathProblem] = []  # the root's problems list: what indexing meets goes there
        self._too_deep: set[str] = set()
        self._count = 0  # entries of the listing indexed so far (``limits.dir_entries``)
        self._held = 0  # entries in ``_folders`` (``_Folder.size``)

    def root(self, problems: list[PathProblem]) -> Entry[dict[str, Any]] | PathProblem:
        """List everything under the prefix and index it (an S3 root: its first page, the rest as the walk asks);
        the root object when it is one file."""
        try:
            fs, path = _filesystem(self.url)
            path = path.rstrip("/")
            # fsspec caches file system instances and their listings per process: a second scan in a long-lived
            # process (a job launcher calling gate() before each resume) must see the bucket as it is now.
            fs.invalidate_cache(path)
            stream = _S3Stream.open(fs, path)
            listing: dict[str, dict[str, Any] | _Cut] | None = None
            if stream is None:  # not s3fs, or nothing under the prefix (one object, or none): the backend's find
                listing = cast("dict[str, dict[str, Any] | _Cut]", fs.find(path, withdirs=True, detail=True))
        except ImportError as e:
            return _unreadable_root(f"{e}; {INSTALL_HINT}")
        except Exception as e:  # backend errors have no common base class
            return _unreadable_root(_listing_error(e))
        self._fs = fs
        self._root = path
        self._problems = problems
        name = path.rsplit("/", 1)[-1]
        self._folders[path] = _Folder()
        if stream is not None:
            self._stream = stream
            self._held = 1
            self._pull()  # its first page: a small root is whole after it
            return Entry(name, path, True, 0.0, path, {})
        if not listing:
            del self._folders[path]
            return _unreadable_root("no such object or prefix")
        own = listing.get(path)
        if isinstance(own, dict) and own.get("type") == "file":  # the root is one object
            del self._folders[path]
            return Entry(name, path, False, _mtime(own), path, own)
        self._index(listing)
        return Entry(name, path, True, 0.0, path, {})

    def listdir(
        self, folder: Entry[dict[str, Any]], rel: str, problems: list[PathProblem]
    ) -> list[Entry[dict[str, Any]]] | None:
        """The files and folders the listing put in ``folder`` (no request, but for an S3 root the pages that reach
        past it, or a one-level listing of a folder that holds more than ``HELD_ENTRIES`` objects below it).
        While an S3 listing is being read, the folder's index is released: the walk lists each folder once."""
        path = folder.path
        node = self._folders[path] if self._stream is None else self._walk_to(path)
        out = []
        for name, full, info in node.files:
            full, meta = _entry(path, name, full, info)
            if name.endswith(".distcp"):  # its entry travels with its path, to its items' read (``_DcpPath``)
                full = _DcpPath(full, meta)
            out.append(Entry(name, full, False, _mtime(meta), full, meta))
        for name in node.dirs:
            full = f"{path}/{name}"
            out.append(Entry(name, full, True, 0.0 if self._stream else self._folders[full].mtime, full, {}))
        return out

    def walked(self, path: str) -> None:
        """The walk of the folder at ``path`` is over: the listing is read past it (what it holds that the walk
        never listed: a folder too deep, a bad key, are problems before the folder is judged) and nothing of it is
        kept. A no-op once the index is whole."""
        stream = self._stream
        if stream is None:
            return
        while not stream.passed(path):
            self._pull()
        if path in stream.levels:  # a folder the walk lists all of leaves nothing below it but what came after
            stream.levels.discard(path)
            prefix = path + "/"
            for key in [k for k in self._folders if k.startswith(prefix)]:
                self._held -= self._folders.pop(key).size()
        if path == self._root:
            self._stream = None
            self._folders.clear()
            self._held = 0

    def entry(
        self, listed: Entry[dict[str, Any]], rel: str, problems: list[PathProblem]
    ) -> Entry[dict[str, Any]] | None:
        """``listed`` as it is: the listing already said what each entry is."""
        return listed

    def read(self, entry: Entry[dict[str, Any]], rel: str, in_dcp: bool) -> FileFacts:
        """Read one object's header (see ``_read``)."""
        return _read(self._fs, entry.path, rel, entry.meta, self.limits, in_dcp)

    def read_dcp_items(self, path: str, facts: FileFacts, items: list[DcpItem] | None) -> FileFacts:
        """The `.distcp` items at ``items``, prefetched in one concurrent batch (see ``_prefetch``)."""
        try:
            listed = path.listed if isinstance(path, _DcpPath) else self._listed(path)
            with _open(self._fs, path, facts.size, listed) as f:
                spans = cast("BinaryIO", _prefetch(self._fs, path, f, facts.size, items))
                return read_dcp_items_from(spans, facts, items, self.limits)
        except Exception as e:  # opening failed: the file stays as read, with why
            return _with_problem(facts, e)

    def _listed(self, path: str) -> dict[str, Any] | None:
        """What the listing said about the object at ``path`` (None when it is not in this source's part)."""
        where = path.rsplit("/", 1)[0]
        folder = self._folders.get(where)
        for name, full, info in folder.files if folder else ():
            if (full or f"{where}/{name}") == path:
                return _entry(where, name, full, info)[1]
        return None

    def shown_target(self, path: str) -> str:
        """``path``: object storage has no links, so no loops either."""
        return path

    def key(self, path: str) -> str:
        """``path``: an object's key is its name everywhere."""
        return path

    def part(self, path: str) -> FsspecSource:
        """This source with the listing of the folder at ``path`` and below only (what a task walking it needs). An S3
        listing is read to its end first: a fan-out plans from the whole listing, before any walk."""
        self._drain()
        out = copy.copy(self)
        prefix = path + "/"
        out._folders = {k: v for k, v in self._folders.items() if k == path or k.startswith(prefix)}
        return out

    def identity(self, entry: Entry[dict[str, Any]]) -> list[Any] | None:
        """The object's version id (S3 ``VersionId``, GCS ``generation``) and ETag (or MD5 or Hub blob id), its size
        and its time, as the listing gave them; None without a version id or an ETag. An ETag is not enough alone:
        S3's is the MD5 of a single-part upload's bytes, and two files of one MD5 can be made, so the time the
        store set on the upload (which no uploader chooses) is part of the key too."""
        info = entry.meta
        tags = [_text(info.get(k)) for k in _VERSION_KEYS]
        if not any(tags) or not isinstance(info.get("size"), int):
            return None
        return [info["size"], _mtime(info), *tags]

    def settled(self, entry: Entry[dict[str, Any]], facts: FileFacts, before_ns: int) -> bool:
        """The listing's size is what was read (an object is replaced whole, under a new ETag or version)."""
        return facts.size == entry.meta.get("size")

    def __getstate__(self) -> dict[str, Any]:
        """What a copy or a pickle (a fan-out's task) holds: the whole index (an S3 listing is read to its end: its
        pages cannot travel), without the root's problems list."""
        self._drain()
        state = self.__dict__.copy()
        state["_problems"] = []
        return state

    def _drain(self) -> None:
        """Read the rest of an S3 listing into the index, which is then whole (before the walk has listed any
        folder: a fan-out plans first)."""
        stream = self._stream
        while stream is not None and not stream.done:
            self._pull()
        self._stream = None

    def _index(self, listing: dict[str, dict[str, Any] | _Cut]) -> None:
        """Sort a flat listing (full path -> info) into folders, as a local listing would show them."""
        for full in sorted(listing):
            if not self._take(full, listing[full]):
                break

    def _pull(self) -> None:
        """Index the next page of the S3 listing: each object, and each folder the first time an object in it comes
        (keys arrive in order, so a folder's objects come together: the one before says whether it is new)."""
        stream = self._stream
        assert stream is not None
        cut = len(self._root)
        for full, entry in stream.page():
            last = stream.last
            new: list[str] = []
            parent = full.rsplit("/", 1)[0]
            while len(parent) > cut and not last.startswith(parent + "/"):
                new.append(parent)
                parent = parent.rsplit("/", 1)[0]
            for folder in reversed(new):
                if not self._take(folder, {"name": folder, "size": 0, "type": "directory"}):
                    stream.stop()
                    return
            if not self._take(full, entry):
                stream.stop()
                return
            stream.last = full

    def _take(self, full: str, info: dict[str, Any] | _Cut) -> bool:
        """Index one entry of the listing (full path, info); False when ``limits.dir_entries`` stops the listing."""
        problems = self._problems
        if self._count >= self.limits.dir_entries:
            msg = f"more than {self.limits.dir_entries} entries under the root; the rest was not read"
            problems.append(PathProblem(".", ReadProblem(ProblemKind.LIMIT, msg)))
            return False
        self._count += 1
        path = self._root
        prefix = path + "/"
        if not full.startswith(prefix):
            return True
        rel = full[len(prefix) :].rstrip("/")
        parts = rel.split("/")
        if not rel or OWN_DIR in parts:
            return True
        if "" in parts:  # `a//b`: a key no file system could hold as a path
            msg = "object key holds an empty path segment (`//`); not read"
            problems.append(PathProblem(rel, ReadProblem(ProblemKind.BAD_NAME, msg)))
            return True
        is_dir = not isinstance(info, _Cut) and info.get("type") == "directory"
        depth = len(parts) - (0 if is_dir else 1)
        if depth > self.limits.dir_depth:
            folder = "/".join(parts[: self.limits.dir_depth + 1])
            if folder not in self._too_deep:
                self._too_deep.add(folder)
                msg = f"deeper than the {self.limits.dir_depth}-level limit; not walked"
                problems.append(PathProblem(folder, ReadProblem(ProblemKind.LIMIT, msg)))
            return True
        if is_dir:
            self._folder(parts).mtime = _mtime(cast("dict[str, Any]", info))
            return True
        where = "/".join([path, *parts[:-1]])
        if self._stream is not None and where in self._stream.levels:
            return True  # its folder was listed a level at a time: the file is in that listing
        if isinstance(info, _Cut):  # named by its folder and name, where they spell its key (see _Cut)
            name = sys.intern(parts[-1])
            self._folder(parts[:-1]).files.append((name, None if full == f"{where}/{name}" else full, info))
        else:
            self._folder(parts[:-1]).files.append((parts[-1], full, info))
        self._held += 1
        return True

    def _folder(self, parts: list[str]) -> _Folder:
        """The folder ``parts`` below the root, created (with its parents) as needed."""
        full = "/".join([self._root, *parts])
        node = self._folders.get(full)
        if node is None:
            parent = full.rsplit("/", 1)[0]
            if self._stream is None or parent not in self._stream.levels:
                self._folder(parts[:-1]).dirs.append(parts[-1])
            node = self._folders[full] = _Folder()
            self._held += 1
        return node

    def _walk_to(self, path: str) -> _Folder:
        """The folder at ``path`` of an S3 listing being read, taken out of the index: read on until the listing
        is past it, or listed a level at a time (one request a thousand entries) once the index holds
        ``HELD_ENTRIES`` (the root of a fleet, a run of thousands of objects)."""
        stream = self._stream
        assert stream is not None
        while not stream.passed(path) and self._held < HELD_ENTRIES:
            self._pull()
        if stream.passed(path):
            node = self._folders.pop(path, None)
            if node is None:  # listed a level above, gone from the bucket since
                return _Folder()
            self._held -= node.size()
            return node
        old = self._folders.pop(path, None)
        if old is not None:
            self._held -= old.size()
        stream.levels.add(path)
        depth = 0 if path == self._root else path[len(self._root) + 1 :].count("/") + 1
        node = _Folder()
        cut = len(path) + 1
        for info in stream.level(path):
            name = info["name"][cut:]
            if not name or name == OWN_DIR:  # the folder's own marker (a file of its parent's), `a//b`, ours
                continue
            if info.get("type") == "directory":
                if depth < self.limits.dir_depth:  # deeper ones: the listing says so as it comes to them
                    node.dirs.append(name)
            else:
                node.files.append((sys.intern(name), None, _Cut(info)))
        node.files.sort(key=_file_name)
        return node


# Entries of an S3 listing the index may hold before a folder the walk asks for is listed a level at a time
# (``FsspecSource._walk_to``): 0.44 KB each (bench/RESULTS.md, "Fleet memory for S3 roots"), about 0.45 MB; a
# folder of up to that many objects below it costs no listing request more than its pages, a larger one (a fleet's
# root, a run of about 90 checkpoints or more) one request a thousand entries directly in it. At 4,096 the index of
# a fleet's first runs was 1.3 MB more than a small root's (bench/RESULTS.md, "An S3 scan's memory from 10 to 1,000
# runs").
HELD_ENTRIES = 1024
# Objects asked for at a time: one page of ListObjectsV2 (``MaxKeys``; 1,000 is the most S3 returns).
PULL = 1000


def _file_name(file: tuple[str, str | None, dict[str, Any] | _Cut]) -> str:
    return file[0]


class _DcpPath(str):
    """A `.distcp` file's path, carrying its listing entry (``listed``) to the read of its items, which comes after
    its folder left the index (``FsspecSource.read_dcp_items``: s3fs asks for an object's details at its first
    read, with a HEAD request when it has none)."""

    listed: dict[str, Any]

    def __new__(cls, full: str, listed: dict[str, Any]) -> _DcpPath:
        out = super().__new__(cls, full)
        out.listed = listed
        return out


class _S3Stream:
    """An S3 listing of everything under a root, read a page at a time (``page``) in key order, each object cut
    (``_Cut``) as its page comes; ``last`` is the last key read. ``levels``: the folders listed a level at a time
    (``level``), whose objects the listing will bring again.

    Pages are asked for one request at a time (ListObjectsV2, ``PULL`` keys, the continuation token kept between
    them), not through s3fs's ``_iterdir``: that generator holds a page's entries (botocore's dicts, about 1 KB an
    object, with s3fs's fields added) until the next page has been fetched and parsed, so two pages lived at once
    while the walk held the index too (bench/RESULTS.md, "An S3 scan's memory from 10 to 1,000 runs")."""

    def __init__(self, fs: AbstractFileSystem, path: str, bucket: str, prefix: str) -> None:
        self.fs = fs
        self.bucket = bucket
        self.path = path
        self.prefix = prefix
        self._token: str | None = None  # where the next page starts (ListObjectsV2's continuation token)
        self._first: list[tuple[str, _Cut]] | None = None
        self.done = False
        self.last = ""
        self.levels: set[str] = set()

    @classmethod
    def open(cls, fs: AbstractFileSystem, path: str) -> _S3Stream | None:
        """The listing of everything under ``path``, its first page read; None when ``fs`` is not s3fs (or lists
        versions) or nothing is under the prefix (the root may be one object: s3fs's own ``find`` asks for it)."""
        if "s3" not in fs.protocol or getattr(fs, "version_aware", False):
            return None
        if getattr(fs, "call_s3", None) is None or getattr(fs, "_iterdir", None) is None:  # another s3fs
            return None
        bucket, key, _ = fs.split_path(path)
        stream = cls(fs, path, bucket, key.rstrip("/") + "/" if key else "")
        first = stream._read()
        if not first:
            return None
        stream._first = first
        return stream

    def page(self) -> list[tuple[str, _Cut]]:
        """The next objects of the listing (at most ``PULL``): each one's full path (``bucket/key``, as s3fs names
        it) and its entry, cut."""
        if self._first is not None:
            first, self._first = self._first, None
            return first
        if self.done:
            return []
        return self._read()

    def _read(self) -> list[tuple[str, _Cut]]:
        asked: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix, "MaxKeys": PULL}
        if self._token is not None:
            asked["ContinuationToken"] = self._token
        got = self.fs.call_s3("list_objects_v2", **asked)  # s3fs adds its request options and retries
        token = got.get("NextContinuationToken") if got.get("IsTruncated") else None
        self._token = token if isinstance(token, str) else None
        self.done = self._token is None
        bucket = self.bucket
        return [(f"{bucket}/{c['Key']}", _Cut(c)) for c in got.get("Contents") or ()]

    def stop(self) -> None:
        """Read no further (the entry limit)."""
        self.done = True
        self._first = None

    def passed(self, path: str) -> bool:
        """Whether every object below the folder at ``path`` has been read."""
        if self.done and self._first is None:
            return True
        last = self.last
        return last > path + "/" and not last.startswith(path + "/")

    def level(self, path: str) -> list[dict[str, Any]]:
        """The objects and the folders (prefixes) directly in the folder at ``path``: a listing with a delimiter."""
        from fsspec.asyn import sync

        _, key, _ = self.fs.split_path(path)
        prefix = key.rstrip("/") + "/" if key else ""
        iterdir = self.fs._iterdir

        async def listed() -> list[dict[str, Any]]:
            return [info async for info in iterdir(self.bucket, delimiter="/", prefix=prefix)]

        return cast("list[dict[str, Any]]", sync(self.fs.loop, listed))


class _Cut:
    """An object of an s3fs listing as the index keeps it: its size, time (a number), ETag and version id, and its
    key only where its folder and name do not spell it (a key ending in ``/``); about 150 bytes with its entry in
    the folder, against s3fs's 1.35 KB. ``info`` gives the entry back as the scan and s3fs read it."""

    __slots__ = ("etag", "mtime", "size", "version")

    def __init__(self, info: dict[str, Any]) -> None:
        self.size: Any = info["size"] if "size" in info else info.get("Size")  # s3fs's entry, or botocore's
        self.mtime = _mtime(info)
        self.etag: Any = info.get("ETag")
        self.version: Any = info.get("VersionId")

    def info(self, full: str) -> dict[str, Any]:
        """The listing entry of the object at ``full``: what ``Entry.meta`` holds (and s3fs's file its details)."""
        out: dict[str, Any] = {"name": full, "size": self.size, "type": "file", "mtime": self.mtime}
        if self.etag is not None:
            out["ETag"] = self.etag
        if self.version is not None:
            out["VersionId"] = self.version
        return out


def _entry(
    where: str, name: str, full: str | None, info: dict[str, Any] | _Cut
) -> tuple[str, dict[str, Any]]:
    """A file of the folder at ``where`` as indexed (``_Folder.files``): its full path and its listing entry."""
    full = full or f"{where}/{name}"
    return full, info.info(full) if isinstance(info, _Cut) else info


# Listing fields that name one version of an object's bytes: S3's version id and ETag (s3fs), GCS's generation and
# MD5 (gcsfs), the Hub's blob id and LFS sha256 (huggingface_hub's HfFileSystem).
_VERSION_KEYS = ("VersionId", "version_id", "generation", "ETag", "etag", "md5Hash", "blob_id", "lfs")


def _text(value: Any) -> str:
    """A listing field as text for the cache key ("" when absent; S3's "null" version id, of an unversioned bucket,
    names no version)."""
    if value is None or value == "null":
        return ""
    if isinstance(value, dict):  # the Hub's `lfs`: {"sha256": ..., "size": ...}
        return str(value.get("sha256") or value.get("oid") or "")
    return str(value)


@dataclass(slots=True)
class _Folder:
    """A folder of the listing: its files (name, full path, entry) in name order, subfolders in listing order. An
    s3fs object is kept cut (``_Cut``), its full path None where the folder's and its name spell it."""

    mtime: float = 0.0
    files: list[tuple[str, str | None, dict[str, Any] | _Cut]] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)

    def size(self) -> int:
        """Its files and itself, as ``FsspecSource._held`` counts them (each subfolder counts itself)."""
        return len(self.files) + 1


def remote_limits(limits: Limits) -> Limits:
    """``limits`` as remote reads apply them: the local header of each tensor storage record in a torch zip is not
    cross-checked (``Limits.zip_data_local_headers``), since every one would be a request of its own (about 600
    for a 7B AdamW state, 2,000 for 70B). Every record a loader parses is still checked. ``--deep`` (which would
    read those records anyway) is refused for remote roots, so there is no case that keeps the check on."""
    return replace(limits, zip_data_local_headers=False)


def log_on_one_line() -> None:
    """Show the storage backends' warnings (missing credentials, retries) as ``logger: message``, one line each.

    For the command line: gcsfs logs every failed request with its traceback, which Python's last-resort handler
    prints whole when nothing configured logging; the error itself reaches the user once, as ours. Does nothing
    when the process already has a handler.
    """
    import logging  # only for URL roots: start-up stays without it

    class OneLine(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            return f"{record.name}: {record.getMessage()}"

    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setLevel(logging.WARNING)
        handler.setFormatter(OneLine())
        root.addHandler(handler)


def _filesystem(url: str) -> tuple[AbstractFileSystem, str]:
    """The fsspec file system and the path inside it for ``url`` (ImportError when fsspec or the backend is missing;
    ``EndpointUnreachable`` when a gs:// endpoint takes no connection, ``BadSetting``)."""
    from fsspec.core import url_to_fs

    timeout, attempts = connect_settings()
    endpoint = _endpoint_to_probe(url)
    if endpoint is not None:  # before the file system exists: building one already looks for credentials
        _probe(endpoint, timeout, attempts)
    fs, path = url_to_fs(url, **_storage_options(url, timeout, attempts))
    return fs, str(path)


def connect_settings() -> tuple[float, int]:
    """Seconds per connection attempt and attempts per request: ``CKPTDOCTOR_CONNECT_TIMEOUT`` and
    ``CKPTDOCTOR_CONNECT_ATTEMPTS`` when set, else ``CONNECT_TIMEOUT`` and ``CONNECT_ATTEMPTS``.

    ``BadSetting`` names a variable set to anything but a positive number (a typo must not mean no timeout).
    """
    timeout = _positive("CKPTDOCTOR_CONNECT_TIMEOUT", float, CONNECT_TIMEOUT)
    attempts = _positive("CKPTDOCTOR_CONNECT_ATTEMPTS", int, CONNECT_ATTEMPTS)
    return timeout, attempts


def _positive(name: str, kind: Callable[[str], _N], default: _N) -> _N:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = kind("0")
    if not 0 < value < float("inf"):  # also NaN
        what = "seconds" if kind is float else "a whole number"
        raise BadSetting(f"{name}={raw!r}: want {what} above 0")
    return value


_S3_PROTOCOLS = ("s3", "s3a")  # s3fs registers both; fsspec's settings may hold either


def _storage_options(url: str, timeout: float, attempts: int) -> dict[str, Any]:
    """Options for ``url_to_fs``: botocore's connect timeout and retries for every S3 layer of ``url`` (plain or
    chained, ``simplecache::s3://``), under whatever the user chose in fsspec's settings or botocore's variables."""
    import fsspec.config

    schemes = {part.split("://", 1)[0] for part in url.split("::")}
    if not schemes & set(_S3_PROTOCOLS):
        return {}
    # fsspec merges its settings with explicit options one level deep: an explicit config_kwargs would replace the
    # user's whole dict, so theirs is the base and ours only fills what they left out.
    user: dict[str, Any] = {}
    for proto in _S3_PROTOCOLS:
        conf = fsspec.config.conf.get(proto)
        if isinstance(conf, dict) and "config_kwargs" in conf:
            user = conf["config_kwargs"]
    if not isinstance(user, dict):  # not ours to interpret
        return {}
    config = dict(user)
    config.setdefault("connect_timeout", timeout)
    if "retries" not in config and not {"AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE"} & os.environ.keys():
        # botocore's default ("legacy", 5 attempts with backoff) takes 8 s on a refused connection and 36 s on one
        # that never answers; "standard" retries the same errors (throttling, 5xx, connection) with shorter waits.
        config["retries"] = {"mode": "standard", "total_max_attempts": attempts}
    return {scheme: {"config_kwargs": config} for scheme in schemes & set(_S3_PROTOCOLS)}


_GCS_PROTOCOLS = ("gs", "gcs")


def _endpoint_to_probe(url: str) -> str | None:
    """The endpoint gcsfs would connect to for ``url`` (its ``endpoint_url`` option, ``STORAGE_EMULATOR_HOST`` or
    Google's), or None: not a gs:// URL, gcsfs missing, or requests that go through a proxy or a connector of the
    user's own (a direct connection would prove nothing)."""
    schemes = {part.split("://", 1)[0] for part in url.split("::")}
    if not schemes & set(_GCS_PROTOCOLS):
        return None
    try:
        import fsspec.config

        gcs = importlib.import_module("gcsfs.core")  # untyped, optional: only its helpers below are used
    except ImportError:  # url_to_fs reports it, with the install hint
        return None
    options: dict[str, Any] = {}
    for proto in _GCS_PROTOCOLS:  # as fsspec merges them into the options (a later protocol wins)
        conf = fsspec.config.conf.get(proto)
        if isinstance(conf, dict):
            options.update(conf)
    session = options.get("session_kwargs") or {}
    if not isinstance(session, dict) or session.get("trust_env") or session.get("connector") is not None:
        return None
    if isinstance(options.get("endpoint_url"), str):
        return str(options["endpoint_url"])
    try:
        # gcsfs's own choice (the emulator, the universe domain, the mTLS host); private helpers, hence the guard.
        mtls = bool(gcs._use_client_cert() and gcs._use_mtls_endpoint())
        return str(gcs._location(mtls))
    except Exception:  # another gcsfs: no probe, its own retries apply
        return None


def _probe(endpoint: str, timeout: float, attempts: int) -> None:
    """Open (and close) one TCP connection to ``endpoint``'s host and port, ``attempts`` tries at ``timeout`` seconds
    each with short pauses between; ``EndpointUnreachable`` naming the endpoint and the last cause when none opens."""
    parts = urlsplit(endpoint)
    host = parts.hostname or ""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:  # a port out of range in STORAGE_EMULATOR_HOST
        raise EndpointUnreachable(f"cannot connect to {endpoint}: {e}") from None
    where = f"{parts.scheme}://{parts.netloc}"
    cause: OSError | None = None
    for attempt in range(attempts):
        if attempt:
            time.sleep(0.25 * 2 ** (attempt - 1))  # a restarting server gets a moment; a dead one costs little
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            return
        except OSError as e:
            cause = e
    if isinstance(cause, TimeoutError):
        why = f"timed out ({attempts} x {timeout:g} s)" if attempts > 1 else f"timed out ({timeout:g} s)"
    else:
        why = f"{cause} ({attempts} attempts)" if attempts > 1 else str(cause)
    raise EndpointUnreachable(f"cannot connect to {where}: {why}")


def _listing_error(e: Exception) -> str:
    """A backend's error while listing, on one line (gcsfs puts the server's message on a second)."""
    if isinstance(e, (EndpointUnreachable, BadSetting)):  # ours: already says what and where
        return _one_line(str(e))
    return _one_line(f"cannot list: {type(e).__name__}: {e}")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _open(fs: AbstractFileSystem, full: str, size: int, listed: dict[str, Any] | None = None) -> _Spans:
    """``full`` open for the readers. The size is known from the listing: passing it saves a HEAD request per file.
    fsspec's own caches are off ("none": each read of the file below is one exact ranged request); _Spans decides
    what is fetched and kept."""
    f = fs.open(full, "rb", cache_type="none", size=size)
    if listed is not None and listed.get("size") == size and isinstance(listed.get("name"), str):
        # The listing's entry is the object's details: s3fs asks for them at the first read (the ETag, to refuse an
        # object replaced since it was listed), from its listings cache or, when that is empty (a Dask worker's
        # copy of the file system; a cache dropped after indexing), with a HEAD request per object. gcsfs's files
        # take no details (read-only; its reads do not ask for them).
        with contextlib.suppress(AttributeError):
            f.details = listed
    return _Spans(cast("BinaryIO", f), size)


# At most this many bytes of `.distcp` items are fetched ahead, whole, one concurrent request per item.
PREFETCH_BYTES = 16 << 20


def _prefetch(fs: AbstractFileSystem, full: str, f: _Spans, size: int, items: list[DcpItem] | None) -> _Spans:
    """``f`` with the small `.distcp` items the reader will walk fetched ahead in one concurrent batch: a torch.save
    blob is read in scattered pieces (end record, directory, each member's header), one request each otherwise."""
    if not items or size <= WHOLE_FILE:  # a small file is fetched whole at its first read
        return f
    wanted: list[tuple[int, int]] = []  # (start, length) spans: neighbouring items merged into one request
    budget = PREFETCH_BYTES
    for start, length in sorted({(item.offset, item.length) for item in items}):
        if start < 0 or not 0 < length <= min(WHOLE_FILE, budget) or start + length > size:
            continue
        if wanted and start - sum(wanted[-1]) <= READAHEAD and start + length - wanted[-1][0] <= 4 * WHOLE_FILE:
            first = wanted[-1][0]
            end = max(sum(wanted[-1]), start + length)
            budget -= end - sum(wanted[-1])
            wanted[-1] = (first, end - first)
        else:
            wanted.append((start, length))
            budget -= length
    if not wanted:
        return f
    if getattr(fs, "async_impl", False):  # s3fs, gcsfs: one concurrent batch of exact ranged requests
        blobs = fs.cat_ranges([full] * len(wanted), [s for s, _ in wanted], [s + n for s, n in wanted])
    else:
        # fsspec's fallback for the others (hf://) reads each span through a file with its default 5 MiB
        # read-ahead: a 35 KB item cost a whole 144 KB shard in the hf:// test, a GB-sized shard much more.
        blobs = [_exact_span(fs, full, s, n) for s, n in wanted]
    for (s, n), b in zip(wanted, blobs, strict=False):
        if isinstance(b, bytes) and len(b) == n:
            f.keep(s, b, pinned=True)
    return f


def _exact_span(fs: AbstractFileSystem, full: str, start: int, length: int) -> bytes | None:
    """Exactly ``length`` bytes at ``start`` (no read-ahead), or None when the backend refuses (the reader then reads
    those bytes itself, as without a prefetch)."""
    try:
        with fs.open(full, "rb", cache_type="none") as g:
            g.seek(start)
            return cast(bytes, g.read(length))
    except Exception:  # any backend error: the prefetch is only an optimisation
        return None


# Bytes of fetched spans one open object keeps (besides prefetched `.distcp` items, which stay): far above what
# a header read needs (a 7B optimizer.pt: its last 64 KB and a 66 KB data.pkl), and a bound when a reader walks a
# large pickle, whose bytes are then fetched again if read twice rather than held.
KEEP_BYTES = 4 << 20


# Remote objects closed between two collections of the youngest garbage-collector generation, and how many of those
# collections make one full collection (``_collect_cycles``).
COLLECT_EVERY = 64
COLLECT_ALL_EVERY = 16
_closed = itertools.count(1)


def _collect_cycles() -> None:
    """Collect the reference cycles the storage backend leaves behind: the youngest generation every
    ``COLLECT_EVERY`` objects closed, everything every ``COLLECT_ALL_EVERY`` of those.

    Each request through aiobotocore and aiohttp leaves about a hundred objects in reference cycles (a socket, its
    transport and protocol, the response parsers), freed only by the cyclic collector; a scan pauses that collector
    (``scanner._gc_paused``: the facts it builds hold no cycles), so without this they stayed until the scan ended:
    24-38 KB of resident memory per checkpoint of an S3 fleet (bench/RESULTS.md, "Fleet memory for S3 roots").
    The young generation holds what was made since the last collection: most of those cycles, and the facts read
    since (which survive, and are not walked again by the next young collection). A cycle still in use then (a
    pooled connection) is promoted and freed by the next full collection, which walks the whole heap (the listing's
    index, the report's rows): rarely, so that it costs a fraction of the reads it follows. Between two full
    collections a scan holds about ``COLLECT_EVERY * COLLECT_ALL_EVERY`` objects' requests of garbage, whatever the
    fleet's size.
    """
    n = next(_closed)
    if n % COLLECT_EVERY == 0:
        gc.collect(2 if n % (COLLECT_EVERY * COLLECT_ALL_EVERY) == 0 else 0)


class _Spans:
    """A read-only remote object as the readers see it (``read``, ``seek``, ``tell``): every span fetched is kept
    while the object is open, so a reader that returns to bytes read before costs no request.

    Readers do return: the sniff reads an object's first bytes, then its reader reads them again (safetensors: the
    length prefix, then the pickle check of the first 64 bytes; a torch zip: the first record's local header); a
    zip reader reads its end records from the last 64 KB, then a record inside that window. fsspec's "readahead"
    cache keeps only its last window, so each return was a request of its own (a third GET per safetensors shard,
    three of the eight of an ``optimizer.pt``; bench/RESULTS.md, "A fleet in S3").

    A read that misses fetches what it lacks plus ``READAHEAD`` bytes (a record's fixed part, then its variable
    part, in one request); an object of at most ``WHOLE_FILE`` bytes is fetched whole at its first read. Kept spans
    beyond ``KEEP_BYTES`` are dropped, the first in the object first (prefetched ones never).
    """

    def __init__(self, f: BinaryIO, size: int) -> None:
        self._f = f
        self._size = size
        self._pos = 0
        self._spans: list[tuple[int, bytes, bool]] = []  # (start, bytes, pinned), by start, never overlapping
        self._kept = 0  # bytes of the unpinned spans

    def __enter__(self) -> _Spans:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the object and drop what was kept."""
        self._spans = []
        self._f.close()
        _collect_cycles()

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        end = self._size if n is None or n < 0 else min(self._size, self._pos + n)
        if end <= self._pos:
            return b""
        parts: list[bytes] = []
        at = self._pos
        while at < end:
            got = self._held(at, end)
            if got:
                parts.append(got)
                at += len(got)
                continue
            # A miss: fetch what is lacking plus the read-ahead, up to the next kept span (nothing is fetched twice);
            # a small object whole, the first time.
            lo, upto = at, min(self._size, end + READAHEAD)
            if self._size <= WHOLE_FILE and not self._spans:
                lo, upto = 0, self._size
            upto = min(upto, self._next_start(lo))
            self._f.seek(lo)
            data = self._f.read(upto - lo)
            if len(data) <= at - lo:  # the object is shorter than listed: read as far as it goes
                break
            self.keep(lo, data)
            got = data[at - lo : end - lo]
            parts.append(got)
            at += len(got)
        self._pos = at
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def keep(self, start: int, data: bytes, pinned: bool = False) -> None:
        """Keep ``data``, the object's bytes at ``start`` (the parts a kept span already holds are not stored twice)."""
        end = start + len(data)
        for s, d, _ in self._spans:  # trim against what is held (spans never overlap)
            if s <= start < s + len(d):
                data, start = data[s + len(d) - start :], s + len(d)
            elif start < s < end:
                data = data[: s - start]
            end = start + len(data)
            if not data:
                return
        self._spans.append((start, data, pinned))
        self._spans.sort(key=_span_start)
        if not pinned:
            self._kept += len(data)
            while self._kept > KEEP_BYTES:
                oldest = next((i for i, (_, d, p) in enumerate(self._spans) if not p and d is not data), None)
                if oldest is None:
                    break
                self._kept -= len(self._spans.pop(oldest)[1])

    def _held(self, at: int, end: int) -> bytes:
        """The kept bytes from ``at`` on (up to ``end``), or b"" when ``at`` is in no kept span."""
        for s, d, _ in self._spans:
            if s <= at < s + len(d):
                return d[at - s : end - s]
        return b""

    def _next_start(self, at: int) -> int:
        """Where the first kept span after ``at`` starts (the object's size when none does)."""
        return min((s for s, _, _ in self._spans if s > at), default=self._size)


def _span_start(span: tuple[int, bytes, bool]) -> int:
    return span[0]


def _read(
    fs: AbstractFileSystem, full: str, rel: str, info: dict[str, Any], limits: Limits, in_dcp: bool
) -> FileFacts:
    """Read one remote object into ``FileFacts`` with the shared sniff and readers; never raises."""
    size = info.get("size")
    base = FileFacts(rel, size if isinstance(size, int) and size >= 0 else 0, _mtime(info), FileKind.OTHER)
    if base.size == 0:  # nothing to fetch: sniffed from the name alone, as a local empty file is
        return read_open_file(cast("BinaryIO", _Empty()), base, limits, in_dcp, frameworks=True)
    try:
        with _open(fs, full, base.size, info) as f:
            return read_open_file(cast("BinaryIO", f), base, limits, in_dcp, frameworks=True)
    except Exception as e:  # opening or closing failed (backend errors have no common base)
        return _with_problem(base, e)


class _Empty:
    """A zero-byte file: what an empty object reads as, without a request."""

    def read(self, n: int = -1) -> bytes:
        return b""

    def seek(self, pos: int, whence: int = 0) -> int:
        return 0


def _with_problem(facts: FileFacts, e: Exception) -> FileFacts:
    problem = ReadProblem(ProblemKind.UNREADABLE, f"cannot read: {type(e).__name__}: {e}")
    return FileFacts(
        facts.path, facts.size, facts.mtime, facts.kind, facts.content, (*facts.problems, problem), facts.is_link,
        facts.alt_pickle,
    )


def _mtime(info: dict[str, Any]) -> float:
    """A listing entry's modification time as a POSIX timestamp, from whichever field the backend gives (0 if none)."""
    for key in ("mtime", "LastModified", "updated", "last_modified", "timeCreated", "created"):
        v = info.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
        if isinstance(v, datetime.datetime):
            return v.timestamp()
        if isinstance(v, str):
            try:
                return datetime.datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0


def _unreadable_root(message: str) -> PathProblem:
    return PathProblem(".", ReadProblem(ProblemKind.UNREADABLE, message))


def read_small_object(url: str, cap: int) -> bytes | None:
    """The bytes of the object at ``url`` (at most ``cap`` + 1 of them), or None when there is no such object.

    For settings files beside a URL root; a backend error other than "not found" is raised as ``OSError``.
    """
    try:
        fs, path = _filesystem(url)
        fs.invalidate_cache(path)  # see FsspecSource.root: never trust a listing from an earlier scan
        with fs.open(path, "rb", block_size=cap + 1, cache_type="all") as f:
            return cast(bytes, f.read(cap + 1))
    except FileNotFoundError:
        return None
    except ImportError as e:
        raise OSError(f"{e}; {INSTALL_HINT}") from None
    except OSError:
        raise
    except Exception as e:  # a backend's own error type (credentials, endpoint): report it, never a traceback
        raise OSError(_one_line(f"{type(e).__name__}: {e}")) from None
