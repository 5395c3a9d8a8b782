"""Zip archives read by hand: the central directory (sizes checked before anything is allocated), records' local headers
and bytes, and a window onto a blob inside a larger file.

This is the interface the byte readers share (``__all__``; the rest is this module's own): ``read_at`` and
``read_problem`` (archive, npy, rawpickle, torchlegacy, torchstore, torchtar, torchzip), the zip signatures
``ZIP_LOCAL``/``ZIP_EOCD`` that sniffing readers test, ``read_directory`` -> ``Directory`` and the per-record
``data_start``/``member_head``/``member_bytes``/``local_mismatches`` (torchzip, npy), the record-name tests
``name_escapes``/``relative_name``/``is_storage`` (torchzip), ``listed_names`` for messages, and ``Window``.
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO

from ckptdoctor.limits import Limits
from ckptdoctor.model import ProblemKind, ReadProblem, ZipMember, frozen
from ckptdoctor.readers.seen import Seen

__all__ = [
    "ZIP_EOCD",
    "ZIP_LOCAL",
    "Directory",
    "Window",
    "data_start",
    "is_storage",
    "listed_names",
    "local_mismatches",
    "member_bytes",
    "member_head",
    "name_escapes",
    "read_at",
    "read_directory",
    "read_problem",
    "relative_name",
]

ZIP_LOCAL = b"PK\x03\x04"
ZIP_EOCD = b"PK\x05\x06"
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


def read_problem(kind: ProblemKind, message: str) -> ReadProblem:
    """A reader's problem of ``kind`` (the readers' one constructor for it)."""
    return ReadProblem(kind, message)


def read_at(f: BinaryIO, offset: int, n: int) -> bytes:
    """``n`` bytes of ``f`` from ``offset`` (fewer at the end of the file)."""
    f.seek(offset)
    return f.read(n)


def _positional_reader(f: BinaryIO) -> Callable[[int, int], bytes]:
    """``read(offset, n)`` for ``f``: one ``pread`` system call for a local file (instead of a seek and a read,
    hundreds of times per optimizer.pt), seek-and-read for anything else (windows, fsspec files)."""
    if type(f) is io.FileIO and hasattr(os, "pread"):
        fd = f.fileno()
        return lambda offset, n: os.pread(fd, n, offset)
    return lambda offset, n: read_at(f, offset, n)


# ---------------------------------------------------------------------------------------------------------------
# Zip central directory (parsed by hand: entry count and sizes are checked before anything is allocated)


@frozen
class Directory:
    """A parsed central directory. Offsets in ``members`` are already shifted by ``base``."""

    members: list[ZipMember]
    cd_offset: int  # where the central directory really starts in the file
    base: int  # bytes before the archive proper (prepended data): 0 for anything torch.save writes
    end: int  # end of the end-of-central-directory record and its comment
    # Per member: its name as stored in the central directory and that entry's UTF-8 flag (0 or 0x800), so the
    # local headers can be compared byte for byte and read in one go (the name's length is known up front).
    raw_names: list[tuple[bytes, int]]


def read_directory(f: BinaryIO, size: int, limits: Limits) -> tuple[Directory | None, list[ReadProblem]]:
    """The archive's central directory, or None with the problem that stops us."""
    members, cd_offset, problems, base, end, raw_names = _central_directory(f, size, limits)
    if members is None:
        return None, problems
    return Directory(members, cd_offset, base, end, raw_names), problems


def _no_directory(problem: ReadProblem) -> tuple[None, int, list[ReadProblem], int, int, list[Any]]:
    """``_central_directory``'s answer when ``problem`` stops it."""
    return None, 0, [problem], 0, 0, []


def _central_directory(
    f: BinaryIO, size: int, limits: Limits
) -> tuple[list[ZipMember] | None, int, list[ReadProblem], int, int, list[tuple[bytes, int]]]:
    """The archive's members, the central directory's offset, problems, the archive's base and end, raw names."""
    tail_len = min(size, 22 + 65535)
    tail = read_at(f, size - tail_len, tail_len)
    at = tail.rfind(ZIP_EOCD)
    while at >= 0 and at + 22 > len(tail):
        at = tail.rfind(ZIP_EOCD, 0, at)
    if at < 0:
        return _no_directory(
            read_problem(
                ProblemKind.TRUNCATED,
                "no zip end-of-central-directory record: the archive is truncated "
                "(torch: `failed finding central directory`)",
            )
        )
    eocd_pos = size - tail_len + at
    _, _disk, _cd_disk, _n_disk, count, cd_size, cd_offset, comment_len = _EOCD.unpack_from(tail, at)
    end = min(size, eocd_pos + 22 + comment_len)
    cd_end_limit = eocd_pos
    loc = read_at(f, eocd_pos - 20, 20) if eocd_pos >= 20 else b""
    # torch writes the zip64 records even for small archives; other writers only when a field overflows.
    if loc[:4] == _ZIP64_LOCATOR or count == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
        if len(loc) != 20 or loc[:4] != _ZIP64_LOCATOR:
            return _no_directory(read_problem(ProblemKind.MALFORMED, "zip64 sizes without a zip64 locator"))
        rec_pos = _ZIP64_LOC.unpack(loc)[2]
        rec = read_at(f, rec_pos, 56) if rec_pos + 56 <= eocd_pos - 20 else b""
        if rec[:4] != _ZIP64_EOCD and eocd_pos >= 76:
            # With data in front of the archive the locator's offset is relative: look where the record must be.
            rec_pos = eocd_pos - 76
            rec = read_at(f, rec_pos, 56)
        if len(rec) != 56 or rec[:4] != _ZIP64_EOCD:
            return _no_directory(read_problem(ProblemKind.MALFORMED, f"zip64 end record missing at byte {rec_pos}"))
        fields = _ZIP64_REC.unpack(rec)
        count, cd_size, cd_offset = fields[7], fields[8], fields[9]
        cd_end_limit = rec_pos
    if count > limits.zip_entries:
        too_many = f"zip declares {count} entries (limit {limits.zip_entries})"
        return _no_directory(read_problem(ProblemKind.LIMIT, too_many))
    # Data before the archive (a zip appended to something else, or a blob cut out of a .distcp) shifts every
    # offset; zipfile and miniz both find the directory from the end record, as we do, and shift by the gap.
    base = cd_end_limit - cd_size - cd_offset if cd_offset + cd_size < cd_end_limit else 0
    if base > 0 and read_at(f, cd_offset + base, 4) == _ZIP_CENTRAL and read_at(f, cd_offset, 4) != _ZIP_CENTRAL:
        cd_offset += base
    else:
        base = 0
    if cd_offset + cd_size > cd_end_limit or count * 46 > cd_size:
        return _no_directory(
            read_problem(
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
        cd = read_at(f, cd_offset, cd_size)
    if len(cd) != cd_size:
        return _no_directory(read_problem(ProblemKind.TRUNCATED, "zip central directory is cut short"))
    members, raw_names, bad = _directory_entries(cd, count, base)
    if bad:
        return _no_directory(read_problem(ProblemKind.MALFORMED, bad))
    return members, cd_offset, [], base, end, raw_names


# Central directories already parsed, by (entry count, size, base): a struct that unpacks every byte of one except
# its entries' modification times and CRCs (which ``_entries`` does not read), those bytes, and the parse. Every
# checkpoint of a training run writes its optimizer.pt's directory with the same bytes but for the CRCs, so from the
# second on it is one unpack and one comparison instead of a Python loop over 879 entries. Shared by threads and
# bounded (``Seen``).
_DIRECTORIES: Seen[tuple[int, int, int], tuple[struct.Struct, tuple[bytes, ...], list[ZipMember], list[Any]]] = Seen(64)


def _directory_entries(cd: bytes, count: int, base: int) -> tuple[list[ZipMember], list[tuple[bytes, int]], str]:
    """``_entries`` of ``cd``, looked up in ``_DIRECTORIES`` first: a directory equal to one parsed before in every
    byte ``_entries`` reads has the same entries."""
    key = (count, len(cd), base)
    known = _DIRECTORIES.get(key)
    if known is not None and known[0].unpack_from(cd) == known[1]:
        return list(known[2]), list(known[3]), ""
    starts: list[int] = []
    members, raw_names, bad = _entries(cd, count, base, starts)
    if not bad and starts:
        parts = ["<"]
        at = 0
        for start in starts:  # each entry's bytes up to its time, date and CRC (12 bytes in), then past them
            parts.append(f"{start + 12 - at}s8x")
            at = start + 20
        parts.append(f"{len(cd) - at}s")
        unvarying = struct.Struct("".join(parts))
        _DIRECTORIES.put(key, (unvarying, unvarying.unpack_from(cd), list(members), list(raw_names)))
    return members, raw_names, bad


def _entries(
    cd: bytes, count: int, base: int, starts: list[int]
) -> tuple[list[ZipMember], list[tuple[bytes, int]], str]:
    """The ``count`` entries of the central directory ``cd``, their raw names, and why they stop early ("" if not);
    where each entry starts is added to ``starts``.

    The hot loop of every zip read (one iteration per tensor): one unpack of the used fields per entry, locals
    bound outside the loop, and the zip64 extra field parsed only for entries that overflowed.
    """
    members: list[ZipMember] = []
    raw_names: list[tuple[bytes, int]] = []
    add_member, add_raw, add_start, unpack = members.append, raw_names.append, starts.append, _CENTRAL_USED.unpack_from
    zip64_first = _ZIP64_FIRST.unpack_from
    n = len(cd)
    pos = 0
    for i in range(count):
        if pos + 46 > n:
            return members, raw_names, f"zip central directory entry {i} is corrupt"
        sig, flags, method, csize, usize, name_len, extra_len, comment_len, local = unpack(cd, pos)
        if sig != _ZIP_CENTRAL:
            return members, raw_names, f"zip central directory entry {i} is corrupt"
        add_start(pos)
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


def data_start(f: BinaryIO, m: ZipMember) -> int | None:
    """Where a record's stored bytes start, as zip readers find them: after its local header's name and extra
    field (not the central directory's); None without a local header there."""
    head = read_at(f, m.offset, 30)
    if len(head) != 30 or head[:4] != ZIP_LOCAL:
        return None
    fields = _LOCAL.unpack(head)
    return int(m.offset + 30 + fields[9] + fields[10])


def member_bytes(f: BinaryIO, m: ZipMember, data_end: int, cap: int) -> tuple[bytes | None, ReadProblem | None]:
    """The (decompressed) content of a small member; ``cap`` bounds what we are willing to hold."""
    if m.size > cap:
        return None, read_problem(ProblemKind.LIMIT, f"record `{m.name}` is {m.size} bytes (limit {cap})")
    start = data_start(f, m)
    if start is None:
        return None, read_problem(ProblemKind.MALFORMED, f"record `{m.name}` has no local header at byte {m.offset}")
    if start + m.compressed_size > data_end:
        return None, read_problem(
            ProblemKind.TRUNCATED, f"record `{m.name}` ends at byte {start + m.compressed_size}, past {data_end}"
        )
    raw = read_at(f, start, m.compressed_size)
    if m.method == 0:
        return raw, None
    if m.method == 8:
        try:
            d = zlib.decompressobj(-15)
            out = d.decompress(raw, cap + 1)  # bounded: a zip bomb stops at the cap
        except zlib.error as exc:
            return None, read_problem(ProblemKind.MALFORMED, f"record `{m.name}` does not inflate: {exc}")
        if len(out) > cap:
            return None, read_problem(ProblemKind.LIMIT, f"record `{m.name}` inflates past {cap} bytes")
        return out, None
    return None, read_problem(ProblemKind.MALFORMED, f"record `{m.name}` uses zip compression method {m.method}")



def name_escapes(name: str) -> bool:
    """Whether a record name leaves the archive: absolute, a drive letter, or a ``..`` part."""
    if ".." not in name and "\\" not in name and name[:1] != "/" and name[1:2] != ":":
        return False  # the common case, without splitting the name
    parts = name.replace("\\", "/").split("/")
    return name.startswith(("/", "\\")) or ".." in parts or (len(parts[0]) == 2 and parts[0][1] == ":")


def local_mismatches(
    f: BinaryIO, d: Directory, skip_storage: str | None = None, cap: int = 10_000, checked: Iterable[int] | None = None
) -> list[str]:
    """Records whose local header names another file, another method or other sizes than the central entry.

    One read per record: the 30-byte header and the name the central directory expects, together; the name is
    read again only when the local header gives it a longer length. With ``skip_storage`` (the archive folder and
    its "/"), the records torch reads only as raw tensor bytes (``<folder>/data/<key>``) are not checked: on
    object storage each would be a request. ``checked``, when given, are the positions of the records to check,
    already chosen by the caller (in order; those past the first ``cap`` are not checked), and ``skip_storage`` is
    not looked at.
    """
    out: list[str] = []
    unpack = _LOCAL_USED.unpack_from
    read = _positional_reader(f)
    members, raw_names = d.members, d.raw_names
    if checked is None:
        checked = (
            range(min(cap, len(members)))
            if skip_storage is None
            else [i for i, m in enumerate(members[:cap]) if not is_storage(relative_name(m.name, skip_storage), m.name)]
        )
    for i in checked:
        if i >= cap:
            break
        m = members[i]
        raw, utf8 = raw_names[i]
        expected = len(raw)
        head = read(m.offset, 30 + expected)
        if len(head) < 30:
            continue  # reported as a missing local header when the record is read
        sig, flags, method, csize, usize, name_len = unpack(head)
        if sig != ZIP_LOCAL:
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
            name_raw = read_at(f, m.offset + 30, name_len)
        else:
            name_raw = head[30 : 30 + name_len]
        if name_raw.decode("utf-8" if flags & 0x800 else "cp437", "replace") != m.name:
            out.append(m.name)
    return out


def relative_name(name: str, folder: str) -> str:
    """``name`` inside the archive folder ``folder`` (which ends with "/"; "" when the archive has none)."""
    return name[len(folder) :] if folder and name.startswith(folder) else name


def is_storage(rel: str, name: str) -> bool:
    """Whether the record ``name`` (``rel`` inside the archive folder) holds raw tensor bytes torch never parses.

    ``data/<key>``; a `.pkl`/`.pickle` name there, in any case, is a pickle to walk, not a storage. The last
    character is looked at first: a 7B optimizer has 873 storages, and lower-casing each name cost 3% of a scan.
    """
    return rel.startswith("data/") and (name[-1:] not in "lLeE" or not name.lower().endswith((".pkl", ".pickle")))


def member_head(f: BinaryIO, m: ZipMember, n: int) -> bytes:
    """The first ``n`` bytes of a record's content (inflated when deflated); b"" when they cannot be had."""
    start = data_start(f, m)
    if start is None:
        return b""
    raw = read_at(f, start, min(m.compressed_size, n if m.method == 0 else 1 << 16))
    if m.method == 0:
        return raw
    try:
        return zlib.decompressobj(-15).decompress(raw, n) if m.method == 8 else b""
    except zlib.error:
        return b""




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



def listed_names(names: list[str]) -> str:
    """Up to five names quoted for a message, then how many more."""
    shown = ", ".join(f"`{n}`" for n in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")
