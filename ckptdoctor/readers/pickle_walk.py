"""A static pickle walker: rebuilds plain values from a pickle stream opcode by opcode, never executing it."""

from __future__ import annotations

import codecs
import struct

# _compat_pickle is the stdlib's table of Python 2 names (``__builtin__.eval`` -> ``builtins.eval``). The real
# unpickler applies it to every global of a protocol < 3 stream, so we record the name it would really import.
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import GlobalRef, Opaque, PickleFacts, PickleValue, ProblemKind, ReadProblem, TensorRef
from ckptdoctor.readers.pickle_runs import _parse_run, _Run
from ckptdoctor.readers.pickle_values import (
    _SCALARS,
    CYCLE,
    OUT_OF_BAND,
    TOO_DEEP,
    _freeze,
    _Key,
    _Obj,
    _SetNode,
    iter_values,
)

__all__ = ["CYCLE", "TOO_DEEP", "UNRESOLVED_CALL", "iter_values", "merge_pickles", "walk_pickle"]


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

# Callee stand-ins recorded in ``calls`` when the unpickler would call something that is not a named global: the
# result of another call, a persistent-id object, an out-of-band buffer. Any module in angle brackets is unresolved.
UNRESOLVED_CALL = GlobalRef("<unresolved>", "<call of a computed object>")

_REBUILD_TENSOR = frozenset({"_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3"})
_REBUILD_PARAM = frozenset({"_rebuild_parameter", "_rebuild_parameter_with_state"})


_INT_ONLY = frozenset({int})


def _is_int_tuple(v: Any) -> bool:
    return type(v) is tuple and _INT_ONLY.issuperset(map(type, v))


def _interpret(func: GlobalRef, args: tuple[Any, ...]) -> Any:
    """The value of a call to a known-harmless reconstructor, or an ``_Obj`` when we do not interpret it."""
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
                        return _Obj(func, args)
                    dtype = TORCH_DTYPES[dt.name]
                return TensorRef(
                    dtype, size, stride, offset, storage.storage_key, storage.storage_numel, storage.location,
                    storage.storage_nbytes,
                )  # fmt: skip
        elif name in _REBUILD_PARAM and n >= 1 and type(args[0]) is TensorRef:
            return args[0]
    elif mod == "collections" and name == "OrderedDict":
        if n == 0:
            return {}
        if n == 1 and type(args[0]) is list and all(type(p) in (tuple, list) and len(p) == 2 for p in args[0]):
            d: dict[Any, Any] = {}
            for k, v in args[0]:
                d[k if type(k) in _SCALARS else _Key(k)] = v
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
                return _Obj(func, args)
    elif mod == "builtins":
        if name in ("set", "frozenset") and (n == 0 or (n == 1 and type(args[0]) in (list, tuple))):
            return _SetNode(list(args[0]) if n else [], name == "frozenset")
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
    return _Obj(func, args)


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


_FAST_PATH = True  # tests switch it off to use the generic loop as the oracle
_HOLDS_GLOBALS = frozenset({GlobalRef, tuple, list, dict})  # what ``_Walker._passed`` records or looks into


def walk_pickle(
    data: bytes,
    *,
    limits: Limits = DEFAULT_LIMITS,
    persistent_load: Callable[[PickleValue], PickleValue] | None = None,
    start: int = 0,
) -> tuple[PickleFacts | None, tuple[ReadProblem, ...], int]:
    """Walk one pickle stream in ``data`` from ``start`` without executing anything.

    Returns the facts (``None`` only when not a single opcode could be read), the problems met, and the offset
    just after STOP (or where the walk stopped), so callers can walk concatenated pickles. When problems are
    returned, ``facts.value`` is None (the stream did not complete) but ``globals``/``calls`` still list what the
    stream imported and called up to that point.
    """
    walker = _Walker(data, limits, persistent_load, start)
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
        value, too_deep = _freeze(value, limits.nesting_depth)
        if too_deep:
            problems.append(
                ReadProblem(ProblemKind.LIMIT, f"value nests deeper than {limits.nesting_depth} levels; cut there")
            )
    facts = PickleFacts(
        protocol=walker.protocol,
        value=value,
        globals=tuple(walker.globals),
        calls=tuple(walker.calls),
        opcodes=walker.count,
        persistent_ids=walker.persistent_ids,
    )
    return facts, tuple(problems), walker.pos


class _Walker:
    """The opcode loop and its state (stack, marks, memo, globals seen)."""

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
        self.persistent_ids = 0
        self._replayed_calls: set[int] = set()  # ids of GlobalRefs already in ``calls`` (kept alive by it)

    def opname(self) -> str:
        return _OPNAMES.get(self.op, f"0x{self.op:02x}") if self.op >= 0 else "<none>"

    def _call_target(self, target: Any) -> None:
        if type(target) is GlobalRef:
            self.calls[target] = None
        elif type(target) is _Obj:
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
        calls its ``base``, torch's _rebuild_from_type_v2 its ``func``, functools.partial/map anything)."""
        todo = [(args, 0)]
        seen = 0
        while todo:
            v, depth = todo.pop()
            seen += 1
            if seen > 256:  # arguments are shallow in real files; a huge literal is not worth more
                return
            t = type(v)
            if t is GlobalRef:
                self.calls[v] = None
            elif (t is tuple or t is list) and depth < 3:
                todo.extend((x, depth + 1) for x in v[:64])
            elif t is dict and depth < 3:
                todo.extend((x, depth + 1) for x in list(v.values())[:64])

    def _persid(self, pid: Any) -> Any:
        self.persistent_ids += 1
        if self.persistent_load is None:
            return _Obj(None, (pid,))
        if not (type(pid) is tuple and _SCALARS.issuperset(map(type, pid))):
            pid, _ = _freeze(pid, self.limits.nesting_depth)
        return self.persistent_load(pid)

    def _replay(self, run: _Run, hooks_idx: int, cell: list[Any], func: GlobalRef, memo: dict[int, Any]) -> Any:
        """Apply a parsed tensor run's effects as the generic loop would; returns the tensor it pushes."""
        puts, pid, tail, od, args_idx, result_idx = run[6:]
        memo.update(puts)  # the memo is only read back by later opcodes: the order of stores is invisible
        # The run may come from _RUN_CACHE: its one mutable value, the hooks dict, is made anew for this stream.
        hooks: dict[Any, Any] = {}
        if hooks_idx >= 0:
            memo[hooks_idx] = hooks
        storage = self._persid(pid)
        # The OrderedDict() REDUCE (its empty argument tuple passes nothing), then the rebuild call. Recorded once:
        # GlobalRefs are interned, so an id check spares hashing them (dataclass hashing is Python code) per tensor.
        seen = self._replayed_calls
        if id(od) not in seen:
            self.calls[od] = None
            seen.add(id(od))
        args = (storage, tail[0], tail[1], tail[2], tail[3], hooks)
        if type(storage) in _HOLDS_GLOBALS:  # the other arguments are ints, int tuples, a bool and an empty dict
            self._passed(args)
        if id(func) not in seen:
            self.calls[func] = None
            seen.add(id(func))
        last = cell[0]  # one read: another thread may replace it, never half of it
        if last is not None and last[0] is storage and last[1] is func:
            result = last[2]
        else:
            result = _interpret(func, args)
            if type(result) is TensorRef:  # immutable, so it can be shared; an _Obj never is
                cell[0] = (storage, func, result)
        if args_idx >= 0:
            memo[args_idx] = args
        if result_idx >= 0:
            memo[result_idx] = result
        return result

    def run(self) -> Any:
        """The opcode loop: one flat if-chain (the fastest dispatch in CPython), most frequent opcodes first."""
        data = self.data
        n = len(data)
        pos = self.pos
        stack: list[Any] = []
        metastack: list[list[Any]] = []
        memo: dict[int, Any] = {}
        append = stack.append
        max_ops = self.limits.pickle_opcodes
        max_memo = self.limits.pickle_memo_entries
        max_marks = self.limits.nesting_depth
        count = 0
        op = -1
        op_pos = pos
        globals_ = self.globals
        scalars = _SCALARS
        fast = _FAST_PATH

        def line() -> bytes:
            nonlocal pos
            end = data.find(b"\n", pos)
            if end < 0:
                raise _Malformed("truncated stream: line argument has no newline")
            raw = data[pos:end]
            pos = end + 1
            return raw

        def take(k: int) -> bytes:
            nonlocal pos
            if k < 0:
                raise _Malformed(f"negative length {k}")
            if pos + k > n:
                raise _Malformed(f"truncated stream: needs {k} bytes, {n - pos} left")
            raw = data[pos : pos + k]
            pos += k
            return raw

        def pop_mark() -> list[Any]:
            nonlocal stack, append
            if not metastack:
                raise _Malformed("no MARK to pop")
            items = stack
            stack = metastack.pop()
            append = stack.append
            return items

        def memo_put(idx: int) -> None:
            if not stack:
                raise _Malformed("memo store with an empty stack")
            memo[idx] = stack[-1]
            if len(memo) > max_memo:
                raise _Malformed(f"more than {max_memo} memo entries", ProblemKind.LIMIT)

        def memo_get(idx: int) -> None:
            try:
                append(memo[idx])
            except KeyError:
                raise _Malformed(f"memo miss: index {idx} was never stored") from None

        try:
            while True:
                if pos >= n:
                    raise _Malformed("truncated stream: no STOP opcode")
                op_pos = pos
                op = data[pos]
                pos += 1
                count += 1
                if count > max_ops:
                    raise _Malformed(f"more than {max_ops} opcodes", ProblemKind.LIMIT)
                # Ordered by how often torch's data.pkl and optimizer pickles use them.
                if op == 0x71:  # BINPUT
                    if pos >= n:
                        raise _Malformed("truncated stream")
                    memo_put(data[pos])
                    pos += 1
                elif op == 0x68 or op == 0x6A:  # BINGET / LONG_BINGET
                    if op == 0x68:
                        if pos >= n:
                            raise _Malformed("truncated stream")
                        memo_get(data[pos])
                        pos += 1
                    else:
                        memo_get(_unpack_u4(take(4))[0])
                    top = stack[-1]
                    if (
                        type(top) is GlobalRef
                        and top.name == "_rebuild_tensor_v2"
                        and top.module == "torch._utils"
                        and fast
                        and len(metastack) + 2 <= max_marks
                    ):
                        found = _parse_run(data, pos, memo, max_ops - count, max_memo - len(memo))
                        if found is not None:
                            run = found[0]
                            try:
                                stack[-1] = self._replay(run, found[1], found[2], top, memo)
                            except BaseException:
                                # Only persistent_load can raise here: leave the walk where the generic loop
                                # would be when it calls it, so the problem names the same opcode and byte.
                                op, op_pos, pos, count = 0x51, run[2], run[2] + 1, count + run[3]
                                raise
                            pos, count, op, op_pos = run[0], count + run[1], run[4], run[5]
                elif op == 0x58:  # BINUNICODE
                    if pos + 4 > n:
                        raise _Malformed("truncated stream")
                    end = pos + 4 + _unpack_u4(data, pos)[0]
                    if end > n:
                        raise _Malformed(f"truncated stream: string ends at byte {end}, stream has {n}")
                    append(data[pos + 4 : end].decode("utf-8", "surrogatepass"))
                    pos = end
                elif op == 0x4B:  # BININT1
                    if pos >= n:
                        raise _Malformed("truncated stream")
                    append(data[pos])
                    pos += 1
                elif op == 0x28:  # MARK
                    if len(metastack) >= max_marks:
                        raise _Malformed(f"more than {max_marks} nested MARKs", ProblemKind.LIMIT)
                    metastack.append(stack)
                    stack = []
                    append = stack.append
                elif op == 0x74:  # TUPLE
                    t = tuple(pop_mark())
                    append(t)
                elif op == 0x85:  # TUPLE1
                    stack[-1] = (stack[-1],)
                elif op == 0x86:  # TUPLE2
                    b = stack.pop()
                    stack[-1] = (stack[-1], b)
                elif op == 0x87:  # TUPLE3
                    c = stack.pop()
                    b = stack.pop()
                    stack[-1] = (stack[-1], b, c)
                elif op == 0x72:  # LONG_BINPUT
                    memo_put(_unpack_u4(take(4))[0])
                elif op == 0x94:  # MEMOIZE
                    memo_put(len(memo))
                elif op == 0x8C:  # SHORT_BINUNICODE
                    if pos >= n:
                        raise _Malformed("truncated stream")
                    k = data[pos]
                    pos += 1
                    append(take(k).decode("utf-8", "surrogatepass"))
                elif op == 0x52:  # REDUCE
                    args = stack.pop()
                    func = stack[-1]
                    self._passed(args)
                    if type(func) is GlobalRef:
                        self.calls[func] = None
                        stack[-1] = _interpret(func, args) if type(args) is tuple else _Obj(func, args)
                    else:
                        self._call_target(func)
                        stack[-1] = _Obj(None, (func, args))
                elif op == 0x29:  # EMPTY_TUPLE
                    append(())
                elif op == 0x7D:  # EMPTY_DICT
                    append({})
                elif op == 0x5D:  # EMPTY_LIST
                    append([])
                elif op == 0x75:  # SETITEMS
                    items = pop_mark()
                    target = stack[-1]
                    if len(items) % 2:
                        raise _Malformed("SETITEMS with an odd number of items")
                    if type(target) is dict:
                        for i in range(0, len(items), 2):
                            k = items[i]
                            target[k if type(k) in scalars else _Key(k)] = items[i + 1]
                    else:
                        self._set_on_non_container(target, "SETITEMS")
                elif op == 0x73:  # SETITEM
                    v = stack.pop()
                    k = stack.pop()
                    target = stack[-1]
                    if type(target) is dict:
                        target[k if type(k) in scalars else _Key(k)] = v
                    else:
                        self._set_on_non_container(target, "SETITEM")
                elif op == 0x65:  # APPENDS
                    items = pop_mark()
                    target = stack[-1]
                    if type(target) is list:
                        target.extend(items)
                    else:
                        self._set_on_non_container(target, "APPENDS")
                elif op == 0x61:  # APPEND
                    v = stack.pop()
                    target = stack[-1]
                    if type(target) is list:
                        target.append(v)
                    else:
                        self._set_on_non_container(target, "APPEND")
                elif op == 0x51:  # BINPERSID
                    stack[-1] = self._persid(stack[-1])
                elif op == 0x63:  # GLOBAL
                    mod = line().decode("utf-8")
                    name = line().decode("utf-8")
                    ref = _global(mod, name, self.protocol)
                    globals_[ref] = None
                    append(ref)
                elif op == 0x93:  # STACK_GLOBAL
                    name_v = stack.pop()
                    mod_v = stack.pop()
                    # A name computed by a call (str.join ...) is a string only at load time: keep it unresolved.
                    ref = _global(
                        mod_v if type(mod_v) is str else "<dynamic>",
                        name_v if type(name_v) is str else "<dynamic>",
                        self.protocol,
                    )
                    globals_[ref] = None
                    append(ref)
                elif op == 0x62:  # BUILD
                    state = stack.pop()
                    inst = stack[-1]
                    if type(inst) is _Obj:
                        self._call_target(inst)
                        if type(inst.state) is dict and type(state) is dict:
                            inst.state.update(state)
                        else:
                            inst.state = state
                    elif type(inst) is GlobalRef:
                        self.calls[inst] = None
                    # BUILD on a dict (torch's ``_metadata`` on state dicts) sets attributes, not items: the
                    # value stays the plain dict.
                elif op == 0x81:  # NEWOBJ
                    args = stack.pop()
                    cls = stack.pop()
                    self._call_target(cls)
                    self._passed(args)
                    append(_Obj(cls, args, new=True) if type(cls) is GlobalRef else _Obj(None, (cls, args)))
                elif op == 0x88:  # NEWTRUE
                    append(True)
                elif op == 0x89:  # NEWFALSE
                    append(False)
                elif op == 0x4E:  # NONE
                    append(None)
                elif op == 0x4A:  # BININT
                    append(_unpack_i4(take(4))[0])
                elif op == 0x4D:  # BININT2
                    append(_unpack_u2(take(2))[0])
                elif op == 0x47:  # BINFLOAT
                    append(_unpack_f8(take(8))[0])
                elif op == 0x8A:  # LONG1
                    if pos >= n:
                        raise _Malformed("truncated stream")
                    k = data[pos]
                    pos += 1
                    append(int.from_bytes(take(k), "little", signed=True))
                elif op == 0x8B:  # LONG4
                    append(int.from_bytes(take(_unpack_i4(take(4))[0]), "little", signed=True))
                elif op == 0x43:  # SHORT_BINBYTES
                    if pos >= n:
                        raise _Malformed("truncated stream")
                    k = data[pos]
                    pos += 1
                    append(take(k))
                elif op == 0x42:  # BINBYTES
                    append(take(_unpack_u4(take(4))[0]))
                elif op == 0x8E or op == 0x96:  # BINBYTES8, BYTEARRAY8 (kept as bytes)
                    append(take(_unpack_u8(take(8))[0]))
                elif op == 0x8D:  # BINUNICODE8
                    append(take(_unpack_u8(take(8))[0]).decode("utf-8", "surrogatepass"))
                elif op == 0x55:  # SHORT_BINSTRING
                    if pos >= n:
                        raise _Malformed("truncated stream")
                    k = data[pos]
                    pos += 1
                    append(_decode_str(take(k)))
                elif op == 0x54:  # BINSTRING
                    append(_decode_str(take(_unpack_i4(take(4))[0])))
                elif op == 0x2E:  # STOP
                    self.pos = pos
                    self.count = count
                    if not stack:
                        raise _Malformed("STOP with an empty stack")
                    return stack[-1]
                elif op == 0x95:  # FRAME
                    # Frames only group opcodes for buffered reads; the opcodes inside are walked as usual.
                    frame_len = _unpack_u8(take(8))[0]
                    if frame_len > n - pos:
                        raise _Malformed(f"truncated stream: frame of {frame_len} bytes, {n - pos} left")
                    _check_frame(data, pos, pos + frame_len)
                elif op == 0x80:  # PROTO
                    if pos >= n:
                        raise _Malformed("truncated stream")
                    proto = data[pos]
                    pos += 1
                    if proto > 5:
                        raise _Malformed(f"unsupported pickle protocol {proto}")
                    self.protocol = proto
                elif op == 0x30:  # POP
                    if stack:
                        stack.pop()
                    else:
                        pop_mark()
                elif op == 0x31:  # POP_MARK
                    pop_mark()
                elif op == 0x32:  # DUP
                    append(stack[-1])
                elif op == 0x64:  # DICT
                    items = pop_mark()
                    if len(items) % 2:
                        raise _Malformed("DICT with an odd number of items")
                    d: dict[Any, Any] = {}
                    for i in range(0, len(items), 2):
                        k = items[i]
                        d[k if type(k) in scalars else _Key(k)] = items[i + 1]
                    append(d)
                elif op == 0x6C:  # LIST
                    items = pop_mark()  # pop first: pop_mark rebinds ``append``
                    append(items)
                elif op == 0x8F:  # EMPTY_SET
                    append(_SetNode([], False))
                elif op == 0x90:  # ADDITEMS
                    items = pop_mark()
                    target = stack[-1]
                    if type(target) is _SetNode and not target.frozen:
                        target.items.extend(items)
                    else:
                        self._set_on_non_container(target, "ADDITEMS")
                elif op == 0x91:  # FROZENSET
                    items = pop_mark()
                    append(_SetNode(items, True))
                elif op == 0x92:  # NEWOBJ_EX
                    kwargs = stack.pop()
                    args = stack.pop()
                    cls = stack.pop()
                    self._call_target(cls)
                    self._passed((args, kwargs))
                    if type(cls) is GlobalRef:
                        append(_Obj(cls, (args, kwargs), new=True))
                    else:
                        append(_Obj(None, (cls, (args, kwargs))))
                elif op == 0x69:  # INST
                    mod = line().decode("utf-8")
                    name = line().decode("utf-8")
                    ref = _global(mod, name, self.protocol)
                    globals_[ref] = None
                    self.calls[ref] = None
                    items = pop_mark()
                    self._passed(items)
                    append(_Obj(ref, tuple(items)))
                elif op == 0x6F:  # OBJ
                    items = pop_mark()
                    if not items:
                        raise _Malformed("OBJ without a class")
                    cls = items[0]
                    self._call_target(cls)
                    self._passed(items[1:])
                    if type(cls) is GlobalRef:
                        append(_Obj(cls, tuple(items[1:])))
                    else:
                        append(_Obj(None, (cls, tuple(items[1:]))))
                elif op in (0x82, 0x83, 0x84):  # EXT1 / EXT2 / EXT4
                    if op == 0x82:
                        code = take(1)[0]
                    elif op == 0x83:
                        code = _unpack_u2(take(2))[0]
                    else:
                        code = _unpack_i4(take(4))[0]
                    if code <= 0:
                        raise _Malformed(f"extension code {code} <= 0")
                    # The copyreg extension registry is process state: never look it up, keep it unresolved.
                    ref = GlobalRef("<extension>", str(code))
                    globals_[ref] = None
                    append(ref)
                elif op == 0x50:  # PERSID
                    append(self._persid(line().decode("ascii")))
                elif op == 0x49:  # INT
                    raw = line()
                    if raw == b"00":
                        append(False)
                    elif raw == b"01":
                        append(True)
                    else:
                        append(int(raw))
                elif op == 0x4C:  # LONG
                    raw = line()
                    append(int(raw[:-1] if raw.endswith(b"L") else raw))
                elif op == 0x46:  # FLOAT
                    append(float(line()))
                elif op == 0x53:  # STRING
                    raw = line().rstrip()
                    if len(raw) < 2 or raw[0] != raw[-1] or raw[:1] not in (b'"', b"'"):
                        raise _Malformed("STRING argument is not quoted")
                    append(_decode_str(codecs.escape_decode(raw[1:-1])[0]))
                elif op == 0x56:  # UNICODE
                    append(line().decode("raw-unicode-escape"))
                elif op == 0x67:  # GET
                    memo_get(int(line()))
                elif op == 0x70:  # PUT
                    memo_put(int(line()))
                elif op == 0x97:  # NEXT_BUFFER
                    append(OUT_OF_BAND)
                elif op == 0x98:  # READONLY_BUFFER
                    if not stack:  # the buffer itself stays opaque
                        raise _Malformed("READONLY_BUFFER with an empty stack")
                else:
                    raise _Malformed(f"unknown opcode 0x{op:02x}")
        finally:
            self.pos = pos
            self.count = count
            self.op_pos = op_pos
            self.op = op

    def _set_on_non_container(self, target: Any, opname: str) -> None:
        """APPEND/SETITEM/ADDITEMS on something that is not the matching container."""
        if type(target) in (_Obj, GlobalRef):
            # The real unpickler would call the object's own append/extend/__setitem__/add.
            self._call_target(target)
            return
        raise _Malformed(f"{opname} on a {type(target).__name__}")


def merge_pickles(main: PickleFacts | None, extra: list[PickleFacts]) -> PickleFacts | None:
    """``main`` with the globals and calls of the ``extra`` streams found in the same file added.

    The value stays ``main``'s (None when there is no main stream): rules that judge what loading the file could
    run see every stream; rules that read the value see the one the loader returns.
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
