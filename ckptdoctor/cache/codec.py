"""A strict, executable-free encoding of file facts and pickle verdicts: what the verdict cache stores.

Nothing here runs code when it decodes, and the only objects it can make are the scalars, ``bytes``, ``complex`` and
containers Python's ``marshal`` carries (the cache file's body: ``cache.store``), and the model's own values named
in ``_CLASSES`` and ``_ENUMS`` (looked up by name in those tables, their fields set in declared order). Every part of
a table is checked before it is used: anything else is a ``CodecError``, in either direction: an entry that cannot
be encoded is not cached, one that cannot be decoded is not trusted.

The encoder's nodes (``Encoder.nodes``): a string, integer, float, boolean, null, bytes or complex number is a node
as it is; every other node is a list ``[tag, child, ...]`` whose children are indices of earlier nodes: ``t`` tuple,
``l`` list, ``d`` dict (keys and values alternating), ``s`` set, ``f`` frozenset, ``@Name`` a model value (its fields
in order), ``%Name`` an enum member (its value), ``z`` a tuple of pairs (two children: the tuple of first items and
the tuple of second items), ``l+`` a list that extends an earlier one (its first child) by the others; ``T`` and
``L`` are a tuple or list of scalars only, held inline (the node's items are the values themselves), and a dict of
scalars under string keys is its own node (a log entry). Equal values are one node (structural sharing, as the
readers share log histories and zip entries): a run's checkpoints repeat the same tensor layouts, so a run's table
holds each once, and decoding builds each once. Stored, the nodes are grouped (``pack``, below) so that decoding
builds a group of alike nodes at a time.
"""

from __future__ import annotations

import enum
import operator
import struct
import sys
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields
from itertools import chain, compress, islice, repeat
from typing import Any

from ckptdoctor import model
from ckptdoctor.cache import CodecError

__all__ = ["CodecError", "Decoder", "Encoder", "Table", "nodes_of", "pack"]

Table = list[Any]  # the encoder's nodes

# Every model value a FileFacts or a PickleVerdict may hold, by name. A name outside this table never decodes.
_CLASSES: dict[str, type[Any]] = {
    cls.__name__: cls
    for cls in (
        model.ReadProblem, model.GlobalRef, model.TensorRef, model.Opaque, model.PickleFacts, model.NestedPickle,
        model.TensorInfo, model.SafetensorsFacts, model.ZipMember, model.TorchFacts, model.CheckpointCallbackState,
        model.SchedulerState, model.LightningFacts, model.JsonFacts, model.TextFacts, model.DcpStorageRef,
        model.DcpMetadataFacts, model.MindSporeFacts, model.TfBundleEntry, model.TfIndexFacts,
        model.TfCheckpointStateFacts, model.Hdf5Dataset, model.Hdf5Facts, model.NpyArray, model.NumpyFacts,
        model.ArchiveFacts, model.FileFacts, model.PickleVerdict,
    )
}  # fmt: skip
_ENUMS: dict[str, type[enum.Enum]] = {cls.__name__: cls for cls in (model.FileKind, model.ProblemKind)}
_ENUM_TAGS: dict[type[Any], str] = {cls: f"%{name}" for name, cls in _ENUMS.items()}
# The field names of each class, in declared order (what an ``@Name`` node's children are).
_FIELDS: dict[type[Any], tuple[str, ...]] = {
    cls: tuple(f.name for f in fields(cls)) for cls in _CLASSES.values()
}
_NAMES: dict[type[Any], str] = {cls: f"@{name}" for name, cls in _CLASSES.items()}
# Each class's fields as one tuple, read at C speed (a run's first checkpoint holds thousands of model values).
def _getter(names: tuple[str, ...]) -> Callable[[Any], Sequence[Any]]:
    if len(names) > 1:
        return operator.attrgetter(*names)
    one = operator.attrgetter(names[0])
    return lambda v: (one(v),)


_GETTERS: dict[type[Any], Callable[[Any], Sequence[Any]]] = {cls: _getter(names) for cls, names in _FIELDS.items()}


class Encoder:
    """Appends values to one ``Table``, each distinct value once. Keeps every container it encoded alive (its ``id``
    is a key of the table) until the encoder is dropped."""

    def __init__(self) -> None:
        self.nodes: Table = []
        self._strs: dict[str, int] = {}
        self._ints: dict[int, int] = {}
        self._floats: dict[float | str, int] = {}  # by value; zeros by repr (0.0 == -0.0)
        self._other: dict[Any, int] = {}  # booleans, None, and each container's node content
        self._by_id: dict[int, int] = {}  # id(container) -> its index
        self._kept: list[Any] = []  # the containers whose ids are keys of ``_by_id``
        # id(first item) -> (length, index, list) of each long list encoded: where ``l+`` nodes look for a prefix
        self._lists: dict[int, deque[tuple[int, int, list[Any]]]] = {}
        self._same: dict[tuple[Any, ...], int] = {}  # (type, ids of items) -> index (see ``_encode``)
        self.seeded_from: Decoder | None = None  # the decoded table this encoder goes on with (``seeded``)

    @classmethod
    def seeded(cls, table: Any, decoded: Decoder) -> Encoder:
        """An encoder that goes on with the stored ``table`` (which ``decoded`` decoded): its values keep their
        indices (``seeded_from``), and what is encoded next finds them as if it had encoded them itself."""
        e = cls()
        nodes = e.nodes = nodes_of(table, decoded)
        e.seeded_from = decoded
        for i, (node, v) in enumerate(zip(nodes, decoded.values, strict=True)):
            t = node.__class__
            if t is dict:  # an inline dict (a log entry): found again by identity, as the readers share them
                e._by_id[id(v)] = i
                e._kept.append(v)
            elif t is list:
                e._other.setdefault(tuple(node), i)
                e._by_id[id(v)] = i
                e._kept.append(v)
                if v.__class__ is list and len(v) >= _PREFIX_MIN:
                    e._lists.setdefault(id(v[0]), deque(maxlen=_PREFIX_TRIES)).append((len(v), i, v))
            elif t is str:
                e._strs.setdefault(node, i)
            elif t is int:
                e._ints.setdefault(node, i)
            elif t is float:
                if node == node:  # a NaN is never shared
                    e._floats.setdefault(node if node else repr(node), i)
            elif t is complex:
                if node == node:
                    e._other.setdefault((t, repr(node)), i)
            else:
                e._other.setdefault((t, node), i)
        return e

    def encode(self, value: Any) -> int:
        """The index of ``value``'s node (added with everything it holds, unless already there). ``CodecError`` for
        a value the encoding does not hold, or one nested deeper than Python's recursion allows."""
        try:
            return self._encode(value)
        except RecursionError:
            raise CodecError("nested too deep to encode") from None

    def _encode(self, v: Any) -> int:
        # The hot path of a cold scan's cache write: a run's facts are hundreds of thousands of values, most of them
        # strings, integers and values the readers already share (one id, one look-up). Strings and integers are
        # looked up inline below, sparing a call each.
        t = v.__class__
        if t is str:
            i = self._strs.get(v)
            if i is None:
                i = self._strs[v] = len(self.nodes)
                self.nodes.append(v)
            return i
        if t is int:
            i = self._ints.get(v)
            if i is None:
                i = self._ints[v] = len(self.nodes)
                self.nodes.append(v)
            return i
        by_id = self._by_id
        i = by_id.get(id(v))
        if i is not None:
            return i
        node: list[Any]
        if t is tuple or t is list or t is dict or t is set or t is frozenset:
            # A container holding the very same objects (by identity, in the same order; a dict's keys and values)
            # as one encoded before encodes as that one: no look at its items. Sound, as the objects of a kept
            # container stay alive (their ids stay theirs). Each checkpoint's optimizer state rebuilds such
            # containers around the tensors and zip entries the readers share.
            same: tuple[Any, ...] | None
            if t is dict:
                # A dict of scalars under string keys (a log entry: each checkpoint adds dozens never met before)
                # is its own inline node, found by its content in ``_add``: no look for one holding the same objects.
                inline = _inline(t, v)
                if inline is not None:
                    return self._add(v, inline)
                # Keys by value (the readers make new key strings for each file) and type (1 and True are equal
                # keys): not for float keys, as 0.0 and -0.0 are equal keys too.
                types = tuple(map(type, v))
                same = None if float in types else (t, tuple(v), types, tuple(map(id, v.values())))
            elif t is tuple and len(v) >= _PREFIX_MIN and _pairs(v) and _strs(map(_FIRST, v)):
                # ((path, tensor), ...): each file's paths are new strings, its tensors the ones the readers share
                same = (_FIRST, tuple(map(_FIRST, v)), tuple(map(id, map(_SECOND, v))))
            elif t is list and len(v) >= _PREFIX_MIN:
                same = None  # ``_list`` finds one holding the same objects by its prefix, at C speed
            else:
                same = (t, tuple(map(id, v)))
            i = None if same is None else self._same.get(same)
            if i is not None:
                by_id[id(v)] = i
                self._kept.append(v)
                return i
            i = self._add(v, self._container(t, v))
            if same is not None:
                self._same[same] = i
            return i
        if t in _FIELDS:
            node = [_NAMES[t]]
            self._items(_GETTERS[t](v), node)
        elif t is float:
            # 0.0 and -0.0 are equal, yet each must stay what it is: zeros by repr. NaN, unequal to itself, is a
            # node of its own each time (never shared, never wrong).
            floats = self._floats
            key: Any = v if v else repr(v)
            i = floats.get(key)
            if i is None:
                i = floats[key] = len(self.nodes)
                self.nodes.append(v)
            return i
        elif t is bool or v is None:
            key = (t, v)
            i = self._other.get(key)
            if i is None:
                i = self._other[key] = len(self.nodes)
                self.nodes.append(v)
            return i
        elif t is bytes or t is complex:
            # a leaf as it is (the table's carrier, ``marshal``, holds both); a complex by its repr (0j and -0j are
            # equal, yet each stays what it is), one holding a NaN never shared
            key = (t, v if t is bytes else repr(v))
            i = self._other.get(key)
            if i is None:
                i = len(self.nodes)
                self.nodes.append(v)
                if v == v:
                    self._other[key] = i
            return i
        elif t in _ENUM_TAGS:
            node = [_ENUM_TAGS[t], self._encode(v.value)]
        else:
            raise CodecError(f"cannot encode a {t.__module__}.{t.__qualname__}")
        return self._add(v, node)

    def _add(self, v: Any, node: list[Any]) -> int:
        """The index of ``node`` (``v``'s), added unless an equal node is there; ``v`` kept."""
        key: tuple[Any, ...] = tuple(node)
        if node[0] in _INLINE:
            # its items are values, not indices: equal nodes must hold the same types too (1, 1.0 and True are
            # equal), and zeros of the same sign (0.0 == -0.0)
            key = (key, tuple(map(type, node)))
            if 0.0 in node and float in key[1]:
                key = (*key, tuple(map(repr, node)))
        i = self._other.get(key)
        if i is None:
            i = self._other[key] = len(self.nodes)
            # an inline dict is its own node (``v`` itself: string keys, scalar values)
            self.nodes.append(v if node[0] == "D" else node)
            if v.__class__ is list and len(v) >= _PREFIX_MIN:
                self._lists.setdefault(id(v[0]), deque(maxlen=_PREFIX_TRIES)).append((len(v), i, v))
        self._by_id[id(v)] = i
        self._kept.append(v)
        return i

    def _container(self, t: type[Any], v: Any) -> list[Any]:
        """The node of the tuple, list, dict, set or frozenset ``v``."""
        node: list[Any]
        if (t is tuple or t is list) and len(v) >= _PACK_MIN and _INT_ONLY.issuperset(map(type, v)):
            packed = _packed(t, v)
            if packed is not None:
                return [packed[0], self._encode(packed[1])]
        if t is tuple or t is list or t is dict:
            inline = _inline(t, v)
            if inline is not None:
                return inline
        if t is list and len(v) >= _PREFIX_MIN:
            return self._list(v)
        if t is tuple and len(v) >= _PREFIX_MIN and _pairs(v):
            # a tuple of pairs ((path, tensor), ...): its first items (new path strings in each file, equal from
            # file to file) as one tuple, its second items (tensors the readers share) as another
            return ["z", self._encode(tuple(map(_FIRST, v))), self._encode(tuple(map(_SECOND, v)))]
        if t is dict:
            node = ["d"]
            self._items([x for kv in v.items() for x in kv], node)
        else:
            node = [_TAGS[t]]
            self._items(v if t is not set and t is not frozenset else list(v), node)
        return node

    def _list(self, v: list[Any]) -> list[Any]:
        """The node of a long list: ``l+`` (a list encoded before that holds the same first items, by identity, and
        the items after them) when there is one, as each checkpoint's log history extends the one before; else
        ``l``. The last few long lists met with the same first item are the candidates."""
        node: list[Any] = ["l"]
        rest: Sequence[Any] = v
        for n, index, base in sorted(self._lists.get(id(v[0]), ()), key=_FIRST, reverse=True):
            if n <= len(v) and all(map(operator.is_, base, v)):
                node, rest = ["l+", index], v[n:]
                break
        self._items(rest, node)
        return node

    def _items(self, items: Sequence[Any], node: list[Any]) -> None:
        """Append the index of each of ``items`` to ``node``."""
        by_id = self._by_id
        # First the values encoded before, by identity, in one pass at C speed (``map``): most of a checkpoint's
        # values are tensors, zip entries and log entries the readers share between files.
        found = list(map(by_id.get, map(id, items)))
        if None not in found:
            node.extend(found)
            return
        strs, ints, floats, nodes = self._strs, self._ints, self._floats, self.nodes
        enc = self._encode
        # only the items not found by identity, by their places (found in one C pass too)
        for k in compress(range(len(found)), map(operator.is_, found, repeat(None))):
            x = items[k]
            t = x.__class__
            if t is str:
                i = strs.get(x)
                if i is None:
                    i = strs[x] = len(nodes)
                    nodes.append(x)
            elif t is int:
                i = ints.get(x)
                if i is None:
                    i = ints[x] = len(nodes)
                    nodes.append(x)
            elif t is float and x:
                i = floats.get(x)
                if i is None:
                    i = floats[x] = len(nodes)
                    nodes.append(x)
            else:
                i = enc(x)
            found[k] = i
        node.extend(found)


# Lists and tuples this long are worth the look for a shared prefix or pairs; a prefix is looked for among this many
# of the last lists encoded that start with the same item.
_PREFIX_MIN = 16
_PREFIX_TRIES = 4


# Tags of nodes whose items are scalars held inline (strings, numbers, booleans, null), not indices: a tuple,
# list or dict (keys and values alternating) of scalars only is one node, written and read at C speed (a checkpoint's
# RNG state, its log entries, a shard index's weight map). A ``D`` node is the encoder's key of an inline dict only:
# the table holds the dict itself.
_INLINE = frozenset({"T", "L", "D"})
_INLINE_READ = frozenset({"T", "L"})
_SCALAR_TYPES = frozenset({str, int, float, bool, type(None)})
_STR_ONLY = frozenset({str})


def _inline(t: type[Any], v: Any) -> list[Any] | None:
    """The inline node of the tuple, list or dict ``v`` when all it holds are scalars (a dict: under string keys);
    else None."""
    if t is dict:
        if not v or not _STR_ONLY.issuperset(map(type, v)) or not _SCALAR_TYPES.issuperset(map(type, v.values())):
            return None
        node = ["D"]
        node.extend(chain.from_iterable(v.items()))
        return node
    if not v or not _SCALAR_TYPES.issuperset(map(type, v)):
        return None
    node = ["T" if t is tuple else "L"]
    node.extend(v)
    return node


# A tuple or list of at least this many integers (a checkpoint's RNG state: 625 of them) is packed: its values'
# little-endian bytes, 4 each when they are all below 2**32 (``I4``: a tuple, ``J4``: a list), else 8 each, signed
# (``I8``, ``J8``), the node's one child. Unpacked at C speed, and its items need no look at their types: ``struct``
# makes integers only.
_PACK_MIN = 64
_PACKS: dict[str, tuple[type[Any], str]] = {"I4": (tuple, "I"), "J4": (list, "I"), "I8": (tuple, "q"),
                                             "J8": (list, "q")}  # fmt: skip


def _packed(t: type[Any], v: Sequence[int]) -> tuple[str, bytes] | None:
    """The tag and bytes of the tuple or list of integers ``v`` packed; None when one is past 64 bits."""
    wide = min(v) < 0 or max(v) >= 1 << 32
    try:
        raw = struct.pack(f"<{len(v)}{'q' if wide else 'I'}", *v)
    except struct.error:
        return None
    return f"{'I' if t is tuple else 'J'}{8 if wide else 4}", raw


def _unpacked(tag: str, values: list[Any]) -> list[Any]:
    """The tuples or lists of a group of packed nodes, from their bytes."""
    kind, code = _PACKS[tag]
    size = struct.calcsize(code)
    if not _BYTES_ONLY.issuperset(map(type, values)) or any(len(b) % size for b in values):
        raise CodecError(f"a {tag} node holds bytes of {size}-byte integers")
    made = [struct.unpack(f"<{len(b) // size}{code}", b) for b in values]
    return made if kind is tuple else list(map(list, made))


_BYTES_ONLY = frozenset({bytes})
_TUPLE_ONLY = frozenset({tuple})
_INT_ONLY = frozenset({int})
_TWO_ONLY = frozenset({2})


def _pairs(v: tuple[Any, ...]) -> bool:
    # at C speed: each checkpoint's optimizer state has a few such tuples of hundreds of pairs
    return _TUPLE_ONLY.issuperset(map(type, v)) and _TWO_ONLY.issuperset(map(len, v))


_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


def _strs(items: Iterable[Any]) -> bool:
    return _STR_ONLY.issuperset(map(type, items))  # at C speed


_TAGS: dict[type[Any], str] = {tuple: "t", list: "l", dict: "d", set: "s", frozenset: "f"}

# ---------------------------------------------------------------------------------------------------------------
# The table as stored: leaves, then groups of nodes alike
#
# The encoder's nodes come in the order met (each after its children). Stored, they are reordered so that a warm
# rescan builds them at C speed, a group at a time instead of a node at a time (10^4 nodes a run): first the leaves
# (scalars, bytes, complex numbers and the tuples and lists of scalars held inline, each its own value), then groups of
# nodes of one tag and one level (a leaf is level 0, a node one more than its highest child), in level order, so
# every child of a group is in an earlier group or a leaf. Each group is a record:
#
#   [tag, count, kids]            a fixed number of children each: a model value (its fields), an enum member (its
#                                 value), ``z`` (two tuples), packed integers (their bytes); ``kids`` holds every
#                                 node's children one after another
#   [tag, lengths, kids]          ``t`` ``l`` ``s`` ``f`` ``d`` (keys and values alternating): each node's number of
#                                 children in ``lengths``
#   ["l+", bases, lengths, kids]  each node the list at its index in ``bases`` extended by its ``lengths`` children
#
#   ["D", keys, count, values]    dicts of scalars under the text ``keys`` (log entries; one record for each set of
#                                 keys, in order), their values one after another; after the leaves, before every
#                                 other group
#
# A node's index is its place in that order (the leaves first); a parent names its children by index. ``kids``,
# ``lengths`` and ``bases`` are bytes of 4-byte numbers (``_indices``); ``count`` is a number.

_LEAF_TYPES = frozenset({str, int, float, bool, type(None), bytes, complex, tuple, list})
_CONTAINER_LEAVES = (tuple, list)
_FIXED: dict[str, int] = {"z": 2}
_VARIABLE: dict[str, Callable[[Iterable[Any]], Any]] = {"t": tuple, "l": list, "s": set, "f": frozenset}
_LIST_ONLY = frozenset({list})


def pack(nodes: Table) -> tuple[list[Any], list[int]]:
    """The stored table of the encoder's ``nodes`` (each after its children), and the index in it of each node."""
    level = [0] * len(nodes)
    leaves: list[int] = []
    dicts: dict[tuple[str, ...], list[int]] = {}  # inline dicts (log entries) by their keys, in order
    groups: dict[tuple[int, str], list[int]] = {}
    get = level.__getitem__
    for i, node in enumerate(nodes):
        t = node.__class__
        if t is list and node[0] not in _INLINE_READ:
            kids = node[1:]
            lv = level[i] = max(map(get, kids), default=0) + 1
            at = groups.get((lv, node[0]))
            if at is None:
                groups[(lv, node[0])] = [i]
            else:
                at.append(i)
        elif t is dict:
            dicts.setdefault(tuple(node), []).append(i)
        else:
            leaves.append(i)
    order = list(leaves)
    for members in dicts.values():
        order.extend(members)
    for key in sorted(groups):
        order.extend(groups[key])
    where = [0] * len(nodes)
    for new, old in enumerate(order):
        where[old] = new
    at_ = where.__getitem__
    out_leaves = [_leaf(nodes[i]) for i in leaves]
    records: list[Any] = [["D", keys, len(members), list(chain.from_iterable(nodes[i].values() for i in members))]
                          for keys, members in dicts.items()]  # fmt: skip
    for (_, tag), members in sorted(groups.items()):
        kid_lists = [list(map(at_, nodes[i][1:])) for i in members]
        if tag == "l+":
            records.append([tag, _indices([k[0] for k in kid_lists]), _indices([len(k) - 1 for k in kid_lists]),
                            _indices(chain.from_iterable(k[1:] for k in kid_lists))])  # fmt: skip
        elif tag in _VARIABLE or tag == "d":
            records.append([tag, _indices(map(len, kid_lists)), _indices(chain.from_iterable(kid_lists))])
        else:
            records.append([tag, len(members), _indices(chain.from_iterable(kid_lists))])
    return [out_leaves, records], where


# A group's children, lengths and bases are stored as unsigned 32-bit integers in little-endian bytes (``_indices``):
# a run's table names some 10^5 children, which ``marshal`` would read as as many integer objects (a third of the
# table's decoding); bytes read at once, and their numbers made one at a time as a group takes its children.
_U32 = next(code for code in "IL" if array(code).itemsize == 4)
_SWAP = sys.byteorder != "little"


def _indices(numbers: Iterable[int]) -> bytes:
    """``numbers`` (indices or counts) as a group record stores them; ``CodecError`` past 32 bits."""
    try:
        packed = array(_U32, numbers)
    except OverflowError:
        raise CodecError("a table too large to store") from None
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


def _numbers(raw: Any) -> array[int]:
    """The indices or counts ``_indices`` stored in ``raw``; ``CodecError`` when ``raw`` is no such bytes."""
    if type(raw) is not bytes or len(raw) % 4:
        raise CodecError("a group's indices and counts are bytes of 4-byte integers")
    numbers = array(_U32)
    numbers.frombytes(raw)
    if _SWAP:
        numbers.byteswap()
    return numbers


def _leaf(node: Any) -> Any:
    if node.__class__ is list:  # an inline tuple or list of scalars
        return tuple(node[1:]) if node[0] == "T" else node[1:]
    return node


def nodes_of(table: Any, decoded: Decoder) -> Table:
    """The encoder's nodes of a stored ``table`` (which ``decoded`` decoded), in its order: what an encoder going on
    with it starts from (``Encoder.seeded``)."""
    leaves, records = table
    out: Table = [_leaf_node(v) for v in leaves]
    for rec in records:
        tag = rec[0]
        if tag == "D":
            it = iter(rec[3])
            out.extend(dict(zip(rec[1], islice(it, len(rec[1])), strict=True)) for _ in range(rec[2]))
        elif tag == "l+":
            it = iter(_numbers(rec[3]))
            out.extend([tag, base, *islice(it, n)] for base, n in zip(_numbers(rec[1]), _numbers(rec[2]), strict=True))
        elif tag in _VARIABLE or tag == "d":
            it = iter(_numbers(rec[2]))
            out.extend([tag, *islice(it, n)] for n in _numbers(rec[1]))
        else:
            kids = _numbers(rec[2]).tolist()
            width = len(kids) // rec[1] if rec[1] else 0
            out.extend([tag, *kids[j * width : (j + 1) * width]] for j in range(rec[1]))
    assert len(out) == len(decoded.values)
    return out


def _leaf_node(v: Any) -> Any:
    t = v.__class__
    if t is tuple:
        return ["T", *v]
    if t is list:
        return ["L", *v]
    return v


class Decoder:
    """The values of one stored table (``pack``), built group by group, each group at C speed."""

    def __init__(self, table: Any) -> None:
        if type(table) is not list or len(table) != 2 or type(table[0]) is not list or type(table[1]) is not list:
            raise CodecError("a table is a list of leaves and a list of groups")
        leaves, records = table
        # the leaves: their types at once, and what the inline containers hold (scalars)
        types = list(map(type, leaves))
        if not _LEAF_TYPES.issuperset(types):
            raise CodecError("a leaf is a scalar, bytes, a complex number or a tuple or list of scalars")
        inline = compress(leaves, map(_CONTAINER_LEAVES.__contains__, types))
        if not _SCALAR_TYPES.issuperset(map(type, chain.from_iterable(inline))):
            raise CodecError("an inline container holds scalars only")
        out = list(leaves)
        for rec in records:
            if type(rec) is not list or len(rec) < 3 or type(rec[0]) is not str:
                raise CodecError("a group is a list that starts with its tag")
            out.extend(_group(rec, out))
        self.values = out

    def value(self, index: Any, kind: type[Any] | None = None) -> Any:
        """The value at ``index``, which must be a ``kind`` when given; ``CodecError`` otherwise."""
        if type(index) is not int or not 0 <= index < len(self.values):
            raise CodecError("an entry names no node of the table")
        v = self.values[index]
        if kind is not None and type(v) is not kind:
            raise CodecError(f"an entry's node is a {type(v).__name__}, not a {kind.__name__}")
        return v


def _fetched(kids: Any, out: list[Any]) -> list[Any]:
    """The values of the nodes ``kids`` names (``_indices``' bytes), which must be indices of nodes built already
    (in ``out``)."""
    try:
        return list(map(out.__getitem__, _numbers(kids)))  # an index past ``out`` is a node not built yet: IndexError
    except IndexError:
        raise CodecError("a child is the index of an earlier node") from None


def _counts(lengths: Any, total: int) -> array[int]:
    """The counts of children ``lengths`` stores (``_indices``' bytes), which must add up to ``total``."""
    counts = _numbers(lengths)
    if sum(counts) != total:
        raise CodecError("a group's lengths are counts of its children")
    return counts


def _group(rec: list[Any], out: list[Any]) -> Iterable[Any]:
    """The values of one group record, whose children are in ``out``."""
    tag = rec[0]
    if tag == "D":
        return _inline_dicts(rec)
    if tag == "l+":
        if len(rec) != 4:
            raise CodecError("an l+ group holds its bases, lengths and children")
        _, bases, raw_lengths, kids = rec
        firsts = _fetched(bases, out)
        extra = _fetched(kids, out)
        lengths = _counts(raw_lengths, len(extra))
        if len(firsts) != len(lengths):
            raise CodecError("an l+ group has a base for each node")
        if not _LIST_ONLY.issuperset(map(type, firsts)):
            raise CodecError("an l+ node extends a list")
        it = iter(extra)
        return list(map(operator.add, firsts, map(list, map(islice, repeat(it), lengths))))
    if len(rec) != 3:
        raise CodecError(f"a {tag} group holds a count and its children")
    _, count, kids = rec
    values = _fetched(kids, out)
    make = _VARIABLE.get(tag)
    if make is not None or tag == "d":
        counts = _counts(count, len(values))
        it = iter(values)
        parts = map(islice, repeat(it), counts)
        if make is not None:
            try:
                return list(map(make, parts))
            except TypeError:  # an unhashable member: not a table this module wrote
                raise CodecError(f"a {tag} node holds an unhashable value") from None
        if any(map((1).__and__, counts)):  # an odd count
            raise CodecError("a dict node with an odd number of children")
        pairs = list(parts)
        try:
            return list(map(dict, map(zip, pairs, pairs)))
        except TypeError:
            raise CodecError("a d node holds an unhashable key") from None
    if type(count) is not int or count < 0:
        raise CodecError(f"a {tag} group's count is a number")
    model = _MODEL_TAGS.get(tag)
    width = model[1] if model is not None else 1 if tag[:1] == "%" or tag in _PACKS else _FIXED.get(tag)
    if width is None:
        raise CodecError(f"unknown tag {tag!r}")
    if len(values) != count * width:
        raise CodecError(f"no {tag} node with {len(values) / count if count else 0:g} children")
    if model is not None:
        # each value made as the class's own ``__init__`` makes it (its fields set, in order, through their slots;
        # a model value has no other step), a field at a time for the whole group
        cls = model[0]
        made = list(map(object.__new__, repeat(cls, count)))
        for j, setter in enumerate(_SETTERS[cls]):
            deque(map(setter, made, values[j::width]), maxlen=0)
        return made
    if tag in _PACKS:
        return _unpacked(tag, values)
    if tag == "z":
        firsts, seconds = values[0::2], values[1::2]
        if not _TUPLE_ONLY.issuperset(map(type, values)) or list(map(len, firsts)) != list(map(len, seconds)):
            raise CodecError("a z node holds two tuples of one length")
        return list(map(tuple, map(zip, firsts, seconds)))
    kind = _ENUMS.get(tag[1:])
    if kind is None:
        raise CodecError(f"no enum {tag[1:]!r}")
    if not _STR_ONLY.issuperset(map(type, values)):
        raise CodecError(f"a {tag[1:]} is named by its text")
    try:
        return list(map(kind._value2member_map_.__getitem__, values))
    except KeyError as e:
        raise CodecError(f"{e.args[0]!r} is no {tag[1:]}") from None


def _inline_dicts(rec: list[Any]) -> list[dict[str, Any]]:
    """The dicts of a ``D`` record: ``count`` dicts of scalars under the text ``keys``, their values one after
    another."""
    if len(rec) != 4:
        raise CodecError("a D group holds its keys, count and values")
    _, keys, count, values = rec
    if (
        type(keys) is not tuple
        or not keys
        or not _STR_ONLY.issuperset(map(type, keys))
        or len(set(keys)) != len(keys)
        or type(count) is not int
        or type(values) is not list
        or len(values) != count * len(keys)
    ):
        raise CodecError("a D group holds distinct text keys and their values for each dict")
    if not _SCALAR_TYPES.issuperset(map(type, values)):
        raise CodecError("an inline dict holds scalars only")
    rows = zip(*[iter(values)] * len(keys), strict=True)  # one iterator, len(keys) at a time: a dict's values
    return list(map(dict, map(zip, repeat(keys, count), rows)))


# ``@Name`` -> the class and its number of fields
_MODEL_TAGS: dict[str, tuple[type[Any], int]] = {f"@{name}": (cls, len(_FIELDS[cls])) for name, cls in _CLASSES.items()}
# each model class's field setters, in field order: its slots' descriptors (the frozen ``__setattr__`` raises)
_SETTERS: dict[type[Any], tuple[Callable[[Any, Any], None], ...]] = {
    cls: tuple(getattr(cls, name).__set__ for name in names) for cls, names in _FIELDS.items()
}
