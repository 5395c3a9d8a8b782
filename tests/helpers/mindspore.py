"""Helpers shared by several test files (moved from tests/readers/test_readers_mindspore_tf.py)."""

from __future__ import annotations

from ckptdoctor.readers.protowire import varint


def _key(field: int, wire: int) -> bytes:
    return _varint((field << 3) | wire)


def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _len_field(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def ms_value(tag: str, dims: list[int], tensor_type: str, content: bytes) -> bytes:
    tensor = b"".join(_key(1, 0) + _varint(d) for d in dims)
    tensor += _len_field(2, tensor_type.encode()) + _len_field(3, content)
    return _len_field(1, _len_field(1, tag.encode()) + _len_field(2, tensor))


def ms_values(data: bytes) -> list[bytes]:
    """The top-level `Value` records of a real file, as bytes (key and length included)."""
    out = []
    pos = 0
    while pos < len(data):
        start = pos
        assert data[pos] == 0x0A
        n, pos = varint(data, pos + 1, len(data))
        pos += n
        out.append(data[start:pos])
    return out
