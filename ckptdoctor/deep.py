"""``--deep``: stream every tensor's bytes in bounded chunks and record NaN/Inf and all-zero tensors.

This is the only scan-path module that reads tensor data, and the only one that imports numpy, lazily, when
``--deep`` is asked for. Memory stays bounded (two chunk buffers per worker thread) whatever the model size:
nothing is ever loaded whole. Rules judge the results (``ckptdoctor.rules.deep``); this module only measures.
"""

from __future__ import annotations

import math
import os
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TextIO

from ckptdoctor.model import (
    FileData,
    FileFacts,
    ProblemKind,
    ReadProblem,
    SafetensorsFacts,
    TensorData,
    TorchFacts,
    Tree,
)

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
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


class DeepUnavailable(RuntimeError):
    """``--deep`` was asked for but numpy cannot be imported."""


@dataclass(frozen=True, slots=True)
class _Span:
    """One tensor's bytes in a file: where they start, how many, and how to decode them."""

    name: str
    dtype: str
    start: int
    nbytes: int


def is_deep_candidate(f: FileFacts) -> bool:
    """Whether ``--deep`` reads this file's tensor data: safetensors files and torch zip archives that parsed."""
    return isinstance(f.content, SafetensorsFacts) or (isinstance(f.content, TorchFacts) and f.content.format == "zip")


def check_tree(tree: Tree, jobs: int = 1, progress: TextIO | None = None) -> tuple[FileData, ...]:
    """Stream the tensor data of every readable weights/state file of ``tree``; results sorted by path.

    ``jobs`` files are read at once (numpy and file reads release the GIL, so threads use several cores).
    ``progress``, when given (a TTY), gets a one-line progress display. Raises ``DeepUnavailable`` without numpy.
    """
    np = _numpy()
    files = sorted((f for f in tree.all_files() if is_deep_candidate(f)), key=lambda f: f.path)
    base = tree.abs_root or os.path.abspath(tree.root)
    single = not os.path.isdir(base)
    bar = _Progress(progress, len(files), sum(f.size for f in files)) if progress is not None else None

    def one(f: FileFacts) -> FileData:
        path = base if single else os.path.join(base, *f.path.split("/"))
        result = check_file(path, f, np, bar.advance if bar is not None else None)
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


def check_file(path: str, facts: FileFacts, np: Any = None, advance: Callable[[int], None] | None = None) -> FileData:
    """Stream the tensors of one file (``facts`` from its header read) and measure each; never raises on bad input.

    The file must still be the one the header came from: a different size means it changed under the scan.
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
            spans, skipped, problems = _plan(f, facts)
            return _measure(f, facts.path, st.st_size, spans, skipped, problems, np, advance)
        except OSError as e:
            return FileData(facts.path, (), 0, (_unreadable(e),))


# ---------------------------------------------------------------------------------------------------------------
# Where each tensor's bytes are


def _plan(f: Any, facts: FileFacts) -> tuple[list[_Span], list[str], list[ReadProblem]]:
    """The spans to measure (float tensors in a decodable dtype), the float tensors skipped, and problems."""
    if isinstance(facts.content, SafetensorsFacts):
        return _safetensors_spans(facts.content)
    if isinstance(facts.content, TorchFacts):
        return _torch_spans(f, facts.content)
    return [], [], []


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
        spans.append(_Span(name, t.dtype, where[0] + begin, length))
    return spans, skipped, problems


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
) -> FileData:
    # A whole number of elements of every decoded dtype per chunk, so no element is ever split between reads.
    chunk = max(8, CHUNK_BYTES - CHUNK_BYTES % 8)
    buf = bytearray(chunk)
    view = memoryview(buf)
    scratch = np.empty(chunk // 2, dtype=np.uint16)
    out: list[TensorData] = []
    total = 0
    for sp in sorted(spans, key=lambda s: s.start):
        if sp.start + sp.nbytes > size:
            skipped.append(f"{sp.name} ({sp.dtype}, past the end of the file)")
            continue
        itemsize = _ITEMSIZE[sp.dtype]
        nan = inf = 0
        nonzero = False
        f.seek(sp.start)
        left = sp.nbytes
        while left > 0:
            want = min(chunk, left)
            got = _read_into(f, view[:want])
            if got < want:
                problems.append(ReadProblem(ProblemKind.TRUNCATED, f"`{sp.name}`: the file ended while reading it"))
                break
            total += got
            left -= got
            n, i, z = _chunk_stats(np, buf, got // itemsize, sp.dtype, scratch)
            nan += n
            inf += i
            nonzero = nonzero or z
            if advance is not None:
                advance(got)
        else:
            out.append(TensorData(sp.name, sp.dtype, sp.nbytes // itemsize, nan, inf, sp.nbytes > 0 and not nonzero))
    return FileData(rel, tuple(out), total, tuple(problems), tuple(skipped))


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
    exp = _HALF_EXP_MASK[dtype]
    bits = np.bitwise_and(np.frombuffer(buf, dtype="<u2", count=count), 0x7FFF, out=scratch[:count])
    top = int(bits.max())
    if top < exp:
        return 0, 0, top != 0
    return int(np.count_nonzero(bits > exp)), int(np.count_nonzero(bits == exp)), True


def _unreadable(e: OSError) -> ReadProblem:
    return ReadProblem(ProblemKind.UNREADABLE, f"cannot read: {e.strerror or e}")


# ---------------------------------------------------------------------------------------------------------------
# Progress (stderr, TTY only)


class _Progress:
    """A one-line progress display: files, bytes and an ETA, redrawn at most a few times a second."""

    def __init__(self, stream: TextIO, files: int, total: int) -> None:
        self.stream = stream
        self.files = files
        self.total = total
        self.done_files = 0
        self.done = 0
        self.start = time.monotonic()
        self.last = 0.0
        self.lock = threading.Lock()

    def advance(self, n: int) -> None:
        with self.lock:
            self.done += n
            self._draw(False)

    def file_done(self) -> None:
        with self.lock:
            self.done_files += 1
            self._draw(True)

    def close(self) -> None:
        with self.lock:
            self._draw(True)
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self.last < 0.2:
            return
        self.last = now
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        # Header bytes are not counted, so `done` may stay a little under `total`: never show a negative ETA.
        eta = f"{_clock(max(0.0, (self.total - self.done) / rate))}" if rate > 0 else "?"
        line = (
            f"\rdeep: {self.done_files}/{self.files} files, {_size(self.done)}/{_size(self.total)}, "
            f"{_size(int(rate))}/s, ETA {eta}  "
        )
        self.stream.write(line)
        self.stream.flush()


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} TB"


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def progress_stream() -> TextIO | None:
    """stderr when it is a terminal (progress is for people), else None (quiet in CI and pipes)."""
    isatty = getattr(sys.stderr, "isatty", None)
    return sys.stderr if isatty is not None and isatty() else None
