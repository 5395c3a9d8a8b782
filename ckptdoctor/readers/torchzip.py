"""Readers for ``torch.save`` files (zip and legacy formats) and raw pickles, by static walk only."""

from __future__ import annotations

import io
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, BinaryIO

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import (
    GlobalRef,
    Opaque,
    PickleFacts,
    ProblemKind,
    ReadOutcome,
    ReadProblem,
    TensorRef,
    TorchFacts,
    ZipMember,
)
from ckptdoctor.readers.pickle_walk import iter_values, walk_pickle

__all__ = ["STORAGE_DTYPES", "Window", "merge_pickles", "read_raw_pickle", "read_torch", "read_zip_at"]

# torch's legacy storage classes (torch/storage.py ``_dtype_to_storage_type_map``) -> (safetensors code, itemsize).
STORAGE_DTYPES: dict[str, tuple[str, int]] = {
    "DoubleStorage": ("F64", 8),
    "FloatStorage": ("F32", 4),
    "HalfStorage": ("F16", 2),
    "BFloat16Storage": ("BF16", 2),
    "LongStorage": ("I64", 8),
    "IntStorage": ("I32", 4),
    "ShortStorage": ("I16", 2),
    "CharStorage": ("I8", 1),
    "ByteStorage": ("U8", 1),
    "BoolStorage": ("BOOL", 1),
    "ComplexDoubleStorage": ("C128", 16),
    "ComplexFloatStorage": ("C64", 8),
    "QInt8Storage": ("QI8", 1),
    "QInt32Storage": ("QI32", 4),
    "QUInt8Storage": ("QU8", 1),
    "QUInt4x2Storage": ("QU4x2", 1),
    "QUInt2x4Storage": ("QU2x4", 1),
    # dtypes newer than the legacy classes (float8, uint16 ...) are saved as bytes and retyped by
    # _rebuild_tensor_v3's dtype argument.
    "UntypedStorage": ("U8", 1),
}

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C  # torch/serialization.py
LEGACY_PROTOCOL_VERSION = 1001

_ZIP_LOCAL = b"PK\x03\x04"
_ZIP_EOCD = b"PK\x05\x06"
_ZIP64_LOCATOR = b"PK\x06\x07"
_ZIP64_EOCD = b"PK\x06\x06"
_ZIP_CENTRAL = b"PK\x01\x02"
_EOCD = struct.Struct("<4s4H2LH")
_ZIP64_LOC = struct.Struct("<4sLQL")
_ZIP64_REC = struct.Struct("<4sQ2H2L4Q")
_LOCAL = struct.Struct("<4s5H3L2H")
# The fields the per-record loops use, unpacked in one call (times, crc, disk and attributes skipped):
# central: signature, flags, method, compressed size, size, name, extra and comment lengths, local header offset;
# local: signature, flags, method, compressed size, size, name length.
_CENTRAL_USED = struct.Struct("<4s4xHH8xLLHHH8xL")
_LOCAL_USED = struct.Struct("<4s2xHH8xLLH")
_EXTRA_HEAD = struct.Struct("<HH")
_ZIP64_FIRST = struct.Struct("<2xHQ")  # an extra field that starts with the zip64 block: its length, first value
_U64 = struct.Struct("<Q")


def _problem(kind: ProblemKind, message: str) -> ReadProblem:
    return ReadProblem(kind, message)


def _read_at(f: BinaryIO, offset: int, n: int) -> bytes:
    f.seek(offset)
    return f.read(n)


def _positional_reader(f: BinaryIO) -> Callable[[int, int], bytes]:
    """``read(offset, n)`` for ``f``: one ``pread`` system call for a local file (instead of a seek and a read,
    hundreds of times per optimizer.pt), seek-and-read for anything else (windows, fsspec files)."""
    if type(f) is io.FileIO and hasattr(os, "pread"):
        fd = f.fileno()
        return lambda offset, n: os.pread(fd, n, offset)
    return lambda offset, n: _read_at(f, offset, n)


# ---------------------------------------------------------------------------------------------------------------
# Zip central directory (parsed by hand: entry count and sizes are checked before anything is allocated)


@dataclass(frozen=True, slots=True)
class _Directory:
    """A parsed central directory. Offsets in ``members`` are already shifted by ``base``."""

    members: list[ZipMember]
    cd_offset: int  # where the central directory really starts in the file
    base: int  # bytes before the archive proper (prepended data): 0 for anything torch.save writes
    end: int  # end of the end-of-central-directory record and its comment
    # Per member: its name as stored in the central directory and that entry's UTF-8 flag (0 or 0x800), so the
    # local headers can be compared byte for byte and read in one go (the name's length is known up front).
    raw_names: list[tuple[bytes, int]]


def _directory(f: BinaryIO, size: int, limits: Limits) -> tuple[_Directory | None, list[ReadProblem]]:
    """The archive's central directory, or None with the problem that stops us."""
    members, cd_offset, problems, base, end, raw_names = _central_directory(f, size, limits)
    if members is None:
        return None, problems
    return _Directory(members, cd_offset, base, end, raw_names), problems


def _no_directory(problem: ReadProblem) -> tuple[None, int, list[ReadProblem], int, int, list[Any]]:
    """``_central_directory``'s answer when ``problem`` stops it."""
    return None, 0, [problem], 0, 0, []


def _central_directory(
    f: BinaryIO, size: int, limits: Limits
) -> tuple[list[ZipMember] | None, int, list[ReadProblem], int, int, list[tuple[bytes, int]]]:
    """The archive's members, the central directory's offset, problems, the archive's base and end, raw names."""
    tail_len = min(size, 22 + 65535)
    tail = _read_at(f, size - tail_len, tail_len)
    at = tail.rfind(_ZIP_EOCD)
    while at >= 0 and at + 22 > len(tail):
        at = tail.rfind(_ZIP_EOCD, 0, at)
    if at < 0:
        return _no_directory(
            _problem(
                ProblemKind.TRUNCATED,
                "no zip end-of-central-directory record: the archive is truncated "
                "(torch: `failed finding central directory`)",
            )
        )
    eocd_pos = size - tail_len + at
    _, _disk, _cd_disk, _n_disk, count, cd_size, cd_offset, comment_len = _EOCD.unpack_from(tail, at)
    end = min(size, eocd_pos + 22 + comment_len)
    cd_end_limit = eocd_pos
    loc = _read_at(f, eocd_pos - 20, 20) if eocd_pos >= 20 else b""
    # torch writes the zip64 records even for small archives; other writers only when a field overflows.
    if loc[:4] == _ZIP64_LOCATOR or count == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
        if len(loc) != 20 or loc[:4] != _ZIP64_LOCATOR:
            return _no_directory(_problem(ProblemKind.MALFORMED, "zip64 sizes without a zip64 locator"))
        rec_pos = _ZIP64_LOC.unpack(loc)[2]
        rec = _read_at(f, rec_pos, 56) if rec_pos + 56 <= eocd_pos - 20 else b""
        if rec[:4] != _ZIP64_EOCD and eocd_pos >= 76:
            # With data in front of the archive the locator's offset is relative: look where the record must be.
            rec_pos = eocd_pos - 76
            rec = _read_at(f, rec_pos, 56)
        if len(rec) != 56 or rec[:4] != _ZIP64_EOCD:
            return _no_directory(_problem(ProblemKind.MALFORMED, f"zip64 end record missing at byte {rec_pos}"))
        fields = _ZIP64_REC.unpack(rec)
        count, cd_size, cd_offset = fields[7], fields[8], fields[9]
        cd_end_limit = rec_pos
    if count > limits.zip_entries:
        return _no_directory(_problem(ProblemKind.LIMIT, f"zip declares {count} entries (limit {limits.zip_entries})"))
    # Data before the archive (a zip appended to something else, or a blob cut out of a .distcp) shifts every
    # offset; zipfile and miniz both find the directory from the end record, as we do, and shift by the gap.
    base = cd_end_limit - cd_size - cd_offset if cd_offset + cd_size < cd_end_limit else 0
    if base > 0 and _read_at(f, cd_offset + base, 4) == _ZIP_CENTRAL and _read_at(f, cd_offset, 4) != _ZIP_CENTRAL:
        cd_offset += base
    else:
        base = 0
    if cd_offset + cd_size > cd_end_limit or count * 46 > cd_size:
        return _no_directory(
            _problem(
                ProblemKind.MALFORMED,
                f"zip central directory ({count} entries, {cd_size} bytes at {cd_offset}) does not fit before "
                f"its end record at byte {cd_end_limit}",
            )
        )
    # The directory is usually inside the tail already read (a 64 KB window): slice it rather than read it again.
    tail_start = size - tail_len
    if len(tail) == tail_len and tail_start <= cd_offset and cd_offset + cd_size <= size:
        cd = tail[cd_offset - tail_start : cd_offset - tail_start + cd_size]
    else:
        cd = _read_at(f, cd_offset, cd_size)
    if len(cd) != cd_size:
        return _no_directory(_problem(ProblemKind.TRUNCATED, "zip central directory is cut short"))
    members, raw_names, bad = _entries(cd, count, base)
    if bad:
        return _no_directory(_problem(ProblemKind.MALFORMED, bad))
    return members, cd_offset, [], base, end, raw_names


def _entries(cd: bytes, count: int, base: int) -> tuple[list[ZipMember], list[tuple[bytes, int]], str]:
    """The ``count`` entries of the central directory ``cd``, their raw names, and why they stop early ("" if not).

    The hot loop of every zip read (one iteration per tensor): one unpack of the used fields per entry, locals
    bound outside the loop, and the zip64 extra field parsed only for entries that overflowed.
    """
    members: list[ZipMember] = []
    raw_names: list[tuple[bytes, int]] = []
    add_member, add_raw, unpack = members.append, raw_names.append, _CENTRAL_USED.unpack_from
    zip64_first = _ZIP64_FIRST.unpack_from
    n = len(cd)
    pos = 0
    for i in range(count):
        if pos + 46 > n:
            return members, raw_names, f"zip central directory entry {i} is corrupt"
        sig, flags, method, csize, usize, name_len, extra_len, comment_len, local = unpack(cd, pos)
        if sig != _ZIP_CENTRAL:
            return members, raw_names, f"zip central directory entry {i} is corrupt"
        start = pos + 46
        pos = start + name_len + extra_len + comment_len
        if pos > n:
            return members, raw_names, f"zip central directory entry {i} overruns it"
        name_raw = cd[start : start + name_len]
        if csize == 0xFFFFFFFF or usize == 0xFFFFFFFF or local == 0xFFFFFFFF:
            at = start + name_len
            if extra_len >= 12 and csize != 0xFFFFFFFF and usize != 0xFFFFFFFF and cd[at : at + 2] == b"\x01\x00":
                # What torch writes past 4 GB: the zip64 field first, holding only the local header's offset.
                tag_len, offset64 = zip64_first(cd, at)
                local = offset64 if tag_len >= 8 else local
            else:
                usize, csize, local = _zip64_extra(cd[at : at + extra_len], usize, csize, local)
        utf8 = flags & 0x800
        key = (name_raw, utf8, local + base, csize, usize, method)
        known = _MEMBERS.get(key)
        if known is None:
            name = name_raw.decode("utf-8" if utf8 else "cp437", "replace")
            known = (ZipMember(name, local + base, csize, usize, method), (name_raw, utf8))
            if len(_MEMBERS) >= _MEMBERS_ENTRIES:
                _MEMBERS.clear()
            _MEMBERS[key] = known
        add_member(known[0])
        add_raw(known[1])
    return members, raw_names, ""


# Entries already decoded, by everything a ZipMember and its raw name are made of. Every checkpoint of a run lists
# the same records at the same offsets (only CRCs differ, which are not kept): one object per entry for the whole
# scan instead of one per file (a 7B optimizer.pt has 879), which also spares decoding the name again. Shared by
# threads (dict get/set are atomic; a lost race costs one decode); bounded, cleared when full.
_MEMBERS: dict[tuple[bytes, int, int, int, int, int], tuple[ZipMember, tuple[bytes, int]]] = {}
_MEMBERS_ENTRIES = 200_000


def _zip64_extra(extra: bytes, usize: int, csize: int, local: int) -> tuple[int, int, int]:
    """Sizes and offset from the zip64 extended-information extra field (only the fields that overflowed)."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, ln = _EXTRA_HEAD.unpack_from(extra, pos)
        body = extra[pos + 4 : pos + 4 + ln]
        pos += 4 + ln
        if tag != 0x0001:
            continue
        # The overflowed fields' 8-byte values, in this order; a field whose value is missing keeps 0xFFFFFFFF.
        vals = iter(_U64.iter_unpack(body[: len(body) // 8 * 8]))
        if usize == 0xFFFFFFFF:
            usize = next(vals, (usize,))[0]
        if csize == 0xFFFFFFFF:
            csize = next(vals, (csize,))[0]
        if local == 0xFFFFFFFF:
            local = next(vals, (local,))[0]
        return usize, csize, local
    return usize, csize, local


def _data_start(f: BinaryIO, m: ZipMember) -> int | None:
    """Where a record's stored bytes start, as zip readers find them: after its local header's name and extra
    field (not the central directory's); None without a local header there."""
    head = _read_at(f, m.offset, 30)
    if len(head) != 30 or head[:4] != _ZIP_LOCAL:
        return None
    fields = _LOCAL.unpack(head)
    return int(m.offset + 30 + fields[9] + fields[10])


def _member_bytes(f: BinaryIO, m: ZipMember, data_end: int, cap: int) -> tuple[bytes | None, ReadProblem | None]:
    """The (decompressed) content of a small member; ``cap`` bounds what we are willing to hold."""
    if m.size > cap:
        return None, _problem(ProblemKind.LIMIT, f"record `{m.name}` is {m.size} bytes (limit {cap})")
    start = _data_start(f, m)
    if start is None:
        return None, _problem(ProblemKind.MALFORMED, f"record `{m.name}` has no local header at byte {m.offset}")
    if start + m.compressed_size > data_end:
        return None, _problem(
            ProblemKind.TRUNCATED, f"record `{m.name}` ends at byte {start + m.compressed_size}, past {data_end}"
        )
    raw = _read_at(f, start, m.compressed_size)
    if m.method == 0:
        return raw, None
    if m.method == 8:
        try:
            d = zlib.decompressobj(-15)
            out = d.decompress(raw, cap + 1)  # bounded: a zip bomb stops at the cap
        except zlib.error as exc:
            return None, _problem(ProblemKind.MALFORMED, f"record `{m.name}` does not inflate: {exc}")
        if len(out) > cap:
            return None, _problem(ProblemKind.LIMIT, f"record `{m.name}` inflates past {cap} bytes")
        return out, None
    return None, _problem(ProblemKind.MALFORMED, f"record `{m.name}` uses zip compression method {m.method}")


# ---------------------------------------------------------------------------------------------------------------
# Storages


_STORAGE_REFS: dict[tuple[str, int, str, str, int | None], TensorRef] = {}
_STORAGE_REFS_ENTRIES = 100_000


class _Storages:
    """Turns torch's persistent ids into storage descriptors (1-D TensorRefs over the whole storage)."""

    def __init__(self, record_sizes: dict[str, int] | None, legacy: bool) -> None:
        self.record_sizes = record_sizes  # zip: key -> record size; legacy: None (checked after the walk)
        self.legacy = legacy
        self.want = 6 if legacy else 5  # ('storage', class, key, location, numel[, view metadata (legacy)])
        self.cache: dict[str, TensorRef] = {}
        self.declared: dict[str, tuple[int, int]] = {}  # key -> (numel, itemsize)
        self.problems: list[ReadProblem] = []
        self.bad_ids = 0

    def __call__(self, pid: Any) -> Any:
        # Called once per storage (hundreds per optimizer.pt): the common, valid id is checked first and cheaply.
        if type(pid) is tuple and len(pid) == self.want and pid[0] in ("storage", b"storage"):
            stype, key, location, numel = pid[1], pid[2], pid[3], pid[4]
            if (
                type(stype) is GlobalRef
                and type(key) is str
                and type(numel) is int
                and numel >= 0
                and type(location) in (str, bytes)
                and stype.module == "torch"
                and stype.name in STORAGE_DTYPES
            ):
                cached = self.cache.get(key)
                return cached if cached is not None else self._storage(stype.name, key, location, numel)
        elif self.legacy and type(pid) is tuple and len(pid) >= 2 and pid[0] in ("module", b"module"):
            return pid[1]  # an nn.Module class saved with its source: only its name matters here
        self.bad_ids += 1
        if self.bad_ids == 1:
            self.problems.append(_problem(ProblemKind.MALFORMED_PICKLE, f"unexpected persistent id {_short(pid)}"))
        return Opaque(None, (pid,))

    def _storage(self, storage_class: str, key: str, location: str | bytes, numel: int) -> TensorRef:
        """The descriptor of a storage met for the first time, checked against its record."""
        dtype, itemsize = STORAGE_DTYPES[storage_class]
        loc = location if isinstance(location, str) else location.decode("ascii", "replace")
        nbytes: int | None = numel * itemsize
        if self.record_sizes is not None:
            nbytes = self.record_sizes.get(key)
            if nbytes is None:
                self.problems.append(_problem(ProblemKind.MALFORMED, f"missing storage record `data/{key}`"))
            elif nbytes != numel * itemsize:
                self.problems.append(
                    _problem(
                        ProblemKind.MALFORMED,
                        f"record size {nbytes} of `data/{key}` does not match expected size {numel * itemsize} "
                        f"({numel} x {storage_class})",
                    )
                )
        self.declared[key] = (numel, itemsize)
        # One object per distinct descriptor across files: every checkpoint of a run describes the same storages,
        # and the pickle walk rebuilds a tensor over an identical (same object) storage without recomputing it.
        ident = (dtype, numel, key, loc, nbytes)
        ref = _STORAGE_REFS.get(ident)
        if ref is None:
            if len(_STORAGE_REFS) >= _STORAGE_REFS_ENTRIES:
                _STORAGE_REFS.clear()
            ref = _STORAGE_REFS[ident] = TensorRef(dtype, (numel,), (1,), 0, key, numel, loc, nbytes)
        self.cache[key] = ref
        return ref


def _short(v: Any) -> str:
    text = repr(v) if type(v) in (tuple, str, bytes, int) and len(str(type(v))) < 100 else type(v).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def _reaches_past(t: TensorRef) -> bool:
    """Whether the tensor's view needs elements beyond its storage (torch's ``set_`` refuses that)."""
    shape, stride, offset = t.shape, t.stride, t.storage_offset
    rank = len(shape)
    if rank != len(stride):
        return True
    # Ranks 0-2 (nearly every tensor of a checkpoint) without generators; the general sum below gives the same.
    if rank == 0:
        last = offset
    elif 0 in shape:
        return False
    elif rank == 1:
        last = offset + (shape[0] - 1) * stride[0]
    elif rank == 2:
        last = offset + (shape[0] - 1) * stride[0] + (shape[1] - 1) * stride[1]
    else:
        last = offset + sum((d - 1) * s for d, s in zip(shape, stride, strict=True))
    return last >= t.storage_numel or offset < 0


def _tensors(value: Any) -> tuple[tuple[tuple[str, TensorRef], ...], list[ReadProblem]]:
    """Every TensorRef under ``value`` with its dotted path, and problems for the ones past their storage."""
    out = [(path, v) for path, v in iter_values(value) if type(v) is TensorRef]
    problems: list[ReadProblem] = []
    for path, v in out:
        if _reaches_past(v):
            problems.append(
                _problem(
                    ProblemKind.MALFORMED,
                    f"tensor `{path}` (shape {list(v.shape)}, stride {list(v.stride)}, offset "
                    f"{v.storage_offset}) reaches past its storage `{v.storage_key}` of {v.storage_numel} "
                    "elements",
                )
            )
            if len(problems) == 10:
                break
    return tuple(out), problems


# ---------------------------------------------------------------------------------------------------------------
# Readers


def read_torch(f: BinaryIO, size: int, limits: Limits = DEFAULT_LIMITS) -> ReadOutcome:
    """Read a ``torch.save`` file, zip or legacy format, without executing its pickle."""
    if size == 0:
        return ReadOutcome(None, (_problem(ProblemKind.EMPTY, "file is empty"),))
    try:
        head = _read_at(f, 0, 4)
        if head in (_ZIP_LOCAL, _ZIP_EOCD):
            return _read_zip(f, size, limits)
        return _read_legacy(f, size, limits)
    except OSError as exc:
        return ReadOutcome(None, (_problem(ProblemKind.UNREADABLE, f"I/O error: {exc}"),))


def _read_zip(f: BinaryIO, size: int, limits: Limits, depth: int = 0) -> ReadOutcome:
    d, problems = _directory(f, size, limits)
    if d is None:
        return ReadOutcome(None, tuple(problems))
    members, cd_offset = d.members, d.cd_offset
    if not members:
        return ReadOutcome(
            TorchFacts("zip", "", (), None, ()), (_problem(ProblemKind.MALFORMED, "zip archive has no records"),)
        )
    first = members[0].name
    prefix = first.split("/", 1)[0] if "/" in first else ""
    by_name: dict[str, ZipMember] = {}
    dupes: list[str] = []
    compressed: list[str] = []
    beyond: list[str] = []
    inconsistent: list[str] = []
    for m in members:
        if m.name in by_name:
            dupes.append(m.name)
        else:
            by_name[m.name] = m
        if m.method != 0:
            compressed.append(m.name)
        elif m.size != m.compressed_size:
            inconsistent.append(m.name)
        # The data can only start after a 30-byte local header and the name.
        if m.offset + 30 + len(m.name.encode()) + m.compressed_size > cd_offset:
            beyond.append(m.name)
    problems.extend(_layout_problems(f, size, d, prefix, dupes, compressed, limits.zip_data_local_headers))
    if inconsistent:
        problems.append(
            _problem(
                ProblemKind.MALFORMED,
                f"stored record(s) whose size differs from their stored bytes: {_names(inconsistent)}",
            )
        )
    if beyond:
        problems.append(_problem(ProblemKind.MALFORMED, f"record(s) overlap the central directory: {_names(beyond)}"))
    main = by_name.get(f"{prefix}/data.pkl") if prefix else None
    # Every other record holding a pickle (a second data.pkl, `constants.pkl`, `x/evil.pkl`, a pickle under any
    # name) and every zip inside the zip is walked too: some loader may read it, and a scanner that looks only at
    # data.pkl is what such layouts are built to fool.
    extra, extra_problems = _extra_pickles(f, d, main, prefix, limits, depth)
    problems.extend(extra_problems)
    if not prefix:
        problems.append(_problem(ProblemKind.MALFORMED, f"first record `{first}` is not inside a folder"))
        merged = merge_pickles(None, extra)
        return ReadOutcome(TorchFacts("zip", "", tuple(members), merged, ()), tuple(problems))
    byteorder = "little"
    bo = by_name.get(f"{prefix}/byteorder")
    if bo is not None:
        raw, p = _member_bytes(f, bo, cd_offset, 16)
        if p is not None:
            problems.append(p)
        elif raw in (b"little", b"big"):
            byteorder = raw.decode()
        else:
            problems.append(_problem(ProblemKind.MALFORMED, f"`{prefix}/byteorder` holds {raw!r}"))
    if main is None:
        problems.append(_problem(ProblemKind.MALFORMED, f"missing record `{prefix}/data.pkl`"))
        merged = merge_pickles(None, extra)
        return ReadOutcome(TorchFacts("zip", prefix, tuple(members), merged, (), byteorder), tuple(problems))
    data, p = _member_bytes(f, main, cd_offset, limits.pickle_bytes)
    if data is None:
        problems.append(p)  # type: ignore[arg-type]  # _member_bytes returns a problem whenever data is None
        merged = merge_pickles(None, extra)
        return ReadOutcome(TorchFacts("zip", prefix, tuple(members), merged, (), byteorder), tuple(problems))
    data_prefix = f"{prefix}/data/"
    record_sizes = {name[len(data_prefix) :]: m.size for name, m in by_name.items() if name.startswith(data_prefix)}
    storages = _Storages(record_sizes, legacy=False)
    facts, walk_problems, _ = walk_pickle(data, limits=limits, persistent_load=storages)
    problems.extend(walk_problems)
    problems.extend(storages.problems)
    tensors, tensor_problems = _tensors(facts.value) if facts is not None else ((), [])
    problems.extend(tensor_problems)
    merged = merge_pickles(facts, extra)
    return ReadOutcome(TorchFacts("zip", prefix, tuple(members), merged, tensors, byteorder), tuple(problems))


# Records torch.save writes besides data.pkl and data/<key> (caffe2/serialize/inline_container.cc, serialization.py).
_TORCH_RECORDS = frozenset({".format_version", ".storage_alignment", "byteorder", "version", ".data/version",
                            ".data/serialization_id"})  # fmt: skip
_MAX_EXTRA_PICKLES = 64  # extra pickle records walked per archive; more is itself the finding
_MAX_ZIP_DEPTH = 2  # zips inside zips followed this deep


def _layout_problems(
    f: BinaryIO,
    size: int,
    d: _Directory,
    prefix: str,
    dupes: list[str],
    compressed: list[str],
    check_storages: bool = True,
) -> list[ReadProblem]:
    """Zip tricks: layouts torch.save never writes that make two readers see two different archives.

    ``check_storages`` False leaves the local headers of storage records unchecked (``Limits.zip_data_local_headers``).
    """
    out: list[ReadProblem] = []

    def add(message: str) -> None:
        out.append(_problem(ProblemKind.SUSPICIOUS_ARCHIVE, message))

    if dupes:
        add(f"duplicate zip records {_names(dupes)}: zip readers disagree on which copy they load")
    if prefix:
        folder = f"{prefix}/"
        outside = [m.name for m in d.members if not m.name.startswith(folder) or _escapes(m.name)]
        if outside:
            add(f"record(s) outside the archive folder `{prefix}/`: {_names(outside)}")
    if compressed:
        add(
            f"{len(compressed)} compressed record(s) ({_names(compressed)}): torch.save stores records "
            "uncompressed, and torch.load(mmap=True) cannot read compressed ones"
        )
    if d.base > 0:
        add(f"{d.base} bytes before the zip archive: data hidden in front of it is read by other tools")
    if d.end < size:
        add(f"{size - d.end} bytes after the zip end record: data hidden behind the archive")
    mismatched = _local_mismatches(f, d, None if check_storages else f"{prefix}/" if prefix else "")
    if mismatched:
        add(
            f"local header(s) disagree with the central directory: {_names(mismatched)}: streaming readers and "
            "torch.load would see different records"
        )
    return out


def _escapes(name: str) -> bool:
    if ".." not in name and "\\" not in name and name[:1] != "/" and name[1:2] != ":":
        return False  # the common case, without splitting the name
    parts = name.replace("\\", "/").split("/")
    return name.startswith(("/", "\\")) or ".." in parts or (len(parts[0]) == 2 and parts[0][1] == ":")


def _local_mismatches(f: BinaryIO, d: _Directory, skip_storage: str | None = None, cap: int = 10_000) -> list[str]:
    """Records whose local header names another file, another method or other sizes than the central entry.

    One read per record: the 30-byte header and the name the central directory expects, together; the name is
    read again only when the local header gives it a longer length. With ``skip_storage`` (the archive folder and
    its "/"), the records torch reads only as raw tensor bytes (``<folder>/data/<key>``) are not checked: on
    object storage each would be a request.
    """
    out: list[str] = []
    unpack = _LOCAL_USED.unpack_from
    read = _positional_reader(f)
    for m, (raw, utf8) in zip(d.members[:cap], d.raw_names, strict=False):
        if skip_storage is not None and _is_storage(_relative(m.name, skip_storage), m.name):
            continue
        expected = len(raw)
        head = read(m.offset, 30 + expected)
        if len(head) < 30:
            continue  # reported as a missing local header when the record is read
        sig, flags, method, csize, usize, name_len = unpack(head)
        if sig != _ZIP_LOCAL:
            continue
        sizes_ok = (
            flags & 0x08
            or csize == 0xFFFFFFFF
            or usize == 0xFFFFFFFF
            or (csize == m.compressed_size and usize == m.size)
        )
        if method != m.method or not sizes_ok:
            out.append(m.name)
            continue
        if name_len == expected and flags & 0x800 == utf8 and head[30:] == raw:
            continue  # the same bytes under the same encoding flag: the same name
        if name_len > expected and len(head) == 30 + expected:
            name_raw = _read_at(f, m.offset + 30, name_len)
        else:
            name_raw = head[30 : 30 + name_len]
        if name_raw.decode("utf-8" if flags & 0x800 else "cp437", "replace") != m.name:
            out.append(m.name)
    return out


def _relative(name: str, folder: str) -> str:
    """``name`` inside the archive folder ``folder`` (which ends with "/"; "" when the archive has none)."""
    return name[len(folder) :] if folder and name.startswith(folder) else name


def _is_storage(rel: str, name: str) -> bool:
    """Whether the record ``name`` (``rel`` inside the archive folder) holds raw tensor bytes torch never parses.

    ``data/<key>``; a `.pkl`/`.pickle` name there is a pickle to walk, not a storage.
    """
    return rel.startswith("data/") and not name.endswith((".pkl", ".pickle"))


def _member_head(f: BinaryIO, m: ZipMember, n: int) -> bytes:
    """The first ``n`` bytes of a record's content (inflated when deflated); b"" when they cannot be had."""
    start = _data_start(f, m)
    if start is None:
        return b""
    raw = _read_at(f, start, min(m.compressed_size, n if m.method == 0 else 1 << 16))
    if m.method == 0:
        return raw
    try:
        return zlib.decompressobj(-15).decompress(raw, n) if m.method == 8 else b""
    except zlib.error:
        return b""


def _looks_pickled(head: bytes) -> bool:
    """A protocol 2-5 pickle header (protocol 0/1 records are caught by their `.pkl` name)."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def _extra_pickles(
    f: BinaryIO, d: _Directory, main: ZipMember | None, prefix: str, limits: Limits, depth: int
) -> tuple[list[PickleFacts], list[ReadProblem]]:
    """Walk every record other than ``main`` that holds a pickle or a nested zip (bounded in number and depth)."""
    found: list[PickleFacts] = []
    problems: list[ReadProblem] = []
    names: list[str] = []
    folder = f"{prefix}/" if prefix else ""
    # By position: entries are interned (``_MEMBERS``), so a second entry identical to data.pkl's is the same object.
    main_at = next((i for i, m in enumerate(d.members) if m is main), -1)
    for i, m in enumerate(d.members):
        if i == main_at:
            continue
        rel = _relative(m.name, folder)
        if rel in _TORCH_RECORDS or _is_storage(rel, m.name):
            continue  # torch's own small records, and storage bytes (any byte pattern is valid tensor data)
        named = m.name.endswith((".pkl", ".pickle"))
        head = _member_head(f, m, 8)
        nested_zip = head[:4] == _ZIP_LOCAL
        if not (named or nested_zip or _looks_pickled(head)):
            continue
        if len(names) >= _MAX_EXTRA_PICKLES:
            problems.append(_problem(ProblemKind.LIMIT, f"more than {_MAX_EXTRA_PICKLES} extra pickle records"))
            break
        names.append(m.name)
        data, p = _member_bytes(f, m, d.cd_offset, limits.pickle_bytes)
        if data is None:
            if p is not None:
                problems.append(p)
            continue
        if nested_zip:
            if depth >= _MAX_ZIP_DEPTH:
                problems.append(_problem(ProblemKind.LIMIT, f"zip record `{m.name}` nests zips too deep"))
                continue
            inner = _read_zip(io.BytesIO(data), len(data), limits, depth + 1)
            if isinstance(inner.content, TorchFacts) and inner.content.pickle is not None:
                found.append(inner.content.pickle)
            problems.extend(ReadProblem(q.kind, f"in zip record `{m.name}`: {q.message}") for q in inner.problems)
            continue
        facts, walk_problems, _ = walk_pickle(data, limits=limits)
        if facts is not None:
            found.append(facts)
        problems.extend(ReadProblem(q.kind, f"in record `{m.name}`: {q.message}") for q in walk_problems)
    if names:
        problems.append(
            _problem(
                ProblemKind.SUSPICIOUS_ARCHIVE,
                f"pickle or zip record(s) besides the one data.pkl torch.load reads: {_names(names)}",
            )
        )
    return found, problems


def merge_pickles(main: PickleFacts | None, extra: list[PickleFacts]) -> PickleFacts | None:
    """``main`` with the globals and calls of the ``extra`` streams found in the same file added.

    The value stays ``main``'s (None when there is no main stream): rules that judge what loading the file could
    run see every stream; rules that read the value see the one torch.load returns.
    """
    if not extra:
        return main
    base = main if main is not None else PickleFacts(extra[0].protocol, None, (), (), 0)
    globals_ = dict.fromkeys(base.globals)
    calls = dict.fromkeys(base.calls)
    opcodes, pids = base.opcodes, base.persistent_ids
    for e in extra:
        globals_.update(dict.fromkeys(e.globals))
        calls.update(dict.fromkeys(e.calls))
        opcodes += e.opcodes
        pids += e.persistent_ids
    return replace(base, globals=tuple(globals_), calls=tuple(calls), opcodes=opcodes, persistent_ids=pids)


class Window(io.RawIOBase):
    """A read-only view of ``length`` bytes of ``f`` from ``start``: one zip blob inside a larger file."""

    def __init__(self, f: BinaryIO, start: int, length: int) -> None:
        super().__init__()
        self._f = f
        self._start = start
        self._length = length
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buf: Any) -> int:
        n = max(0, min(len(buf), self._length - self._pos))
        if n == 0:
            return 0
        self._f.seek(self._start + self._pos)
        got = self._f.read(n)
        buf[: len(got)] = got
        self._pos += len(got)
        return len(got)


def read_zip_at(f: BinaryIO, start: int, length: int, limits: Limits = DEFAULT_LIMITS) -> ReadOutcome:
    """Read the torch zip blob occupying ``length`` bytes of ``f`` from ``start`` (a `.distcp` item)."""
    if start < 0 or length <= 0:
        return ReadOutcome(None, (_problem(ProblemKind.TRUNCATED, f"empty zip blob at byte {start}"),))
    view = io.BufferedReader(Window(f, start, length))
    return _read_zip(view, length, limits)


def _names(names: list[str]) -> str:
    shown = ", ".join(f"`{n}`" for n in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _read_legacy(f: BinaryIO, size: int, limits: Limits) -> ReadOutcome:
    """Magic number, protocol version, sys_info, the object, the storage keys, then the raw storages."""
    cap = min(size, limits.pickle_bytes)
    chunk = min(cap, 1 << 20)
    while True:
        buf = _read_at(f, 0, chunk)
        outcome = _walk_legacy(f, size, buf, limits)
        # The pickles come first and their total length is unknown: read more only when a walk ran off the end.
        if outcome is not None or chunk >= cap:
            break
        chunk = min(cap, chunk * 4)
    if outcome is None:
        outcome = _walk_legacy(f, size, buf, limits, final=True)
    assert outcome is not None
    return outcome


def _walk_legacy(f: BinaryIO, size: int, buf: bytes, limits: Limits, final: bool = False) -> ReadOutcome | None:
    """One attempt on the first ``len(buf)`` bytes; None when the pickles continue past them (and not final)."""
    problems: list[ReadProblem] = []
    pos = 0

    def step(persistent_load: Any = None) -> tuple[PickleFacts | None, tuple[ReadProblem, ...]]:
        nonlocal pos
        facts, probs, end = walk_pickle(buf, limits=limits, persistent_load=persistent_load, start=pos)
        pos = end
        return facts, probs

    def ran_off(probs: tuple[ReadProblem, ...]) -> bool:
        # A walk that failed on a partial buffer may just need more bytes; on the full buffer it is final.
        return bool(probs) and not final and len(buf) < size

    magic, probs = step()
    if probs or magic is None or magic.value != MAGIC_NUMBER:
        # Bytes that are neither a zip nor a legacy file (a zeroed or overwritten `.bin`): the walk's complaints are
        # about non-pickle bytes, so only the one fact that matters is reported.
        return ReadOutcome(
            None, (_problem(ProblemKind.MALFORMED, "not a torch file: no zip header and no legacy magic number"),)
        )
    version, probs = step()
    if probs or version is None or version.value != LEGACY_PROTOCOL_VERSION:
        got = version.value if version is not None else None
        return ReadOutcome(None, (*probs, _problem(ProblemKind.MALFORMED, f"invalid legacy protocol version {got!r}")))
    sys_info, probs = step()
    if ran_off(probs):
        return None
    problems.extend(probs)
    byteorder = "little"
    if sys_info is not None and type(sys_info.value) is dict and sys_info.value.get("little_endian") is False:
        byteorder = "big"
    storages = _Storages(None, legacy=True)
    obj, probs = step(storages)
    if ran_off(probs):
        return None
    problems.extend(probs)
    problems.extend(storages.problems)
    if probs:
        return ReadOutcome(TorchFacts("legacy", "", (), obj, (), byteorder), tuple(problems))
    keys, probs = step()
    if ran_off(probs):
        return None
    problems.extend(probs)
    missing: set[str] = set()
    if keys is not None and not probs:
        if type(keys.value) is not list or not all(type(k) is str for k in keys.value):
            problems.append(_problem(ProblemKind.MALFORMED, "legacy storage key list is not a list of strings"))
        else:
            missing = _check_legacy_storages(f, size, pos, keys.value, storages, byteorder, problems)
    tensors, tensor_problems = _tensors(obj.value) if obj is not None else ((), [])
    problems.extend(tensor_problems)
    if missing:
        tensors = tuple((p, replace(t, storage_nbytes=None) if t.storage_key in missing else t) for p, t in tensors)
    return ReadOutcome(TorchFacts("legacy", "", (), obj, tensors, byteorder), tuple(problems))


def _check_legacy_storages(
    f: BinaryIO,
    size: int,
    pos: int,
    keys: list[str],
    storages: _Storages,
    byteorder: str,
    problems: list[ReadProblem],
) -> set[str]:
    """Seek over each raw storage (8-byte element count + data); returns the keys whose bytes are absent."""
    missing: set[str] = set()
    for key in keys:
        declared = storages.declared.get(key)
        if declared is None:
            problems.append(_problem(ProblemKind.MALFORMED, f"storage `{key}` is listed but no tensor uses it"))
            missing.update(k for k in keys if k not in storages.declared)
            return missing
        numel, itemsize = declared
        head = _read_at(f, pos, 8)
        if len(head) < 8:
            problems.append(
                _problem(ProblemKind.TRUNCATED, f"storage `{key}` should start at byte {pos}; the file has {size}")
            )
            missing.update(keys[keys.index(key) :])
            return missing
        count = int.from_bytes(head, "little" if byteorder == "little" else "big")
        if count != numel:
            problems.append(
                _problem(ProblemKind.MALFORMED, f"storage `{key}` holds {count} elements, the pickle declares {numel}")
            )
        end = pos + 8 + numel * itemsize
        if end > size:
            problems.append(
                _problem(ProblemKind.TRUNCATED, f"storage `{key}` ends at byte {end}; the file has {size} bytes")
            )
            missing.update(keys[keys.index(key) :])
            return missing
        pos = end
    unlisted = sorted(set(storages.declared) - set(keys))
    if unlisted:
        problems.append(_problem(ProblemKind.MALFORMED, f"storages used but not stored: {_names(unlisted)}"))
        missing.update(unlisted)
    if pos != size:
        problems.append(_problem(ProblemKind.MALFORMED, f"{size - pos} bytes after the last storage"))
    return missing


def read_raw_pickle(f: BinaryIO, size: int, limits: Limits = DEFAULT_LIMITS) -> ReadOutcome:
    """Walk a plain pickle file (``pickle.dump`` output); content is its ``PickleFacts``."""
    if size == 0:
        return ReadOutcome(None, (_problem(ProblemKind.EMPTY, "file is empty"),))
    if size > limits.pickle_bytes:
        return ReadOutcome(
            None, (_problem(ProblemKind.LIMIT, f"pickle is {size} bytes (limit {limits.pickle_bytes})"),)
        )
    try:
        data = _read_at(f, 0, size)
    except OSError as exc:
        return ReadOutcome(None, (_problem(ProblemKind.UNREADABLE, f"I/O error: {exc}"),))
    facts, problems, end = walk_pickle(data, limits=limits)
    if facts is None or problems or end >= size:
        return ReadOutcome(facts, problems)
    # Bytes after STOP: pickle.load stops there, but a loader that calls it again (as legacy torch.load does)
    # runs the next stream. Walk what follows as further streams and report the layout.
    first_end = end
    extra: list[PickleFacts] = []
    more: list[ReadProblem] = []
    while end < size and len(extra) < _MAX_EXTRA_PICKLES:
        nxt, probs, new_end = walk_pickle(data, limits=limits, start=end)
        if nxt is None or new_end <= end:
            break
        extra.append(nxt)
        more.extend(probs)
        if probs:
            break
        end = new_end
    more.append(
        _problem(
            ProblemKind.SUSPICIOUS_ARCHIVE,
            f"{size - first_end} bytes after the pickle's STOP opcode"
            + (f", holding {len(extra)} more pickle stream(s)" if extra else ""),
        )
    )
    return ReadOutcome(merge_pickles(facts, extra), tuple(more))
