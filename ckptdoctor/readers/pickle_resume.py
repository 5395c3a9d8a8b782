"""Resuming a pickle walk from a snapshot taken in an earlier stream with the same leading bytes.

Every checkpoint of a training run pickles its optimizer state with the same bytes up to the param_groups near the
end (the learning rate differs), so once two such streams have been walked, the walker's whole state at an opcode
boundary inside their common prefix is kept, and a later stream whose bytes up to there are equal (compared at C
speed) goes on from that state instead of walking its ~27,000 opcodes again. What this module holds is the part that
knows nothing of the opcode loop: finding the common prefix and the last opcode boundary in it, the graph of working
values a snapshot keeps, and the bounded registry of snapshots. ``pickle_walk`` takes and resumes them.

Why a resumed walk is the walk: the opcode loop reads no byte past the opcode it executes (a FRAME's check reads to
the frame's end: a snapshot compares its bytes up to there too), the tensor fast path leaves the walker in the state
the generic loop leaves it in at every boundary, and ``persistent_load`` objects that take part say what their
later answers depend on and hand it over (``Resumable``). What a later opcode can observe of the earlier values is
kept apart:

- the values on the stack (and those holding them) are the ones later SETITEMs fill (the optimizer's outer dict):
  each resume gets its own copies of those (``Graph.copy``), wired into its memo;
- every other mutable value (a per-parameter dict, a tensor's hooks dict) is shared with the walk that took the
  snapshot and with every walk resumed from it. A walk that would change one stops (``Diverged``) and the stream
  is walked afresh; the walk that took the snapshot drops it instead. Real streams never do either.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any, Protocol

from ckptdoctor.model import GlobalRef, Opaque, TensorRef
from ckptdoctor.readers.pickle_values import Key, Obj, SetNode, shared
from ckptdoctor.readers.seen import Seen

__all__ = ["Diverged", "Graph", "Resumable", "Snapshot", "common_prefix", "last_boundary"]


class Diverged(Exception):
    """Internal: a resumed walk would change a value it shares with other walks; walk the stream afresh."""


class Resumable(Protocol):
    """A ``persistent_load`` whose state a snapshot can carry: what its later answers depend on, copied."""

    def __call__(self, pid: Any) -> Any: ...

    def walk_state(self) -> Any:
        """Everything later calls depend on or report, copied (nothing the caller goes on to change)."""

    def walk_state_fits(self, state: Any) -> bool:
        """Whether, given ``state``, this object answers every later call as the one ``state`` was taken from."""

    def walk_restore(self, state: Any) -> None:
        """Take ``state`` (copying it: it serves other walks too)."""


# ---------------------------------------------------------------------------------------------------------------
# Bytes


_CHUNK = 4096


def common_prefix(a: bytes, b: bytes, start: int) -> int:
    """The length of the common prefix of ``a[start:]`` and ``b[start:]`` (compared at C speed)."""
    n = min(len(a), len(b)) - start
    lo = 0
    while lo < n:
        hi = min(lo + _CHUNK, n)
        if a[start + lo : start + hi] != b[start + lo : start + hi]:
            while hi - lo > 1:  # the first differing byte is in [lo, hi)
                mid = (lo + hi) // 2
                if a[start + lo : start + mid] == b[start + lo : start + mid]:
                    lo = mid
                else:
                    hi = mid
            return lo
        lo = hi
    return max(n, 0)


def last_boundary(data: bytes, at: int, end: int) -> int:
    """The last opcode boundary at or before ``end`` of the opcodes that start at the boundary ``at`` (``at`` when
    the first one runs past ``end``). A boundary before STOP, never after it. ``pickletools.genops`` cuts opcodes as
    the unpickler does; a stream it cannot cut stops the search (the walk then does not land there: no snapshot)."""
    import pickletools  # here: a scan that learns no stream (most of them, and every empty one) never imports it

    f = io.BytesIO(data[at:end])
    last = 0
    try:
        for opcode, _, _ in pickletools.genops(f):
            if opcode.name == "STOP":
                break
            last = f.tell()
    except Exception:  # any byte it cannot cut ends the search where it is
        pass
    return at + last


# ---------------------------------------------------------------------------------------------------------------
# The working values a snapshot keeps


_MUTABLE = frozenset({dict, list, SetNode, Obj})
_LEAVES = frozenset({str, int, float, bool, bytes, type(None), complex, GlobalRef, TensorRef})
_FROZEN = frozenset({Opaque, set, frozenset})  # model values: the walk never changes them
_SCALAR_TYPES = _LEAVES.issuperset


def _kids(x: Any, t: type) -> list[Any]:
    if t is dict:
        return [*x.keys(), *x.values()]
    if t is list or t is tuple or t is set or t is frozenset:
        return list(x)
    if t is SetNode:
        return list(x.items)
    if t is Key:
        return [x.obj]
    return [x.func, x.args, x.state]  # Obj, Opaque


class Graph:
    """The values a walk's state reaches at one boundary, sorted for a snapshot.

    ``copied``: the mutable values on the stack and every value that reaches one (the only ones a real stream goes
    on to change), in the order ``copy`` makes them (mutable ones first, then tuples and keys children first);
    ``owned``: the ids of every other mutable value (shared, never changed); ``seeds``: the frozen form of the owned
    containers of scalars the stack reaches (``freeze`` takes them as made).
    """

    __slots__ = ("copied", "owned", "seeds")

    def __init__(self, copied: list[Any], owned: frozenset[int], seeds: dict[int, tuple[Any, int]]) -> None:
        self.copied = copied
        self.owned = owned
        self.seeds = seeds

    @staticmethod
    def of(memo: dict[int, Any], stacks: list[list[Any]]) -> Graph | None:
        """The graph of ``memo`` and ``stacks`` (the stack and the stacks below each MARK), or None when it holds
        something this module does not know how to keep apart (a working value inside a model value)."""
        nodes: dict[int, Any] = {}
        parents: dict[int, list[int]] = {}
        todo: list[Any] = [*memo.values()]
        for s in stacks:
            todo.extend(s)
        while todo:
            x = todo.pop()
            t = type(x)
            if t in _LEAVES or id(x) in nodes:
                continue
            if t not in _MUTABLE and t is not tuple and t is not Key:
                if t not in _FROZEN or not _inert(x):
                    return None
                continue
            nodes[id(x)] = x
            for c in _kids(x, t):
                ct = type(c)
                if ct not in _LEAVES and ct not in _FROZEN:
                    parents.setdefault(id(c), []).append(id(x))
                    todo.append(c)
                elif ct in _FROZEN and not _inert(c):
                    return None
        # The stack's mutable values, and every value they are reached from
        on_stack = [id(x) for s in stacks for x in s if type(x) in _MUTABLE]
        copied: set[int] = set(on_stack)
        up = list(on_stack)
        while up:
            for p in parents.get(up.pop(), ()):
                if p not in copied:
                    copied.add(p)
                    up.append(p)
        order = [nodes[i] for i in copied if type(nodes[i]) in _MUTABLE]
        order.extend(_children_first([nodes[i] for i in copied if type(nodes[i]) not in _MUTABLE], copied))
        owned = frozenset(i for i, x in nodes.items() if i not in copied and type(x) in _MUTABLE)
        return Graph(order, owned, _seeds(stacks, nodes, copied))

    @staticmethod
    def copy(node_order: list[Any]) -> dict[int, Any]:
        """New values for ``node_order`` (a ``copied`` list, or a copy of one), by the id of each old one: the same
        contents, with the new values in place of the old ones they hold."""
        new: dict[int, Any] = {}
        get = new.get
        n_mut = 0
        for x in node_order:
            t = type(x)
            if t is dict:
                new[id(x)] = {}
            elif t is list:
                new[id(x)] = []
            elif t is SetNode:
                new[id(x)] = SetNode([], x.frozen)
            elif t is Obj:
                new[id(x)] = Obj(None, None, None, x.new)
            else:
                break
            n_mut += 1
        for x in node_order[n_mut:]:
            if type(x) is tuple:
                new[id(x)] = tuple([get(id(c), c) for c in x])
            else:  # Key
                new[id(x)] = Key(get(id(x.obj), x.obj))
        for x in node_order[:n_mut]:
            t = type(x)
            y = new[id(x)]
            if t is dict:
                for k, v in x.items():
                    y[get(id(k), k)] = get(id(v), v)
            elif t is list:
                y.extend([get(id(c), c) for c in x])
            elif t is SetNode:
                y.items.extend([get(id(c), c) for c in x.items])
            else:
                y.func, y.args, y.state = get(id(x.func), x.func), get(id(x.args), x.args), get(id(x.state), x.state)
        return new


def _inert(x: Any) -> bool:
    """Whether the model value ``x`` holds no working value (the walk never changes what it holds)."""
    todo = [x]
    seen: set[int] = set()
    while todo:
        v = todo.pop()
        t = type(v)
        if t in _LEAVES:
            continue
        if t in _MUTABLE or t is Key:
            return False
        if id(v) in seen:
            continue
        seen.add(id(v))
        if t in _FROZEN or t is tuple:
            todo.extend(_kids(v, t))
        else:
            return False
    return True


def _children_first(items: list[Any], within: set[int]) -> list[Any]:
    """``items`` (tuples and keys: they never form a cycle among themselves) ordered so each comes after those of
    them it holds."""
    placed: set[int] = set()
    out: list[Any] = []
    for root in items:
        if id(root) in placed:
            continue
        stack: list[tuple[Any, bool]] = [(root, False)]
        while stack:
            x, done = stack.pop()
            if done:
                if id(x) not in placed:
                    placed.add(id(x))
                    out.append(x)
                continue
            if id(x) in placed:
                continue
            stack.append((x, True))
            for c in _kids(x, type(x)):
                if id(c) in within and type(c) not in _MUTABLE and id(c) not in placed:
                    stack.append((c, False))
    return out


def _seeds(stacks: list[list[Any]], nodes: dict[int, Any], copied: set[int]) -> dict[int, tuple[Any, int]]:
    """The frozen form (``freeze``'s ``(value, height)``) of the owned lists, tuples and dicts of scalars the stacks
    reach: the values a later freeze meets again, taken as made."""
    out: dict[int, tuple[Any, int]] = {}
    seen: set[int] = set()
    todo = [x for s in stacks for x in s]
    while todo:
        x = todo.pop()
        t = type(x)
        if t in _LEAVES or t in _FROZEN or id(x) in seen:
            continue
        seen.add(id(x))
        kids = _kids(x, t)
        if id(x) not in copied and (t is dict or t is list or t is tuple) and _SCALAR_TYPES(map(type, kids)):
            out[id(x)] = (shared(x, t), 1)
            continue
        todo.extend(kids)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Snapshots and where they are kept


class Snapshot:
    """A walker's state at the boundary ``pos`` of a stream whose bytes from ``start`` are ``prefix``.

    ``state`` holds the walker's fields (see ``pickle_walk``); ``memo`` and ``stacks`` hold ``copied``, the
    snapshot's own copies of ``graph.copied`` (made when it was taken), and ``in_memo`` the memo indices of those.
    """

    __slots__ = (
        "copied", "graph", "in_memo", "limits", "load_state", "load_type", "memo", "pos", "prefix", "stacks", "state",
    )  # fmt: skip

    def __init__(
        self,
        prefix: bytes,
        pos: int,
        limits: Any,
        load: Callable[[Any], Any] | None,
        state: tuple[Any, ...],
        memo: dict[int, Any],
        stacks: list[list[Any]],
        graph: Graph,
    ) -> None:
        self.prefix = prefix
        self.pos = pos
        self.limits = limits
        self.load_type = type(load)
        self.load_state = load.walk_state() if load is not None else None  # type: ignore[attr-defined]
        self.state = state
        self.graph = graph
        # The walk goes on changing the copied values: the snapshot keeps its own, made now
        copies = Graph.copy(graph.copied)
        get = copies.get
        self.copied = [copies[id(x)] for x in graph.copied]
        self.memo = {i: get(id(v), v) for i, v in memo.items()}
        self.in_memo = [i for i, v in memo.items() if id(v) in copies]
        self.stacks = [[get(id(x), x) for x in s] for s in stacks]

    def fits(self, data: bytes, start: int, limits: Any, load: Callable[[Any], Any] | None) -> bool:
        """Whether a walk of ``data`` from ``start`` with these limits and this ``persistent_load`` is in this
        snapshot's state when it reaches ``pos``."""
        if not data.startswith(self.prefix, start) or type(load) is not self.load_type:
            return False
        if limits is not self.limits and limits != self.limits:
            return False
        return load is None or load.walk_state_fits(self.load_state)  # type: ignore[attr-defined]

    def values(self) -> tuple[dict[int, Any], list[list[Any]]]:
        """A memo and stacks of this snapshot's own: the copied values made anew, the owned ones shared."""
        copies = Graph.copy(self.copied)
        memo = dict(self.memo)
        for i in self.in_memo:
            memo[i] = copies[id(memo[i])]
        get = copies.get
        return memo, [[get(id(x), x) for x in s] for s in self.stacks]


class Stream:
    """What was learnt of the streams that start with one run of bytes: the last one walked, and snapshots."""

    __slots__ = ("last", "snapshots")

    def __init__(self, last: bytes) -> None:
        self.last = last
        self.snapshots: tuple[Snapshot, ...] = ()


HEAD = 64  # the leading bytes streams are told apart by
MIN_BYTES = 8192  # shorter streams walk faster than a snapshot is taken and restored
GAIN = 2048  # a snapshot further on than one that fits is taken when it spares at least these bytes
SNAPSHOTS = 4  # kept per run of leading bytes (a scan may hold several runs of one model)
# Shared by the threads of a scan without a lock (house style of ``seen.Seen``): a lost race loses a snapshot, and
# a snapshot is never changed once it is in here.
STREAMS: Seen[tuple[int, bytes], Stream] = Seen(32)
