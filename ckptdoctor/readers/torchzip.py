"""Readers for ``torch.save`` files (zip and legacy formats) and raw pickles, by static walk only."""

from __future__ import annotations

import struct
import zlib
from dataclasses import replace
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

__all__ = ["STORAGE_DTYPES", "read_raw_pickle", "read_torch"]

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
_CENTRAL = struct.Struct("<4s6H3L5H2L")
_LOCAL = struct.Struct("<4s5H3L2H")


def _problem(kind: ProblemKind, message: str) -> ReadProblem:
    return ReadProblem(kind, message)


def _read_at(f: BinaryIO, offset: int, n: int) -> bytes:
    f.seek(offset)
    return f.read(n)


# ---------------------------------------------------------------------------------------------------------------
# Zip central directory (parsed by hand: entry count and sizes are checked before anything is allocated)


def _central_directory(f: BinaryIO, size: int, limits: Limits) -> tuple[list[ZipMember] | None, int, list[ReadProblem]]:
    """The archive's members and the central directory's offset, or None with the problem that stops us."""
    tail_len = min(size, 22 + 65535)
    tail = _read_at(f, size - tail_len, tail_len)
    at = tail.rfind(_ZIP_EOCD)
    while at >= 0 and at + 22 > len(tail):
        at = tail.rfind(_ZIP_EOCD, 0, at)
    if at < 0:
        return (
            None,
            0,
            [
                _problem(
                    ProblemKind.TRUNCATED,
                    "no zip end-of-central-directory record: the archive is truncated "
                    "(torch: `failed finding central directory`)",
                )
            ],
        )
    eocd_pos = size - tail_len + at
    _, _disk, _cd_disk, _n_disk, count, cd_size, cd_offset, _comment = _EOCD.unpack_from(tail, at)
    cd_end_limit = eocd_pos
    if count == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
        loc = _read_at(f, eocd_pos - 20, 20) if eocd_pos >= 20 else b""
        if len(loc) != 20 or loc[:4] != _ZIP64_LOCATOR:
            return None, 0, [_problem(ProblemKind.MALFORMED, "zip64 sizes without a zip64 locator")]
        rec_pos = _ZIP64_LOC.unpack(loc)[2]
        rec = _read_at(f, rec_pos, 56) if rec_pos + 56 <= eocd_pos - 20 else b""
        if len(rec) != 56 or rec[:4] != _ZIP64_EOCD:
            return None, 0, [_problem(ProblemKind.MALFORMED, f"zip64 end record missing at byte {rec_pos}")]
        fields = _ZIP64_REC.unpack(rec)
        count, cd_size, cd_offset = fields[7], fields[8], fields[9]
        cd_end_limit = rec_pos
    if count > limits.zip_entries:
        return None, 0, [_problem(ProblemKind.LIMIT, f"zip declares {count} entries (limit {limits.zip_entries})")]
    if cd_offset + cd_size > cd_end_limit or count * 46 > cd_size:
        return (
            None,
            0,
            [
                _problem(
                    ProblemKind.MALFORMED,
                    f"zip central directory ({count} entries, {cd_size} bytes at {cd_offset}) does not fit before "
                    f"its end record at byte {cd_end_limit}",
                )
            ],
        )
    cd = _read_at(f, cd_offset, cd_size)
    if len(cd) != cd_size:
        return None, 0, [_problem(ProblemKind.TRUNCATED, "zip central directory is cut short")]
    members: list[ZipMember] = []
    pos = 0
    for i in range(count):
        if pos + 46 > len(cd) or cd[pos : pos + 4] != _ZIP_CENTRAL:
            return None, cd_offset, [_problem(ProblemKind.MALFORMED, f"zip central directory entry {i} is corrupt")]
        fl = _CENTRAL.unpack_from(cd, pos)
        flags, method = fl[3], fl[4]
        csize, usize, name_len, extra_len, comment_len, local = fl[8], fl[9], fl[10], fl[11], fl[12], fl[16]
        name_raw = cd[pos + 46 : pos + 46 + name_len]
        extra = cd[pos + 46 + name_len : pos + 46 + name_len + extra_len]
        pos += 46 + name_len + extra_len + comment_len
        if pos > len(cd):
            return None, cd_offset, [_problem(ProblemKind.MALFORMED, f"zip central directory entry {i} overruns it")]
        if 0xFFFFFFFF in (csize, usize, local):
            usize, csize, local = _zip64_extra(extra, usize, csize, local)
        name = name_raw.decode("utf-8" if flags & 0x800 else "cp437", "replace")
        members.append(ZipMember(name=name, offset=local, compressed_size=csize, size=usize, method=method))
    return members, cd_offset, []


def _zip64_extra(extra: bytes, usize: int, csize: int, local: int) -> tuple[int, int, int]:
    """Sizes and offset from the zip64 extended-information extra field (only the fields that overflowed)."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, ln = struct.unpack_from("<HH", extra, pos)
        body = extra[pos + 4 : pos + 4 + ln]
        pos += 4 + ln
        if tag != 0x0001:
            continue
        vals = [int.from_bytes(body[j : j + 8], "little") for j in range(0, len(body) - 7, 8)]
        out = []
        for v in (usize, csize, local):
            out.append(vals.pop(0) if v == 0xFFFFFFFF and vals else v)
        return out[0], out[1], out[2]
    return usize, csize, local


def _member_bytes(f: BinaryIO, m: ZipMember, data_end: int, cap: int) -> tuple[bytes | None, ReadProblem | None]:
    """The (decompressed) content of a small member; ``cap`` bounds what we are willing to hold."""
    if m.size > cap:
        return None, _problem(ProblemKind.LIMIT, f"record `{m.name}` is {m.size} bytes (limit {cap})")
    head = _read_at(f, m.offset, 30)
    if len(head) != 30 or head[:4] != _ZIP_LOCAL:
        return None, _problem(ProblemKind.MALFORMED, f"record `{m.name}` has no local header at byte {m.offset}")
    fields = _LOCAL.unpack(head)
    start = m.offset + 30 + fields[9] + fields[10]
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


class _Storages:
    """Turns torch's persistent ids into storage descriptors (1-D TensorRefs over the whole storage)."""

    def __init__(self, record_sizes: dict[str, int] | None, legacy: bool) -> None:
        self.record_sizes = record_sizes  # zip: key -> record size; legacy: None (checked after the walk)
        self.legacy = legacy
        self.cache: dict[str, TensorRef] = {}
        self.declared: dict[str, tuple[int, int]] = {}  # key -> (numel, itemsize)
        self.problems: list[ReadProblem] = []
        self.bad_ids = 0

    def __call__(self, pid: Any) -> Any:
        want = 6 if self.legacy else 5
        if type(pid) is tuple and len(pid) >= 2 and pid[0] in ("module", b"module") and self.legacy:
            return pid[1]  # an nn.Module class saved with its source: only its name matters here
        ok = type(pid) is tuple and len(pid) == want and pid[0] in ("storage", b"storage")
        if ok:
            stype, key, location, numel = pid[1], pid[2], pid[3], pid[4]
            ok = (
                type(stype) is GlobalRef
                and stype.module == "torch"
                and stype.name in STORAGE_DTYPES
                and type(key) is str
                and type(location) in (str, bytes)
                and type(numel) is int
                and numel >= 0
            )
        if not ok:
            self.bad_ids += 1
            if self.bad_ids == 1:
                self.problems.append(_problem(ProblemKind.MALFORMED_PICKLE, f"unexpected persistent id {_short(pid)}"))
            return Opaque(None, (pid,))
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        dtype, itemsize = STORAGE_DTYPES[stype.name]
        loc = location if type(location) is str else location.decode("ascii", "replace")
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
                        f"({numel} x {stype.name})",
                    )
                )
        self.declared[key] = (numel, itemsize)
        ref = TensorRef(dtype, (numel,), (1,), 0, key, numel, loc, nbytes)
        self.cache[key] = ref
        return ref


def _short(v: Any) -> str:
    text = repr(v) if type(v) in (tuple, str, bytes, int) and len(str(type(v))) < 100 else type(v).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def _reaches_past(t: TensorRef) -> bool:
    """Whether the tensor's view needs elements beyond its storage (torch's ``set_`` refuses that)."""
    if len(t.shape) != len(t.stride):
        return True
    if any(d == 0 for d in t.shape):
        return False
    last = t.storage_offset + sum((d - 1) * s for d, s in zip(t.shape, t.stride, strict=True))
    return last >= t.storage_numel or t.storage_offset < 0


def _tensors(value: Any) -> tuple[tuple[tuple[str, TensorRef], ...], list[ReadProblem]]:
    """Every TensorRef under ``value`` with its dotted path, and problems for the ones past their storage."""
    out: list[tuple[str, TensorRef]] = []
    problems: list[ReadProblem] = []
    for path, v in iter_values(value):
        if type(v) is TensorRef:
            out.append((path, v))
            if len(problems) < 10 and _reaches_past(v):
                problems.append(
                    _problem(
                        ProblemKind.MALFORMED,
                        f"tensor `{path}` (shape {list(v.shape)}, stride {list(v.stride)}, offset "
                        f"{v.storage_offset}) reaches past its storage `{v.storage_key}` of {v.storage_numel} "
                        "elements",
                    )
                )
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


def _read_zip(f: BinaryIO, size: int, limits: Limits) -> ReadOutcome:
    members, cd_offset, problems = _central_directory(f, size, limits)
    if members is None:
        return ReadOutcome(None, tuple(problems))
    if not members:
        return ReadOutcome(
            TorchFacts("zip", "", (), None, ()), (_problem(ProblemKind.MALFORMED, "zip archive has no records"),)
        )
    first = members[0].name
    if "/" not in first:
        problems.append(_problem(ProblemKind.MALFORMED, f"first record `{first}` is not inside a folder"))
        return ReadOutcome(TorchFacts("zip", "", tuple(members), None, ()), tuple(problems))
    prefix = first.split("/", 1)[0]
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
    if dupes:
        problems.append(_problem(ProblemKind.MALFORMED, f"duplicate zip records: {_names(dupes)}"))
    if compressed:
        problems.append(
            _problem(
                ProblemKind.MALFORMED,
                f"{len(compressed)} compressed record(s) ({_names(compressed)}): torch.save stores records "
                "uncompressed, and torch.load(mmap=True) cannot read compressed ones",
            )
        )
    if inconsistent:
        problems.append(
            _problem(
                ProblemKind.MALFORMED,
                f"stored record(s) whose size differs from their stored bytes: {_names(inconsistent)}",
            )
        )
    if beyond:
        problems.append(_problem(ProblemKind.MALFORMED, f"record(s) overlap the central directory: {_names(beyond)}"))
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
    pkl = by_name.get(f"{prefix}/data.pkl")
    if pkl is None:
        problems.append(_problem(ProblemKind.MALFORMED, f"missing record `{prefix}/data.pkl`"))
        return ReadOutcome(TorchFacts("zip", prefix, tuple(members), None, (), byteorder), tuple(problems))
    data, p = _member_bytes(f, pkl, cd_offset, limits.pickle_bytes)
    if data is None:
        problems.append(p)  # type: ignore[arg-type]  # _member_bytes returns a problem whenever data is None
        return ReadOutcome(TorchFacts("zip", prefix, tuple(members), None, (), byteorder), tuple(problems))
    data_prefix = f"{prefix}/data/"
    record_sizes = {name[len(data_prefix) :]: m.size for name, m in by_name.items() if name.startswith(data_prefix)}
    storages = _Storages(record_sizes, legacy=False)
    facts, walk_problems, _ = walk_pickle(data, limits=limits, persistent_load=storages)
    problems.extend(walk_problems)
    problems.extend(storages.problems)
    tensors, tensor_problems = _tensors(facts.value) if facts is not None else ((), [])
    problems.extend(tensor_problems)
    return ReadOutcome(TorchFacts("zip", prefix, tuple(members), facts, tensors, byteorder), tuple(problems))


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
        return ReadOutcome(
            None,
            (*probs, _problem(ProblemKind.MALFORMED, "not a torch file: no zip header and no legacy magic number")),
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
    facts, problems, _ = walk_pickle(data, limits=limits)
    return ReadOutcome(facts, problems)
