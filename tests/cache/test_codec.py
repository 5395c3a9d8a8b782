"""The cache's encoding: every fact a reader makes of a real checkpoint comes back exactly (``repr``-equal: 0.0
and -0.0, 1 and True and 1.0 kept apart), and a document it did not write decodes to nothing."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from ckptdoctor.cache.codec import CodecError, Decoder, Encoder
from ckptdoctor.discover import discover
from ckptdoctor.model import FileFacts, FileKind, GlobalRef, JsonFacts, Opaque, PickleFacts, PickleVerdict, TensorRef
from tests.helpers.paths import REPO


def _round_trip(values: list[Any]) -> list[Any]:
    e = Encoder()
    at = [e.encode(v) for v in values]
    d = Decoder(json.loads(json.dumps(e.nodes)))
    return [d.value(i) for i in at]


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
    assert e.nodes == [{"a": 1, "b": "x"}]  # written as the JSON object it is: json.loads builds it


def test_long_runs_of_integers_are_packed() -> None:
    """A tuple or list of 64 or more 64-bit integers (an RNG state) is one hex text; one past 64 bits, a bool
    among them or a float keeps it JSON numbers; all come back as they were."""
    rng = (*range(2**31, 2**31 + 625), -(2**63), 2**63 - 1)
    values = [rng, list(rng), (*range(63), 2**63), (*range(70), True), (*range(70), 1.0), tuple(range(63))]
    e = Encoder()
    for v in values:
        e.encode(v)
    assert [n[0] for n in e.nodes if isinstance(n, list)] == ["I", "J", "T", "T", "T", "T"]
    back = _round_trip(values)
    assert [repr(b) for b in back] == [repr(v) for v in values]
    assert [type(b) for b in back] == [type(v) for v in values]


def test_an_inline_node_holds_scalars_only() -> None:
    for node in (["T", [1]], ["L", {"a": 1}], ["D", 1, 2], ["D", "a"], ["z", 0]):
        with pytest.raises(CodecError):
            Decoder([0, node])


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
    d = Decoder(json.loads(json.dumps(e.nodes)))
    assert d.value(a).value == first and d.value(b).value == second
    assert d.value(b).value[0] is d.value(a).value[0]


def test_an_unknown_value_is_not_encoded() -> None:
    class Stranger:
        pass

    with pytest.raises(CodecError):
        Encoder().encode([Stranger()])
    with pytest.raises(CodecError):
        Encoder().encode(bytearray(b"x"))  # exact types only: a subclass or a look-alike is not the model's


@pytest.mark.parametrize(
    "nodes",
    [
        {"not": "a list"},
        [["@Nope", 0]],  # a class outside the table
        [["@GlobalRef", 0]],  # a model value with too few fields
        ["os", "system", ["@GlobalRef", 0, 1, 1]],  # ... or too many
        [["t", 1], 5],  # a child after its parent
        ["x", ["t", -1]],  # a negative index
        ["x", ["t", 0.0]],  # an index that is no integer
        [["%FileKind", 0]],  # an enum whose value is no node yet
        ["no-such-kind", ["%FileKind", 0]],  # an enum value that does not exist
        ["%Stack", ["%Stack", 0]],  # an enum outside the table
        [[], "x"],  # a node with no tag
        ["x", ["b", 0]],  # bytes that are not base64
        [1, ["b", 0]],  # bytes of a number
        [[1, 2]],  # a tag that is not text
        [{"a": [1]}],  # a JSON object (an inline dict) holding more than scalars
        [{"a": {"b": 1}}],
        [["D", "a", 1]],  # an inline dict is a JSON object, never a tagged list
        [["I", "000000"]],  # packed integers of 3 bytes
        [["I", "not hex!"]],
        [["J", 0]],  # packed integers that are no text
        [["I"]],
        [["I", "0000000000000000", "x"]],
        [["l", 0]],  # a self-reference
        [[], ["l+", 0]],
        ["x", ["l+", 0]],  # l+ of no list
        [1, ["d", 0]],  # a dict with a key and no value
        [[], ["s", 0]],  # an unhashable member
        ["__import__", ["__import__", 0]],  # a tag that is a function name
        [["eval", 0]],
    ],
)
def test_a_document_it_did_not_write_decodes_to_nothing(nodes: Any) -> None:
    with pytest.raises(CodecError):
        Decoder(nodes)


def test_an_entry_must_name_a_node_of_the_expected_kind() -> None:
    d = Decoder(["x", ["t", 0]])
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
