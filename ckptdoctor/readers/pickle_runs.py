"""The tensor fast path of the pickle walk: torch.save's per-tensor opcode run, parsed in one step (and cached).

Split from the opcode loop (``pickle_walk``), which applies a parsed run's effects as its generic loop would.
"""

from __future__ import annotations

import struct
from typing import Any

from ckptdoctor.model import GlobalRef

_unpack_i4 = struct.Struct("<i").unpack_from
_unpack_u4 = struct.Struct("<I").unpack_from
_unpack_u2 = struct.Struct("<H").unpack_from
_unpack_u8 = struct.Struct("<Q").unpack_from

# ---------------------------------------------------------------------------------------------------------------
# The tensor fast path. torch.save (protocol 2) writes every tensor after the first of its kind as one fixed run of
# opcodes (torch/_tensor.py ``_reduce_ex_internal``, torch/serialization.py ``persistent_id``):
#
#   <_rebuild_tensor_v2 from the memo> MARK MARK <pid items> TUPLE [PUT] BINPERSID <offset int> <shape> [PUT]
#   <stride> [PUT] NEWFALSE|NEWTRUE <OrderedDict from the memo> EMPTY_TUPLE REDUCE [PUT] TUPLE [PUT] REDUCE [PUT]
#
# where a pid item is a memo read, a BINUNICODE or an int, each with an optional PUT, and a shape or stride is
# EMPTY_TUPLE, 1-3 ints and TUPLE1/2/3, or MARK ints TUPLE. ``parse_run`` reads such a run without touching the
# walk's state and answers None on any deviation: the generic loop then walks the same bytes and reports whatever
# it reports. On a match the loop applies the run's effects at once, as the generic loop would have.

_MAX_RUN_ITEMS = 64  # pid items or tuple ints; longer runs are left to the generic loop
_MISS = object()


def _int_at(data: bytes, p: int, n: int) -> tuple[Any, int]:
    """BININT1/BININT2/BININT/LONG1 at ``p``: (the int or _MISS, offset after it)."""
    op = data[p]
    if op == 0x4B:
        return data[p + 1], p + 2
    if op == 0x4D:
        return _unpack_u2(data, p + 1)[0], p + 3
    if op == 0x4A:
        return _unpack_i4(data, p + 1)[0], p + 5
    if op == 0x8A:
        end = p + 2 + data[p + 1]
        if end <= n:
            return int.from_bytes(data[p + 2 : end], "little", signed=True), end
    return _MISS, p


def _ints_tuple(data: bytes, p: int, n: int) -> tuple[tuple[int, ...] | None, int, int]:
    """A shape/stride at ``p``: EMPTY_TUPLE, 1-3 ints and TUPLE1/2/3, or MARK ints TUPLE.

    Returns (the tuple or None, offset after it, opcodes read).
    """
    op = data[p]
    if op == 0x29:  # EMPTY_TUPLE
        return (), p + 1, 1
    marked = op == 0x28
    if marked:
        p += 1
    items: list[int] = []
    while len(items) < _MAX_RUN_ITEMS:
        op = data[p]
        if op == 0x4B:  # BININT1 (shapes and strides are mostly small)
            items.append(data[p + 1])
            p += 2
        else:
            v, after = _int_at(data, p, n)
            if v is _MISS:
                break
            items.append(v)
            p = after
    op = data[p]
    k = len(items)
    if marked:
        return (tuple(items), p + 1, k + 2) if op == 0x74 else (None, p, 0)
    # TUPLE1/2/3 take exactly that many items: with more or fewer, the stack holds something else.
    if k and op - 0x84 == k:
        return tuple(items), p + 1, k + 1
    return None, p, 0


def _memo_index(data: bytes, p: int, short: int, long: int) -> tuple[int, int]:
    """The index of a memo opcode at ``p`` (``short``: 1-byte operand, ``long``: 4-byte) and the offset after it;
    (-1, p) when the opcode at ``p`` is neither."""
    op = data[p]
    if op == short:
        return data[p + 1], p + 2
    if op == long:
        return _unpack_u4(data, p + 1)[0], p + 5
    return -1, p


def _store(data: bytes, p: int, puts: dict[int, Any], value: Any) -> int:
    """Record an optional BINPUT/LONG_BINPUT of ``value`` at ``p``; the offset after it, or -1 for an index
    stored twice in the run (left to the generic loop)."""
    idx, after = _memo_index(data, p, 0x71, 0x72)
    if idx < 0:
        return p
    if idx in puts:
        return -1
    puts[idx] = value
    return after


# A parsed run, applied by ``_Walker._replay``: (end, opcodes, BINPERSID offset, opcodes through BINPERSID,
# last opcode, its offset, memo stores known before persistent_load, pid, (offset, shape, stride, requires_grad,
# hooks dict), the OrderedDict GlobalRef, memo index of the argument tuple, memo index of the tensor (-1: none)).
Run = tuple[int, int, int, int, int, int, dict[int, Any], tuple[Any, ...], tuple[Any, ...], Any, int, int]

# Runs already parsed, by the offset they start at: (their bytes, the run, the memo reads it depends on, the memo
# index of its hooks dict). Every checkpoint of one training run pickles its optimizer state with the same bytes at
# the same offsets (only the param_groups after it differ), so from the second optimizer.pt on a run is looked up
# (bytes compared, memo reads re-checked) instead of parsed. Shared by threads: dict get/set are atomic, and a lost
# race only costs a parse. Bounded: cleared when full. The last cell holds (storage, rebuild global, tensor) of the
# run's last replay: a storage that is the same object (torchzip interns them) rebuilds the same tensor.
_RUN_CACHE: dict[int, tuple[bytes, Run, tuple[tuple[int, Any], ...], int, list[Any]]] = {}
_RUN_CACHE_ENTRIES = 50_000
_CACHEABLE_READS = frozenset({str, GlobalRef})  # equal values of these types are interchangeable (not 1 and True)


def parse_run(
    data: bytes, p: int, memo: dict[int, Any], room_ops: int, room_memo: int
) -> tuple[Run, int, list[Any]] | None:
    """The tensor run after a ``_rebuild_tensor_v2`` memo read ending at ``p``, the memo index of its hooks dict
    (-1: not stored) and its replay cell (see ``_RUN_CACHE``), or None unless it matches exactly.

    ``room_*`` are the opcodes and memo entries the limits still allow: a run that could trip one is left to the
    generic loop, which reports it at the opcode where it trips. Never raises, never changes ``memo``. Looks the
    run up in ``_RUN_CACHE`` first and caches what it parses.
    """
    entry = _RUN_CACHE.get(p)
    run: Run | None = None
    hooks_idx = -1
    cell: list[Any] = [None]
    if entry is not None and data.startswith(entry[0], p):
        run, hooks_idx, cell = entry[1], entry[3], entry[4]
        for idx, value in entry[2]:
            got = memo.get(idx, _MISS)
            if got is not value and (type(got) is not type(value) or got != value):
                run = None
                break
    if run is None:
        reads: list[tuple[int, Any]] = []
        try:
            run = _parse_run_unchecked(data, p, memo, reads)
        except (IndexError, struct.error, UnicodeDecodeError):
            return None  # truncated or undecodable: the generic loop reports it at its opcode
        if run is None:
            return None
        hooks = run[8][4]
        hooks_idx = next((i for i, v in run[6].items() if v is hooks), -1)
        if _CACHEABLE_READS.issuperset(type(v) for _, v in reads):
            if len(_RUN_CACHE) >= _RUN_CACHE_ENTRIES:
                _RUN_CACHE.clear()
            cell = [None]
            _RUN_CACHE[p] = (data[p : run[0]], run, tuple(reads), hooks_idx, cell)
    if run[1] > room_ops or len(run[6]) > room_memo:
        return None
    return run, hooks_idx, cell


def _memo_read(
    data: bytes, p: int, memo: dict[int, Any], puts: dict[int, Any], reads: list[tuple[int, Any]]
) -> tuple[Any, int]:
    """BINGET/LONG_BINGET at ``p`` of an entry stored before the run: (value or _MISS, offset after it); the read
    is added to ``reads``."""
    idx, p = _memo_index(data, p, 0x68, 0x6A)
    if idx < 0 or idx in puts:  # a read of a store made inside the run: too unusual to be worth replaying here
        return _MISS, p
    value = memo.get(idx, _MISS)
    reads.append((idx, value))
    return value, p


def _parse_run_unchecked(data: bytes, p: int, memo: dict[int, Any], reads: list[tuple[int, Any]]) -> Run | None:
    n = len(data)
    if data[p] != 0x28 or data[p + 1] != 0x28:  # MARK MARK
        return None
    p += 2
    k = 2  # opcodes read
    puts: dict[int, Any] = {}
    items: list[Any] = []
    while True:  # pid items (an int, a BINUNICODE or a memo read, each maybe stored) up to TUPLE
        op = data[p]
        if op == 0x68 or op == 0x6A:  # BINGET / LONG_BINGET
            v, p = _memo_read(data, p, memo, puts, reads)
        elif op == 0x58:  # BINUNICODE
            end = p + 5 + _unpack_u4(data, p + 1)[0]
            if end > n:
                return None
            v = data[p + 5 : end].decode("utf-8", "surrogatepass")
            p = end
        elif op == 0x74:  # TUPLE
            break
        else:
            v, p = _int_at(data, p, n)
        if v is _MISS or len(items) >= _MAX_RUN_ITEMS:
            return None
        items.append(v)
        q = _store(data, p, puts, v)
        if q < 0:
            return None
        k += 1 + (q != p)
        p = q
    pid = tuple(items)
    q = _store(data, p + 1, puts, pid)
    if q < 0 or data[q] != 0x51:  # BINPERSID
        return None
    k += 2 + (q != p + 1)  # TUPLE, its store, BINPERSID
    pid_at, pid_ops = q, k
    offset, q = _int_at(data, q + 1, n)
    if offset is _MISS:
        return None
    k += 1
    dims: list[tuple[int, ...]] = []
    while len(dims) < 2:  # the shape, then the stride, each maybe stored
        dim, p, ops = _ints_tuple(data, q, n)
        if dim is None:
            return None
        q = _store(data, p, puts, dim)
        if q < 0:
            return None
        k += ops + (q != p)
        dims.append(dim)
    shape, stride = dims
    grad = data[q]
    if grad != 0x88 and grad != 0x89:  # NEWTRUE / NEWFALSE
        return None
    od, p = _memo_read(data, q + 1, memo, puts, reads)
    if type(od) is not GlobalRef or od.name != "OrderedDict" or od.module != "collections":
        return None
    if data[p] != 0x29 or data[p + 1] != 0x52:  # EMPTY_TUPLE REDUCE: OrderedDict()
        return None
    hooks: dict[Any, Any] = {}
    q = _store(data, p + 2, puts, hooks)
    if q < 0 or data[q] != 0x74:  # TUPLE: the arguments
        return None
    k += 5 + (q != p + 2)  # requires_grad, the OrderedDict read, EMPTY_TUPLE, REDUCE, its store, TUPLE
    # The argument tuple and the tensor exist only once persistent_load has answered: they are stored as None
    # here and overwritten by the replay (nothing reads the memo in between).
    p = _store(data, q + 1, puts, None)
    if p < 0 or data[p] != 0x52:  # REDUCE: the tensor
        return None
    args_idx = next(reversed(puts)) if p != q + 1 else -1
    end = _store(data, p + 1, puts, None)
    if end < 0:
        return None
    last_op, last_at, result_idx = 0x52, p, -1
    if end != p + 1:
        last_op, last_at, result_idx = data[p + 1], p + 1, next(reversed(puts))
    k += 1 + (args_idx >= 0) + (result_idx >= 0)
    tail = (offset, shape, stride, grad == 0x88, hooks)
    return end, k, pid_at, pid_ops, last_op, last_at, puts, pid, tail, od, args_idx, result_idx
