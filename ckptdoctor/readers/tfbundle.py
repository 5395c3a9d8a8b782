"""Read TensorFlow checkpoint bundles without TensorFlow: the ``ckpt-N.index`` table, its data shards, and the text
``checkpoint`` file of ``tf.train.CheckpointManager``.

The index is a LevelDB-format table (``tensorflow/core/lib/io/table_builder.cc``, ``format.cc``): data blocks of
prefix-compressed keys with restart points, a metaindex block, an index block of ``BlockHandle``s, and a 48-byte
footer ending in the magic ``0xdb4775248b80fb57``; every block is followed by a type byte (0 plain, 1 snappy) and
the masked crc32c of block + type. Keys are tensor names; values are ``BundleEntryProto``s, plus the
``BundleHeaderProto`` under the empty key (``tensorflow/core/protobuf/tensor_bundle.proto``). The bytes of each
tensor sit in ``<prefix>.data-0000K-of-0000M`` at the entry's offset, and their masked crc32c is in the entry.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import BinaryIO

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import (
    ProblemKind,
    ReadOutcome,
    ReadProblem,
    TfBundleEntry,
    TfCheckpointStateFacts,
    TfIndexFacts,
    frozen,
)
from ckptdoctor.readers.jsonfiles import read_bounded
from ckptdoctor.readers.protowire import I32, LEN, VARINT, Field, WireError, fields, varint
from ckptdoctor.readers.safetensors import DTYPE_BITS
from ckptdoctor.readers.sniff import TF_TABLE_MAGIC, looks_like_tf_index_head

TABLE_MAGIC = int.from_bytes(TF_TABLE_MAGIC, "little")
FOOTER_BYTES = 48  # two BlockHandles padded to 40 bytes, then the 8-byte magic
_TRAILER = 5  # block type byte + masked crc32c
_NO_COMPRESSION, _SNAPPY = 0, 1

# TensorFlow DataType (tensorflow/core/framework/types.proto) -> safetensors dtype code where one exists.
_TF_DTYPES: dict[int, str] = {
    1: "F32",
    2: "F64",
    3: "I32",
    4: "U8",
    5: "I16",
    6: "I8",
    8: "C64",
    9: "I64",
    10: "BOOL",
    14: "BF16",
    17: "U16",
    19: "F16",
    22: "U32",
    23: "U64",
    24: "F8_E5M2",
    25: "F8_E4M3",
}
_TF_NAMES: dict[int, str] = {
    7: "DT_STRING",
    11: "DT_QINT8",
    12: "DT_QUINT8",
    13: "DT_QINT32",
    15: "DT_QINT16",
    16: "DT_QUINT16",
    18: "DT_COMPLEX128",
    20: "DT_RESOURCE",
    21: "DT_VARIANT",
}
# Bounds on what one index may make the reader hold (TensorFlow sets none; real indexes are far below them).
MAX_INDEX_ENTRIES = 10_000_000
MAX_BLOCK_BYTES = 256 * 1024 * 1024


# ---------------------------------------------------------------------------------------------------------------
# crc32c (Castagnoli), table-driven, as TensorFlow's crc32c::Value / Extend / Mask compute it


def _crc_table() -> tuple[int, ...]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return tuple(table)


_CRC_TABLE = _crc_table()


def crc32c(data: bytes, crc: int = 0) -> int:
    """The crc32c of ``data``, extending ``crc`` (the value of the bytes before it); pure Python, ~10 MB/s."""
    table = _CRC_TABLE
    c = crc ^ 0xFFFFFFFF
    for b in data:
        c = table[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def mask_crc(crc: int) -> int:
    """``crc32c::Mask``: what LevelDB tables and TensorFlow bundles store instead of the raw crc."""
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------------------------
# The index table


class _Bad(Exception):
    """The index cannot be read further; carries the problem. Never escapes this module."""

    def __init__(self, kind: ProblemKind, message: str) -> None:
        super().__init__(message)
        self.problem = ReadProblem(kind, message)


def read_tf_index(f: BinaryIO, size: int, limits: Limits = DEFAULT_LIMITS) -> ReadOutcome:
    """Read a bundle index of ``size`` bytes open as ``f``: its header and entries; never raises.

    Problems: TRUNCATED (shorter than its footer, or no magic where a bundle index starts), MALFORMED (bad magic,
    block handles outside the file, block checksums, broken entries, no header), LIMIT (a snappy-compressed block,
    which is not read, or past the bounds above), UNREADABLE (an OS error). Facts only when every block was read.
    """
    try:
        return _read_index(f, size)
    except _Bad as e:
        return ReadOutcome(None, (e.problem,))
    except OSError as e:
        return ReadOutcome(None, (ReadProblem(ProblemKind.UNREADABLE, f"cannot read the file: {e.strerror or e}"),))


def _read_index(f: BinaryIO, size: int) -> ReadOutcome:
    if size == 0:
        raise _Bad(ProblemKind.EMPTY, "file is empty (0 bytes); a TensorFlow index holds at least its footer")
    f.seek(0)
    head = f.read(min(size, 64))
    if size < FOOTER_BYTES:
        raise _Bad(ProblemKind.TRUNCATED, f"file has {size:,} bytes, fewer than the {FOOTER_BYTES}-byte table footer")
    f.seek(size - FOOTER_BYTES)
    footer = f.read(FOOTER_BYTES)
    if len(footer) < FOOTER_BYTES:
        raise _Bad(ProblemKind.TRUNCATED, "the file ended while reading the table footer")
    magic = int.from_bytes(footer[40:], "little")
    if magic != TABLE_MAGIC:
        if looks_like_tf_index_head(head):
            raise _Bad(ProblemKind.TRUNCATED, f"no table footer: the file starts like a TensorFlow index but its "
                       f"last 8 bytes are not the table magic (0x{magic:016x}); the file is truncated")
        raise _Bad(ProblemKind.MALFORMED, f"bad table magic 0x{magic:016x} (expected 0x{TABLE_MAGIC:016x})")
    limit = size - FOOTER_BYTES
    try:
        meta_off, pos = varint(footer, 0, 40, "metaindex offset")
        meta_size, pos = varint(footer, pos, 40, "metaindex size")
        index_off, pos = varint(footer, pos, 40, "index offset")
        index_size, pos = varint(footer, pos, 40, "index size")
    except WireError as e:
        raise _Bad(ProblemKind.MALFORMED, f"table footer: {e.message}") from None
    _block(f, meta_off, meta_size, limit, "metaindex block")  # read for its checksum; TensorFlow writes it empty
    index = _block(f, index_off, index_size, limit, "index block")
    header: tuple[list[Field], bytes] | None = None
    entries: list[TfBundleEntry] = []
    last_key: bytes | None = None
    for sep, handle in _entries(index, "index block"):
        try:
            off, p = varint(handle, 0, len(handle), "block offset")
            n, _ = varint(handle, p, len(handle), "block size")
        except WireError as e:
            raise _Bad(ProblemKind.MALFORMED, f"index block entry {_show(sep)}: {e.message}") from None
        for key, value in _entries(_block(f, off, n, limit, f"data block at offset {off:,}"), f"block at {off:,}"):
            if last_key is not None and key <= last_key:
                raise _Bad(ProblemKind.MALFORMED, f"key {_show(key)} follows {_show(last_key)}: table keys must "
                           "increase")
            last_key = key
            if key == b"":
                header = _fields(value, "the bundle header"), value
                continue
            if len(entries) >= MAX_INDEX_ENTRIES:
                raise _Bad(ProblemKind.LIMIT, f"more than {MAX_INDEX_ENTRIES:,} entries; the rest was not read")
            entries.append(_entry(key, value))
    if header is None:
        raise _Bad(ProblemKind.MALFORMED, "no bundle header (the entry under the empty key): TensorFlow refuses it")
    num_shards, endianness, version = _header(*header)
    problems = [p for e in entries for p in _entry_problems(e, num_shards)]
    return ReadOutcome(TfIndexFacts(num_shards, tuple(entries), endianness, version), tuple(problems))


def _block(f: BinaryIO, off: int, n: int, limit: int, what: str) -> bytes:
    """The contents of the block at ``off`` (``n`` bytes + trailer, all before ``limit``), checksum verified."""
    if off + n + _TRAILER > limit:
        raise _Bad(ProblemKind.MALFORMED, f"{what} spans bytes {off:,}..{off + n + _TRAILER:,}, past the table data "
                   f"(which ends at {limit:,})")
    if n > MAX_BLOCK_BYTES:
        raise _Bad(ProblemKind.LIMIT, f"{what} is {n:,} bytes, over {MAX_BLOCK_BYTES:,}; not read")
    f.seek(off)
    raw = f.read(n + _TRAILER)
    if len(raw) < n + _TRAILER:
        raise _Bad(ProblemKind.TRUNCATED, f"{what}: the file ended while reading it")
    kind = raw[n]
    stored = int.from_bytes(raw[n + 1 :], "little")
    if mask_crc(crc32c(raw[: n + 1])) != stored:
        raise _Bad(ProblemKind.MALFORMED, f"{what} (bytes {off:,}..{off + n:,}) fails its crc32c: the block is "
                   "corrupt")
    if kind == _SNAPPY:
        raise _Bad(ProblemKind.LIMIT, f"{what} is snappy-compressed, not read (TensorFlow writes bundle indexes "
                   "uncompressed)")
    if kind != _NO_COMPRESSION:
        raise _Bad(ProblemKind.MALFORMED, f"{what} has compression type {kind}, which LevelDB tables do not use")
    return raw[:n]


def _entries(block: bytes, what: str) -> Iterable[tuple[bytes, bytes]]:
    """The (key, value) pairs of a block, keys rebuilt from their shared prefixes."""
    if len(block) < 4:
        raise _Bad(ProblemKind.MALFORMED, f"{what} is {len(block)} bytes, too short for its restart count")
    restarts = int.from_bytes(block[-4:], "little")
    if restarts == 0 or restarts * 4 + 4 > len(block):
        raise _Bad(ProblemKind.MALFORMED, f"{what} declares {restarts:,} restart points, impossible in "
                   f"{len(block):,} bytes")
    end = len(block) - 4 - restarts * 4
    pos = 0
    key = b""
    try:
        while pos < end:
            shared, pos = varint(block, pos, end, "shared key length")
            unshared, pos = varint(block, pos, end, "key length")
            vlen, pos = varint(block, pos, end, "value length")
            if shared > len(key) or unshared + vlen > end - pos:
                raise _Bad(ProblemKind.MALFORMED, f"{what}: entry after key {_show(key)} overruns its block")
            key = key[:shared] + block[pos : pos + unshared]
            pos += unshared
            yield key, block[pos : pos + vlen]
            pos += vlen
    except WireError as e:
        raise _Bad(ProblemKind.MALFORMED, f"{what}: {e.message}") from None


def _fields(value: bytes, what: str) -> list[Field]:
    try:
        return fields(value, 0, len(value))
    except WireError as e:
        raise _Bad(ProblemKind.MALFORMED, f"{what}: {e.message}") from None


def _header(header: list[Field], raw: bytes) -> tuple[int, str, int]:
    """(num_shards, endianness, version producer) of a ``BundleHeaderProto``."""
    num_shards, endianness, version = 0, "little", 0
    for fl in header:
        if fl.number == 1 and fl.wire == VARINT:
            num_shards = _int32(fl.value)
        elif fl.number == 2 and fl.wire == VARINT:
            endianness = "big" if fl.value == 1 else "little"
        elif fl.number == 3 and fl.wire == LEN:  # VersionDef {producer = 1, min_consumer = 2, bad_consumers = 3}
            for v in _fields(raw[fl.start : fl.stop], "the bundle header's version"):
                if v.number == 1 and v.wire == VARINT:
                    version = _int32(v.value)
    return num_shards, endianness, version


def _int32(v: int) -> int:
    """A protobuf int32/int64 read as a varint: negative numbers are 10-byte two's complement."""
    return v - (1 << 64) if v >= 1 << 63 else v


def _entry(key: bytes, value: bytes) -> TfBundleEntry:
    name = key.decode("utf-8", "backslashreplace")
    what = f"entry `{name}`"
    dtype_code, shard, offset, size, sliced, unknown_rank = 0, 0, 0, 0, False, False
    shape: tuple[int, ...] = ()
    crc: int | None = None
    for fl in _fields(value, what):
        if fl.number == 1 and fl.wire == VARINT:
            dtype_code = fl.value
        elif fl.number == 2 and fl.wire == LEN:
            shape, unknown_rank = _shape(value[fl.start : fl.stop], what)
        elif fl.number == 3 and fl.wire == VARINT:
            shard = _int32(fl.value)
        elif fl.number == 4 and fl.wire == VARINT:
            offset = _int32(fl.value)
        elif fl.number == 5 and fl.wire == VARINT:
            size = _int32(fl.value)
        elif fl.number == 6 and fl.wire == I32:
            crc = fl.value
        elif fl.number == 7 and fl.wire == LEN:
            sliced = True
    if unknown_rank:
        shape = ()
    dtype = _TF_DTYPES.get(dtype_code) or _TF_NAMES.get(dtype_code) or f"DT_{dtype_code}"
    return TfBundleEntry(name, dtype, shape, shard, offset, size, crc, sliced)


def _shape(raw: bytes, what: str) -> tuple[tuple[int, ...], bool]:
    dims: list[int] = []
    unknown = False
    for fl in _fields(raw, f"shape of {what}"):
        if fl.number == 2 and fl.wire == LEN:
            size = 0
            for d in _fields(raw[fl.start : fl.stop], f"dimension of {what}"):
                if d.number == 1 and d.wire == VARINT:
                    size = _int32(d.value)
            dims.append(size)
        elif fl.number == 3 and fl.wire == VARINT:
            unknown = fl.value != 0
    return tuple(dims), unknown


def _entry_problems(e: TfBundleEntry, num_shards: int) -> Iterable[ReadProblem]:
    if e.offset < 0 or e.size < 0 or e.shard_id < 0 or any(d < 0 for d in e.shape):
        yield ReadProblem(ProblemKind.MALFORMED, f"entry `{e.key}` has a negative shard, offset, size or dimension")
        return
    if e.shard_id >= num_shards:
        yield ReadProblem(ProblemKind.MALFORMED, f"entry `{e.key}` is in shard {e.shard_id}, but the bundle header "
                          f"declares {num_shards} shard(s)")
    bits = DTYPE_BITS.get(e.dtype)
    if bits is not None and not e.sliced:
        numel = 1
        for d in e.shape:
            numel *= d
        need = numel * bits // 8
        if need != e.size:
            yield ReadProblem(ProblemKind.MALFORMED, f"entry `{e.key}` {e.dtype} {list(e.shape)} needs {need:,} "
                              f"bytes but the index gives it {e.size:,}")


def _show(key: bytes) -> str:
    return "`" + key[:80].decode("utf-8", "backslashreplace") + "`"


# ---------------------------------------------------------------------------------------------------------------
# Data shards: presence and length (always), crc32c (``--deep``)

_DATA_NAME = re.compile(r"^(?P<prefix>.+)\.data-(?P<k>\d{5})-of-(?P<n>\d{5})$", re.ASCII)
_CRC_CHUNK = 1 << 20
_STRING_LENGTHS_MAX = 64 << 20  # bytes of varint lengths read at once for a DT_STRING entry's crc


def shard_name(prefix: str, shard_id: int, num_shards: int) -> str:
    """``<prefix>.data-0000K-of-0000M``, the file TensorFlow writes shard ``shard_id`` of ``num_shards`` to."""
    return f"{prefix}.data-{shard_id:05d}-of-{num_shards:05d}"


def parse_data_name(name: str) -> tuple[str, int, int] | None:
    """(prefix, shard id, number of shards) of a data shard's file name; None for any other name."""
    m = _DATA_NAME.match(name)
    if m is None:
        return None
    return m.group("prefix"), int(m.group("k")), int(m.group("n"))


def shard_problems(prefix: str, index: TfIndexFacts, sizes: Mapping[str, int]) -> tuple[tuple[str, ReadProblem], ...]:
    """What is wrong with the data shards of the bundle ``prefix`` (``ckpt-3``) whose index is ``index``.

    ``sizes`` maps the names of the files present beside the index to their sizes. Returns (file name, problem)
    pairs: a shard an entry needs that is missing (MALFORMED, named after the missing file), a shard shorter than
    the end of an entry's bytes (TRUNCATED). Pure: nothing is read.
    """
    out: list[tuple[str, ReadProblem]] = []
    by_shard: dict[int, list[TfBundleEntry]] = {}
    for e in index.entries:
        if not e.sliced and e.size > 0 and 0 <= e.shard_id < index.num_shards and e.offset >= 0:
            by_shard.setdefault(e.shard_id, []).append(e)
    # only the shards some entry needs: a shard no entry places bytes in has nothing to report, and the index's
    # num_shards (up to 2**31 - 1) must not drive the loop
    for shard in sorted(by_shard):
        name = shard_name(prefix, shard, index.num_shards)
        entries = by_shard[shard]
        size = sizes.get(name)
        if size is None:
            out.append((name, ReadProblem(ProblemKind.MALFORMED, f"`{name}` is missing: {prefix}.index places "
                        f"{len(entries):,} tensor(s) in it (`{entries[0].key}` ...)")))
            continue
        short = [e for e in entries if e.offset + e.size > size]
        if short:
            worst = max(short, key=lambda e: e.offset + e.size)
            end = worst.offset + worst.size
            out.append((name, ReadProblem(ProblemKind.TRUNCATED, f"`{name}` has {size:,} bytes but {prefix}.index "
                        f"places {len(short):,} tensor(s) past its end (`{worst.key}` ends at byte {end:,}, "
                        f"{end - size:,} missing): the shard is truncated")))
    return tuple(out)


@frozen
class CrcSpan:
    """The bytes of one bundle entry whose crc32c the index records: ``length`` bytes at ``start`` in its shard,
    whose crc32c, extended from ``seed`` (a DT_STRING entry's lengths, 0 otherwise), masked, must equal
    ``entry.crc32c``."""

    entry: TfBundleEntry
    start: int
    length: int
    seed: int


def crc_spans(index: TfIndexFacts, shard_id: int, f: BinaryIO, size: int) -> tuple[list[CrcSpan], list[ReadProblem]]:
    """The entries of shard ``shard_id`` (open as ``f``, ``size`` bytes) whose crc32c can be checked, as spans to
    stream, and the entries already found corrupt (MALFORMED: DT_STRING lengths that do not fit). Reads only the
    length prefixes of DT_STRING entries. Entries past the end of the shard are ``shard_problems``' to report and
    are left out, as are sliced entries and DT_STRING entries whose lengths take over 64 MB. Raises ``OSError``."""
    spans: list[CrcSpan] = []
    corrupt: list[ReadProblem] = []
    for e in index.entries:
        if e.shard_id != shard_id or e.sliced or e.crc32c is None or e.offset < 0 or e.size < 0:
            continue
        if e.offset + e.size > size:
            continue
        seed, skip = _string_lengths_crc(e, f) if e.dtype == "DT_STRING" else (0, 0)
        if skip == -2:
            continue
        if skip < 0:
            corrupt.append(ReadProblem(ProblemKind.MALFORMED, f"`{e.key}`: its string lengths do not fit its "
                           f"{e.size:,} bytes: the data is corrupt"))
            continue
        spans.append(CrcSpan(e, e.offset + skip, e.size - skip, seed))
    return spans, corrupt


def crc_mismatch(span: CrcSpan, crc: int, index_name: str = "the index") -> ReadProblem | None:
    """MALFORMED when ``crc`` (the crc32c of the span's bytes, extended from its seed) is not what the index
    records, as ``BundleReader::GetValue`` then fails with ``DataLoss``; None when it matches."""
    e = span.entry
    if mask_crc(crc) == e.crc32c:
        return None
    return ReadProblem(ProblemKind.MALFORMED, f"`{e.key}`: its {e.size:,} bytes at offset {e.offset:,} fail the "
                       f"crc32c {index_name} records: the data is corrupt")


@functools.cache
def crc32c_extender() -> Callable[[bytes, int], int]:
    """The fastest ``crc32c(data, crc)`` at hand: google-crc32c's C extension when it is installed (GB/s), else the
    pure-Python ``crc32c`` above (~10 MB/s). Both compute the same value."""
    try:
        import google_crc32c
    except ImportError:
        return crc32c
    if getattr(google_crc32c, "implementation", "") != "c":
        return crc32c
    extend = google_crc32c.extend

    def fast(data: bytes, crc: int = 0) -> int:
        return int(extend(crc, data))

    return fast


def crc_problems(index: TfIndexFacts, shard_id: int, f: BinaryIO, size: int) -> tuple[ReadProblem, ...]:
    """Check the masked crc32c of every entry of shard ``shard_id`` (open as ``f``, ``size`` bytes) against the
    index, reading each entry's bytes in 1 MB chunks; never raises. Entries past the end of the shard are
    ``shard_problems``' to report and are skipped here. MALFORMED per mismatch, TRUNCATED when the shard ends
    early, UNREADABLE on an OS error. (``--deep`` streams the same ``crc_spans`` in its own pass.)"""
    out: list[ReadProblem] = []
    extend = crc32c_extender()
    try:
        spans, out = crc_spans(index, shard_id, f, size)
        for sp in spans:
            f.seek(sp.start)
            left = sp.length
            crc = sp.seed
            while left > 0:
                chunk = f.read(min(_CRC_CHUNK, left))
                if not chunk:
                    break
                crc = extend(chunk, crc)
                left -= len(chunk)
            if left > 0:
                out.append(ReadProblem(ProblemKind.TRUNCATED, f"`{sp.entry.key}`: the shard ended {left:,} bytes "
                           "early"))
            elif (bad := crc_mismatch(sp, crc)) is not None:
                out.append(bad)
    except OSError as e:
        out.append(ReadProblem(ProblemKind.UNREADABLE, f"cannot read the shard: {e.strerror or e}"))
    return tuple(out)


def _string_lengths_crc(e: TfBundleEntry, f: BinaryIO) -> tuple[int, int]:
    """For a DT_STRING entry (``[varint64 len]... [masked crc of the lengths] [bytes]``, ``WriteStringTensor``):
    the crc32c TensorFlow starts from (each length as a little-endian uint32, or uint64 past 2**32) and how many
    bytes the varints take; (0, -1) when the lengths are not varints inside the entry, (0, -2) when they may take
    more than ``_STRING_LENGTHS_MAX`` bytes (not checked)."""
    numel = 1
    for d in e.shape:
        numel *= d
    f.seek(e.offset)
    want = min(e.size, 10 * numel)
    if want > _STRING_LENGTHS_MAX:
        return 0, -2
    head = f.read(want)
    crc = 0
    pos = 0
    try:
        for _ in range(numel):
            n, pos = varint(head, pos, len(head), "string length")
            crc = crc32c(n.to_bytes(4 if n <= 0xFFFFFFFF else 8, "little"), crc)
    except WireError:
        return 0, -1
    return crc, pos


# ---------------------------------------------------------------------------------------------------------------
# The text `checkpoint` file (a CheckpointState in protobuf text format)

_TOKEN = re.compile(
    r"""\s*(?:\#[^\n]*\n?\s*)*(?P<name>[A-Za-z_][A-Za-z0-9_]*)\s*:\s*"""
    r"""(?P<value>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*'|[-+.0-9A-Za-z_]+)""",
)
_TRAILING = re.compile(r"\s*(?:\#[^\n]*(?:\n|$)\s*)*")
_STRING_FIELDS = ("model_checkpoint_path", "all_model_checkpoint_paths")
_NUMBER_FIELDS = ("all_model_checkpoint_timestamps", "last_preserved_timestamp")
_ESCAPES = {"n": 10, "t": 9, "r": 13, "a": 7, "b": 8, "f": 12, "v": 11, "\\": 92, "'": 39, '"': 34, "?": 63}


def read_tf_checkpoint_state(f: BinaryIO, size: int, limits: Limits = DEFAULT_LIMITS) -> ReadOutcome:
    """Parse the ``checkpoint`` file: ``model_checkpoint_path`` and ``all_model_checkpoint_paths``; never raises.

    TensorFlow parses it with ``text_format.Merge`` and, on a parse error, logs a warning and finds no checkpoint
    (``get_checkpoint_state`` returns None): training silently starts over. So any line it would refuse (unknown
    field, bad string, stray text) is a MALFORMED problem and gives no facts. LIMIT past ``limits.json_bytes``.
    """
    try:
        data = read_bounded(f, size, limits.json_bytes, "checkpoint state file")
    except OSError as e:
        return ReadOutcome(None, (ReadProblem(ProblemKind.UNREADABLE, f"cannot read the file: {e.strerror or e}"),))
    if isinstance(data, ReadProblem):
        return ReadOutcome(None, (data,))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return _bad_state(f"not UTF-8 text (invalid byte at offset {e.start})")
    latest: str | None = None
    paths: list[str] = []
    pos = 0
    while True:
        pos = _TRAILING.match(text, pos).end()  # type: ignore[union-attr]  # matches the empty string at worst
        if pos >= len(text):
            break
        m = _TOKEN.match(text, pos)
        if m is None:
            return _bad_state(f"line {text.count(chr(10), 0, pos) + 1}: expected `name: value`, found "
                              f"{text[pos : pos + 40]!r}")
        name, raw = m.group("name"), m.group("value")
        line = text.count("\n", 0, m.start("name")) + 1
        if name in _STRING_FIELDS:
            value = _unquote(raw)
            if value is None:
                return _bad_state(f"line {line}: `{name}` needs a quoted string, found {raw[:40]!r}")
            if name == "model_checkpoint_path":
                latest = value
            else:
                paths.append(value)
        elif name in _NUMBER_FIELDS:
            try:
                float(raw)
            except ValueError:
                return _bad_state(f"line {line}: `{name}` needs a number, found {raw[:40]!r}")
        else:
            return _bad_state(f"line {line}: unknown field `{name[:40]}` (CheckpointState has no such field)")
        pos = m.end()
    return ReadOutcome(TfCheckpointStateFacts(latest, tuple(paths)))


def _bad_state(message: str) -> ReadOutcome:
    return ReadOutcome(None, (ReadProblem(ProblemKind.MALFORMED, message + "; TensorFlow then finds no checkpoint"),))


def _unquote(raw: str) -> str | None:
    """A text-format string literal's value (C escapes, octal, hex), or None when ``raw`` is not one."""
    if len(raw) < 2 or raw[0] not in "\"'" or raw[-1] != raw[0]:
        return None
    body = raw[1:-1]
    out = bytearray()
    i = 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out += c.encode("utf-8")
            i += 1
            continue
        nxt = body[i + 1 : i + 2]
        if nxt in _ESCAPES:
            out.append(_ESCAPES[nxt])
            i += 2
        elif nxt in ("x", "X"):
            m = re.match(r"[0-9A-Fa-f]{1,2}", body[i + 2 :])
            if m is None:
                return None
            out.append(int(m.group(), 16))
            i += 2 + len(m.group())
        elif nxt.isdigit() and nxt < "8":
            m = re.match(r"[0-7]{1,3}", body[i + 1 :])
            assert m is not None
            out.append(int(m.group(), 8) & 0xFF)
            i += 1 + len(m.group())
        else:
            return None
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError:
        return None
