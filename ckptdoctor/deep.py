"""``--deep``: stream every tensor's bytes in bounded chunks and record NaN/Inf, all-zero tensors and checksums.

TensorFlow data shards (``ckpt-N.data-K-of-M``) are streamed the same way, each entry's bytes against the crc32c
its ``ckpt-N.index`` records (``ckptdoctor.readers.tfbundle.crc_spans``).

This is the only scan-path module that reads tensor data, and the only one that imports numpy, lazily, when
``--deep`` is asked for. Memory stays bounded (two chunk buffers per worker thread) whatever the model size:
nothing is ever loaded whole. With ``checksums`` every file is read front to back once, and the same chunks feed
both the sha256 and the tensor checks. Rules judge the results (the ``deep_only`` rules); this module only
measures, and reads (never writes) the checksum manifest.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import itertools
import json
import math
import os
import stat
import struct
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from ckptdoctor.errors import UsageError
from ckptdoctor.model import (
    FileData,
    FileFacts,
    FileKind,
    Manifest,
    ManifestEntry,
    ProblemKind,
    ReadProblem,
    SafetensorsFacts,
    TensorData,
    TfIndexFacts,
    TorchFacts,
    Tree,
)
from ckptdoctor.progress import Meter

if TYPE_CHECKING:
    from ckptdoctor.readers.tfbundle import CrcSpan

# 1 MiB: large enough that per-call overhead vanishes, small enough that the bytes just read are still in the
# CPU cache when numpy reduces them (measured in bench/RESULTS.md: 4-16 MiB chunks were slower).
CHUNK_BYTES = 1 << 20

# Floating dtypes the deep reader decodes: itemsize, and for the 16-bit ones the exponent mask of their bits
# (NaN/Inf are the values whose exponent bits are all ones; the sign bit is masked off first).
_NATIVE_FLOATS = {"F32": 4, "F64": 8}
_HALF_EXP_MASK = {"F16": 0x7C00, "BF16": 0x7F80}
# Floating dtypes it does not decode yet (8/6/4-bit floats, complex): listed as skipped, never guessed at.
_FLOAT_CODES = frozenset(
    {"F16", "BF16", "F32", "F64", "C64", "F4", "F6_E2M3", "F6_E3M2", "F8_E5M2", "F8_E4M3", "F8_E8M0"}
    | {"F8_E4M3FNUZ", "F8_E5M2FNUZ"}
)
_ITEMSIZE = {**_NATIVE_FLOATS, "F16": 2, "BF16": 2}

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # zip local file header
_ZIP_LOCAL = b"PK\x03\x04"
MANIFEST_SCHEMA = "ckptdoctor.manifest/1"
MANIFEST_PATH = ".ckptdoctor/manifest.json"  # relative to the scan root; discovery never scans `.ckptdoctor/`
# A manifest lists one short entry per file: even a million files stay far below this.
_MANIFEST_MAX_BYTES = 256_000_000
_HEX = frozenset("0123456789abcdef")

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


class DeepUnavailable(UsageError, RuntimeError):
    """``--deep`` was asked for where it cannot run: numpy cannot be imported, or the root is remote. A
    ``UsageError``, as the command exits 2 for it (still a ``RuntimeError``, as it was first)."""


@dataclass(frozen=True, slots=True)
class _Span:
    """One tensor's bytes in a file: where they start, how many, and how to decode them (or, for a TensorFlow
    bundle entry, ``crc``: the crc32c its index records, checked instead of decoding the values)."""

    name: str
    dtype: str
    start: int
    nbytes: int
    crc: CrcSpan | None = None
    index: str = ""  # the name of the index that records ``crc``
    contiguous: bool = True  # its bytes are exactly the tensor's elements, in order (a value digest means something)

    @property
    def end(self) -> int:
        return self.start + self.nbytes


def is_deep_candidate(f: FileFacts) -> bool:
    """Whether ``--deep`` reads this file's tensor data: safetensors files and torch zip archives that parsed."""
    return isinstance(f.content, SafetensorsFacts) or (isinstance(f.content, TorchFacts) and f.content.format == "zip")


# A TensorFlow data shard's place in its bundle: the index's facts, the shard's number, the index's file name.
TfShard = tuple[TfIndexFacts, int, str]


def tf_shards(tree: Tree) -> dict[str, TfShard]:
    """Every data shard a readable ``ckpt-N.index`` of ``tree`` places entries in, by root-relative path (present
    or not: ``check_tree`` reads only the files discovery found)."""
    indexes = [f for f in tree.all_files() if f.kind is FileKind.TF_INDEX and isinstance(f.content, TfIndexFacts)]
    if not indexes:
        return {}
    from ckptdoctor.readers.tfbundle import shard_name  # only a tree with a TF bundle pays for it

    out: dict[str, TfShard] = {}
    for idx in indexes:
        assert isinstance(idx.content, TfIndexFacts)
        folder = idx.path[: -len(idx.name)]
        prefix = idx.name[: -len(".index")]
        for k in range(min(idx.content.num_shards, len(idx.content.entries))):
            out[folder + shard_name(prefix, k, idx.content.num_shards)] = (idx.content, k, idx.name)
    return out


def check_tree(
    tree: Tree,
    jobs: int = 1,
    progress: TextIO | None = None,
    checksums: bool = False,
    values: frozenset[str] = frozenset(),
) -> tuple[FileData, ...]:
    """Stream the tensor data of every readable weights/state file of ``tree``; results sorted by path.

    ``jobs`` files are read at once (numpy, hashlib and file reads release the GIL, so threads use several cores).
    ``progress``, when given (a TTY), gets a one-line progress display. ``checksums`` also reads every other
    regular file and records each file's sha256 (``FileData.sha256``). TensorFlow data shards are checked against
    the crc32c of their index's entries (``FileData.corrupt``). Files whose root-relative path is in ``values``
    also get a digest of each tensor's bytes (``TensorData.digest``), to compare with another form of the same
    weights; other files cost nothing more. Raises ``DeepUnavailable`` without numpy.
    """
    np = _numpy()
    tf = tf_shards(tree)
    kind = (lambda f: f.kind != FileKind.SPECIAL) if checksums else is_deep_candidate
    files = sorted((f for f in tree.all_files() if kind(f) or f.path in tf), key=lambda f: f.path)
    base = tree.abs_root or os.path.abspath(tree.root)
    single = not os.path.isdir(base)
    bar = Meter(progress, len(files), sum(f.size for f in files)) if progress is not None else None

    def one(f: FileFacts) -> FileData:
        path = base if single else os.path.join(base, *f.path.split("/"))
        advance = bar.advance if bar is not None else None
        result = check_file(path, f, np, advance, checksums, tf.get(f.path), f.path in values)
        if bar is not None:
            bar.file_done()
        return result

    try:
        if jobs <= 1 or len(files) <= 1:
            results = [one(f) for f in files]
        else:
            with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="ckptdoctor-deep") as pool:
                results = list(pool.map(one, files))
    finally:
        if bar is not None:
            bar.close()
    return tuple(results)


def _numpy() -> Any:
    try:
        import numpy
    except ImportError as exc:
        raise DeepUnavailable(f"--deep needs numpy to check tensor data (pip install numpy): {exc}") from None
    return numpy


def check_file(
    path: str,
    facts: FileFacts,
    np: Any = None,
    advance: Callable[[int], None] | None = None,
    checksum: bool = False,
    tf_shard: TfShard | None = None,
    values: bool = False,
) -> FileData:
    """Stream the tensors of one file (``facts`` from its header read) and measure each; never raises on bad input.

    The file must still be the one the header came from: a different size means it changed under the scan.
    ``checksum`` reads the whole file (not only its tensor data) and records its sha256 in the same pass.
    ``tf_shard`` (for a TensorFlow data shard) checks each of its index's entries against its crc32c.
    ``values`` records a digest of each contiguous tensor's bytes (``TensorData.digest``).
    """
    np = np if np is not None else _numpy()
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:
        return FileData(facts.path, (), 0, (_unreadable(e),))
    with os.fdopen(fd, "rb", buffering=0) as f:
        try:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                return FileData(facts.path, (), 0, (ReadProblem(ProblemKind.SPECIAL_FILE, "no longer a regular file"),))
            if st.st_size != facts.size:
                msg = f"changed while scanning: {facts.size:,} bytes when its header was read, {st.st_size:,} now"
                return FileData(facts.path, (), 0, (ReadProblem(ProblemKind.UNREADABLE, msg),))
            spans, skipped, problems, corrupt = _plan(f, facts, tf_shard)
            digest = hashlib.sha256() if checksum else None
            data = _measure(f, facts.path, st.st_size, spans, skipped, problems, np, advance, digest, values)
            return dataclasses.replace(data, corrupt=corrupt + data.corrupt) if corrupt else data
        except OSError as e:
            return FileData(facts.path, (), 0, (_unreadable(e),))


# ---------------------------------------------------------------------------------------------------------------
# Where each tensor's bytes are


def _plan(
    f: Any, facts: FileFacts, tf_shard: TfShard | None = None
) -> tuple[list[_Span], list[str], list[ReadProblem], tuple[ReadProblem, ...]]:
    """The spans to measure (float tensors in a decodable dtype, TensorFlow entries with a crc32c), the float
    tensors skipped, problems reading the file, and corruption found while planning (TensorFlow entries)."""
    if tf_shard is not None:
        return _tf_spans(f, facts.size, *tf_shard)
    if isinstance(facts.content, SafetensorsFacts):
        return (*_safetensors_spans(facts.content), ())
    if isinstance(facts.content, TorchFacts):
        return (*_torch_spans(f, facts.content), ())
    return [], [], [], ()


def _tf_spans(
    f: Any, size: int, index: TfIndexFacts, shard_id: int, index_name: str
) -> tuple[list[_Span], list[str], list[ReadProblem], tuple[ReadProblem, ...]]:
    from ckptdoctor.readers.tfbundle import crc_spans

    spans, corrupt = crc_spans(index, shard_id, f, size)
    out = [_Span(s.entry.key, s.entry.dtype, s.start, s.length, s, index_name) for s in spans]
    return out, [], [], tuple(corrupt)


def _safetensors_spans(c: SafetensorsFacts) -> tuple[list[_Span], list[str], list[ReadProblem]]:
    # The reader keeps tensors in offset order and has verified they are contiguous from the data start.
    spans: list[_Span] = []
    skipped: list[str] = []
    at = 8 + c.header_bytes
    for t in c.tensors:
        if t.dtype in _ITEMSIZE:
            spans.append(_Span(t.name, t.dtype, at, t.nbytes))
        elif t.dtype in _FLOAT_CODES:
            skipped.append(f"{t.name} ({t.dtype})")
        at += t.nbytes
    return spans, skipped, []


def _torch_spans(f: Any, c: TorchFacts) -> tuple[list[_Span], list[str], list[ReadProblem]]:
    spans: list[_Span] = []
    skipped: list[str] = []
    problems: list[ReadProblem] = []
    if c.byteorder != "little":
        return [], [f"{name} ({t.dtype}, {c.byteorder}-endian)" for name, t in c.tensors if t.dtype in _FLOAT_CODES], []
    members = {m.name: m for m in c.members}
    starts: dict[str, tuple[int, int] | None] = {}  # storage key -> (first data byte, record size)
    for name, t in c.tensors:
        if t.dtype not in _ITEMSIZE:
            if t.dtype in _FLOAT_CODES:
                skipped.append(f"{name} ({t.dtype})")
            continue
        if t.storage_key not in starts:
            starts[t.storage_key] = _record_start(f, members.get(f"{c.prefix}/data/{t.storage_key}"), problems)
        where = starts[t.storage_key]
        if where is None or t.numel == 0:
            continue
        itemsize = _ITEMSIZE[t.dtype]
        # The elements a strided view can touch: from its offset to its farthest element. For contiguous views
        # (what state dicts hold) that is exactly the tensor; for others it is the storage range it spans.
        extent = 1 + sum((d - 1) * s for d, s in zip(t.shape, t.stride, strict=False) if d > 0)
        begin, length = t.storage_offset * itemsize, extent * itemsize
        if t.storage_offset < 0 or begin + length > where[1]:
            continue  # the header read already reports views past their storage (torch refuses them)
        spans.append(_Span(name, t.dtype, where[0] + begin, length, contiguous=_row_major(t.shape, t.stride)))
    return spans, skipped, problems


def _row_major(shape: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """Whether a view's elements lie in its bytes in order, one after another (``Tensor.is_contiguous``)."""
    want = 1
    for d, s in zip(reversed(shape), reversed(stride), strict=False):
        if d != 1 and s != want:
            return False
        want *= d
    return len(shape) == len(stride)


def _record_start(f: Any, m: Any, problems: list[ReadProblem]) -> tuple[int, int] | None:
    """First data byte and size of a stored (uncompressed) zip record, from its local header."""
    if m is None or m.method != 0 or m.size != m.compressed_size:
        return None  # missing or compressed records are reported by the header read
    f.seek(m.offset)
    head = f.read(_LOCAL.size)
    if len(head) != _LOCAL.size or head[:4] != _ZIP_LOCAL:
        problems.append(ReadProblem(ProblemKind.MALFORMED, f"record `{m.name}` has no local header at {m.offset}"))
        return None
    fields = _LOCAL.unpack(head)
    return m.offset + _LOCAL.size + fields[9] + fields[10], m.size


# ---------------------------------------------------------------------------------------------------------------
# Measuring


def _measure(
    f: Any,
    rel: str,
    size: int,
    spans: list[_Span],
    skipped: list[str],
    problems: list[ReadProblem],
    np: Any,
    advance: Callable[[int], None] | None,
    digest: Any = None,
    values: bool = False,
) -> FileData:
    """Read the spans (with ``digest``: the whole file) once, front to back, feeding each chunk to every span it
    lies in (views of one torch storage may overlap) and to the digest; with ``values``, to each contiguous span's
    own digest too."""
    # A whole number of elements of every decoded dtype per chunk, so no element is ever split between reads.
    chunk = max(8, CHUNK_BYTES - CHUNK_BYTES % 8)
    buf = bytearray(chunk)
    view = memoryview(buf)
    scratch = np.empty(chunk // 2, dtype=np.uint16)
    inside = []
    for sp in spans:
        if sp.end > size:
            skipped.append(f"{sp.name} ({sp.dtype}, past the end of the file)")
        else:
            inside.append(sp)
    inside.sort(key=lambda s: s.start)
    stats: list[_Stats | _Crc] = [
        _Crc(sp.crc) if sp.crc is not None else _Stats(values and sp.contiguous) for sp in inside
    ]
    # Reads never cross a span boundary, so every read starts on an element of each span it lies in (spans that
    # share bytes are views of one storage, whose offsets count whole elements).
    cuts = {p for sp in inside for p in (sp.start, sp.end)} | ({0, size} if digest is not None else set())
    bounds = sorted(cuts)
    total = 0
    nxt = 0
    active: list[int] = []
    where = -1
    for lo, hi in itertools.pairwise(bounds):
        while nxt < len(inside) and inside[nxt].start <= lo:
            active.append(nxt)
            nxt += 1
        active = [i for i in active if inside[i].end > lo]
        if not active and digest is None:
            continue  # a gap between tensors: only a checksum needs its bytes
        if where != lo:
            f.seek(lo)
        at = lo
        while at < hi:
            want = min(chunk, hi - at)
            got = _read_into(f, view[:want])
            total += got
            if digest is not None:
                digest.update(view[:got])
            for i in active:
                stats[i].add(np, buf, at - inside[i].start, got, inside[i].dtype, scratch)
            if advance is not None and got:
                advance(got)
            if got < want:
                where_ = ", ".join(f"`{inside[i].name}`" for i in active) or f"byte {at + got:,}"
                problems.append(ReadProblem(ProblemKind.TRUNCATED, f"{where_}: the file ended while reading it"))
                tensors, corrupt = _results(inside, stats, skipped, lo)
                return FileData(rel, tensors, total, tuple(problems), tuple(skipped), corrupt=corrupt)
            at += got
        where = hi
    sha = digest.hexdigest() if digest is not None else None
    tensors, corrupt = _results(inside, stats, skipped, size + 1)
    return FileData(rel, tensors, total, tuple(problems), tuple(skipped), sha, corrupt)


class _Stats:
    """Running NaN/Inf counts and the any-nonzero flag of one span; ``bad`` when a read was not element-aligned;
    ``values``: the running digest of its bytes (``TensorData.digest``), None when not asked for."""

    __slots__ = ("bad", "inf", "nan", "nonzero", "values")

    def __init__(self, values: bool = False) -> None:
        self.nan = self.inf = 0
        self.nonzero = self.bad = False
        self.values = hashlib.blake2b(digest_size=16) if values else None

    def add(self, np: Any, buf: bytearray, offset: int, got: int, dtype: str, scratch: Any) -> None:
        itemsize = _ITEMSIZE[dtype]
        if offset % itemsize or got % itemsize:
            # Only a hostile archive gets here: two views of one storage with different dtypes.
            self.bad = True
            return
        n, i, z = _chunk_stats(np, buf, got // itemsize, dtype, scratch)
        if self.values is not None:
            self.values.update(memoryview(buf)[:got])
        self.nan += n
        self.inf += i
        self.nonzero = self.nonzero or z


class _Crc:
    """The running crc32c of one TensorFlow bundle entry's bytes (``add`` has ``_Stats.add``'s signature)."""

    __slots__ = ("crc", "extend")

    def __init__(self, span: CrcSpan) -> None:
        from ckptdoctor.readers.tfbundle import crc32c_extender

        self.crc = span.seed
        self.extend = crc32c_extender()

    def add(self, np: Any, buf: bytearray, offset: int, got: int, dtype: str, scratch: Any) -> None:
        self.crc = self.extend(bytes(memoryview(buf)[:got]), self.crc)


def _results(
    spans: list[_Span], stats: list[_Stats | _Crc], skipped: list[str], done: int
) -> tuple[tuple[TensorData, ...], tuple[ReadProblem, ...]]:
    """The spans read to their end (before offset ``done``), in file order, and the TensorFlow entries among them
    that fail their crc32c; misaligned spans go to ``skipped``."""
    out: list[TensorData] = []
    corrupt: list[ReadProblem] = []
    for sp, st in zip(spans, stats, strict=True):
        if sp.end > done and sp.nbytes > 0:
            continue
        if isinstance(st, _Crc):
            from ckptdoctor.readers.tfbundle import crc_mismatch

            assert sp.crc is not None
            bad = crc_mismatch(sp.crc, st.crc, f"`{sp.index}`")
            if bad is not None:
                corrupt.append(bad)
            continue
        if st.bad:
            skipped.append(f"{sp.name} ({sp.dtype}, a view misaligned with another view of its storage)")
            continue
        numel = sp.nbytes // _ITEMSIZE[sp.dtype]
        digest = st.values.hexdigest() if st.values is not None else None
        out.append(TensorData(sp.name, sp.dtype, numel, st.nan, st.inf, sp.nbytes > 0 and not st.nonzero, digest))
    return tuple(out), tuple(corrupt)


def _read_into(f: Any, view: memoryview) -> int:
    got = 0
    while got < len(view):
        k = f.readinto(view[got:])
        if not k:
            break
        got += k
    return got


def _chunk_stats(np: Any, buf: bytearray, count: int, dtype: str, scratch: Any) -> tuple[int, int, bool]:
    """(NaN count, Inf count, any nonzero element) of ``count`` elements of ``dtype`` at the start of ``buf``."""
    if count == 0:
        return 0, 0, False
    if dtype in _NATIVE_FLOATS:
        a = np.frombuffer(buf, dtype="<f4" if dtype == "F32" else "<f8", count=count)
        # min and max are the fastest full reductions numpy has; both propagate NaN, so one pair answers
        # "all finite?" and "all zero?" (+0.0 == -0.0); counting is only needed on the rare bad chunk.
        hi, lo = float(a.max()), float(a.min())
        nonzero = hi != 0.0 or lo != 0.0
        if math.isfinite(hi) and math.isfinite(lo):
            return 0, 0, nonzero
        return int(np.count_nonzero(np.isnan(a))), int(np.count_nonzero(np.isinf(a))), nonzero
    # F16/BF16: no fast native type for BF16 (and numpy's float16 reductions convert), so work on the bits:
    # clear the sign, then every value at or above the exponent mask is Inf (equal) or NaN (above).
    # Two read-only reductions instead of writing the cleared bits out first: as signed 16-bit numbers, positive
    # Inf/NaN are the largest values; as unsigned ones, negative Inf/NaN are. +0.0 is 0 and -0.0 is 0x8000, so
    # anything else nonzero shows as a signed max above 0 or an unsigned max above 0x8000.
    exp = _HALF_EXP_MASK[dtype]
    raw = np.frombuffer(buf, dtype="<u2", count=count)
    u_max = int(raw.max())
    s_max = int(raw.view("<i2").max())
    if s_max < exp and u_max < (0x8000 | exp):
        return 0, 0, s_max > 0 or u_max > 0x8000
    bits = np.bitwise_and(raw, 0x7FFF, out=scratch[:count])
    return int(np.count_nonzero(bits > exp)), int(np.count_nonzero(bits == exp)), True


def _unreadable(e: OSError) -> ReadProblem:
    return ReadProblem(ProblemKind.UNREADABLE, f"cannot read: {e.strerror or e}")


# ---------------------------------------------------------------------------------------------------------------
# Checksum manifests (built and read here; ``ckptdoctor.fixer.write_manifest`` is what writes one)


def manifest_document(tree: Tree, version: str, now: float | None = None) -> tuple[dict[str, Any], list[str]]:
    """The ``ckptdoctor.manifest/1`` document for ``tree`` (scanned with checksums) and the files left out of it.

    Files left out are those ``--deep`` could not read whole (their ``FileData.problems`` say why).
    """
    sizes = {f.path: f.size for f in tree.all_files()}
    entries: list[dict[str, Any]] = []
    missed: list[str] = []
    for d in tree.data:
        if d.sha256 is None or d.path not in sizes:
            missed.append(d.path)
        else:
            entries.append({"path": d.path, "size": sizes[d.path], "sha256": d.sha256})
    created = datetime.datetime.fromtimestamp(time.time() if now is None else now, datetime.timezone.utc)
    doc = {
        "schema": MANIFEST_SCHEMA,
        "ckptdoctor": version,
        "created": created.isoformat(timespec="seconds").replace("+00:00", "Z"),
        "algorithm": "sha256",
        "files": sorted(entries, key=lambda e: str(e["path"])),
    }
    return doc, missed


def manifest_exists(root: str) -> bool:
    """Whether ``root`` (a folder) holds a manifest file (or anything else at its place)."""
    return os.path.lexists(os.path.join(root, *MANIFEST_PATH.split("/")))


def read_manifest(root: str) -> Manifest:
    """Read ``<root>/.ckptdoctor/manifest.json``; anything wrong with it is a problem in the value, never raised."""
    path = os.path.join(root, *MANIFEST_PATH.split("/"))

    def bad(kind: ProblemKind, why: str) -> Manifest:
        return Manifest(MANIFEST_PATH, (), problems=(ReadProblem(kind, why),))

    try:
        fd = os.open(path, _OPEN_FLAGS | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        return bad(ProblemKind.UNREADABLE, f"cannot read: {e.strerror or e}")
    with os.fdopen(fd, "rb", buffering=0) as f:
        try:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                return bad(ProblemKind.SPECIAL_FILE, "not a regular file")
            if st.st_size > _MANIFEST_MAX_BYTES:
                return bad(ProblemKind.LIMIT, f"{st.st_size:,} bytes, over the {_MANIFEST_MAX_BYTES:,}-byte limit")
            raw = f.read(_MANIFEST_MAX_BYTES + 1)
        except OSError as e:
            return bad(ProblemKind.UNREADABLE, f"cannot read: {e.strerror or e}")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        return bad(ProblemKind.INVALID_JSON, f"not valid JSON: {e}")
    return manifest_from_document(doc) or bad(ProblemKind.MALFORMED, f"not a `{MANIFEST_SCHEMA}` document")


def manifest_from_document(doc: Any) -> Manifest | None:
    """The manifest a decoded document describes, or None when it does not follow the schema."""
    if not isinstance(doc, dict) or doc.get("schema") != MANIFEST_SCHEMA or not isinstance(doc.get("files"), list):
        return None
    entries: list[ManifestEntry] = []
    for e in doc["files"]:
        if not isinstance(e, dict):
            return None
        path, size, sha = e.get("path"), e.get("size"), e.get("sha256")
        if not isinstance(path, str) or not path or path.startswith("/") or ".." in path.split("/"):
            return None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return None
        if not isinstance(sha, str) or len(sha) != 64 or not set(sha) <= _HEX:
            return None
        entries.append(ManifestEntry(path, size, sha))
    version, created = doc.get("ckptdoctor"), doc.get("created")
    return Manifest(
        MANIFEST_PATH,
        tuple(entries),
        version if isinstance(version, str) else "",
        created if isinstance(created, str) else "",
    )


# ---------------------------------------------------------------------------------------------------------------
# Progress (stderr, TTY only)


