"""Read a MindSpore ``.ckpt`` (protobuf ``Checkpoint``) without MindSpore: tensor names, dtypes and shapes.

The schema (``mindspore/ccsrc/utils/checkpoint.proto``, proto2)::

    message Checkpoint { repeated Value value = 1; }
    message Value { required string tag = 1; TensorProto tensor = 2; /* MapTensorProto maptensor = 3 */ }
    message TensorProto { repeated int64 dims = 1; required string tensor_type = 2; required bytes tensor_content = 3; }

A walk of the wire format reads every field key and length but seeks over ``tensor_content``, so a multi-GB file
costs a few small reads per tensor. Unknown fields are skipped, as protobuf does. MindSpore saves a tensor over
512 MB as consecutive values under one tag, each with a slice of the bytes (``_exec_save``), and writes a scalar
with ``dims == [0]``; the loader (``_load_into_param_dict``) joins the slices and reshapes, which fails when the
bytes do not match ``prod(dims) x itemsize``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import BinaryIO

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import MindSporeFacts, ProblemKind, ReadOutcome, ReadProblem, TensorInfo
from ckptdoctor.readers.protowire import I32, I64, LEN, VARINT, Cursor, WireError, split_key, varint
from ckptdoctor.readers.safetensors import DTYPE_BITS

# MindSpore's tensor_type strings, lower-cased and without the ``mindspore.`` prefix: ``Float32`` is what
# mindspore.save_checkpoint writes (``tensor_to_np_type``), ``mindspore.float32`` what MindNLP 0.4 writes
# (``str(dtype)``), ``Uint8`` what MindSpore 1.x wrote.
_DTYPES: dict[str, str] = {
    "bool": "BOOL",
    "bool_": "BOOL",
    "int8": "I8",
    "uint8": "U8",
    "int16": "I16",
    "uint16": "U16",
    "int32": "I32",
    "uint32": "U32",
    "int64": "I64",
    "uint64": "U64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
    "complex64": "C64",
}
# Bounds on what one value may make the walk read (MindSpore sets none; no real file comes near them).
MAX_VALUES = 10_000_000
MAX_TAG_BYTES = 64 * 1024
MAX_TYPE_BYTES = 256
MAX_DIMS = 64


@dataclass(slots=True)
class _Value:
    """One ``Value`` record as walked: its tag and tensor fields (content length only)."""

    at: int
    tag: str | None = None
    dims: list[int] | None = None
    tensor_type: str | None = None
    content: int | None = None  # bytes of tensor_content
    has_tensor: bool = False
    has_map: bool = False  # a MapTensorProto (field 3), which this reader does not describe


def read_mindspore(f: BinaryIO, size: int, limits: Limits = DEFAULT_LIMITS) -> ReadOutcome:
    """Walk the MindSpore checkpoint of ``size`` bytes open as ``f``; never raises.

    Problems: TRUNCATED (a length or varint past the end of the file), MALFORMED (bad varints, wire types this
    schema never uses, lengths past their message, missing required fields, negative dims, content bytes that
    do not match the shape), LIMIT (past the bounds above), UNREADABLE (an OS error). A file whose structure
    breaks has no facts; one whose tensors disagree with their bytes has facts and problems.
    """
    if size == 0:
        return _failed(ProblemKind.EMPTY, "file is empty (0 bytes); a MindSpore checkpoint holds at least one value")
    try:
        values = _walk(Cursor(f, size), size)
    except WireError as e:
        return _failed(e.kind, e.message)
    except OSError as e:
        return _failed(ProblemKind.UNREADABLE, f"cannot read the file: {e.strerror or e}")
    if isinstance(values, ReadProblem):
        return ReadOutcome(None, (values,))
    tensors, problems = _tensors(values)
    return ReadOutcome(MindSporeFacts(tuple(tensors), len(values)), tuple(problems))


def _failed(kind: ProblemKind, message: str) -> ReadOutcome:
    return ReadOutcome(None, (ReadProblem(kind, message),))


def _walk(cur: Cursor, size: int) -> list[_Value] | ReadProblem:
    """Every ``Value`` of the file, in order."""
    values: list[_Value] = []
    while cur.pos < size:
        at = cur.pos
        number, wire = split_key(cur.varint(size, "field key"), at)
        if number != 1 or wire != LEN:
            _skip(cur, number, wire, size)
            continue
        if len(values) >= MAX_VALUES:
            return ReadProblem(ProblemKind.LIMIT, f"more than {MAX_VALUES:,} values; the rest was not read")
        n = cur.varint(size, f"length of value #{len(values) + 1}")
        if n > size - cur.pos:
            raise WireError(ProblemKind.TRUNCATED, _cut_message(cur, at, n, len(values) + 1))
        values.append(_value(cur, cur.pos + n, at, len(values) + 1))
    return values


def _cut_message(cur: Cursor, at: int, n: int, index: int) -> str:
    """What a value that runs past the end of the file is, naming its tag when the tag itself is intact."""
    start = cur.pos
    missing = n - (cur.size - start)
    name = ""
    try:
        number, wire = split_key(cur.varint(cur.size, "field key"), cur.pos)
        if number == 1 and wire == LEN:
            k = cur.varint(cur.size, "length of tag")
            if k <= MAX_TAG_BYTES:
                name = f" (`{cur.take(k, 'tag').decode('utf-8', 'backslashreplace')}`)"
    except WireError:
        pass
    return (
        f"value #{index}{name} at offset {at:,} declares {n:,} bytes but the file ends {cur.size - start:,} bytes "
        f"later ({missing:,} missing): the file is truncated"
    )


def _value(cur: Cursor, end: int, at: int, index: int) -> _Value:
    v = _Value(at)
    while cur.pos < end:
        fat = cur.pos
        number, wire = split_key(cur.varint(end, "field key"), fat)
        if number == 1 and wire == LEN:
            n = _length(cur, end, f"tag of value #{index}", MAX_TAG_BYTES)
            v.tag = cur.take(n, "tag").decode("utf-8", "backslashreplace")
        elif number == 2 and wire == LEN:
            n = _length(cur, end, f"tensor of value #{index}")
            v.has_tensor = True
            _tensor(cur, cur.pos + n, v, index)
        elif number == 3 and wire == LEN:
            v.has_map = True
            _skip(cur, number, wire, end)
        else:
            _skip(cur, number, wire, end)
    if v.tag is None:
        raise WireError(ProblemKind.MALFORMED, f"value #{index} at offset {at:,} has no tag (a required field)")
    return v


def _tensor(cur: Cursor, end: int, v: _Value, index: int) -> None:
    dims: list[int] = []
    what = f"value #{index} (`{v.tag}`)" if v.tag is not None else f"value #{index}"
    while cur.pos < end:
        fat = cur.pos
        number, wire = split_key(cur.varint(end, "field key"), fat)
        if number == 1 and wire == VARINT:
            dims.append(cur.varint(end, f"dimension of {what}"))
        elif number == 1 and wire == LEN:  # packed repeated int64: accepted by every protobuf parser
            n = _length(cur, end, f"dims of {what}", MAX_DIMS * 10)
            packed = cur.take(n, "dims")
            pos = 0
            while pos < n:
                d, pos = varint(packed, pos, n, f"dimension of {what}", fat)
                dims.append(d)
        elif number == 2 and wire == LEN:
            n = _length(cur, end, f"tensor_type of {what}", MAX_TYPE_BYTES)
            v.tensor_type = cur.take(n, "tensor_type").decode("utf-8", "backslashreplace")
        elif number == 3 and wire == LEN:
            n = _length(cur, end, f"tensor_content of {what}")
            v.content = n
            cur.skip(n)
        else:
            _skip(cur, number, wire, end)
        if len(dims) > MAX_DIMS:
            raise WireError(ProblemKind.MALFORMED, f"{what} has more than {MAX_DIMS} dimensions")
    for d in dims:
        if d >= 1 << 63:
            raise WireError(ProblemKind.MALFORMED, f"{what} has a negative dimension ({d - (1 << 64)})")
    v.dims = dims


def _length(cur: Cursor, end: int, what: str, cap: int | None = None) -> int:
    """A LEN field's length, checked against the end of its message and of the file (and ``cap``)."""
    at = cur.pos
    n = cur.varint(end, f"length of {what}")
    if n > end - cur.pos and end < cur.size:
        raise WireError(ProblemKind.MALFORMED, f"{what} at offset {at:,} declares {n:,} bytes but its message "
                        f"ends {end - cur.pos:,} bytes later")
    if n > cur.size - cur.pos:
        raise WireError(ProblemKind.TRUNCATED, f"{what} at offset {at:,} declares {n:,} bytes but the file ends "
                        f"{cur.size - cur.pos:,} bytes later ({n - (cur.size - cur.pos):,} missing): the file is "
                        "truncated")
    if cap is not None and n > cap:
        raise WireError(ProblemKind.MALFORMED, f"{what} at offset {at:,} is {n:,} bytes, over {cap:,}")
    return n


def _skip(cur: Cursor, number: int, wire: int, end: int) -> None:
    """Move over an unknown field, as protobuf parsers do."""
    if wire == VARINT:
        cur.varint(end, f"field {number}")
        return
    n = 8 if wire == I64 else 4 if wire == I32 else _length(cur, end, f"field {number}")
    if wire != LEN:
        if n > cur.size - cur.pos:
            raise WireError(ProblemKind.TRUNCATED, f"field {number} at offset {cur.pos:,} needs {n} bytes but the "
                            f"file ends {cur.size - cur.pos:,} bytes later: the file is truncated")
        if n > end - cur.pos:
            raise WireError(ProblemKind.MALFORMED, f"field {number} at offset {cur.pos:,} runs past its message")
    cur.skip(n)


# ---------------------------------------------------------------------------------------------------------------
# Values -> tensors


def _tensors(values: list[_Value]) -> tuple[list[TensorInfo], list[ReadProblem]]:
    """Join the slices of each tag (consecutive values), map dtypes and check bytes against shapes."""
    tensors: list[TensorInfo] = []
    problems: list[ReadProblem] = []
    i = 0
    while i < len(values):
        j = i + 1
        while j < len(values) and values[j].tag == values[i].tag:
            j += 1
        group = values[i:j]
        i = j
        info = _tensor_info(group, problems)
        if info is not None:
            tensors.append(info)
    return tensors, problems


def _tensor_info(group: list[_Value], problems: list[ReadProblem]) -> TensorInfo | None:
    last = group[-1]
    name = last.tag or ""
    if any(v.has_map for v in group):
        return None  # a map tensor: not described here
    if not all(v.has_tensor for v in group):
        problems.append(ReadProblem(ProblemKind.MALFORMED, f"value `{name}` holds no tensor: MindSpore cannot load it"))
        return None
    missing = next((f for f in ("tensor_type", "tensor_content") if _field(last, f) is None), None)
    if missing is None:
        missing = next((f for v in group for f in ("tensor_type", "tensor_content") if _field(v, f) is None), None)
    if missing is not None:
        problems.append(ReadProblem(ProblemKind.MALFORMED, f"tensor `{name}` has no {missing} (a required field)"))
        return None
    types = {v.tensor_type for v in group}
    if len(types) > 1:
        problems.append(ReadProblem(ProblemKind.MALFORMED, f"tensor `{name}` is saved in {len(group)} slices of "
                                    f"different types ({', '.join(sorted(t or '' for t in types))})"))
        return None
    raw_type = last.tensor_type or ""
    dtype = _DTYPES.get(raw_type.lower().removeprefix("mindspore."))
    if dtype is None:
        return None  # strings ("str") and types without a safetensors code (Int4) are not tensors to compare
    dims = tuple(last.dims or ())
    shape = () if dims == (0,) else dims  # MindSpore writes a scalar as dims [0]
    nbytes = sum(v.content or 0 for v in group)
    need = math.prod(shape) * DTYPE_BITS[dtype] // 8
    if nbytes != need:
        slices = f" in {len(group)} slices" if len(group) > 1 else ""
        problems.append(
            ReadProblem(
                ProblemKind.MALFORMED,
                f"tensor `{name}` {dtype} {list(shape)} needs {need:,} bytes but its tensor_content holds "
                f"{nbytes:,}{slices}: MindSpore cannot reshape it",
            )
        )
    return TensorInfo(name, dtype, shape, nbytes)


def _field(v: _Value, name: str) -> object:
    return v.tensor_type if name == "tensor_type" else v.content
