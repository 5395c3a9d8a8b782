"""A strict, executable-free encoding of file facts and pickle verdicts as JSON: what the verdict cache stores.

Nothing here can run code when it decodes: the document is JSON (``json.loads``), and the only objects it can make
are the containers and scalars JSON and Python share, ``bytes`` and ``complex``, and the model's own values named in
``_CLASSES`` and ``_ENUMS`` (looked up by name in those tables, built with their fields in declared order). Anything
else, in either direction, is a ``CodecError``: an entry that cannot be encoded is not cached, one that cannot be
decoded is not trusted.

A ``Table`` is a list of nodes, each after the nodes it refers to. A JSON string, integer, float, boolean or null is
a node as it is; every other node is a list ``[tag, child, ...]`` whose children are indices of earlier nodes:
``t`` tuple, ``l`` list, ``d`` dict (keys and values alternating), ``s`` set, ``f`` frozenset, ``b`` bytes (one
child: base64 text), ``c`` complex (real and imaginary parts), ``@Name`` a model value (its fields in order),
``%Name`` an enum member (its value), ``z`` a tuple of pairs (two children: the tuple of first items and the tuple
of second items); ``T`` and ``L`` are a tuple or list of scalars only, held inline (the node's items are the values
themselves, not indices), and a JSON object is a dict of scalars under string keys (a log entry: ``json.loads``
builds it, and decoding takes it as it is); ``I`` and ``J`` are a tuple or list of 64 or more integers of 64 bits
(one child: the hex text of their little-endian 8-byte values, a checkpoint's RNG state). Equal values are one node
(structural sharing, as the readers share log histories and zip entries): a run's checkpoints repeat the same tensor
layouts, so a run's table holds each once, and decoding builds each once.
"""

from __future__ import annotations

import binascii
import enum
import operator
import struct
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields
from itertools import chain, compress, repeat
from typing import Any

from ckptdoctor import model
from ckptdoctor.cache import CodecError

__all__ = ["CodecError", "Decoder", "Encoder", "Table"]

Table = list[Any]  # the nodes, as json.loads gives them back

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
    def seeded(cls, nodes: Table, decoded: Decoder) -> Encoder:
        """An encoder that goes on with the table ``nodes`` (which ``decoded`` decoded): its values keep their
        indices (``seeded_from``), and what is encoded next finds them as if it had encoded them itself."""
        e = cls()
        e.nodes = list(nodes)
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
        elif t is bytes:
            node = ["b", self._encode(binascii.b2a_base64(v, newline=False).decode("ascii"))]
        elif t is complex:
            node = ["c", self._encode(v.real), self._encode(v.imag)]
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
            # an inline dict is written as the JSON object it is (``v`` itself: string keys, scalar values)
            self.nodes.append(v if node[0] == "D" else node)
            if v.__class__ is list and len(v) >= _PREFIX_MIN:
                self._lists.setdefault(id(v[0]), deque(maxlen=_PREFIX_TRIES)).append((len(v), i, v))
        self._by_id[id(v)] = i
        self._kept.append(v)
        return i

    def _container(self, t: type[Any], v: Any) -> list[Any]:
        """The node of the tuple, list, dict, set or frozenset ``v``."""
        node: list[Any]
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


# Tags of nodes whose items are scalars held inline (JSON strings, numbers, booleans, null), not indices: a tuple,
# list or dict (keys and values alternating) of scalars only is one node, written and read at C speed (a checkpoint's
# RNG state, its log entries, a shard index's weight map). A ``D`` node is the encoder's key of an inline dict only:
# the table holds the dict itself, a JSON object.
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
    if len(v) >= _PACK_MIN and _INT_ONLY.issuperset(map(type, v)):
        try:
            packed = struct.pack(f"<{len(v)}q", *v)
        except struct.error:  # an integer past 64 bits: held as JSON numbers
            pass
        else:
            return ["I" if t is tuple else "J", packed.hex()]
    node = ["T" if t is tuple else "L"]
    node.extend(v)
    return node


# A tuple or list of at least this many integers, each of 64 bits, is packed: ``I`` (a tuple) or ``J`` (a list)
# holds the hex text of their little-endian 8-byte values (a checkpoint's RNG state is 625 of them: one string for
# json.loads to scan instead of 625 numbers to parse; hex, as ``bytes.fromhex`` reads it three times faster than
# base64 is decoded)
_PACK_MIN = 64
_PACKED = frozenset({"I", "J"})


def _unpacked(node: list[Any]) -> tuple[int, ...] | list[int]:
    """The tuple or list of a packed node (``_PACKED``)."""
    if len(node) != 2 or node[1].__class__ is not str:
        raise CodecError("a packed node holds one hex text")
    try:
        raw = bytes.fromhex(node[1])
    except ValueError:
        raise CodecError("a packed node whose text is not hex") from None
    if len(raw) % 8:
        raise CodecError("a packed node's bytes are not 8-byte integers")
    values = struct.unpack(f"<{len(raw) // 8}q", raw)
    return values if node[0] == "I" else list(values)


_TUPLE_ONLY = frozenset({tuple})
_INT_ONLY = frozenset({int})
_TWO_ONLY = frozenset({2})


def _pairs(v: tuple[Any, ...]) -> bool:
    # at C speed: each checkpoint's optimizer state has a few such tuples of hundreds of pairs
    return _TUPLE_ONLY.issuperset(map(type, v)) and _TWO_ONLY.issuperset(map(len, v))


_FIRST, _SECOND = operator.itemgetter(0), operator.itemgetter(1)


def _strs(items: Iterable[Any]) -> bool:
    return _STR_ONLY.issuperset(map(type, items))  # at C speed


_NODE_TYPES = frozenset({str, int, float, bool, type(None), list, dict})
# ``@Name`` -> the class and its number of fields (the decoder builds these nodes without a call to ``_build``)
_MODEL_TAGS: dict[str, tuple[type[Any], int]] = {f"@{name}": (cls, len(_FIELDS[cls])) for name, cls in _CLASSES.items()}

_TAGS: dict[type[Any], str] = {
    tuple: "t", list: "l", dict: "d", set: "s", frozenset: "f", bytes: "b", complex: "c"
}  # fmt: skip


def _dict(kids: list[Any]) -> dict[Any, Any]:
    if len(kids) % 2:
        raise CodecError("a dict node with an odd number of children")
    return dict(zip(kids[::2], kids[1::2], strict=True))


def _extended(kids: list[Any]) -> list[Any]:
    if not kids or type(kids[0]) is not list:
        raise CodecError("an l+ node starts with a list")
    return kids[0] + kids[1:]


def _pairs_of(kids: list[Any]) -> tuple[Any, ...]:
    if len(kids) % 2:
        raise CodecError("a t2 node with an odd number of children")
    return tuple(zip(kids[::2], kids[1::2], strict=True))


def _bytes(kids: list[Any]) -> bytes:
    if len(kids) != 1 or type(kids[0]) is not str:
        raise CodecError("a bytes node holds one base64 text")
    try:
        import base64  # here: most scans decode no bytes, and the module costs a scan's start-up

        return base64.b64decode(kids[0], validate=True)
    except binascii.Error:
        raise CodecError("a bytes node whose text is not base64") from None


def _complex(kids: list[Any]) -> complex:
    if len(kids) != 2 or any(type(k) is not float for k in kids):
        raise CodecError("a complex node holds two floats")
    return complex(kids[0], kids[1])


def _zipped(kids: list[Any]) -> tuple[Any, ...]:
    if len(kids) != 2 or type(kids[0]) is not tuple or type(kids[1]) is not tuple or len(kids[0]) != len(kids[1]):
        raise CodecError("a z node holds two tuples of one length")
    return tuple(zip(kids[0], kids[1], strict=True))


def _inline_value(node: list[Any]) -> Any:
    """The tuple or list of an inline node (``_INLINE_READ``): its items are JSON's scalars, as ``json.loads`` gave
    them."""
    items = node[1:]
    if not _SCALAR_TYPES.issuperset(map(type, items)):
        raise CodecError("an inline node holds scalars only")
    return tuple(items) if node[0] == "T" else items


_BUILDERS: dict[str, Callable[[list[Any]], Any]] = {
    "t": tuple, "l": list, "l+": _extended, "t2": _pairs_of, "z": _zipped, "d": _dict, "s": set, "f": frozenset,
    "b": _bytes, "c": _complex,
}  # fmt: skip


class Decoder:
    """The values of one ``Table``, built once each, in table order (every child before its parent)."""

    def __init__(self, nodes: Any) -> None:
        if type(nodes) is not list:
            raise CodecError("a table is a list")
        # A warm rescan decodes a run's whole table (10^4 nodes), so what can be is done at C speed: the nodes'
        # types are checked at once, scalars and log entries (JSON objects, as ``json.loads`` built them) are their
        # own values, and only the list nodes are built, one by one, their children checked and fetched by ``map``.
        types = list(map(type, nodes))
        if not _NODE_TYPES.issuperset(types):
            raise CodecError("a node is a scalar, a list or an object of scalars")
        dicts = compress(nodes, map(operator.is_, types, repeat(dict)))
        if not _SCALAR_TYPES.issuperset(map(type, chain.from_iterable(map(dict.values, dicts)))):
            raise CodecError("an inline dict holds scalars only")
        out = list(nodes)
        get = out.__getitem__
        for i in compress(range(len(types)), map(operator.is_, types, repeat(list))):
            node = nodes[i]
            if not node or node[0].__class__ is not str:
                raise CodecError("a node list starts with its tag")
            tag = node[0]
            if tag in _INLINE_READ:
                out[i] = _inline_value(node)
                continue
            if tag in _PACKED:
                out[i] = _unpacked(node)
                continue
            kids = node[1:]
            if kids and (not _INT_ONLY.issuperset(map(type, kids)) or min(kids) < 0 or max(kids) >= i):
                raise CodecError("a child is the index of an earlier node")
            values = list(map(get, kids))
            model = _MODEL_TAGS.get(tag)
            if model is None:
                out[i] = _build(tag, values)
            elif len(values) != model[1]:
                raise CodecError(f"no model value {tag[1:]!r} with {len(values)} fields")
            else:
                out[i] = model[0](*values)
        self.values = out

    def value(self, index: Any, kind: type[Any] | None = None) -> Any:
        """The value at ``index``, which must be a ``kind`` when given; ``CodecError`` otherwise."""
        if type(index) is not int or not 0 <= index < len(self.values):
            raise CodecError("an entry names no node of the table")
        v = self.values[index]
        if kind is not None and type(v) is not kind:
            raise CodecError(f"an entry's node is a {type(v).__name__}, not a {kind.__name__}")
        return v


def _build(tag: str, kids: list[Any]) -> Any:
    builder = _BUILDERS.get(tag)
    if builder is not None:
        try:
            return builder(kids)
        except TypeError:  # an unhashable key or member: not a table this module wrote
            raise CodecError(f"a {tag} node holds an unhashable value") from None
    head, name = tag[:1], tag[1:]
    if head == "@":
        cls = _CLASSES.get(name)
        if cls is None or len(kids) != len(_FIELDS[cls]):
            raise CodecError(f"no model value {name!r} with {len(kids)} fields")
        return cls(*kids)
    if head == "%":
        kind = _ENUMS.get(name)
        if kind is None or len(kids) != 1:
            raise CodecError(f"no enum {name!r}")
        try:
            return kind(kids[0])
        except ValueError:
            raise CodecError(f"{kids[0]!r} is no {name}") from None
    raise CodecError(f"unknown tag {tag!r}")
