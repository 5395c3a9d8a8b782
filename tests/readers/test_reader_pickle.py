"""Tests for the static pickle walker: plain values, hostile payloads, limits, and never raising."""

from __future__ import annotations

import collections
import io
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptdoctor.limits import Limits
from ckptdoctor.model import GlobalRef, Opaque, ProblemKind
from ckptdoctor.readers.pickle_walk import CYCLE, iter_values, walk_pickle
from tests.helpers import payloads

PLAIN = {
    "ints": [0, 1, -1, 255, 256, 65535, 65536, -(2**31), 2**31, 2**100, -(2**70)],
    "floats": [0.0, -1.5, 1e300],
    "text": ["", "a", "é\u1234", "x" * 300],
    "bytes": [b"", b"\x00\xff", b"y" * 300],
    "consts": (None, True, False),
    "nested": {"t": (), "t1": (1,), "t2": (1, 2), "t3": (1, 2, 3), "t4": (1, 2, 3, 4)},
    "set": {1, 2, 3},
    "frozenset": frozenset({"a"}),
    "complex": complex(1, -2),
    "bytearray": bytearray(b"ab"),
    "ordered": collections.OrderedDict([("b", 1), ("a", 2)]),
    3: "int key",
    (1, "x"): "tuple key",
}


@pytest.mark.parametrize("protocol", range(6))
def test_plain_values_round_trip(protocol: int) -> None:
    facts, problems, _ = walk_pickle(pickle.dumps(PLAIN, protocol=protocol))
    assert problems == ()
    assert facts is not None
    assert facts.value == PLAIN
    assert facts.protocol == (protocol if protocol >= 2 else 0)
    assert type(facts.value["ordered"]) is dict
    assert all(g.module in ("builtins", "collections", "_codecs", "__builtin__") for g in facts.globals)


def test_memo_sharing_and_cycles() -> None:
    shared = [1, 2]
    cyclic: list[object] = [shared, shared]
    cyclic.append(cyclic)
    facts, problems, _ = walk_pickle(pickle.dumps(cyclic, protocol=2))
    assert problems == ()
    assert facts is not None
    assert facts.value[0] is facts.value[1]
    assert facts.value[2] is CYCLE


class Point:
    def __init__(self) -> None:
        self.x = 1
        self.tags = ["a"]


def test_objects_become_opaque_with_built_state() -> None:
    obj = Point()
    facts, problems, _ = walk_pickle(pickle.dumps({"p": obj, "again": obj}, protocol=2))
    assert problems == ()
    assert facts is not None
    p = facts.value["p"]
    assert p == Opaque(GlobalRef(__name__, "Point"), (), {"x": 1, "tags": ["a"]}, new=True)  # NEWOBJ made it
    # a REDUCE of the same class (protocol 0's copyreg._reconstructor aside) is a call: ``new`` stays False
    reduced = pickle.dumps(Point, protocol=2)[:-1] + b")R."  # GLOBAL Point, EMPTY_TUPLE, REDUCE
    facts2, _, _ = walk_pickle(reduced)
    assert facts2 is not None and facts2.value == Opaque(GlobalRef(__name__, "Point"), ())
    assert facts.value["again"] is p  # the memo entry sees the state BUILD applied
    assert GlobalRef(__name__, "Point") in facts.calls


def test_unhashable_keys_are_kept() -> None:
    # (cos\nsystem\n...o gives an object; use it and a list as dict keys (DICT opcode).
    data = b"\x80\x02(]K\x01a\x8c\x01v(cmod\nCls\n}o\x8c\x02v2d."
    facts, problems, _ = walk_pickle(data)
    assert problems == ()
    assert facts is not None
    assert set(facts.value.values()) == {"v", "v2"}


def test_concatenated_streams() -> None:
    data, second = payloads.concatenated_payload(Path("/nonexistent/canary"))
    first, problems, end = walk_pickle(data)
    assert problems == () and first is not None and first.value == {"ok": 1}
    assert end == second
    facts, problems, end = walk_pickle(data, start=end)
    assert problems == () and facts is not None and end == len(data)
    assert facts.calls


def test_payloads_are_live(tmp_path: Path) -> None:
    """The hostile payloads really run code when unpickled (in a child process): the walker tests mean something."""
    canary = tmp_path / "canary"
    data, _ = payloads.hostile_payloads(canary)["os.system"]
    subprocess.run([sys.executable, "-c", "import pickle,sys; pickle.loads(sys.stdin.buffer.read())"], input=data,
                   check=True)  # fmt: skip
    assert canary.exists()


@pytest.mark.parametrize("name", sorted(payloads.hostile_payloads(Path("/x"))))
def test_hostile_payloads_are_recorded_never_run(tmp_path: Path, name: str) -> None:
    canary = tmp_path / "canary"
    data, dangerous = payloads.hostile_payloads(canary)[name]
    facts, problems, _ = walk_pickle(data)
    assert facts is not None
    seen = {g.dotted for g in facts.globals} | {g.dotted for g in facts.calls}
    assert dangerous in seen, (name, seen, problems)
    assert facts.calls  # something is called in every payload
    assert not canary.exists()


def test_persistent_ids_without_callback_are_opaque() -> None:
    marker = Point()

    class P(pickle.Pickler):
        def persistent_id(self, obj: object) -> object:
            return ("storage", "ext") if obj is marker else None

    buf = io.BytesIO()
    P(buf, protocol=2).dump([marker, 1])
    facts, problems, _ = walk_pickle(buf.getvalue())
    assert problems == () and facts is not None
    assert facts.persistent_ids == 1
    assert facts.value[0] == Opaque(None, (("storage", "ext"),))
    seen: list[object] = []
    facts, _, _ = walk_pickle(buf.getvalue(), persistent_load=lambda pid: seen.append(pid) or "loaded")
    assert facts is not None and facts.value == ["loaded", 1] and seen == [("storage", "ext")]


@pytest.mark.parametrize("build", [payloads.deep_lists, payloads.deep_tuples, payloads.deep_via_memo])
def test_deep_nesting_is_a_limit_not_a_crash(build: object) -> None:
    data = build(100_000)  # type: ignore[operator]
    facts, problems, _ = walk_pickle(data)
    assert [p.kind for p in problems] == [ProblemKind.LIMIT]
    depth = max(path.count(".") for path, _ in iter_values(facts.value if facts else None)) if facts else 0
    assert depth <= Limits().nesting_depth + 1  # + the placeholder's own argument


def test_deep_marks_are_a_limit() -> None:
    _, problems, _ = walk_pickle(b"(" * 100_000 + b".")
    assert problems[0].kind is ProblemKind.LIMIT


def test_memo_and_opcode_limits() -> None:
    data = pickle.dumps([[i] for i in range(100)], protocol=2)
    _, problems, _ = walk_pickle(data, limits=Limits(pickle_memo_entries=10))
    assert problems[0].kind is ProblemKind.LIMIT and "memo" in problems[0].message
    _, problems, _ = walk_pickle(data, limits=Limits(pickle_opcodes=50))
    assert problems[0].kind is ProblemKind.LIMIT and "opcodes" in problems[0].message


def test_shared_structure_stays_linear() -> None:
    facts, problems, _ = walk_pickle(payloads.shared_doubling(60))
    assert problems == () and facts is not None
    assert sum(1 for _ in iter_values(facts.value)) < 200


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"", "no STOP"),
        (b"\x80\x02]", "no STOP"),
        (b"\x80\x02a.", "underflow"),
        (b"\x80\x02h\x05.", "memo miss"),
        (b"\x80\x021.", "MARK"),
        (b"\x80\x02\xff.", "unknown opcode"),
        (b"\x80\x09N.", "protocol"),
        (b"\x80\x02X\xff\xff\xff\x7fabc.", "truncated"),
        (b"\x80\x02\x8a\x02\x01", "truncated"),
        (b"\x80\x02K\x01K\x02K\x03(K\x01d.", "odd"),
        (b"I12x\n.", "invalid argument"),
        (b"\x80\x02\x82\x00.", "extension code"),
        (b"\x80\x02K\x01K\x01K\x02s.", "SETITEM on a int"),
    ],
)
def test_malformed_streams(data: bytes, words: str) -> None:
    facts, problems, _ = walk_pickle(data)
    assert len(problems) == 1 and problems[0].kind is ProblemKind.MALFORMED_PICKLE
    assert words in problems[0].message
    if facts is not None:
        assert facts.value is None


def test_dotted_paths() -> None:
    value = {"state": {0: {"exp_avg": 1}}, "groups": [{"lr": 0.1}], "obj": Opaque(None, ("a",), {"f": 2})}
    paths = dict(iter_values(value))
    assert paths["state.0.exp_avg"] == 1 and paths["groups.0.lr"] == 0.1
    assert paths["obj.f"] == 2 and paths["obj.args.0"] == "a"


_REAL = pickle.dumps({"a": [1, 2.5, "x", b"y", (None, True)], "b": collections.OrderedDict(c={1, 2})}, protocol=4)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cut=st.integers(0, len(_REAL)),
    flips=st.lists(st.tuples(st.integers(0, len(_REAL) - 1), st.integers(0, 255)), max_size=4),
)
def test_mutations_never_raise(cut: int, flips: list[tuple[int, int]]) -> None:
    data = bytearray(_REAL)
    for at, byte in flips:
        data[at] = byte
    walk_pickle(bytes(data[:cut] if cut % 3 == 0 else data))


def test_an_opcode_running_past_its_frame_is_malformed_and_a_clean_framed_pickle_is_not() -> None:
    """CPython's C unpickler reading a file drops what is left of a frame when an argument runs past it and reads
    the argument from the bytes after the frame, while ``pickle.loads`` refuses the data: a payload can hide in the
    reading a walk does not take (CPython issue 154848), so such a stream is malformed (CKD603), never walked one way.
    """
    import io
    import pickle
    import struct

    hidden = b"cos\nsystem\nVtrue\n\x85R"
    # FRAME of 2 bytes ("B\x07"), then BINBYTES' length read from past the frame: 1 byte, then the hidden call.
    data = b"\x80\x05N0(\x95" + struct.pack("<Q", 2) + b"B\x07\x01\x00\x00\x00\x00" + hidden + b"1."
    seen: list[tuple[str, str]] = []

    class Recording(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> object:
            seen.append((module, name))
            raise pickle.UnpicklingError("refused")

    with pytest.raises(pickle.UnpicklingError):
        Recording(io.BytesIO(data)).load()
    assert seen == [("os", "system")]  # the file reading reaches the call
    facts, problems, _ = walk_pickle(data)
    assert [p.kind for p in problems] == [ProblemKind.MALFORMED_PICKLE]
    assert "past the end of its FRAME" in problems[0].message
    framed = pickle.dumps({"a": list(range(70000)), "b": "x" * 100000}, protocol=5)  # several frames
    facts, problems, _ = walk_pickle(framed)
    assert facts is not None and problems == ()
