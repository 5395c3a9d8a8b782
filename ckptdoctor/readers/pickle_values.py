"""The values a pickle walk rebuilds: its working nodes, freezing them into model values, and walking the result.

Split from the opcode loop (``pickle_walk``): what the loop builds and how it becomes a frozen ``PickleValue``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ckptdoctor.model import GlobalRef, Opaque, PickleValue, TensorRef
from ckptdoctor.readers.seen import Seen

__all__ = ["CYCLE", "OUT_OF_BAND", "TOO_DEEP", "iter_values"]

# Values that are leaves of a rebuilt structure (hashable as they are).
SCALARS = frozenset({str, int, float, bool, bytes, type(None), complex, GlobalRef, TensorRef})

# Placeholders the walk puts where a value would make the rebuilt structure cyclic or deeper than the limit.
CYCLE = Opaque(None, ("<cycle>",))
TOO_DEEP = Opaque(None, ("<nesting limit>",))
OUT_OF_BAND = Opaque(None, ("<out-of-band buffer>",))


class Obj:
    """A mutable stand-in for an object the stream would create; frozen into ``Opaque`` at the end."""

    __slots__ = ("args", "func", "new", "state")

    def __init__(self, func: Any, args: Any, state: Any = None, new: bool = False) -> None:
        self.func = func
        self.args = args
        self.state = state
        self.new = new  # made by NEWOBJ/NEWOBJ_EX (``Opaque.new``)


class SetNode:
    """A set or frozenset under construction; its items become hashable only when frozen."""

    __slots__ = ("frozen", "items")

    def __init__(self, items: list[Any], frozen: bool) -> None:
        self.items = items
        self.frozen = frozen


class Key:
    """An identity-hashed wrapper for a dict key that is not a plain scalar (hashing it could recurse or fail)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj


# ---------------------------------------------------------------------------------------------------------------
# Freezing: internal nodes -> model values, iteratively, with cycles and over-deep nesting cut.


def _hashable(v: Any, depth: int = 0) -> Any:
    """A hashable equivalent of a frozen value (lists -> tuples, dicts -> pairs), depth-bounded."""
    t = type(v)
    if t in SCALARS:
        return v
    if depth > 32:
        raise ValueError("too deep for a key")
    if t is tuple or t is list:
        return tuple(_hashable(x, depth + 1) for x in v)
    if t is dict:
        return tuple((_hashable(k, depth + 1), _hashable(x, depth + 1)) for k, x in v.items())
    if t is set or t is frozenset:
        return frozenset(_hashable(x, depth + 1) for x in v)
    if t is Opaque:
        return Opaque(v.func, _hashable(v.args, depth + 1), _hashable(v.state, depth + 1), v.new)
    raise ValueError("unhashable")


def _as_key(v: Any) -> Any:
    try:
        h = _hashable(v)
        hash(h)
        return h
    except (ValueError, TypeError, RecursionError):
        return f"<unhashable {type(v).__name__}>"


def _build(node: Any, kids: list[Any]) -> Any:
    t = type(node)
    if t is list:
        return kids
    if t is tuple:
        return tuple(kids)
    if t is dict:
        d: dict[Any, Any] = {}
        for i in range(0, len(kids), 2):
            k = kids[i]
            if type(k) not in SCALARS:
                k = _as_key(k)
                if k in d:
                    k = f"{k}#{i // 2}"  # keep colliding stand-in keys apart
            d[k] = kids[i + 1]
        return d
    if t is SetNode:
        items = [x if type(x) in SCALARS else _as_key(x) for x in kids]
        return frozenset(items) if node.frozen else set(items)
    if t is Key:
        return kids[0]
    # Obj
    return Opaque(kids[0], kids[1], kids[2], node.new)


# Equal containers rebuilt by the walks of a run's checkpoints, one object each: every checkpoint pickles its
# optimizer state around the same (shared) tensors, so its per-parameter dicts and the state dict holding them come
# out the very objects of the checkpoint before. Consumers that remember what they saw by identity (the verdict
# cache's encoder, per-object views) then meet each once. Keyed by the items' identities (a dict's keys by value and
# type: each walk makes its own key strings), so a hit holds the same objects, never merely equal ones; the values
# kept here keep those ids theirs.
_SHARED: Seen[tuple[Any, ...], Any] = Seen(1 << 14)


def forget() -> None:
    """Drop the containers kept for sharing (``shared``): a scan calls it once a run is judged. A hit needs the very
    objects, which another run's walks seldom hold (only values a walk resumed from a snapshot shares), and sharing
    is a saving, never a fact: memory then holds one run's containers, not a fleet's (the memo filled to 16,384
    entries, about 300 runs of ten checkpoints, before it cleared itself)."""
    _SHARED.clear()


_NO_FLOAT_KEY = SCALARS - {float, complex}  # keys that equal only themselves in kind (0.0 == -0.0, 0j == -0j)
_PLAIN = SCALARS - {GlobalRef, TensorRef}  # values each walk makes anew (but small ints and a few strings)


def shared(c: Any, t: type[Any]) -> Any:
    """The frozen dict, list or tuple ``c`` (of type ``t``), or one built before holding the same objects."""
    if t is dict:
        types = tuple(map(type, c))
        if not _NO_FLOAT_KEY.issuperset(types):  # 0.0 and -0.0 are one key
            return c
        key: tuple[Any, ...] = (t, tuple(c), types, tuple(map(id, c.values())))
    else:
        key = (t, tuple(map(id, c)))
    got = _SHARED.get(key)
    if got is not None:
        return got
    _SHARED.put(key, c)
    return c


def _children(node: Any) -> list[Any]:
    t = type(node)
    if t is list or t is tuple:
        return list(node)
    if t is dict:
        out: list[Any] = []
        for k, v in node.items():
            out.append(k.obj if type(k) is Key else k)
            out.append(v)
        return out
    if t is SetNode:
        return list(node.items)
    if t is Key:
        return [node.obj]
    return [node.func, node.args, node.state]


_NODES = frozenset({list, tuple, dict, SetNode, Key, Obj})


def freeze(
    root: Any, limit: int, seeds: dict[int, tuple[Any, int]] | None = None, share: bool = True
) -> tuple[Any, bool]:
    """Turn the walk's internal graph into model values; returns (value, whether nesting was cut).

    Every node ends up with a height <= ``limit`` (children that would exceed it become ``TOO_DEEP``), so no
    consumer can recurse deeper than the limit; shared nodes stay shared, back edges become ``CYCLE``. ``seeds``:
    containers of scalars already frozen, by id, as ``(value, 1)`` (a walk resumed from a snapshot meets those of
    the walk before); a container of scalars met first is taken as it is, so with a limit above 1 a seed is what
    freezing it would give. ``share``: equal containers are the ones frozen before (``shared``); not for a value
    frozen mid-walk (a persistent id), whose containers the rest of the walk may still change.
    """
    if type(root) not in _NODES:
        return root, False
    # id -> (frozen, height)
    done: dict[int, tuple[Any, int]] = dict(seeds) if seeds is not None and limit > 1 else {}
    scalar_types = SCALARS.issuperset
    plain_types = _PLAIN.issuperset
    active: set[int] = set()
    cut = False
    # Each frame: [node, children, next index, frozen kids, max child height]
    frames: list[list[Any]] = [[root, _children(root), 0, [], 0]]
    active.add(id(root))
    result: Any = None
    while frames:
        fr = frames[-1]
        node, kids, i, out = fr[0], fr[1], fr[2], fr[3]
        pushed = False
        while i < len(kids):
            c = kids[i]
            i += 1
            if type(c) not in _NODES:
                out.append(c)
                continue
            cid = id(c)
            got = done.get(cid)
            if got is not None:
                if got[1] >= limit:
                    out.append(TOO_DEEP)
                    cut = True
                else:
                    out.append(got[0])
                    if got[1] > fr[4]:
                        fr[4] = got[1]
                continue
            if cid in active:
                out.append(CYCLE)
                continue
            ct = type(c)
            if (ct is list or ct is tuple) and scalar_types(map(type, c)):
                # Leaf containers (most of any real pickle) are final as they are: skip a frame.
                if not plain_types(map(type, c)):  # one of plain values is new in every file: never shared
                    c = shared(c, ct) if share else c
                done[cid] = (c, 1)
                out.append(c)
                if fr[4] < 1:
                    fr[4] = 1
                continue
            if ct is dict and scalar_types(map(type, c.values())) and scalar_types(map(type, c)):
                if not plain_types(map(type, c.values())):
                    c = shared(c, ct) if share else c
                done[cid] = (c, 1)
                out.append(c)
                if fr[4] < 1:
                    fr[4] = 1
                continue
            fr[2] = i
            active.add(cid)
            frames.append([c, _children(c), 0, [], 0])
            pushed = True
            break
        if pushed:
            continue
        frames.pop()
        active.discard(id(node))
        frozen = _build(node, out)
        ft = type(frozen)
        if ft is dict or ft is list or ft is tuple:
            frozen = shared(frozen, ft) if share else frozen
        height = fr[4] + 1
        done[id(node)] = (frozen, height)
        if not frames:
            result = frozen
        elif height >= limit:
            frames[-1][3].append(TOO_DEEP)
            cut = True
        else:
            frames[-1][3].append(frozen)
            if height > frames[-1][4]:
                frames[-1][4] = height
    return result, cut


# ---------------------------------------------------------------------------------------------------------------
# Walking a rebuilt value


def key_text(k: Any) -> str:
    """The path step of the dict key ``k`` (as ``iter_values`` writes it)."""
    if type(k) is str:
        return k
    if type(k) in (int, bool, float, type(None)):
        return str(k)
    if type(k) is bytes:
        return k.decode("utf-8", "replace")
    if type(k) is GlobalRef:
        return k.dotted
    return f"<{type(k).__name__}>"


def iter_values(
    value: PickleValue, path: str = "", seen: set[int] | None = None
) -> Iterator[tuple[str, PickleValue]]:
    """Every value reachable from ``value`` with its dotted path (``state.0.exp_avg``), root first.

    Dict keys and list positions make the path; an ``Opaque`` contributes its state's keys (object attributes)
    and ``args.N``. Iterative; a container reached twice is entered only the first time, so shared structure
    never multiplies the work. ``seen`` (when given) collects the ids of the containers entered.
    """
    if seen is None:
        seen = set()
    todo: list[tuple[str, Any]] = [(path, value)]
    while todo:
        p, v = todo.pop()
        yield p, v
        t = type(v)
        if t is dict or t is list or t is tuple or t is Opaque:
            if id(v) in seen:
                continue
            seen.add(id(v))
        else:
            continue
        pre = f"{p}." if p else ""
        kids: list[tuple[str, Any]]
        if t is dict:
            # str and int keys (a state dict's names and parameter indices) without a call each
            kids = [(pre + (k if type(k) is str else str(k) if type(k) is int else key_text(k)), x)
                    for k, x in v.items()]  # fmt: skip
        elif t is Opaque:
            kids = []
            if type(v.args) is tuple:
                kids.extend((f"{pre}args.{i}", x) for i, x in enumerate(v.args))
            if type(v.state) is dict:
                kids.extend((pre + key_text(k), x) for k, x in v.state.items())
            elif v.state is not None:
                kids.append((pre + "state", v.state))
        else:
            kids = [(f"{pre}{i}", x) for i, x in enumerate(v)]
        todo.extend(reversed(kids))
