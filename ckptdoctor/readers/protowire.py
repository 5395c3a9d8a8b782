"""Protocol-buffer wire format, read without the protobuf runtime: varints, field keys, and a bounded file cursor.

Only the encoding is known here (https://protobuf.dev/programming-guides/encoding/); what a field means is up to
the reader that walks a message. Every length is checked against the end of its enclosing message and of the file
before anything is read, so a hostile length costs nothing.
"""

from __future__ import annotations

from typing import BinaryIO

from ckptdoctor.model import ProblemKind, frozen

VARINT, I64, LEN, I32 = 0, 1, 2, 5
_WIRE_NAMES = {3: "group start", 4: "group end", 6: "reserved 6", 7: "reserved 7"}
_MAX_VARINT = 10  # bytes in the longest varint (64 bits, 7 per byte)
_WINDOW = 64 * 1024  # bytes a file cursor reads ahead


class WireError(Exception):
    """Bytes that are not the wire format, or that end too soon: ``kind`` is TRUNCATED or MALFORMED."""

    def __init__(self, kind: ProblemKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


def varint(
    buf: bytes, pos: int, end: int, what: str = "varint", base: int = 0, short: ProblemKind = ProblemKind.MALFORMED
) -> tuple[int, int]:
    """The unsigned varint at ``buf[pos:end]`` and the position after it.

    Raises ``WireError``: ``short`` when ``end`` comes first (the end of a message: MALFORMED; of the file:
    TRUNCATED), MALFORMED past 10 bytes or above 2**64. Messages give offsets as ``base + pos``.
    """
    value = 0
    shift = 0
    i = pos
    while True:
        if i >= end:
            where = "the file" if short is ProblemKind.TRUNCATED else "its message"
            raise WireError(short, f"{what} at offset {base + pos:,} runs past the end of {where}")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            break
        shift += 7
        if i - pos >= _MAX_VARINT:
            raise WireError(ProblemKind.MALFORMED, f"{what} at offset {base + pos:,} is longer than 10 bytes")
    if value >= 1 << 64:
        raise WireError(ProblemKind.MALFORMED, f"{what} at offset {base + pos:,} does not fit in 64 bits")
    return value, i


def split_key(key: int, at: int) -> tuple[int, int]:
    """(field number, wire type) of a field key read at offset ``at``; MALFORMED for field 0 or wire types 3/4/6/7."""
    field, wire = key >> 3, key & 7
    if wire not in (VARINT, I64, LEN, I32):
        raise WireError(ProblemKind.MALFORMED, f"field {field} at offset {at:,} has wire type {wire} "
                        f"({_WIRE_NAMES[wire]}), which this format never uses")
    if field == 0:
        raise WireError(ProblemKind.MALFORMED, f"field number 0 at offset {at:,} (no message has one)")
    return field, wire


@frozen
class Field:
    """One field of a message in a bytes buffer: VARINT/I64/I32 carry ``value``; LEN spans ``buf[start:stop]``."""

    number: int
    wire: int
    value: int
    start: int
    stop: int


def fields(buf: bytes, pos: int, end: int) -> list[Field]:
    """Every field of the message at ``buf[pos:end]``, in order; raises ``WireError`` on the first bad byte."""
    out: list[Field] = []
    while pos < end:
        at = pos
        key, pos = varint(buf, pos, end, "field key")
        number, wire = split_key(key, at)
        if wire == VARINT:
            value, pos = varint(buf, pos, end, f"field {number}")
            out.append(Field(number, wire, value, pos, pos))
            continue
        if wire == LEN:
            n, pos = varint(buf, pos, end, f"length of field {number}")
        else:
            n = 8 if wire == I64 else 4
        if n > end - pos:
            raise WireError(ProblemKind.MALFORMED, f"field {number} at offset {at:,} declares {n:,} bytes but "
                            f"{end - pos:,} remain in its message")
        value = int.from_bytes(buf[pos : pos + n], "little") if wire != LEN else n
        out.append(Field(number, wire, value, pos, pos + n))
        pos += n
    return out


def packed_varints(buf: bytes, start: int, stop: int, what: str) -> list[int]:
    """The varints of a packed repeated field spanning ``buf[start:stop]``."""
    out: list[int] = []
    pos = start
    while pos < stop:
        v, pos = varint(buf, pos, stop, what)
        out.append(v)
    return out


class Cursor:
    """A forward cursor over a file of ``size`` bytes: reads through a small window and seeks over skipped spans,
    so a message holding gigabytes of tensor bytes costs a few reads. Reading past ``size`` raises TRUNCATED."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self._f = f
        self.size = size
        self.pos = 0
        self._buf = b""
        self._buf_at = 0  # file offset of self._buf[0]

    def _fill(self, n: int) -> None:
        """Make ``self._buf`` cover at least ``n`` bytes from ``self.pos`` (fewer only at the end of the file)."""
        have = self._buf_at + len(self._buf) - self.pos
        if self._buf_at <= self.pos and have >= n:
            return
        want = min(max(n, _WINDOW), self.size - self.pos)
        self._f.seek(self.pos)
        parts: list[bytes] = []
        got = 0
        while got < want:
            chunk = self._f.read(want - got)
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
        self._buf = b"".join(parts)
        self._buf_at = self.pos

    def varint(self, end: int, what: str) -> int:
        """The varint at the cursor, which must end by ``end`` (its message's end, at most the file's)."""
        self._fill(_MAX_VARINT)
        rel = self.pos - self._buf_at
        short = ProblemKind.TRUNCATED if end >= self.size else ProblemKind.MALFORMED
        value, after = varint(self._buf, rel, min(len(self._buf), rel + end - self.pos), what, self._buf_at, short)
        self.pos += after - rel
        return value

    def take(self, n: int, what: str) -> bytes:
        """The next ``n`` bytes (the caller bounds ``n``)."""
        if n > self.size - self.pos:
            raise WireError(ProblemKind.TRUNCATED, f"{what} at offset {self.pos:,} declares {n:,} bytes but the "
                            f"file ends {self.size - self.pos:,} bytes later")
        self._fill(n)
        rel = self.pos - self._buf_at
        data = self._buf[rel : rel + n]
        if len(data) < n:
            raise WireError(ProblemKind.TRUNCATED, f"{what} at offset {self.pos:,}: the file ended while reading")
        self.pos += n
        return data

    def skip(self, n: int) -> None:
        """Move over ``n`` bytes without reading them (the caller checked they lie inside the file)."""
        self.pos += n
