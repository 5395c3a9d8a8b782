"""Read a ``.safetensors`` header the way the safetensors library validates it, without touching tensor data."""

from __future__ import annotations

import json
import operator
from typing import Any, BinaryIO

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import ProblemKind, ReadOutcome, ReadProblem, SafetensorsFacts, TensorInfo
from ckptdoctor.readers.extra_state import named_extra_state, safetensors_extra_state
from ckptdoctor.readers.jsonfiles import deeper_than
from ckptdoctor.readers.pickle_walk import merge_pickles
from ckptdoctor.readers.seen import Seen

# safetensors dtype code -> bits per element (``Dtype::bitsize`` in safetensors/src/tensor.rs, 0.8).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}

_LEN_PREFIX = 8  # the u64 little-endian header length
_USIZE_END = 2**64  # the library holds shapes, offsets and sizes in usize (64-bit targets)
_I64_MIN = -(2**63)
# serde_json's recursion limit: 128 nested containers fail, so 127 is the deepest accepted document.
_MAX_JSON_DEPTH = 127
_FIELDS = ("dtype", "shape", "data_offsets")
# Digits to "0", anything else to " ": a run of 20 zeros then marks an integer literal that may not fit a u64.
_DIGIT_RUNS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_DIGITS = b"0" * 20
_READ_CHUNK = 1 << 20


class _Reject(Exception):
    """A header the library would refuse; carries the reason. Never escapes this module."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _Obj:
    """A JSON object kept as its (key, value) pairs, so duplicate keys stay visible (serde sees them all)."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        self.pairs = pairs


def read_safetensors(f: BinaryIO, size: int, limits: Limits = DEFAULT_LIMITS) -> ReadOutcome:
    """Parse and validate the header of a safetensors file of ``size`` bytes open as ``f``.

    Mirrors ``SafeTensors::read_metadata``: a file the library would refuse yields a problem. Only the 8-byte length
    and the header are read. A valid header in a file of the wrong length yields the facts and the problem.
    """
    try:
        return _read(f, size, limits)
    except OSError as exc:
        return _failed(ProblemKind.UNREADABLE, f"cannot read the file: {exc}")


def _failed(kind: ProblemKind, message: str) -> ReadOutcome:
    return ReadOutcome(content=None, problems=(ReadProblem(kind, message),))


def _read(f: BinaryIO, size: int, limits: Limits) -> ReadOutcome:
    if size == 0:
        return _failed(
            ProblemKind.EMPTY, "file is empty (0 bytes); safetensors needs at least the 8-byte header length"
        )
    if size < _LEN_PREFIX:
        return _failed(ProblemKind.TRUNCATED, f"file has {size} bytes, fewer than the 8-byte header length")
    f.seek(0)
    prefix = _read_exact(f, _LEN_PREFIX)
    if len(prefix) < _LEN_PREFIX:
        return _failed(ProblemKind.TRUNCATED, f"file ended after {len(prefix)} bytes while reading the header length")
    n = int.from_bytes(prefix, "little")
    if n > limits.safetensors_header_bytes:
        return _failed(
            ProblemKind.MALFORMED,
            f"header too large: declares {n:,} bytes, safetensors accepts at most {limits.safetensors_header_bytes:,}",
        )
    available = size - _LEN_PREFIX
    if n > available:
        return _failed(
            ProblemKind.TRUNCATED,
            f"header declares {n:,} bytes but the file has {available:,} after the length prefix",
        )
    raw = _read_exact(f, n)
    if len(raw) < n:
        return _failed(ProblemKind.TRUNCATED, f"header declares {n:,} bytes but only {len(raw):,} could be read")
    facts = _SEEN.get(raw)
    if facts is None:
        try:
            facts = _parse_header(raw)
        except _Reject as rej:
            return _failed(ProblemKind.MALFORMED, rej.message)
        if len(raw) <= _SEEN_MAX_BYTES:
            _SEEN.put(raw, facts)
    problems = _length_problems(facts, size)
    if named_extra_state(map(_NAME, facts.tensors)):
        # TransformerEngine's `_extra_state` tensors: pickles loaded after the weights (``readers/extra_state.py``)
        pickles, more = safetensors_extra_state(f, facts, limits)
        return ReadOutcome(facts, (*problems, *more), merge_pickles(None, pickles))
    return ReadOutcome(content=facts, problems=problems)


_NAME = operator.attrgetter("name")

# The facts of the headers parsed before, by their bytes: a run's checkpoints repeat the same shards' headers, so
# each distinct header is parsed once and its facts are one object (which the verdict cache then encodes once,
# ``cache.codec.Encoder`` finding it by identity). The facts are a function of the header's bytes alone.
_SEEN: Seen[bytes, SafetensorsFacts] = Seen(16)  # a 7B run in three shards has three
_SEEN_MAX_BYTES = 1 << 20  # a larger header is parsed each time (the library's own limit is 100 MB)


def _read_exact(f: BinaryIO, n: int) -> bytes:
    """Read up to ``n`` bytes, in chunks so a short file never gets a buffer of the declared size up front."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        chunk = f.read(min(_READ_CHUNK, n - got))
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _length_problems(facts: SafetensorsFacts, size: int) -> tuple[ReadProblem, ...]:
    expected = _LEN_PREFIX + facts.header_bytes + facts.data_bytes
    if expected == size:
        return ()
    if size < expected:
        return (
            ReadProblem(
                ProblemKind.TRUNCATED,
                f"header declares {facts.data_bytes:,} bytes of tensor data, so the file should be {expected:,} "
                f"bytes, but it has {size:,} ({expected - size:,} missing)",
            ),
        )
    return (
        ReadProblem(
            ProblemKind.MALFORMED,
            f"file has {size - expected:,} trailing bytes after the last tensor's data "
            f"(header accounts for {expected:,} bytes, the file has {size:,})",
        ),
    )


# ---------------------------------------------------------------------------------------------------------------
# Header JSON, decoded with serde_json's rules (what the library accepts), not Python's


def _parse_header(raw: bytes) -> SafetensorsFacts:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _Reject(
            f"header is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at header offset {exc.start:,})"
        ) from None
    # Without a minus sign anywhere, integer literals of at most 19 digits are all in 0..2**64, where the parser's
    # own int conversion gives what _parse_int would, without a Python call per number (most of a header).
    plain_ints = b"-" not in raw and _LONG_DIGITS not in raw.translate(_DIGIT_RUNS)
    try:
        doc = json.loads(
            text,
            object_pairs_hook=_Obj,
            parse_int=None if plain_ints else _parse_int,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
        )
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":
            where = f"line {exc.lineno} column {exc.colno}"
            raise _Reject(
                f"header has non-whitespace bytes after the JSON object at {where} ({text[exc.pos]!r})"
            ) from None
        raise _Reject(f"header is not valid JSON: {exc}") from None
    except RecursionError:
        raise _Reject(f"header nests JSON deeper than safetensors' limit of {_MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:  # e.g. Python's int digit limit, reached only by numbers serde also refuses
        raise _Reject(f"header is not valid JSON: {exc}") from None
    # The walk refuses lone surrogates, which only a \u escape can make (the text is valid UTF-8), and nesting
    # past serde's limit: skip it when the header has no backslash and is shallow enough.
    if b"\\" in raw or deeper_than(raw, _MAX_JSON_DEPTH):
        _check_json_value(doc)
    if not isinstance(doc, _Obj):
        raise _Reject(f"header is a JSON {_json_type(doc)}, expected an object")
    metadata: dict[str, str] | None = None
    seen_metadata = False
    entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    for key, value in doc.pairs:
        if key == "__metadata__":
            if seen_metadata:
                raise _Reject("header has `__metadata__` twice")
            seen_metadata = True
            metadata = _metadata(value)
        else:
            # serde deserializes every entry, then keeps the last one for a repeated name.
            entries[key] = _entry(key, value)
    return _validate(len(raw), metadata, entries)


def _parse_int(s: str) -> int | float:
    # serde_json reads "-0" as a float, and integers outside i64/u64 as floats ("number out of range" past f64).
    if s == "-0":
        return -0.0
    if len(s) <= 21:
        v = int(s)
        if _I64_MIN <= v < _USIZE_END:
            return v
    return _parse_float(s)


def _parse_float(s: str) -> float:
    v = float(s)
    if v in (float("inf"), float("-inf")):
        raise _Reject(f"header holds a number out of range: {s[:40]}")
    return v


def _parse_constant(s: str) -> float:
    raise _Reject(f"header holds `{s}`, which is not JSON")


def _check_json_value(doc: Any) -> None:
    """Refuse what Python's json accepts but serde_json does not: lone surrogates and deep nesting."""
    stack: list[tuple[Any, int]] = [(doc, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_str(value)
        elif isinstance(value, (_Obj, list)):
            if depth + 1 > _MAX_JSON_DEPTH:
                raise _Reject(f"header nests JSON deeper than safetensors' limit of {_MAX_JSON_DEPTH} levels")
            if isinstance(value, _Obj):
                for key, item in value.pairs:
                    _check_str(key)
                    stack.append((item, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in value)


def _check_str(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise _Reject(f"header string {s[:40]!r} holds a lone UTF-16 surrogate escape") from None


def _json_type(value: Any) -> str:
    if isinstance(value, _Obj):
        return "object"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    return "array"


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, _Obj):
        raise _Reject(f"`__metadata__` is a JSON {_json_type(value)}, expected an object of strings")
    out: dict[str, str] = {}
    for key, item in value.pairs:
        if not isinstance(item, str):
            raise _Reject(f"`__metadata__` value for `{key}` is a JSON {_json_type(item)}, expected a string")
        out[key] = item
    return out


def _entry(name: str, value: Any) -> tuple[str, tuple[int, ...], int, int]:
    """One tensor entry as (dtype, shape, begin, end). serde also accepts the ``[dtype, shape, offsets]`` form."""
    if isinstance(value, _Obj):
        fields = dict(value.pairs)
        if len(fields) < len(value.pairs):
            _refuse_repeated_field(name, value.pairs)
        try:  # other keys are ignored, as serde does
            dtype_v, shape_v, offsets_v = fields["dtype"], fields["shape"], fields["data_offsets"]
        except KeyError:
            missing = next(k for k in _FIELDS if k not in fields)
            raise _Reject(f"tensor `{name}` has no `{missing}`") from None
    elif isinstance(value, list):
        if len(value) != len(_FIELDS):
            raise _Reject(f"tensor `{name}` is an array of {len(value)} items, expected [dtype, shape, data_offsets]")
        dtype_v, shape_v, offsets_v = value
    else:
        raise _Reject(f"tensor `{name}` is a JSON {_json_type(value)}, expected an object")
    dtype = _dtype(name, dtype_v)
    if not isinstance(shape_v, list):
        raise _Reject(f"tensor `{name}` shape is a JSON {_json_type(shape_v)}, expected an array")
    shape = _usizes(name, "shape", shape_v)
    if not isinstance(offsets_v, list) or len(offsets_v) != 2:
        raise _Reject(f"tensor `{name}` data_offsets must be an array [begin, end]")
    begin, end = _usizes(name, "data_offsets", offsets_v)
    return dtype, shape, begin, end


def _refuse_repeated_field(name: str, pairs: list[tuple[str, Any]]) -> None:
    """serde refuses a tensor field given twice; other repeated keys are ignored like any unknown key."""
    seen: set[str] = set()
    for key, _ in pairs:
        if key in _FIELDS:
            if key in seen:
                raise _Reject(f"tensor `{name}` has the field `{key}` twice")
            seen.add(key)


def _dtype(name: str, value: Any) -> str:
    if type(value) is str and value in DTYPE_BITS:
        return value  # the usual case first
    # serde's enum form {"F32": null} is accepted by the library as well as the plain string.
    if isinstance(value, _Obj) and len(value.pairs) == 1 and value.pairs[0][1] is None:
        value = value.pairs[0][0]
    if not isinstance(value, str):
        raise _Reject(f"tensor `{name}` dtype is a JSON {_json_type(value)}, expected a dtype code")
    if value not in DTYPE_BITS:
        raise _Reject(f"tensor `{name}` has unknown dtype `{value[:40]}`")
    return value


def _usizes(name: str, field: str, values: list[Any]) -> tuple[int, ...]:
    for value in values:
        if type(value) is not int or not 0 <= value < _USIZE_END:
            raise _Reject(f"tensor `{name}` {field} entry {value!r} is not an integer in 0..2**64")
    return tuple(values)


# ---------------------------------------------------------------------------------------------------------------
# Offsets and sizes (``Metadata::validate``)


def _validate(
    header_bytes: int,
    metadata: dict[str, str] | None,
    entries: dict[str, tuple[str, tuple[int, ...], int, int]],
) -> SafetensorsFacts:
    ordered = sorted(entries.items(), key=_offsets_key)
    tensors: list[TensorInfo] = []
    start = 0
    for name, (dtype, shape, begin, end) in ordered:
        if end < begin:
            raise _Reject(f"tensor `{name}` spans bytes {begin:,}..{end:,}: its end is before its begin")
        if begin != start:
            if not tensors:
                raise _Reject(f"tensor `{name}` begins at byte {begin:,} but the first tensor must begin at 0")
            gap = "a hole" if begin > start else "an overlap"
            raise _Reject(f"tensor `{name}` begins at byte {begin:,} but the previous tensor ends at {start:,} ({gap})")
        start = end
        numel = 1
        for d in shape:
            numel *= d
            if numel >= _USIZE_END:  # the library's checked_mul fails here, even if a later dimension is 0
                raise _Reject(f"tensor `{name}` {_described(dtype, shape)} has more elements than fit in 64 bits")
        nbits = numel * DTYPE_BITS[dtype]
        if nbits >= _USIZE_END:
            raise _Reject(f"tensor `{name}` {_described(dtype, shape)} needs more bits than fit in 64 bits")
        if nbits % 8:
            raise _Reject(f"tensor `{name}` {_described(dtype, shape)} is {nbits:,} bits, not a whole number of bytes")
        if end - begin != nbits // 8:
            raise _Reject(
                f"tensor `{name}` spans bytes {begin:,}..{end:,} but {_described(dtype, shape)} needs {nbits // 8:,}"
            )
        tensors.append(TensorInfo(name, dtype, shape, end - begin))
    return SafetensorsFacts(header_bytes=header_bytes, metadata=metadata, tensors=tuple(tensors), data_bytes=start)


def _offsets_key(item: tuple[str, tuple[str, tuple[int, ...], int, int]]) -> tuple[int, int]:
    # Only (begin, end): tensors that tie keep their header order, as the library's stable sort does.
    return item[1][2], item[1][3]


def _described(dtype: str, shape: tuple[int, ...]) -> str:
    return f"{dtype} {list(shape)}"
