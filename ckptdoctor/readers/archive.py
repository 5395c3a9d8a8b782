"""Tar archives (plain, gzip, bz2 or xz compressed, nested) and compressed single files: every member a loader could
unpickle, found by its content whatever its name, walked statically; nothing is extracted, to disk or otherwise.

A tar holding ``model.pkl`` (or ``x.anything``) is loaded by extracting it and calling ``pickle.load`` on the member,
``tarfile.open(...).extractfile(m)`` then ``pickle.load``, or by tools such as ``pandas.read_pickle`` on a
compressed pickle. The tar headers are parsed here, as ``tarfile.TarInfo.frombuf`` / ``TarFile.next`` read them
(CPython ``Lib/tarfile.py``): same checksum test, same end (the first all-zero or invalid header), same PAX and GNU
long-name handling, same data skipping (a member of a supported non-regular type has no data blocks), but every
header body is bounded (``Limits.archive_header_bytes``), where ``tarfile`` reads them whole whatever their size.
Compressed streams are decompressed as they are read, up to ``Limits.archive_decompressed_bytes`` in all; members
and nesting are bounded too. Going past a bound leaves the rest unchecked, which is reported as an evasion layout
(``SUSPICIOUS_ARCHIVE``): a decompression bomb is a finding, never a hang.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Protocol

from ckptdoctor.limits import Limits
from ckptdoctor.model import (
    ArchiveFacts,
    NumpyFacts,
    PickleFacts,
    ProblemKind,
    ReadOutcome,
    ReadProblem,
    TorchFacts,
    frozen,
)
from ckptdoctor.readers.pickle_walk import merge_pickles
from ckptdoctor.readers.sniff import (
    LEGACY_MAGIC,
    NPY_MAGIC,
    PICKLE_SUFFIXES,
    TAR_BLOCK,
    pickled_head,
    shifted_head,
    tar_number,
)
from ckptdoctor.readers.sniff import compression as _compression
from ckptdoctor.readers.sniff import looks_like_tar as _looks_like_tar
from ckptdoctor.readers.zipdir import ZIP_LOCAL, read_at, read_problem

__all__ = ["SHIFTED", "ArchiveScan", "FileReader", "Over", "TarMember", "TorchReader", "read_archive", "shifted_pickle"]

_HEAD = TAR_BLOCK  # bytes of a member read to tell what a loader would make of it
_MAX_PICKLES = 1024  # members walked as pickles per file; more leaves the rest unchecked
_CHUNK = 1 << 20  # bytes decompressed per read while skipping
# tarfile's types (Lib/tarfile.py SUPPORTED_TYPES, REGULAR_TYPES): a regular member or one of an unknown type is a
# file ``extractfile`` reads; the other supported types carry no data blocks.
_REGULAR = frozenset({b"0", b"\0", b"7"})
_SUPPORTED = frozenset({b"0", b"\0", b"1", b"2", b"3", b"4", b"5", b"6", b"7", b"L", b"K", b"S"})
_PAX = frozenset({b"x", b"g", b"X"})
_NUMBER_FIELDS = ((100, 108), (108, 116), (116, 124), (124, 136), (136, 148), (329, 337), (337, 345))


# ``readers.torchzip.read_torch``, handed in by the caller: a zip or magic-number torch file inside an archive, and
# archives inside torch zips and tars, are read by each other's readers (a module import would be a circle).
TorchReader = Callable[[BinaryIO, int, Limits], ReadOutcome]


class Over(Exception):
    """A bound was reached: the message says which; what follows is not checked. ``kind`` is how it is reported:
    a layout no writer makes (a bomb, a header body of megabytes, nesting past the bound) is ``SUSPICIOUS_ARCHIVE``
    (CKD605); a big archive that merely outgrows the decompression budget is a ``LIMIT`` (CKD001: not checked)."""

    def __init__(self, message: str, kind: ProblemKind = ProblemKind.SUSPICIOUS_ARCHIVE) -> None:
        super().__init__(message)
        self.kind = kind


# Decompressed-to-compressed ratio past which an archive that outgrows ``Limits.archive_decompressed_bytes`` is a
# bomb: gzip/xz shrink checkpoint tensors by well under 10x, a bomb of zeros by about 1,000x.
BOMB_RATIO = 100


class _Reader(Protocol):
    def read(self, n: int) -> bytes: ...

    def skip(self, n: int) -> None: ...


class FileReader:
    """A reader of ``length`` bytes of a seekable file from ``start``; skipping costs nothing."""

    def __init__(self, f: BinaryIO, start: int, length: int) -> None:
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def read(self, n: int) -> bytes:
        n = max(0, min(n, self.length - self.pos))
        data = read_at(self.f, self.start + self.pos, n) if n else b""
        self.pos += len(data)
        return data

    def skip(self, n: int) -> None:
        self.pos = min(self.length, self.pos + max(0, n))


class _Limited:
    """The next ``length`` bytes of another reader (one member's data)."""

    def __init__(self, parent: _Reader, length: int) -> None:
        self.parent, self.left = parent, length

    def read(self, n: int) -> bytes:
        data = self.parent.read(max(0, min(n, self.left)))
        self.left -= len(data)
        return data

    def skip(self, n: int) -> None:
        n = max(0, min(n, self.left))
        self.parent.skip(n)
        self.left -= n


class _Pushback:
    """A reader whose first bytes were already read (a member's head): also a file object for the decompressors."""

    def __init__(self, head: bytes, parent: _Reader) -> None:
        self.head, self.parent = head, parent

    def read(self, n: int = -1) -> bytes:
        n = _CHUNK if n is None or n < 0 else n
        if self.head:
            out, self.head = self.head[:n], self.head[n:]
            return out
        return self.parent.read(n)

    def skip(self, n: int) -> None:
        k = min(n, len(self.head))
        self.head = self.head[k:]
        self.parent.skip(n - k)

    def readable(self) -> bool:
        return True


class _Inflating:
    """A decompressed stream; every byte it yields is charged to the scan's budget (``ArchiveScan.spend``)."""

    def __init__(self, fobj: Any, scan: ArchiveScan) -> None:
        self.fobj, self.scan = fobj, scan

    def read(self, n: int) -> bytes:
        parts: list[bytes] = []
        got = 0
        while got < n:
            part = self.fobj.read(min(n - got, _CHUNK))
            if not part:
                break
            self.scan.spend(len(part))
            parts.append(part)
            got += len(part)
        return b"".join(parts)

    def skip(self, n: int) -> None:
        while n > 0:
            part = self.read(min(n, _CHUNK))
            if not part:
                return
            n -= len(part)


def _decompressor(codec: str, raw: _Pushback) -> Any:
    """The standard library's reader of ``codec`` over ``raw`` (imported only for such a file)."""
    fobj: Any = raw  # a file object as far as the decompressors go: they only call read()
    if codec == "gz":
        import gzip

        return gzip.GzipFile(fileobj=fobj, mode="rb")
    if codec == "bz2":
        import bz2

        return bz2.BZ2File(fobj, mode="rb")
    if codec == "zf":  # joblib < 0.10: ``ZF``, a hex length (and maybe a space), then a zlib stream
        head = raw.read(_ZF_HEADER + 1)
        raw.head = head[_ZF_HEADER + (head[_ZF_HEADER : _ZF_HEADER + 1] == b" ") :] + raw.head
        codec = "zlib"
    if codec == "zlib":
        return _ZlibReader(fobj)
    import lzma

    return lzma.LZMAFile(fobj, mode="rb")  # xz, and joblib's legacy ``.lzma`` (FORMAT_AUTO reads both)


_ZF_HEADER = 2 + len(hex(2**64))  # joblib/numpy_pickle_compat.py: b"ZF" + hex_str(length).ljust(_MAX_LEN)


class _ZlibReader:
    """A zlib (RFC 1950) stream read as joblib's ``BinaryZlibFile`` reads one: inflated in chunks, up to its end."""

    def __init__(self, fobj: Any) -> None:
        import zlib

        self.fobj = fobj
        self.d = zlib.decompressobj()

    def read(self, n: int) -> bytes:
        out = b""
        while len(out) < n and not self.d.eof:
            raw = self.d.unconsumed_tail or self.fobj.read(_CHUNK)
            if not raw:
                raise EOFError("compressed file ended before the end-of-stream marker was reached")
            out += self.d.decompress(raw, n - len(out))
        return out


@frozen
class TarMember:
    """One member as ``tarfile`` lists it: ``name`` (PAX path, GNU long name or ustar prefix applied), its type
    flag, its data ``size`` and whether ``extractfile`` reads it as a file (``readable``)."""

    name: str
    type: bytes
    size: int
    readable: bool


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")


def _pax(body: bytes) -> dict[str, str]:
    """The ``path`` and ``size`` records of a PAX header body (tarfile's ``_proc_pax``); a malformed record ends it."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(body):
        space = body.find(b" ", pos, pos + 24)
        if space < 0 or not body[pos:space].isdigit():
            break
        length = int(body[pos:space])
        record = body[space + 1 : pos + length - 1]
        if length <= 0 or b"=" not in record:
            break
        key, _, value = record.partition(b"=")
        if key in (b"path", b"size"):
            out[key.decode()] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


def _block(n: int) -> int:
    return -(-n // TAR_BLOCK) * TAR_BLOCK


@dataclass
class ArchiveScan:
    """The work done on one file's archives: members listed, bytes decompressed, pickles walked, and what was found
    (the streams, the problems), shared by every archive nested in it."""

    limits: Limits
    read_torch: TorchReader
    size: int = 0  # the file's size on disk, for the ratio that tells a bomb from a big archive
    members: int = 0
    inflated: int = 0
    walked: int = 0
    pickles: list[PickleFacts] = field(default_factory=list)
    problems: list[ReadProblem] = field(default_factory=list)

    def spend(self, n: int) -> None:
        """Charge ``n`` decompressed bytes; raises ``Over`` past ``Limits.archive_decompressed_bytes``."""
        self.inflated += n
        if self.inflated > self.limits.archive_decompressed_bytes:
            cap = self.limits.archive_decompressed_bytes
            if self.size and self.inflated <= BOMB_RATIO * self.size:
                raise Over(f"decompresses to more than {cap} bytes (Limits.archive_decompressed_bytes)",
                           ProblemKind.LIMIT)  # fmt: skip
            raise Over(f"decompresses to more than {cap} bytes")

    def tar(self, r: _Reader, where: str) -> Iterator[tuple[TarMember, _Limited]]:
        """Each member of the tar read from ``r`` with a reader of its data (whatever the caller leaves unread is
        skipped), until the archive ends as ``tarfile`` ends it. Header bodies and the member count are bounded."""
        pax_global: dict[str, str] = {}
        pax_next: dict[str, str] = {}
        long_name: str | None = None
        first = True
        while True:
            block = r.read(TAR_BLOCK)
            if len(block) < TAR_BLOCK or block.count(0) == TAR_BLOCK:
                return  # the end (tarfile: empty, truncated or end-of-archive header)
            numbers = [tar_number(block[a:b]) for a, b in _NUMBER_FIELDS]
            if not _looks_like_tar(block) or None in numbers or (numbers[3] or 0) < 0:
                if not first:  # tarfile stops without a word at an invalid header after the first
                    self.problems.append(read_problem(ProblemKind.MALFORMED, f"{where}invalid tar header: the rest is "
                                                  "what no tar reader lists"))  # fmt: skip
                return
            first = False
            size = numbers[3] or 0
            kind = block[156:157]
            if kind in (b"L", b"K") or kind in _PAX:
                if size > self.limits.archive_header_bytes:
                    raise Over(f"a tar header body of {size} bytes (limit {self.limits.archive_header_bytes})")
                body = r.read(_block(size))[:size]
                if kind == b"L":
                    long_name = _text(body)
                elif kind == b"g":
                    pax_global.update(_pax(body))
                elif kind in _PAX:
                    pax_next = _pax(body)
                continue
            name = _text(block[0:100])
            if kind == b"\0" and name.endswith("/"):
                kind = b"5"  # a V7 directory
            prefix = _text(block[345:500])
            if prefix:
                name = f"{prefix}/{name}"
            if long_name is not None:
                name = long_name
            pax = {**pax_global, **pax_next}
            name = pax.get("path", name)
            if "size" in pax:
                try:
                    size = int(pax["size"])
                except ValueError:
                    size = 0  # tarfile's ``_apply_pax_info``: an unreadable number is 0
                if size < 0:
                    return
            long_name, pax_next = None, {}
            self.members += 1
            if self.members > self.limits.archive_members:
                raise Over(f"more than {self.limits.archive_members} tar members")
            if kind == b"S":
                raise Over(f"{where}GNU sparse member `{name}` (its data map is not followed)")
            readable = kind in _REGULAR or kind not in _SUPPORTED
            if not readable:
                continue  # tarfile skips no data blocks for these
            data = _Limited(r, size)
            yield TarMember(name, kind, size, True), data
            data.skip(size)
            r.skip(_block(size) - size)

    def member(self, r: _Reader, name: str, size: int, depth: int) -> None:
        """Judge one member (or decompressed stream) of ``size`` bytes (-1: up to its end) by its content: a pickle
        of any protocol, a torch file (zip or magic-number format), a `.npy`, another archive (``depth`` deeper)."""
        head = r.read(_HEAD if size < 0 else min(size, _HEAD))
        where = f"in archive member `{name}`: "
        lower = name.lower()
        if _looks_like_tar(head) or _compression(head) is not None:
            if depth >= self.limits.archive_depth:
                raise Over(f"archives nested more than {self.limits.archive_depth} deep")
            try:
                self.archive(_Pushback(head, r), name, depth + 1)
            except Exception as exc:  # a corrupt nested stream ends that member only: the archive around it goes on
                if not _corrupt_stream(exc):
                    raise
                why = f"{where}compressed stream is unreadable: {exc}"
                self.problems.append(read_problem(ProblemKind.MALFORMED, why))
            return
        npy = head.startswith(NPY_MAGIC)
        torch = head.startswith((ZIP_LOCAL, LEGACY_MAGIC))
        pickled = pickled_head(head, lower.endswith(PICKLE_SUFFIXES))
        shifted = not (npy or torch or pickled) and shifted_head(head)
        if not (npy or torch or pickled or shifted):
            return
        self.walked += 1
        if self.walked > _MAX_PICKLES:
            raise Over(f"more than {_MAX_PICKLES} pickle members")
        cap = self.limits.pickle_bytes
        data = head + r.read((cap + 1 if size < 0 else min(size, cap + 1)) - len(head))
        if len(data) > cap:
            self.problems.append(read_problem(ProblemKind.LIMIT, f"{where}more than {cap} bytes: not walked"))
            return
        if shifted:
            facts = shifted_pickle(data, self.limits)
            if facts is not None:
                self.pickles.append(facts)
                self.problems.append(read_problem(ProblemKind.SUSPICIOUS_ARCHIVE, f"{where}{SHIFTED}"))
            return
        outcome = _read_member(io.BytesIO(data), len(data), self.limits, npy, self.read_torch if torch else None)
        c = outcome.content
        own = c if isinstance(c, PickleFacts) else c.pickle if isinstance(c, (TorchFacts, NumpyFacts)) else None
        self.pickles.extend(p for p in (own, outcome.alt_pickle) if p is not None)
        self.problems.extend(ReadProblem(p.kind, where + p.message) for p in outcome.problems)

    def archive(self, r: _Pushback, name: str, depth: int) -> str:
        """Read the tar or compressed stream ``r`` (its head pushed back); its format (``tar``, ``tar.gz``, ``gz``)."""
        codec = _compression(r.head)
        where = f"in archive member `{name}`: " if name else ""
        if codec is not None:
            inner = _Pushback(b"", _Inflating(_decompressor(codec, r), self))
            inner.head = inner.read(TAR_BLOCK)
            if not _looks_like_tar(inner.head):
                self.member(inner, f"{name}({codec})" if name else f"({codec})", -1, depth)
                return codec
            r = inner
        for m, data in self.tar(r, where):
            self.member(data, f"{name}/{m.name}" if name else m.name, m.size, depth)
        return "tar" if codec is None else f"tar.{codec}"


# What a member whose first byte is no opcode but whose next bytes are a pickle that imports or calls is reported as.
SHIFTED = (
    "a pickle that imports or calls globals starts after a first byte that is no pickle opcode: pickle.load refuses "
    "it as it is, but a loader that skips that byte runs it, and no writer produces such a record"
)


def shifted_pickle(data: bytes, limits: Limits) -> PickleFacts | None:
    """The streams a loader reads from ``data`` past its first byte when that byte is no opcode (``pickle.load``
    raises on it) and what follows walks cleanly and imports or calls something; None for anything else.

    Such a record is dead for ``pickle.load`` but is how a payload is staged past scanners that judge only what
    ``pickle.load`` accepts (ModelAudit flags it); no writer emits a junk byte before a pickle, so no real file
    trips this (a text record would have to walk cleanly as a pickle that names a global from its second byte).
    """
    if not shifted_head(data[:_HEAD]):
        return None
    from ckptdoctor.readers.rawpickle import read_raw_pickle

    outcome = read_raw_pickle(io.BytesIO(data[1:]), len(data) - 1, limits)
    facts = outcome.content
    if not isinstance(facts, PickleFacts) or not (facts.globals or facts.calls):
        return None
    if any(p.kind != ProblemKind.SUSPICIOUS_ARCHIVE for p in outcome.problems):
        return None
    return facts


def _read_member(f: BinaryIO, size: int, limits: Limits, npy: bool, read_torch: TorchReader | None) -> ReadOutcome:
    """A member's bytes read as the loader its content names would read them."""
    if npy:
        from ckptdoctor.readers.npy import read_numpy

        return read_numpy(f, size, limits)
    if read_torch is not None:
        return read_torch(f, size, limits)
    from ckptdoctor.readers.rawpickle import read_raw_pickle

    return read_raw_pickle(f, size, limits)


def _corrupt_stream(exc: Exception) -> bool:
    """What the decompressors raise on corrupt or truncated input: EOFError, OSError (``gzip.BadGzipFile``, bz2's
    invalid data), ValueError, ``zlib.error``, ``lzma.LZMAError`` (checked by module: nothing imported for it)."""
    if isinstance(exc, Over):
        return False
    return isinstance(exc, (EOFError, OSError, ValueError)) or type(exc).__module__ in ("zlib", "_lzma", "lzma", "_bz2")


def read_archive(f: BinaryIO, size: int, limits: Limits, read_torch: TorchReader) -> ReadOutcome:
    """Read a tar (any name) or a gzip/bz2/xz stream: ``ArchiveFacts`` with every member's pickle streams merged
    (``readers.torchzip.read_archive`` is the reader the dispatch calls)."""
    scan = ArchiveScan(limits, read_torch, size)
    fmt = "archive"
    head = read_at(f, 0, TAR_BLOCK)
    try:
        rest = FileReader(f, 0, size)
        rest.skip(len(head))
        fmt = scan.archive(_Pushback(head, rest), "", 0)
    except Over as exc:
        scan.problems.append(read_problem(exc.kind, f"{exc}: the rest is not checked"))
    except Exception as exc:  # the rest of a corrupt compressed stream is what no loader reads either
        if not _corrupt_stream(exc):
            raise
        scan.problems.append(read_problem(ProblemKind.MALFORMED, f"compressed stream is unreadable: {exc}"))
    merged = merge_pickles(None, scan.pickles)
    from ckptdoctor.readers.rawpickle import read_as_pickle

    # A polyglot: a plain pickle.load of the file reads its first bytes as a pickle.
    alt, alt_problems = read_as_pickle(f, size, limits) if pickled_head(head) else (None, ())
    return ReadOutcome(ArchiveFacts(fmt, scan.members, merged), (*scan.problems, *alt_problems), alt)

