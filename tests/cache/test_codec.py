"""The cache's encoding: every fact a reader makes of a real checkpoint comes back exactly (``repr``-equal: 0.0
and -0.0, 1 and True and 1.0 kept apart) through the stored table (``pack``, then ``marshal`` as the store writes
it), and a table it did not write decodes to nothing."""

from __future__ import annotations

import marshal
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptdoctor.cache.codec import CodecError, Decoder, Encoder, _indices, nodes_of, pack
from ckptdoctor.discover import discover
from ckptdoctor.model import FileFacts, FileKind, GlobalRef, JsonFacts, Opaque, PickleFacts, PickleVerdict, TensorRef
from tests.helpers.paths import REPO


def _n(*numbers: int) -> bytes:
    """Indices or counts as a stored group record holds them."""
    return _indices(numbers)


def _read_back(table: Any) -> Decoder:
    """The decoder of a stored ``table`` as the cache writes and reads it (through ``marshal``)."""
    return Decoder(marshal.loads(marshal.dumps(table, 4)))


def _stored(e: Encoder) -> tuple[Decoder, list[int]]:
    """The decoder of ``e``'s table as the cache stores and reads it, and where each of ``e``'s nodes went."""
    table, where = pack(e.nodes)
    return _read_back(table), where


def _round_trip(values: list[Any]) -> list[Any]:
    e = Encoder()
    at = [e.encode(v) for v in values]
    d, where = _stored(e)
    return [d.value(where[i]) for i in at]


def test_every_fixture_file_comes_back_exactly() -> None:
    files = discover(str(REPO / "fixtures")).all_files()
    kinds = {f.kind for f in files}
    assert {FileKind.SAFETENSORS, FileKind.TORCH_ZIP, FileKind.JSON, FileKind.DCP_METADATA} <= kinds
    back = _round_trip(list(files))
    assert [repr(b) for b in back] == [repr(f) for f in files]
    assert back == list(files)


def test_values_equal_in_python_stay_apart() -> None:
    tricky = [0.0, -0.0, 1, True, 1.0, None, math.inf, -math.inf, b"", b"\x00\xff", "1", 2j, (1, True), [1.0, 1],
              {1: "int"}, {True: "bool"}, {(1, 2): frozenset({3})}, {-0.0: 1}, {0.0: 1}, set(), frozenset()]
    back = _round_trip(tricky)
    assert [repr(b) for b in back] == [repr(v) for v in tricky]
    assert [type(b) for b in back] == [type(v) for v in tricky]
    nan = _round_trip([math.nan])[0]
    assert isinstance(nan, float) and math.isnan(nan)


def test_containers_of_scalars_held_inline_stay_apart() -> None:
    """Tuples, lists and string-keyed dicts of scalars only are one inline node each: equal-looking ones of other
    types or signs stay apart (1, 1.0 and True; 0.0 and -0.0), equal ones are one value."""
    tricky = [(1, 2), (1.0, 2), (True, 2), (0.0,), (-0.0,), [0.0, -0.0], [-0.0, 0.0], ["a", None, False],
              {"a": 1}, {"a": 1.0}, {"a": True}, {"a": -0.0}, {"a": 0.0}, {"a": math.inf, "b": "x"},
              tuple(range(40)), tuple(float(i) for i in range(40)), (("p", 1),) * 20, (("p", 1.0),) * 20]
    back = _round_trip(tricky)
    assert [repr(b) for b in back] == [repr(v) for v in tricky]
    assert [type(b) for b in back] == [type(v) for v in tricky]
    e = Encoder()
    assert e.encode({"a": 1, "b": "x"}) == e.encode({"a": 1, "b": "x"})  # new dicts, equal: one node
    assert e.nodes == [{"a": 1, "b": "x"}]  # the dict itself: stored with the others of its keys, a D group


def test_long_runs_of_integers_are_packed() -> None:
    """A tuple or list of 64 or more integers (a checkpoint's RNG state: 625) is packed in bytes, 4 to a value when
    all are below 2**32, else 8; one past 64 bits, a bool among them or a float keeps it inline; all come back as
    they were."""
    rng = (*range(2**31, 2**31 + 625), -(2**63), 2**63 - 1)
    values = [rng, list(rng), tuple(range(2**32 - 100, 2**32)), list(range(64)), (*range(63), 2**70),
              (*range(70), True), (*range(70), 1.0), tuple(range(63))]  # fmt: skip
    e = Encoder()
    for v in values:
        e.encode(v)
    assert [n[0] for n in e.nodes if isinstance(n, list)] == ["I8", "J8", "I4", "J4", "T", "T", "T", "T"]
    back = _round_trip(values)
    assert [repr(b) for b in back] == [repr(v) for v in values]
    assert [type(b) for b in back] == [type(v) for v in values]


def test_a_stored_table_groups_alike_nodes_after_their_children() -> None:
    """Stored, the leaves come first, then one group per tag and level; an encoder going on with a stored table
    finds its values where they are."""
    g, h = GlobalRef("os", "system"), GlobalRef("os", "popen")
    values = [(g, h), [g, (g, h)], {"k": (h,)}, frozenset({g}), b"\x00", 3j]
    e = Encoder()
    at = [e.encode(v) for v in values]
    table, where = pack(e.nodes)
    leaves, groups = table
    assert {type(v) for v in leaves} == {str, bytes, complex}
    assert [r[0] for r in groups] == ["@GlobalRef", "f", "t", "d", "l"]
    logs = [{"loss": 1.0, "step": 1}, {"loss": 0.5, "step": 2}, {"step": 2, "loss": 0.5}, {"eval_loss": 2.0}]
    e2 = Encoder()
    at2 = [e2.encode(v) for v in logs]
    table2, where2 = pack(e2.nodes)
    assert table2 == [[], [["D", ("loss", "step"), 2, [1.0, 1, 0.5, 2]], ["D", ("step", "loss"), 1, [2, 0.5]],
                           ["D", ("eval_loss",), 1, [2.0]]]]  # fmt: skip
    d2 = Decoder(table2)
    assert [list(d2.value(where2[i]).items()) for i in at2] == [list(v.items()) for v in logs]  # keys in order
    d = _read_back(table)
    assert [repr(d.value(where[i])) for i in at] == [repr(v) for v in values]
    again = Encoder.seeded(table, d)
    assert again.nodes == nodes_of(table, d)
    assert [again.encode(v) for v in values] == [where[i] for i in at]


def test_an_inline_container_holds_scalars_only() -> None:
    for leaf in ((1, [1]), [{"a": 1}], ((1,),), [b"x"], (2j,)):
        with pytest.raises(CodecError):
            Decoder([[0, leaf], []])


def test_pickle_values_and_verdicts() -> None:
    g = GlobalRef("os", "system")
    t = TensorRef("F32", (2, 3), (3, 1), 0, "0", 6, "cpu", 24)
    pf = PickleFacts(2, {"w": t, "call": Opaque(g, ("ls",), None, True), 3: [t, t]}, (g,), (g,), 9)
    verdict = PickleVerdict(("`os.system`",), (), 0, True, (("a.B", "a.*", "cli"),), (("x.Y", "fact"),), "")
    facts = FileFacts("a/b.pkl", 10, 1.5, FileKind.PICKLE, pf)
    back_facts, back_verdict = _round_trip([facts, verdict])
    assert repr(back_facts) == repr(facts) and repr(back_verdict) == repr(verdict)
    value = back_facts.content.value
    assert value["w"] is value[3][0] is value[3][1]  # equal values decode as one object, as the reader shares them


def test_long_lists_that_extend_another_share_its_items() -> None:
    first = [{"step": i} for i in range(40)]
    second = [*first, {"step": 40}]
    e = Encoder()
    a, b = e.encode(JsonFacts(first)), e.encode(JsonFacts(second))
    assert any(isinstance(n, list) and n[0] == "l+" for n in e.nodes)
    d, where = _stored(e)
    assert d.value(where[a]).value == first and d.value(where[b]).value == second
    assert d.value(where[b]).value[0] is d.value(where[a]).value[0]


def test_an_unknown_value_is_not_encoded() -> None:
    class Stranger:
        pass

    with pytest.raises(CodecError):
        Encoder().encode([Stranger()])
    with pytest.raises(CodecError):
        Encoder().encode(bytearray(b"x"))  # exact types only: a subclass or a look-alike is not the model's


@pytest.mark.parametrize(
    "table",
    [
        {"not": "a list"},
        [[], [], []],  # not leaves and groups
        [(), []],
        [["x"], ()],
        [[], [["@Nope", 1, _n(0)]]],  # a class outside the table
        [["os"], [["@GlobalRef", 1, _n(0)]]],  # a model value with too few fields
        [["os", "system"], [["@GlobalRef", 1, _n(0, 1, 1)]]],  # ... or too many
        [["os", "system"], [["@GlobalRef", 2, _n(0, 1, 1)]]],  # children that do not fill the count
        [["os", "system"], [["@GlobalRef", -1, _n()]]],
        [["os", "system"], [["@GlobalRef", 1.0, _n(0, 1)]]],
        [[], [["t", _n(1), _n(0)]]],  # a child that is no earlier node
        [["x"], [["t", _n(1), _n(1)]]],  # ... itself
        [["x"], [["t", _n(1), _n(2**32 - 1)]]],  # ... past the table
        [["x"], [["t", _n(1), [0]]]],  # children that are not stored as bytes of 4-byte numbers (format 4's list)
        [["x"], [["t", _n(1), b"\x00\x00"]]],
        [["x"], [["t", _n(1), bytearray(4)]]],
        [["x"], [["t", _n(2), _n(0)]]],  # lengths that are not the children's
        [["x"], [["t", _n(0, 2), _n(0)]]],
        [["x"], [["t", 1, _n(0)]]],
        [["x"], [["t", [1], _n(0)]]],
        [["no-such-kind"], [["%FileKind", 1, _n(0)]]],  # an enum value that does not exist
        [[1], [["%FileKind", 1, _n(0)]]],  # ... or that is no text
        [["file"], [["%Stack", 1, _n(0)]]],  # an enum outside the table
        [["x"], [[]]],  # a group with no tag
        [["x"], [[1, _n(1), _n(0)]]],  # a tag that is not text
        [["x"], ["t"]],
        [[1], [["d", _n(1), _n(0)]]],  # a dict with a key and no value
        [[[]], [["s", _n(1), _n(0)]]],  # an unhashable member
        [[[]], [["d", _n(2), _n(0, 0)]]],  # ... or key
        [["x"], [["l+", _n(0), _n(0), _n()]]],  # l+ of no list
        [[[1]], [["l+", _n(0), _n(1), _n()]]],  # extras it does not hold
        [[[1]], [["l+", _n(0, 0), _n(0), _n()]]],
        [[[1]], [["l+", _n(0), _n(0)]]],
        [["x", (1,)], [["z", 1, _n(1, 0)]]],  # z of no tuples
        [[(1,), (1, 2)], [["z", 1, _n(0, 1)]]],  # ... of two lengths
        [["x"], [["__import__", 1, _n(0)]]],  # a tag that is a function name
        [["x"], [["eval", 1, _n(0)]]],
        [["x"], [["b", 1, _n(0)]]],  # a tag of an older format
        [["x"], [["I4", 1, _n(0)]]],  # packed integers of no bytes
        [[b"\x00" * 6], [["I4", 1, _n(0)]]],  # ... or of bytes that are no 4-byte integers
        [[b"\x00" * 12], [["J8", 1, _n(0)]]],
        [[{"a": 1}], []],  # a dict of scalars is a D group's, never a leaf
        [[], [["D", ("a",), 1, [[1]]]]],  # ... holding scalars only
        [[], [["D", ("a",), 2, [1]]]],  # ... a value for each key of each dict
        [[], [["D", ("a", "a"), 1, [1, 2]]]],  # ... under distinct keys
        [[], [["D", (1,), 1, [1]]]],  # ... of text
        [[], [["D", ["a"], 1, [1]]]],
        [[], [["D", (), 1, []]]],
        [[], [["D", ("a",), 1]]],
        [[object()], []],  # a leaf of no type the table holds
        [[print], []],
        [[compile("1", "<x>", "eval")], []],  # code: marshal carries it, a table never holds it
    ],
)
def test_a_table_it_did_not_write_decodes_to_nothing(table: Any) -> None:
    with pytest.raises(CodecError):
        Decoder(table)


def test_an_entry_must_name_a_node_of_the_expected_kind() -> None:
    d = Decoder([["x"], [["t", _n(1), _n(0)]]])
    for index in (-1, 2, "0", None, 1.0):
        with pytest.raises(CodecError):
            d.value(index)
    with pytest.raises(CodecError):
        d.value(1, FileFacts)
    assert d.value(1, tuple) == ("x",)


def test_deep_nesting_is_refused_not_a_crash() -> None:
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(CodecError):
        Encoder().encode(deep)


_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=False),
    st.text(max_size=6), st.binary(max_size=6), st.complex_numbers(allow_nan=False, max_magnitude=1e6),
)  # fmt: skip
_KEYS = st.one_of(st.text(max_size=4), st.integers(-3, 3), st.booleans(), st.none())


def _values(leaf: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    refs = st.builds(GlobalRef, st.sampled_from(["os", "torch"]), st.sampled_from(["system", "load", "a.b"]))
    return st.recursive(
        st.one_of(leaf, refs, st.lists(st.integers(0, 2**40), min_size=60, max_size=70).map(tuple)),
        lambda inner: st.one_of(
            st.lists(inner, max_size=5), st.lists(inner, max_size=5).map(tuple),
            st.dictionaries(_KEYS, inner, max_size=4),  # sets: their repr's order is their hashes' (fixed tests)
            st.lists(st.tuples(st.text(max_size=3), inner), min_size=16, max_size=18).map(tuple),
            st.lists(inner, min_size=16, max_size=20).map(lambda v: [v, [*v, *v[:3]]]),
            inner.map(lambda v: JsonFacts(v)), inner.map(lambda v: Opaque(GlobalRef("m", "f"), (v,), None, False)),
        ),
        max_leaves=30,
    )  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(first=st.lists(_values(_SCALARS), max_size=6), then=st.lists(_values(_SCALARS), max_size=6))
def test_any_values_come_back_through_a_stored_table_and_one_that_goes_on(first: list[Any], then: list[Any]) -> None:
    """Random values (containers of scalars, shared prefixes, pairs, packed integers, model values) come back
    ``repr``-equal through a stored table; an encoder going on with that table (a changed file's rescan) keeps the
    first values where they are and adds the others, and the table it stores brings all of them back."""
    e = Encoder()
    at = [e.encode(v) for v in first]
    table, where = pack(e.nodes)
    d = _read_back(table)
    assert [repr(d.value(where[i])) for i in at] == [repr(v) for v in first]
    again = Encoder.seeded(table, d)
    old = [where[i] for i in at]
    assert [again.encode(d.value(i)) for i in old] == old
    more = [again.encode(v) for v in then]
    table2, where2 = pack(again.nodes)
    d2 = _read_back(table2)
    assert [repr(d2.value(where2[i])) for i in old] == [repr(v) for v in first]
    assert [repr(d2.value(where2[i])) for i in more] == [repr(v) for v in then]
