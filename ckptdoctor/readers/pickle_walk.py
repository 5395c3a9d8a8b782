"""A static pickle walker: rebuilds plain values from a pickle stream opcode by opcode, never executing it."""

from __future__ import annotations

import codecs
import itertools
import re
import struct

# _compat_pickle is the stdlib's table of Python 2 names (``__builtin__.eval`` -> ``builtins.eval``). The real
# unpickler applies it to every global of a protocol < 3 stream, so we record the name it would really import.
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import (
    BYTES_LOADER,
    UNRESOLVED_CALL,
    GlobalRef,
    Opaque,
    PickleFacts,
    PickleValue,
    ProblemKind,
    ReadProblem,
    TensorRef,
)
from ckptdoctor.readers.pickle_resume import (
    GAIN,
    HEAD,
    MIN_BYTES,
    SNAPSHOTS,
    STREAMS,
    Diverged,
    Graph,
    Snapshot,
    Stream,
    common_prefix,
    last_boundary,
)
from ckptdoctor.readers.pickle_runs import Run, parse_run
from ckptdoctor.readers.pickle_values import (
    CYCLE,
    OUT_OF_BAND,
    SCALARS,
    TOO_DEEP,
    Key,
    Obj,
    SetNode,
    freeze,
    iter_values,
)
from ckptdoctor.readers.seen import Seen

__all__ = [
    "BYTES_LOADER", "CYCLE", "PAST_BUDGET", "TOO_DEEP", "UNRESOLVED_CALL", "c_load_float", "c_load_int", "c_load_long",
    "c_memo_index", "iter_values", "merge_pickles", "walk_pickle",
]


def _check_frame(data: bytes, start: int, end: int) -> None:
    """Raise ``_Malformed`` unless the opcodes of the frame ``data[start:end]`` end exactly at its end.

    Writers end a frame between opcodes. When an opcode's argument runs past the frame, CPython's C unpickler reading
    a file (``torch.load``, ``pickle.load``) drops the frame's remaining bytes and reads the argument from the bytes
    after it, while ``pickle.loads`` refuses the data: one stream, two meanings, and a payload can hide in the one
    this walk would not take (CPython issue 154848). Only framed pickles (protocol 4 and 5) pay for this pass.
    """
    import io
    import pickletools

    try:
        for opcode, _, at in pickletools.genops(io.BytesIO(data[start:end])):
            if opcode.name == "STOP":
                return
            if opcode.name == "FRAME":
                raise _Malformed(f"a FRAME opens at byte {start + (at or 0)}, inside the frame before it")
    except ValueError as exc:  # an argument cut by the frame's end, or a byte that is no opcode
        if str(exc) == "pickle exhausted before seeing STOP":  # the last opcode ended with the frame: as written
            return
        raise _Malformed(f"an opcode runs past the end of its FRAME at byte {end} ({exc}): the unpickler reading "
                         "a file and pickle.loads read different streams") from None


class _Malformed(Exception):
    """Internal: aborts the walk with a MALFORMED_PICKLE (or LIMIT) problem."""

    def __init__(self, message: str, kind: ProblemKind = ProblemKind.MALFORMED_PICKLE) -> None:
        super().__init__(message)
        self.kind = kind


# Torch dtype objects (``torch.float32``) pickle as globals; _rebuild_tensor_v3 passes one explicitly.
TORCH_DTYPES: dict[str, str] = {
    "float64": "F64", "double": "F64", "float32": "F32", "float": "F32", "float16": "F16", "half": "F16",
    "bfloat16": "BF16", "int64": "I64", "long": "I64", "int32": "I32", "int": "I32", "int16": "I16",
    "short": "I16", "int8": "I8", "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64",
    "bool": "BOOL", "complex64": "C64", "cfloat": "C64", "complex128": "C128", "cdouble": "C128",
    "complex32": "C32", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0", "float4_e2m1fn_x2": "F4",
}  # fmt: skip

_MAX_GLUED = 4096  # longest string the walk rebuilds from a concatenation call

# (``UNRESOLVED_CALL`` and ``BYTES_LOADER``, the callee stand-ins recorded in ``calls``, are the model's.)
# Recorded as called when the arguments handed to calls hold more values than one walk looks at (``_PASSED_VALUES``):
# whatever the rest holds is not judged, so it cannot be proved harmless.
PAST_BUDGET = GlobalRef("<limit>", "globals handed to calls past the walk's budget (not judged)")
_PASSED_VALUES = 4_000_000  # values of call arguments looked at per walk; real arguments hold a handful

_REBUILD_TENSOR = frozenset({"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3"})
_REBUILD_PARAM = frozenset({"_rebuild_parameter", "_rebuild_parameter_with_state"})


_INT_ONLY = frozenset({int})


def _is_int_tuple(v: Any) -> bool:
    return type(v) is tuple and _INT_ONLY.issuperset(map(type, v))


_TENSORS: Seen[tuple[Any, ...], tuple[TensorRef, TensorRef]] = Seen(1 << 15)  # -> (storage, tensor)


def _interpret(func: GlobalRef, args: tuple[Any, ...], share: bool = False) -> Any:
    """The value of a call to a known-harmless reconstructor, or an ``Obj`` when we do not interpret it. ``share``:
    a tensor rebuilt before over the same storage object is that tensor (a replayed run shares its own)."""
    mod, name = func.module, func.name
    n = len(args)
    if mod == "torch._utils":
        if name in _REBUILD_TENSOR and n >= 4:
            storage, offset, size, stride = args[0], args[1], args[2], args[3]
            if type(storage) is TensorRef and type(offset) is int and _is_int_tuple(size) and _is_int_tuple(stride):
                dtype = storage.dtype
                if name == "_rebuild_tensor_v3":
                    dt = args[6] if n >= 7 else None
                    if type(dt) is not GlobalRef or dt.module != "torch" or dt.name not in TORCH_DTYPES:
                        return Obj(func, args)
                    dtype = TORCH_DTYPES[dt.name]
                # One object per tensor over one (interned) storage object: a run's checkpoints rebuild the same
                # tensors, and consumers that remember by identity meet each once (``pickle_values.shared``).
                key = (id(storage), dtype, offset, size, stride) if share else None
                if key is not None:
                    got = _TENSORS.get(key)
                    if got is not None and got[0] is storage:
                        return got[1]
                ref = TensorRef(
                    dtype, size, stride, offset, storage.storage_key, storage.storage_numel, storage.location,
                    storage.storage_nbytes,
                )  # fmt: skip
                if key is not None:
                    _TENSORS.put(key, (storage, ref))
                return ref
        elif name in _REBUILD_PARAM and n >= 1 and type(args[0]) is TensorRef:
            return args[0]
    elif mod == "collections" and name == "OrderedDict":
        if n == 0:
            return {}
        if n == 1 and type(args[0]) is list and all(type(p) in (tuple, list) and len(p) == 2 for p in args[0]):
            d: dict[Any, Any] = {}
            for k, v in args[0]:
                d[k if type(k) in SCALARS else Key(k)] = v
            return d
    elif mod in ("operator", "_operator") and name in ("add", "concat") and n == 2:
        # Names for STACK_GLOBAL can be glued together at load time ("po" + "six"); rebuild short strings so the
        # global they name is reported by name. Long ones stay opaque: doubling through the memo is exponential.
        a, b = args
        if type(a) is str and type(b) is str and len(a) + len(b) <= _MAX_GLUED:
            return a + b
    elif mod == "builtins" and name == "str.join" and n == 2:
        sep, parts = args
        ok = type(sep) is str and type(parts) in (list, tuple) and all(type(x) is str for x in parts)
        if ok and len(sep) * len(parts) + sum(len(x) for x in parts) <= _MAX_GLUED:
            return sep.join(parts)
    elif mod == "torch" and name == "Size":
        if n == 1 and _is_int_tuple(args[0]):
            return args[0]
    elif mod == "_codecs" and name == "encode":
        if n == 2 and type(args[0]) is str and args[1] in ("latin1", "latin-1"):
            try:
                return args[0].encode("latin1")
            except UnicodeEncodeError:
                return Obj(func, args)
    elif mod == "builtins":
        if name in ("set", "frozenset") and (n == 0 or (n == 1 and type(args[0]) in (list, tuple))):
            return SetNode(list(args[0]) if n else [], name == "frozenset")
        if name == "bytes" and n == 0:  # protocol 0-2 write b"" this way
            return b""
        if name == "bytearray":
            # bytearray(int) would allocate that many bytes: only copies of existing data are interpreted.
            if n == 0:
                return b""
            if n == 1 and type(args[0]) is bytes:
                return args[0]
        if name == "complex" and 1 <= n <= 2 and all(type(a) in (int, float) for a in args):
            return complex(*args)
    return Obj(func, args)


# joblib's array wrapper (joblib/numpy_pickle.py): ``joblib.load`` reads an array's bytes after its BUILD.
JOBLIB_WRAPPER = GlobalRef("joblib.numpy_pickle", "NumpyArrayWrapper")
_NP_DTYPE = GlobalRef("numpy", "dtype")
# numpy's fixed-size type strings, as ``dtype.__reduce__`` writes them (kind + bytes): bool, ints, floats, complex,
# datetimes. Flexible kinds (V, S, U) take their size from the pickled state; O is a pointer (64-bit builds).
_NP_FIXED = re.compile(r"(?:b1|[iu][1248]|f(?:2|4|8|12|16)|c(?:8|16|24|32)|[Mm]8(?:\[[0-9A-Za-z]+\])?)")
_NP_FLEXIBLE = re.compile(r"[VSU][0-9]*")
_NP_OBJECT = re.compile(r"O[48]")


def _np_dtype(v: Any) -> tuple[int, bool] | None:
    """The itemsize of the dtype a walked ``numpy.dtype(str, align, copy)`` REDUCE + BUILD makes, and whether it
    holds Python objects; None when the walk cannot tell as numpy would. numpy's ``arraydescr_setstate``
    (numpy/_core/src/multiarray/descriptor.c) takes a flexible type's size from the state's ``elsize`` and
    ``hasobject`` from the state's ``flags`` (``NPY_ITEM_HASOBJECT``, bit 0), whatever the type string says."""
    if type(v) is not Obj or v.func != _NP_DTYPE or type(v.args) is not tuple or not v.args:
        return None
    name, st = v.args[0], v.state
    if type(name) is not str or type(st) is not tuple or len(st) < 8 or st[0] not in (3, 4):
        return None  # every numpy since 1.7 pickles a dtype with a version 3 or 4 state
    elsize, flags = st[5], st[7]
    if type(flags) is not int:
        return None
    if _NP_OBJECT.fullmatch(name):
        itemsize = 8
    elif _NP_FIXED.fullmatch(name):
        itemsize = int(name[1:].split("[")[0])
    elif _NP_FLEXIBLE.fullmatch(name) and type(elsize) is int and elsize >= 0:
        itemsize = elsize
    else:
        return None
    return itemsize, bool(flags & 1)


# One GlobalRef object per name across walks (bounded), so the tensor-run cache compares memo reads by identity.
_GLOBALS: dict[tuple[str, str], GlobalRef] = {}
_GLOBALS_ENTRIES = 10_000


def _global(module: str, name: str, protocol: int) -> GlobalRef:
    if protocol < 3:
        if (module, name) in NAME_MAPPING:
            module, name = NAME_MAPPING[(module, name)]
        elif module in IMPORT_MAPPING:
            module = IMPORT_MAPPING[module]
    ref = _GLOBALS.get((module, name))
    if ref is None:
        if len(_GLOBALS) >= _GLOBALS_ENTRIES:
            _GLOBALS.clear()
        ref = _GLOBALS[(module, name)] = GlobalRef(module, name)
    return ref


def _one_bytes(args: Any) -> bool:
    return type(args) is tuple and len(args) == 1 and type(args[0]) is bytes


def _decode_str(raw: bytes) -> str | bytes:
    """Protocol 0-2 STRING/BINSTRING payloads: str when ASCII (the unpickler's default), else kept as bytes."""
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        return raw


_OPNAMES = {
    0x28: "MARK", 0x2E: "STOP", 0x30: "POP", 0x31: "POP_MARK", 0x32: "DUP", 0x46: "FLOAT", 0x49: "INT",
    0x4A: "BININT", 0x4B: "BININT1", 0x4C: "LONG", 0x4D: "BININT2", 0x4E: "NONE", 0x50: "PERSID",
    0x51: "BINPERSID", 0x52: "REDUCE", 0x53: "STRING", 0x54: "BINSTRING", 0x55: "SHORT_BINSTRING",
    0x56: "UNICODE", 0x58: "BINUNICODE", 0x61: "APPEND", 0x62: "BUILD", 0x63: "GLOBAL", 0x64: "DICT",
    0x7D: "EMPTY_DICT", 0x65: "APPENDS", 0x67: "GET", 0x68: "BINGET", 0x69: "INST", 0x6A: "LONG_BINGET",
    0x6C: "LIST", 0x5D: "EMPTY_LIST", 0x6F: "OBJ", 0x70: "PUT", 0x71: "BINPUT", 0x72: "LONG_BINPUT",
    0x73: "SETITEM", 0x74: "TUPLE", 0x29: "EMPTY_TUPLE", 0x75: "SETITEMS", 0x47: "BINFLOAT", 0x80: "PROTO",
    0x81: "NEWOBJ", 0x82: "EXT1", 0x83: "EXT2", 0x84: "EXT4", 0x85: "TUPLE1", 0x86: "TUPLE2", 0x87: "TUPLE3",
    0x88: "NEWTRUE", 0x89: "NEWFALSE", 0x8A: "LONG1", 0x8B: "LONG4", 0x42: "BINBYTES", 0x43: "SHORT_BINBYTES",
    0x8C: "SHORT_BINUNICODE", 0x8D: "BINUNICODE8", 0x8E: "BINBYTES8", 0x8F: "EMPTY_SET", 0x90: "ADDITEMS",
    0x91: "FROZENSET", 0x92: "NEWOBJ_EX", 0x93: "STACK_GLOBAL", 0x94: "MEMOIZE", 0x95: "FRAME",
    0x96: "BYTEARRAY8", 0x97: "NEXT_BUFFER", 0x98: "READONLY_BUFFER",
}  # fmt: skip

_unpack_i4 = struct.Struct("<i").unpack_from
_unpack_u4 = struct.Struct("<I").unpack_from
_unpack_u2 = struct.Struct("<H").unpack_from
_unpack_u8 = struct.Struct("<Q").unpack_from
_unpack_f8 = struct.Struct(">d").unpack_from


# ---------------------------------------------------------------------------------------------------------------
# The text arguments of protocol 0 opcodes, parsed as CPython's C unpickler parses them (Modules/_pickle.c,
# ``load_int``, ``load_long``, ``load_float``, ``load_put``, ``load_get``), not as Python's ``int()``/``float()`` do:
# the line is a C string (it ends at its first NUL), INT and LONG read base 0 (``0x10``, octal ``010``), FLOAT
# accepts no whitespace. Where a value steers what a reader looks at next (legacy torch's magic number and version,
# a DCP offset), reading another value than ``torch.load`` does would hide what follows.

_C_SPACE = frozenset(b" \t\n\v\f\r")  # isspace() in the C locale
_LONG_MAX = (1 << 63) - 1  # C ``long`` on the LP64 platforms torch ships for
_HEX = frozenset(b"0123456789abcdefABCDEF")
_DIGIT = {c: int(chr(c), 16) for c in _HEX}  # the value of each hex digit's byte
_C_FLOAT = re.compile(
    rb"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[iI][nN][fF](?:[iI][nN][iI][tT][yY])?|[nN][aA][nN])"
)
_NUMERIC = re.compile(rb"[+-]?[0-9.]")


def _c_string(line: bytes) -> bytes:
    """What C code sees of a line argument: the line and its newline, up to the first NUL."""
    return (line + b"\n").split(b"\0", 1)[0]


def _strtol0(s: bytes) -> tuple[int, int, bool]:
    """``strtol(s, &end, 0)``: (value, offset of ``end``, whether it overflowed a C long)."""
    n = len(s)
    i = 0
    while i < n and s[i] in _C_SPACE:
        i += 1
    neg = i < n and s[i] == 0x2D
    if i < n and s[i] in (0x2B, 0x2D):
        i += 1
    base = 10
    if s[i : i + 1] == b"0":
        base = 8
        if s[i + 1 : i + 2] in (b"x", b"X") and i + 2 < n and s[i + 2] in _HEX:
            base, i = 16, i + 2
    start = i
    while i < n and _DIGIT.get(s[i], 99) < base:
        i += 1
    if i == start:
        return 0, 0, False  # no digits: nothing converted, ``end`` is ``s``
    value = int(s[start:i], base)
    over = value > (_LONG_MAX + 1 if neg else _LONG_MAX)
    return (-value if neg else value), i, over


def _py_long(s: bytes, base: int) -> int:
    """``PyLong_FromString(s, NULL, base)`` of a C string (``int()`` of bytes is that function)."""
    try:
        return int(s, base)
    except ValueError:
        raise _Malformed("invalid argument: could not convert string to int") from None


def c_load_int(line: bytes) -> int:
    """The value of an INT opcode's ``line`` (without its newline) as ``_pickle.c`` ``load_int`` reads it."""
    if not line:
        raise _Malformed("pickle data was truncated: empty INT line")
    s = _c_string(line)
    value, end, over = _strtol0(s)
    if over or (end < len(s) and s[end] != 0x0A):  # ``*endptr`` neither '\n' nor '\0': read as a Python int
        return _py_long(s, 0)
    if len(line) == 2 and value in (0, 1):
        return bool(value)  # protocol 0's True/False are "I01"/"I00": any two bytes that strtol reads as 0 or 1
    return value


def c_load_long(line: bytes) -> int:
    """The value of a LONG opcode's ``line`` as ``load_long`` reads it: a trailing ``L`` dropped, base 0."""
    if not line:
        raise _Malformed("pickle data was truncated: empty LONG line")
    return _py_long(_c_string(line[:-1] if line.endswith(b"L") else line), 0)


def c_load_float(line: bytes) -> float:
    """The value of a FLOAT opcode's ``line`` as ``load_float`` reads it (``PyOS_string_to_double``: no
    whitespace, no underscores, stops at a NUL; a value too large to be finite is an OverflowError)."""
    if not line:
        raise _Malformed("pickle data was truncated: empty FLOAT line")
    s = _c_string(line)
    m = _C_FLOAT.match(s)
    if m is None or (m.end() < len(s) and s[m.end()] != 0x0A):
        raise _Malformed("invalid argument: could not convert string to float")
    value = float(m.group())
    if value in (float("inf"), float("-inf")) and _NUMERIC.match(m.group()):
        raise _Malformed("invalid argument: value too large to convert to float")
    return value


def c_memo_index(line: bytes) -> int:
    """A PUT/GET memo index: ``PyLong_FromString(s, NULL, 10)`` of the line."""
    if not line:
        raise _Malformed("pickle data was truncated: empty memo index line")
    return _py_long(_c_string(line), 10)


_FAST_PATH = True  # tests switch it off to use the generic loop as the oracle
_RESUME = True  # tests switch it off to use a fresh walk as the oracle of a resumed one
_MAX_LEARNT = 16_000_000  # streams remembered for a later one to share a prefix with (a 70B optimizer's is a few MB)
_NEAR = 1024  # bytes before a planned snapshot the loop goes opcode by opcode from
_PAUSED = object()  # ``_Walker._loop`` stopped at its limit
_HOLDS_GLOBALS = frozenset({GlobalRef, tuple, list, dict})  # what ``_Walker._passed`` records or looks into
_CONTAINERS = frozenset({tuple, list, dict})
# Above this budget a replayed run's arguments cannot exhaust it (at most 10 + 2 x _MAX_RUN_ITEMS values).
_REPLAY_SLACK = 1024


# What every message of a stream that ran off the end of its bytes starts with: a caller reading a file in growing
# prefixes reads more only then (any other problem, an unknown opcode at byte 0 of a zeroed file, stays with more).
TRUNCATED = "truncated stream"


def ran_off_the_end(problems: tuple[ReadProblem, ...]) -> bool:
    """Whether a walk's ``problems`` say only that its bytes ended early (more bytes may complete the stream)."""
    return bool(problems) and all(p.message.startswith(TRUNCATED) for p in problems)


def walk_pickle(
    data: bytes,
    *,
    limits: Limits = DEFAULT_LIMITS,
    persistent_load: Callable[[PickleValue], PickleValue] | None = None,
    start: int = 0,
    joblib: bool = False,
) -> tuple[PickleFacts | None, tuple[ReadProblem, ...], int]:
    """Walk one pickle stream in ``data`` from ``start`` without executing anything.

    Returns the facts (``None`` only when not a single opcode could be read), the problems met, and the offset
    just after STOP (or where the walk stopped), so callers can walk concatenated pickles. When problems are
    returned, ``facts.value`` is None (the stream did not complete) but ``globals``/``calls`` still list what the
    stream imported and called up to that point.

    ``joblib``: read the stream as ``joblib.load`` does (its ``NumpyUnpickler``): the bytes of each array written
    after a ``joblib.numpy_pickle.NumpyArrayWrapper`` BUILD are data, or a nested pickle for an object array
    (``_joblib_array``). Any other loader reads those bytes as opcodes: a caller passing it also walks the stream
    without it, when the stream names the wrapper.
    """
    size = len(data) - start
    if joblib or not _RESUME or not MIN_BYTES <= size <= _MAX_LEARNT or not _resumable(data, persistent_load):
        walker = _Walker(data, limits, persistent_load, start)
        walker.joblib = joblib
        return _finish(walker)
    key = (start, data[start : start + HEAD])
    stream = STREAMS.get(key)
    if stream is None:
        # The first stream of its kind: nothing walked before shares its values, so they are not looked up for
        # sharing (``pickle_values.shared``, the tensor memo); the next one of its kind registers them for the rest.
        first = _Walker(data, limits, persistent_load, start)
        first.share = False
        out = _finish(first)
        STREAMS.put(key, Stream(data))
        return out
    best: Snapshot | None = None  # the one that goes furthest of those that fit
    for snap in stream.snapshots:
        if (best is None or snap.pos > best.pos) and snap.fits(data, start, limits, persistent_load):
            best = snap
    before = persistent_load.walk_state() if persistent_load is not None and best is not None else None  # type: ignore[attr-defined]
    if best is not None:
        walker = _Walker.from_snapshot(data, limits, persistent_load, start, best)
    else:
        walker = _Walker(data, limits, persistent_load, start)
    # The bytes this stream shares with the last one walked: a snapshot where they end, when it saves more than an
    # early one that fits (streams of another run of the same model may share only a first part)
    common = start + common_prefix(stream.last, data, start)
    if common - start >= MIN_BYTES and common >= (best.pos if best is not None else start) + GAIN:
        walker.plan_snapshot(common)
    try:
        out = _finish(walker)
    except Diverged:  # a resumed walk would change a value other walks share: walk the stream afresh
        if persistent_load is not None:
            persistent_load.walk_restore(before)  # type: ignore[attr-defined]
        return _finish(_Walker(data, limits, persistent_load, start))
    stream.last = data
    if walker.snapshot is not None:
        stream.snapshots = (walker.snapshot, *stream.snapshots)[:SNAPSHOTS]
    return out


def _resumable(data: bytes, load: Callable[[Any], Any] | None) -> bool:
    """Whether a walk of ``data`` with this ``persistent_load`` can be resumed: bytes (kept as they are), and no
    ``persistent_load`` or one whose state a snapshot carries (``pickle_resume.Resumable``)."""
    return type(data) is bytes and (load is None or hasattr(load, "walk_state"))


def _finish(walker: _Walker) -> tuple[PickleFacts | None, tuple[ReadProblem, ...], int]:
    """Run ``walker`` to its end: its facts, problems and where it stopped (``walk_pickle``)."""
    limits = walker.limits
    problem: ReadProblem | None = None
    value: Any = None
    try:
        value = walker.run()
    except _Malformed as exc:
        problem = ReadProblem(exc.kind, f"{exc} (opcode {walker.opname()} at byte {walker.op_pos})")
    except IndexError:
        problem = ReadProblem(
            ProblemKind.MALFORMED_PICKLE, f"stack underflow (opcode {walker.opname()} at byte {walker.op_pos})"
        )
    except (ValueError, OverflowError, struct.error, TypeError) as exc:
        problem = ReadProblem(
            ProblemKind.MALFORMED_PICKLE,
            f"invalid argument: {type(exc).__name__} (opcode {walker.opname()} at byte {walker.op_pos})",
        )
    if walker.count == 0 and problem is not None:
        return None, (problem,), walker.pos
    problems: list[ReadProblem] = []
    if problem is not None:
        problems.append(problem)
        value = None
    else:
        value, too_deep = freeze(value, limits.nesting_depth, walker.seeds, walker.share)
        if too_deep:
            problems.append(
                ReadProblem(ProblemKind.LIMIT, f"value nests deeper than {limits.nesting_depth} levels; cut there")
            )
    calls = walker.calls
    loads = walker.loads
    if loads:
        # called or used some other way too (handed to a call, rebuilt, OBJ/INST): not every call's bytes are known
        if BYTES_LOADER in calls or BYTES_LOADER in walker.rebuilt:
            loads.append(None)
        calls[BYTES_LOADER] = None
    rebuilt = tuple(g for g in walker.rebuilt if g not in calls)
    facts = PickleFacts(
        protocol=walker.protocol,
        value=value,
        globals=tuple(walker.globals),
        calls=(*calls, *rebuilt) if rebuilt else tuple(calls),
        opcodes=walker.count,
        persistent_ids=walker.persistent_ids,
        rebuilt=rebuilt,
        loads=tuple(loads),
    )
    return facts, tuple(problems), walker.pos


class _Walker:
    """The opcode loop and its state (stack, marks, memo, globals seen)."""

    share = True  # whether its values are handed out as the equal ones walked before (``walk_pickle``)

    def __init__(self, data: bytes, limits: Limits, persistent_load: Callable[[Any], Any] | None, start: int) -> None:
        self.data = data
        self.limits = limits
        self.persistent_load = persistent_load
        self.pos = start
        self.op_pos = start
        self.op = -1
        self.count = 0
        self.protocol = 0
        self.globals: dict[GlobalRef, None] = {}  # insertion-ordered set
        self.calls: dict[GlobalRef, None] = {}
        # classes NEWOBJ-ed with no arguments, and BUILDs of such objects: the policy proves these from source, where
        # any other call needs a reviewed entry (``PickleFacts.rebuilt``)
        self.rebuilt: dict[GlobalRef, None] = {}
        self.loads: list[bytes | None] = []  # the literal bytes each REDUCE hands ``BYTES_LOADER`` (not in ``calls``)
        self.persistent_ids = 0
        self._replayed_calls: set[int] = set()  # ids of GlobalRefs already in ``calls`` (kept alive by it)
        self.n = len(data)
        self.stack: list[Any] = []
        self.metastack: list[list[Any]] = []  # the stacks below each open MARK
        self.memo: dict[int, Any] = {}
        self.max_ops = limits.pickle_opcodes
        self.max_memo = limits.pickle_memo_entries
        self.max_marks = limits.nesting_depth
        self.fast = _FAST_PATH
        self.passed_budget = _PASSED_VALUES
        self.joblib = False  # BUILD of joblib's array wrapper reads the array's bytes (``walk_pickle``)
        self.frame_end = 0  # where the last FRAME ends (joblib reads an array's bytes from the file past it)
        self.start = start
        self.limit = self.n  # the loop pauses at the first boundary at or past it (``plan_snapshot``)
        self.handlers = _HANDLERS
        self.plan = -1
        self.fast_saved: bool | None = None
        self.snapshot: Snapshot | None = None
        self.owned: frozenset[int] = frozenset()  # ids of values shared with other walks (``pickle_resume``)
        self.resumed = False
        self.seeds: dict[int, tuple[Any, int]] | None = None

    def opname(self) -> str:
        return _OPNAMES.get(self.op, f"0x{self.op:02x}") if self.op >= 0 else "<none>"

    def _call_target(self, target: Any) -> None:
        if type(target) is GlobalRef:
            self.calls[target] = None
        elif type(target) is Obj:
            if type(target.func) is GlobalRef:
                # A method of an object the stream built (its append/__setitem__/__setstate__) would run.
                self.calls[target.func] = None
            else:
                # The result of a call, a persistent-id object, a buffer: what runs is only known at load time.
                self.calls[UNRESOLVED_CALL] = None
        elif type(target) in (Opaque, TensorRef):
            self.calls[UNRESOLVED_CALL] = None

    def _passed(self, args: Any) -> None:
        """Globals handed to a call as arguments count as called: the callee may call them (copyreg._reconstructor
        calls its ``base``, torch's _rebuild_from_type_v2 its ``func``, functools.partial/map anything).

        Every tuple, list and dict value the arguments hold is looked at, however deep or long; what one walk looks
        at in all is bounded (``_PASSED_VALUES``), and past that bound the walk records ``PAST_BUDGET`` as called:
        what it did not look at is not proved harmless."""
        if type(args) is tuple and _CONTAINERS.isdisjoint(map(type, args)):  # the usual flat argument tuple
            for x in args:
                if type(x) is GlobalRef:
                    self.calls[x] = None
            self.passed_budget -= len(args)
            if self.passed_budget < 0:
                self.calls[PAST_BUDGET] = None
            return
        todo = [args]
        seen: set[int] = set()
        budget = self.passed_budget
        while todo:
            v = todo.pop()
            budget -= 1
            if budget < 0:
                self.calls[PAST_BUDGET] = None
                break
            t = type(v)
            if t is GlobalRef:
                self.calls[v] = None
            elif t is tuple or t is list or t is dict:
                if id(v) in seen:  # shared structure is looked at once per call
                    continue
                seen.add(id(v))
                items = v.values() if t is dict else v
                todo.extend(x for x in items if type(x) in _HOLDS_GLOBALS)
                budget -= len(v)
        self.passed_budget = max(budget, 0)

    def _persid(self, pid: Any) -> Any:
        self.persistent_ids += 1
        if self.persistent_load is None:
            return Obj(None, (pid,))
        if not (type(pid) is tuple and SCALARS.issuperset(map(type, pid))):
            pid, _ = freeze(pid, self.limits.nesting_depth, share=False)
        return self.persistent_load(pid)

    def _replay(self, run: Run, hooks_idx: int, cell: list[Any], func: GlobalRef, memo: dict[int, Any]) -> Any:
        """Apply a parsed tensor run's effects as the generic loop would; returns the tensor it pushes."""
        puts, pid, tail, od, args_idx, result_idx = run[6:]
        memo.update(puts)  # the memo is only read back by later opcodes: the order of stores is invisible
        # The run may come from _RUN_CACHE: its one mutable value, the hooks dict, is made anew for this stream.
        hooks: dict[Any, Any] = {}
        if hooks_idx >= 0:
            memo[hooks_idx] = hooks
        # _persid, inlined (once per tensor)
        self.persistent_ids += 1
        load = self.persistent_load
        if load is None:
            storage: Any = Obj(None, (pid,))
        else:
            if not (type(pid) is tuple and SCALARS.issuperset(map(type, pid))):
                pid, _ = freeze(pid, self.limits.nesting_depth, share=False)
            storage = load(pid)
        # The OrderedDict() REDUCE (its empty argument tuple passes nothing), then the rebuild call. Recorded once:
        # GlobalRefs are interned, so an id check spares hashing them (dataclass hashing is Python code) per tensor.
        seen = self._replayed_calls
        args = (storage, tail[0], tail[1], tail[2], tail[3], hooks)
        if self.passed_budget < _REPLAY_SLACK or type(storage) in _HOLDS_GLOBALS:
            # what the generic loop does, call for call: near the end of the budget the order PAST_BUDGET is
            # recorded in depends on it
            self._passed(())
            self.calls[od] = None
            self._passed(args)
        else:
            if id(od) not in seen:
                self.calls[od] = None
                seen.add(id(od))
            # What ``_passed(args)`` takes off the budget (the other arguments hold no global): the tuple and its 6
            # items, the hooks dict, the stride and its ints, the shape and its ints (once when it is the stride:
            # a 0-d tensor's two ``()``). The walker's state after a run is then the generic loop's, budget
            # included, which a walk resumed from a snapshot relies on (``pickle_resume``).
            size, stride = tail[1], tail[2]
            self.passed_budget -= 10 + len(stride) + (len(size) if size is not stride else 0)
        if id(func) not in seen:
            self.calls[func] = None
            seen.add(id(func))
        last = cell[0]  # one read: another thread may replace it, never half of it
        if last is not None and last[0] is storage and last[1] is func:
            result = last[2]
        else:
            result = _interpret(func, args)
            if type(result) is TensorRef:  # immutable, so it can be shared; an Obj never is
                cell[0] = (storage, func, result)
        if args_idx >= 0:
            memo[args_idx] = args
        if result_idx >= 0:
            memo[result_idx] = result
        return result

    def run(self) -> Any:
        """The opcode loop (``_loop``) until STOP, stopping where a snapshot is planned (``plan_snapshot``)."""
        while True:
            value = self._loop()
            if value is not _PAUSED:
                return value
            self._pause()

    def _loop(self) -> Any:
        """The opcode loop: dispatches each opcode to its handler through a table indexed by the opcode byte.

        A handler returns None, or True to hand control back: STOP (the walk's value is on the stack) or a BINGET of
        ``torch._utils._rebuild_tensor_v2`` that may open a tensor run the fast path replays whole. Returns the
        value at STOP, or ``_PAUSED`` at the first boundary at or past ``limit`` (before the end of the bytes).
        """
        data = self.data
        n = self.n
        limit = self.limit
        handlers = self.handlers
        max_ops = self.max_ops
        count = self.count
        op = self.op
        op_pos = self.op_pos
        try:
            while True:
                pos = self.pos
                if pos >= limit:
                    if pos >= n:  # the problem names the last opcode read
                        raise _Malformed(f"{TRUNCATED}: no STOP opcode")
                    return _PAUSED
                op_pos = pos
                op = data[pos]
                self.pos = pos + 1
                count += 1
                if count > max_ops:
                    raise _Malformed(f"more than {max_ops} opcodes", ProblemKind.LIMIT)
                if handlers[op](self):
                    if op == 0x2E:  # STOP
                        return self.stack[-1]
                    found = parse_run(data, self.pos, self.memo, max_ops - count, self.max_memo - len(self.memo))
                    if found is not None:
                        run = found[0]
                        stack = self.stack
                        try:
                            stack[-1] = self._replay(run, found[1], found[2], stack[-1], self.memo)
                        except BaseException:
                            # Only persistent_load can raise here: leave the walk where the generic loop would be
                            # when it calls it, so the problem names the same opcode and byte.
                            op, op_pos, self.pos, count = 0x51, run[2], run[2] + 1, count + run[3]
                            raise
                        self.pos, count, op, op_pos = run[0], count + run[1], run[4], run[5]
        finally:
            self.count = count
            self.op_pos = op_pos
            self.op = op

    # Snapshots (``pickle_resume``): this walk's state at a boundary, for later streams with the same bytes to there.

    def plan_snapshot(self, end: int) -> None:
        """Take a snapshot at the last opcode boundary at or before ``end`` (the bytes before ``end`` are those of
        other streams): the loop pauses ``_NEAR`` bytes before it, and from there goes opcode by opcode."""
        self.plan = end
        self.limit = max(self.pos, end - _NEAR)

    def _pause(self) -> None:
        self.limit = self.n
        if self.fast_saved is not None:  # went opcode by opcode to the planned boundary
            self.fast, self.fast_saved = self.fast_saved, None
            if self.pos == self.plan:
                self._snap()
            return
        if self.pos > self.plan:  # an opcode (or a tensor run) spans the end of the common bytes
            return
        at = last_boundary(self.data, self.pos, self.plan)
        if at == self.pos:
            self._snap()
            return
        # The tensor fast path would jump over the boundary (the generic loop leaves the same state at each)
        self.plan, self.limit, self.fast_saved, self.fast = at, at, self.fast, False

    def _snap(self) -> None:
        stacks = [*self.metastack, self.stack]
        graph = Graph.of(self.memo, stacks)
        if graph is None:
            return
        state = (
            self.count, self.op, self.op_pos, self.protocol, dict(self.globals), dict(self.calls), dict(self.rebuilt),
            list(self.loads), self.persistent_ids, set(self._replayed_calls), self.passed_budget, self.frame_end,
        )  # fmt: skip
        prefix = self.data[self.start : max(self.pos, self.frame_end)]
        self.snapshot = Snapshot(prefix, self.pos, self.limits, self.persistent_load, state, self.memo, stacks, graph)
        # From here on, a change to a value the snapshot shares drops it (or, in a resumed walk, one shared with the
        # snapshot it resumed from: stops it)
        self.owned = self.owned | graph.owned
        self.handlers = _GUARDED

    @classmethod
    def from_snapshot(
        cls, data: bytes, limits: Limits, load: Callable[[Any], Any] | None, start: int, snap: Snapshot
    ) -> _Walker:
        """A walker of ``data`` in ``snap``'s state (``snap.fits`` it), its ``persistent_load`` given the state
        it had there."""
        w = cls(data, limits, load, start)
        (w.count, w.op, w.op_pos, w.protocol, globals_, calls, rebuilt, loads, w.persistent_ids, replayed,
         w.passed_budget, w.frame_end) = snap.state  # fmt: skip
        w.globals, w.calls, w.rebuilt = dict(globals_), dict(calls), dict(rebuilt)
        w.loads, w._replayed_calls = list(loads), set(replayed)
        w.memo, stacks = snap.values()
        w.stack = stacks.pop()
        w.metastack = stacks
        w.pos = snap.pos
        w.owned, w.seeds, w.resumed, w.handlers = snap.graph.owned, snap.graph.seeds, True, _GUARDED
        if load is not None:
            load.walk_restore(snap.load_state)  # type: ignore[attr-defined]
        return w

    def _touch(self) -> None:
        """A value shared with other walks (``owned``) is about to change."""
        if self.resumed:
            raise Diverged
        self.snapshot = None
        self.owned = frozenset()

    def _guard_marked(self) -> None:
        """SETITEMS, APPENDS and ADDITEMS change the value below their MARK."""
        below = self.metastack[-1] if self.metastack else None
        if below and id(below[-1]) in self.owned:
            self._touch()

    def _guarded_setitems(self) -> None:
        self._guard_marked()
        self._op_setitems()

    def _guarded_appends(self) -> None:
        self._guard_marked()
        self._op_appends()

    def _guarded_additems(self) -> None:
        self._guard_marked()
        self._op_additems()

    def _guarded_setitem(self) -> None:
        stack = self.stack
        if len(stack) >= 3 and id(stack[-3]) in self.owned:
            self._touch()
        self._op_setitem()

    def _guarded_append(self) -> None:
        stack = self.stack
        if len(stack) >= 2 and id(stack[-2]) in self.owned:
            self._touch()
        self._op_append()

    def _guarded_build(self) -> None:
        stack = self.stack
        if len(stack) >= 2:
            inst = stack[-2]
            if type(inst) is Obj and (id(inst) in self.owned or id(inst.state) in self.owned):
                self._touch()
        self._op_build()

    # Argument readers: each moves ``pos`` past what it read before anything that can fail after it, so a problem
    # reports the byte the walk stopped at.

    def _line(self) -> bytes:
        data = self.data
        pos = self.pos
        end = data.find(b"\n", pos)
        if end < 0:
            raise _Malformed(f"{TRUNCATED}: line argument has no newline")
        self.pos = end + 1
        return data[pos:end]

    def _take(self, k: int) -> bytes:
        if k < 0:
            raise _Malformed(f"negative length {k}")
        pos = self.pos
        if pos + k > self.n:
            raise _Malformed(f"{TRUNCATED}: needs {k} bytes, {self.n - pos} left")
        self.pos = pos + k
        return self.data[pos : pos + k]

    def _peek_byte(self) -> int:
        """A one-byte argument, left unread: BINPUT/BINGET move past it only once its memo access succeeded."""
        pos = self.pos
        if pos >= self.n:
            raise _Malformed(TRUNCATED)
        return self.data[pos]

    def _byte(self) -> int:
        pos = self.pos
        if pos >= self.n:
            raise _Malformed(TRUNCATED)
        self.pos = pos + 1
        return self.data[pos]

    def _pop_mark(self) -> list[Any]:
        if not self.metastack:
            raise _Malformed("no MARK to pop")
        items = self.stack
        self.stack = self.metastack.pop()
        return items

    def _memo_put(self, idx: int) -> None:
        stack = self.stack
        if not stack:
            raise _Malformed("memo store with an empty stack")
        memo = self.memo
        memo[idx] = stack[-1]
        if len(memo) > self.max_memo:
            raise _Malformed(f"more than {self.max_memo} memo entries", ProblemKind.LIMIT)

    def _memo_get(self, idx: int) -> None:
        try:
            self.stack.append(self.memo[idx])
        except KeyError:
            raise _Malformed(f"memo miss: index {idx} was never stored") from None

    # Constants: each pushes the value of its argument.

    def _op_none(self) -> None:
        self.stack.append(None)

    def _op_newtrue(self) -> None:
        self.stack.append(True)

    def _op_newfalse(self) -> None:
        self.stack.append(False)

    def _op_binint1(self) -> None:
        pos = self.pos  # _peek_byte, inlined: a state dict's integer keys
        if pos >= self.n:
            raise _Malformed(TRUNCATED)
        self.stack.append(self.data[pos])
        self.pos = pos + 1

    def _op_binint(self) -> None:
        self.stack.append(_unpack_i4(self._take(4))[0])

    def _op_binint2(self) -> None:
        self.stack.append(_unpack_u2(self._take(2))[0])

    def _op_binfloat(self) -> None:
        self.stack.append(_unpack_f8(self._take(8))[0])

    def _op_long1(self) -> None:
        k = self._byte()
        self.stack.append(int.from_bytes(self._take(k), "little", signed=True))

    def _op_long4(self) -> None:
        self.stack.append(int.from_bytes(self._take(_unpack_i4(self._take(4))[0]), "little", signed=True))

    def _op_int(self) -> None:
        self.stack.append(c_load_int(self._line()))

    def _op_long(self) -> None:
        self.stack.append(c_load_long(self._line()))

    def _op_float(self) -> None:
        self.stack.append(c_load_float(self._line()))

    def _op_binunicode(self) -> None:
        data = self.data
        pos = self.pos
        n = self.n
        if pos + 4 > n:
            raise _Malformed(TRUNCATED)
        end = pos + 4 + _unpack_u4(data, pos)[0]
        if end > n:
            raise _Malformed(f"{TRUNCATED}: string ends at byte {end}, stream has {n}")
        self.stack.append(data[pos + 4 : end].decode("utf-8", "surrogatepass"))
        self.pos = end

    def _op_short_binunicode(self) -> None:
        k = self._byte()
        self.stack.append(self._take(k).decode("utf-8", "surrogatepass"))

    def _op_binunicode8(self) -> None:
        self.stack.append(self._take(_unpack_u8(self._take(8))[0]).decode("utf-8", "surrogatepass"))

    def _op_unicode(self) -> None:
        self.stack.append(self._line().decode("raw-unicode-escape"))

    def _op_string(self) -> None:
        raw = self._line()  # _pickle.c load_string: quoted exactly, no whitespace around the quotes
        if len(raw) < 2 or raw[0] != raw[-1] or raw[:1] not in (b'"', b"'"):
            raise _Malformed("STRING argument is not quoted")
        self.stack.append(_decode_str(codecs.escape_decode(raw[1:-1])[0]))

    def _op_binstring(self) -> None:
        self.stack.append(_decode_str(self._take(_unpack_i4(self._take(4))[0])))

    def _op_short_binstring(self) -> None:
        k = self._byte()
        self.stack.append(_decode_str(self._take(k)))

    def _op_binbytes(self) -> None:
        self.stack.append(self._take(_unpack_u4(self._take(4))[0]))

    def _op_short_binbytes(self) -> None:
        k = self._byte()
        self.stack.append(self._take(k))

    def _op_binbytes8(self) -> None:  # also BYTEARRAY8, kept as bytes
        self.stack.append(self._take(_unpack_u8(self._take(8))[0]))

    def _op_next_buffer(self) -> None:
        self.stack.append(OUT_OF_BAND)

    def _op_readonly_buffer(self) -> None:
        if not self.stack:  # the buffer itself stays opaque
            raise _Malformed("READONLY_BUFFER with an empty stack")

    # Memo, marks and the stack.

    def _op_binput(self) -> None:
        pos = self.pos  # _peek_byte, inlined: the second most frequent opcode
        if pos >= self.n:
            raise _Malformed(TRUNCATED)
        self._memo_put(self.data[pos])
        self.pos = pos + 1

    def _op_long_binput(self) -> None:
        self._memo_put(_unpack_u4(self._take(4))[0])

    def _op_put(self) -> None:
        idx = c_memo_index(self._line())
        if idx < 0:
            raise _Malformed("negative PUT argument")
        self._memo_put(idx)

    def _op_memoize(self) -> None:
        self._memo_put(len(self.memo))

    def _op_binget(self) -> bool:
        # _peek_byte and _memo_get in one: the most frequent opcode of a torch pickle (a tensor's rebuild global
        # and a state dict's repeated keys are memo reads).
        pos = self.pos
        if pos >= self.n:
            raise _Malformed(TRUNCATED)
        idx = self.data[pos]
        try:
            top = self.memo[idx]
        except KeyError:
            raise _Malformed(f"memo miss: index {idx} was never stored") from None
        self.stack.append(top)
        self.pos = pos + 1
        # the key strings a state dict repeats are memo reads too: only a rebuild global asks the full question
        return type(top) is GlobalRef and top.name == "_rebuild_tensor_v2" and self._may_open_run()

    def _op_long_binget(self) -> bool:
        self._memo_get(_unpack_u4(self._take(4))[0])
        return self._may_open_run()

    def _may_open_run(self) -> bool:
        """Whether the global just read back is the tensor rebuild that opens a run the fast path can replay."""
        top = self.stack[-1]
        return (
            type(top) is GlobalRef
            and top.name == "_rebuild_tensor_v2"
            and top.module == "torch._utils"
            and self.fast
            and len(self.metastack) + 2 <= self.max_marks
        )

    def _op_get(self) -> None:
        self._memo_get(c_memo_index(self._line()))

    def _op_mark(self) -> None:
        metastack = self.metastack
        if len(metastack) >= self.max_marks:
            raise _Malformed(f"more than {self.max_marks} nested MARKs", ProblemKind.LIMIT)
        metastack.append(self.stack)
        self.stack = []

    def _op_pop(self) -> None:
        if self.stack:
            self.stack.pop()
        else:
            self._pop_mark()

    def _op_pop_mark(self) -> None:
        self._pop_mark()

    def _op_dup(self) -> None:
        stack = self.stack
        stack.append(stack[-1])

    # Containers: tuples, lists, dicts and sets, built empty or from the items above a MARK, then filled.

    def _op_empty_tuple(self) -> None:
        self.stack.append(())

    def _op_tuple(self) -> None:
        t = tuple(self._pop_mark())
        self.stack.append(t)

    def _op_tuple1(self) -> None:
        stack = self.stack
        stack[-1] = (stack[-1],)

    def _op_tuple2(self) -> None:
        stack = self.stack
        b = stack.pop()
        stack[-1] = (stack[-1], b)

    def _op_tuple3(self) -> None:
        stack = self.stack
        c = stack.pop()
        b = stack.pop()
        stack[-1] = (stack[-1], b, c)

    def _op_empty_list(self) -> None:
        self.stack.append([])

    def _op_list(self) -> None:
        items = self._pop_mark()  # pop first: it rebinds ``stack``
        self.stack.append(items)

    def _op_empty_dict(self) -> None:
        self.stack.append({})

    def _op_dict(self) -> None:
        items = self._pop_mark()
        if len(items) % 2:
            raise _Malformed("DICT with an odd number of items")
        d: dict[Any, Any] = {}
        for i in range(0, len(items), 2):
            k = items[i]
            d[k if type(k) in SCALARS else Key(k)] = items[i + 1]
        self.stack.append(d)

    def _op_empty_set(self) -> None:
        self.stack.append(SetNode([], False))

    def _op_frozenset(self) -> None:
        items = self._pop_mark()
        self.stack.append(SetNode(items, True))

    def _op_setitems(self) -> None:
        items = self._pop_mark()
        target = self.stack[-1]
        if len(items) % 2:
            raise _Malformed("SETITEMS with an odd number of items")
        if type(target) is dict:
            scalars = SCALARS
            for i in range(0, len(items), 2):
                k = items[i]
                target[k if type(k) in scalars else Key(k)] = items[i + 1]
        else:
            self._set_on_non_container(target, "SETITEMS")

    def _op_setitem(self) -> None:
        stack = self.stack
        v = stack.pop()
        k = stack.pop()
        target = stack[-1]
        if type(target) is dict:
            target[k if type(k) in SCALARS else Key(k)] = v
        else:
            self._set_on_non_container(target, "SETITEM")

    def _op_appends(self) -> None:
        items = self._pop_mark()
        target = self.stack[-1]
        if type(target) is list:
            target.extend(items)
        else:
            self._set_on_non_container(target, "APPENDS")

    def _op_append(self) -> None:
        stack = self.stack
        v = stack.pop()
        target = stack[-1]
        if type(target) is list:
            target.append(v)
        else:
            self._set_on_non_container(target, "APPEND")

    def _op_additems(self) -> None:
        items = self._pop_mark()
        target = self.stack[-1]
        if type(target) is SetNode and not target.frozen:
            target.items.extend(items)
        else:
            self._set_on_non_container(target, "ADDITEMS")

    # Globals and calls: what loading would import, and what it would call.

    def _line_global(self) -> GlobalRef:
        """The global named by the two text lines of GLOBAL and INST, recorded as imported."""
        raw_mod = self._line()
        raw_name = self._line()
        if not raw_mod or not raw_name:  # _pickle.c load_global/load_inst: bad_readline
            raise _Malformed("pickle data was truncated: empty GLOBAL/INST line")
        mod = raw_mod.decode("utf-8")
        name = raw_name.decode("utf-8")
        ref = _global(mod, name, self.protocol)
        self.globals[ref] = None
        return ref

    def _op_global(self) -> None:
        self.stack.append(self._line_global())

    def _op_stack_global(self) -> None:
        stack = self.stack
        name_v = stack.pop()
        mod_v = stack.pop()
        # A name computed by a call (str.join ...) is a string only at load time: keep it unresolved.
        ref = _global(
            mod_v if type(mod_v) is str else "<dynamic>",
            name_v if type(name_v) is str else "<dynamic>",
            self.protocol,
        )
        self.globals[ref] = None
        stack.append(ref)

    def _op_ext(self) -> None:  # EXT1 / EXT2 / EXT4
        op = self.data[self.pos - 1]
        if op == 0x82:
            code = self._take(1)[0]
        elif op == 0x83:
            code = _unpack_u2(self._take(2))[0]
        else:
            code = _unpack_i4(self._take(4))[0]
        if code <= 0:
            raise _Malformed(f"extension code {code} <= 0")
        # The copyreg extension registry is process state: never look it up, keep it unresolved.
        ref = GlobalRef("<extension>", str(code))
        self.globals[ref] = None
        self.stack.append(ref)

    def _op_reduce(self) -> None:
        stack = self.stack
        args = stack.pop()
        func = stack[-1]
        self._passed(args)
        if type(func) is GlobalRef:
            if func.name == "_load_from_bytes" and func == BYTES_LOADER and _one_bytes(args):
                self.loads.append(args[0])  # ``_finish`` records the call
            else:
                self.calls[func] = None
            stack[-1] = _interpret(func, args, self.share) if type(args) is tuple else Obj(func, args)
        else:
            self._call_target(func)
            stack[-1] = Obj(None, (func, args))

    def _op_build(self) -> None:
        stack = self.stack
        state = stack.pop()
        inst = stack[-1]
        if type(inst) is Obj:
            # A slot state (``(state, slotstate)``) is applied with ``setattr``: a property's setter runs, and
            # ``__class__`` swaps the object's type. Only a ``__dict__`` update (or ``__setstate__``, which the
            # policy proves absent) leaves a NEWOBJ() object plain data.
            slots = type(state) is tuple and len(state) == 2 and state[1] is not None
            if slots:
                self._passed(state[1])
                attrs = state[1]
                if type(attrs) is not dict or any(type(k) is not str or k[:2] == k[-2:] == "__" for k in attrs):
                    # ``setattr(obj, "__class__", cls)`` swaps the type (an audited ``object.__setattr__``): no
                    # longer the object the stream named, whatever its class
                    self.calls[UNRESOLVED_CALL] = None
            if inst.new and inst.args == () and type(inst.func) is GlobalRef and not slots:
                self.rebuilt[inst.func] = None  # ``__setstate__`` or a ``__dict__`` update of a NEWOBJ() object
            else:
                self._call_target(inst)
            if type(inst.state) is dict and type(state) is dict:
                inst.state.update(state)
            else:
                inst.state = state
            if self.joblib and inst.func == JOBLIB_WRAPPER:
                self._joblib_array(inst)
        elif type(inst) is GlobalRef:
            self.calls[inst] = None
        # BUILD on a dict (torch's ``_metadata`` on state dicts) sets attributes, not items: the value stays the
        # plain dict.

    def _joblib_array(self, wrapper: Obj) -> None:
        """Step over the array ``joblib.load`` reads right after a BUILD of its array wrapper, as its
        ``NumpyUnpickler.load_build`` and ``NumpyArrayWrapper.read_array`` read it (joblib/numpy_pickle.py): for an
        object dtype a nested pickle, loaded by a fresh unpickler (walked here as the pickle it is; what it imports
        and calls counts for this stream); else a padding-length byte and that many bytes (when the state has a
        ``numpy_array_alignment_bytes`` that is not None), then shape x itemsize bytes of data. The bytes are read
        from the file past the current frame, so a BUILD that does not end its frame is not followed. Whatever the
        walk cannot size exactly as numpy would is a problem, never a guess."""
        state = wrapper.state
        if self.pos < self.frame_end:
            raise _Malformed("joblib array wrapper built inside a frame: joblib.load reads its array past the frame")
        if type(state) is not dict:
            raise _Malformed("joblib array wrapper whose state is no dict: its array cannot be sized")
        shape: Any = state.get("shape")
        dtype = _np_dtype(state.get("dtype"))
        if dtype is None:
            raise _Malformed("joblib array wrapper whose dtype the walk cannot size as numpy does")
        itemsize, hasobject = dtype
        mmap = state.get("allow_mmap")
        if hasobject and not (mmap is None or mmap is False):
            # ``joblib.load(mmap_mode=...)`` memory-maps such an array (``read_mmap``: shape x itemsize bytes) where
            # the default load unpickles it: two readings, and ``joblib.dump`` never allows mmap for objects
            raise _Malformed("joblib object array that allows mmap: joblib.load reads it two ways")
        if hasobject:
            nested = _Walker(self.data, self.limits, None, self.pos)
            facts, problems, end = _finish(nested)
            if facts is None or problems:
                why = problems[0].message if problems else "no opcode"
                raise _Malformed(f"joblib object array's nested pickle: {why}",
                                 problems[0].kind if problems else ProblemKind.MALFORMED_PICKLE)  # fmt: skip
            self.globals.update(dict.fromkeys(facts.globals))
            self.calls.update(dict.fromkeys(g for g in facts.calls if g not in facts.rebuilt))
            self.rebuilt.update(dict.fromkeys(facts.rebuilt))
            self.persistent_ids += facts.persistent_ids
            # the nested unpickler read its last frame whole, even past its STOP
            self.pos = max(end, nested.frame_end)
            self.stack[-1] = Obj(None, (wrapper, facts.value))  # the array: what it is built from, not a wrapper
            return
        if type(shape) not in (tuple, list) or not _INT_ONLY.issuperset(map(type, shape)) or min(shape, default=0) < 0:
            raise _Malformed("joblib array wrapper whose shape is not a tuple of counts")
        count = 1
        for d in shape:
            count *= d
        if state.get("numpy_array_alignment_bytes") is not None:  # ``safe_get_numpy_array_alignment_bytes``
            self.pos += 1 + self._peek_byte()
        self._take(count * itemsize)  # raises past the end: joblib reads exactly these bytes
        self.stack[-1] = Obj(None, (wrapper, None))

    def _op_newobj(self) -> None:
        stack = self.stack
        args = stack.pop()
        cls = stack.pop()
        if args == () and type(cls) is GlobalRef:
            self.rebuilt[cls] = None  # ``cls.__new__(cls)``: no argument reaches its code
        else:
            self._call_target(cls)
            self._passed(args)
        stack.append(Obj(cls, args, new=True) if type(cls) is GlobalRef else Obj(None, (cls, args)))

    def _op_newobj_ex(self) -> None:
        stack = self.stack
        kwargs = stack.pop()
        args = stack.pop()
        cls = stack.pop()
        self._call_target(cls)
        self._passed((args, kwargs))
        if type(cls) is GlobalRef:
            stack.append(Obj(cls, (args, kwargs), new=True))
        else:
            stack.append(Obj(None, (cls, (args, kwargs))))

    def _op_inst(self) -> None:
        ref = self._line_global()
        self.calls[ref] = None
        items = self._pop_mark()
        self._passed(items)
        self.stack.append(Obj(ref, tuple(items)))

    def _op_obj(self) -> None:
        items = self._pop_mark()
        if not items:
            raise _Malformed("OBJ without a class")
        cls = items[0]
        self._call_target(cls)
        self._passed(items[1:])
        if type(cls) is GlobalRef:
            self.stack.append(Obj(cls, tuple(items[1:])))
        else:
            self.stack.append(Obj(None, (cls, tuple(items[1:]))))

    # Persistent ids: references to data outside the stream (torch's storages).

    def _op_binpersid(self) -> None:
        stack = self.stack
        stack[-1] = self._persid(stack[-1])

    def _op_persid(self) -> None:
        self.stack.append(self._persid(self._line().decode("ascii")))

    # Framing, protocol and the end of the stream.

    def _op_proto(self) -> None:
        proto = self._byte()
        if proto > 5:
            raise _Malformed(f"unsupported pickle protocol {proto}")
        self.protocol = proto

    def _op_frame(self) -> None:
        # Frames only group opcodes for buffered reads; the opcodes inside are walked as usual.
        frame_len = _unpack_u8(self._take(8))[0]
        pos = self.pos
        if frame_len > self.n - pos:
            raise _Malformed(f"{TRUNCATED}: frame of {frame_len} bytes, {self.n - pos} left")
        _check_frame(self.data, pos, pos + frame_len)
        self.frame_end = pos + frame_len

    def _op_stop(self) -> bool:
        if not self.stack:
            raise _Malformed("STOP with an empty stack")
        return True

    def _op_unknown(self) -> None:
        raise _Malformed(f"unknown opcode 0x{self.data[self.pos - 1]:02x}")

    def _set_on_non_container(self, target: Any, opname: str) -> None:
        """APPEND/SETITEM/ADDITEMS on something that is not the matching container."""
        if type(target) in (Obj, GlobalRef):
            # The real unpickler would call the object's own append/extend/__setitem__/add.
            self._call_target(target)
            return
        raise _Malformed(f"{opname} on a {type(target).__name__}")


# The handler of each opcode byte, indexed by the byte: one list lookup per opcode, shared by every walker.
_HANDLER_NAMES = {
    0x4E: "_op_none", 0x88: "_op_newtrue", 0x89: "_op_newfalse", 0x4B: "_op_binint1", 0x4A: "_op_binint",
    0x4D: "_op_binint2", 0x47: "_op_binfloat", 0x8A: "_op_long1", 0x8B: "_op_long4", 0x49: "_op_int",
    0x4C: "_op_long", 0x46: "_op_float", 0x58: "_op_binunicode", 0x8C: "_op_short_binunicode",
    0x8D: "_op_binunicode8", 0x56: "_op_unicode", 0x53: "_op_string", 0x54: "_op_binstring",
    0x55: "_op_short_binstring", 0x42: "_op_binbytes", 0x43: "_op_short_binbytes", 0x8E: "_op_binbytes8",
    0x96: "_op_binbytes8", 0x97: "_op_next_buffer", 0x98: "_op_readonly_buffer",
    0x71: "_op_binput", 0x72: "_op_long_binput", 0x70: "_op_put", 0x94: "_op_memoize", 0x68: "_op_binget",
    0x6A: "_op_long_binget", 0x67: "_op_get", 0x28: "_op_mark", 0x30: "_op_pop", 0x31: "_op_pop_mark",
    0x32: "_op_dup",
    0x29: "_op_empty_tuple", 0x74: "_op_tuple", 0x85: "_op_tuple1", 0x86: "_op_tuple2", 0x87: "_op_tuple3",
    0x5D: "_op_empty_list", 0x6C: "_op_list", 0x7D: "_op_empty_dict", 0x64: "_op_dict", 0x8F: "_op_empty_set",
    0x91: "_op_frozenset", 0x75: "_op_setitems", 0x73: "_op_setitem", 0x65: "_op_appends", 0x61: "_op_append",
    0x90: "_op_additems",
    0x63: "_op_global", 0x93: "_op_stack_global", 0x82: "_op_ext", 0x83: "_op_ext", 0x84: "_op_ext",
    0x52: "_op_reduce", 0x62: "_op_build", 0x81: "_op_newobj", 0x92: "_op_newobj_ex", 0x69: "_op_inst",
    0x6F: "_op_obj",
    0x51: "_op_binpersid", 0x50: "_op_persid",
    0x80: "_op_proto", 0x95: "_op_frame", 0x2E: "_op_stop",
}  # fmt: skip
_HANDLERS: list[Callable[[_Walker], bool | None]] = [
    getattr(_Walker, _HANDLER_NAMES.get(byte, "_op_unknown")) for byte in range(256)
]
assert _HANDLER_NAMES.keys() == _OPNAMES.keys()  # every opcode the walk names has its handler
# The same, guarding the opcodes that change a value in place: used once values are shared with other walks.
_GUARDED: list[Callable[[_Walker], bool | None]] = list(_HANDLERS)
for _byte, _name in ((0x75, "setitems"), (0x73, "setitem"), (0x65, "appends"), (0x61, "append"),
                     (0x90, "additems"), (0x62, "build")):  # fmt: skip
    _GUARDED[_byte] = getattr(_Walker, f"_guarded_{_name}")


def merge_pickles(main: PickleFacts | None, extra: list[PickleFacts]) -> PickleFacts | None:
    """``main`` with the globals and calls of the ``extra`` streams found in the same file added.

    The value stays ``main``'s (None when there is no main stream): rules that judge what loading the file could
    run see every stream; rules that read the value see the one the loader returns. Every stream, each with its own
    value, is kept in ``streams`` (main first): the judge reads each one's values, for the pickles nested in them and
    the globals handed to its calls.
    """
    if not extra:
        return main
    streams = (*(_parts(main) if main is not None else ()), *itertools.chain.from_iterable(map(_parts, extra)))
    base = main if main is not None else PickleFacts(extra[0].protocol, None, (), (), 0)
    globals_ = dict.fromkeys(base.globals)
    calls = dict.fromkeys(base.calls)
    rebuilt = dict.fromkeys(base.rebuilt)
    called = {g for g in base.calls if g not in rebuilt}  # called some other way in some stream
    opcodes, pids = base.opcodes, base.persistent_ids
    for e in extra:
        globals_.update(dict.fromkeys(e.globals))
        calls.update(dict.fromkeys(e.calls))
        rebuilt.update(dict.fromkeys(e.rebuilt))
        called.update(g for g in e.calls if g not in e.rebuilt)
        opcodes += e.opcodes
        pids += e.persistent_ids
    only_rebuilt = tuple(g for g in rebuilt if g not in called)
    return replace(base, globals=tuple(globals_), calls=tuple(calls), opcodes=opcodes, persistent_ids=pids,
                   rebuilt=only_rebuilt, loads=(), streams=streams, nested=None, unsearched=())  # fmt: skip


def _parts(pf: PickleFacts) -> tuple[PickleFacts, ...]:
    """The streams ``pf`` stands for: those it was merged from, or itself."""
    return pf.streams or (pf,)
