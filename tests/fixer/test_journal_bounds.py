"""Reading a journal back is bounded in memory: hostile shapes of a few MB that `json.loads` would blow up 25-30
times are refused as invalid journals, while the fixer's own journals (rewrites of large trainer states, moves)
load, undo and complete; a fix whose journal could not be read back is refused before its first change."""

from __future__ import annotations

import json
import os
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptdoctor import fixer as fixmod
from ckptdoctor.findings import OpKind
from ckptdoctor.fixer import journal as jmod
from ckptdoctor.fixer import transaction
from ckptdoctor.fixer.digests import sha256_of
from tests.helpers.builders import trainer_state
from tests.helpers.fixing import clone, mixed_run, run_cli, tree_state
from tests.helpers.journals import TXID, forge, journal_op

LOG_ENTRIES = 6_000  # a trainer_state.json of ~1 MB: what a long run's log_history makes
EXPECTED_OPS = [  # every kind of fix, the same on every machine (a different plan fails here, not further down)
    ("checkpoint-1/model.safetensors.index.json", "rewrite-json"),
    ("checkpoint-2/trainer_state.json", "rewrite-json"),
    ("checkpoint-3/latest", "rewrite-text"),
    ("checkpoint-4/pytorch_model.bin", "quarantine"),
    ("tmp-checkpoint-6", "quarantine"),
]


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every kind of fix (file and folder moves, both rewrites) plus a CKD105 rewrite of a ~1 MB trainer state."""
    src = tmp_path_factory.mktemp("bounds") / "src"
    src.mkdir()
    mixed_run(src)
    state = trainer_state(LOG_ENTRIES, LOG_ENTRIES + 10, best_model_checkpoint="/home/alice/runs/x/checkpoint-2")
    (src / "checkpoint-2" / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    # One time for every entry, an hour ago: what the scan finds (and so the plan and the journal) must not depend on
    # how long the build took. With the build's own times, a loaded machine spreads the checkpoints over seconds and
    # CKD101 turns from a manual finding into an unsafe one; the recency guard needs them older than a minute.
    when = time.time_ns() - 3600 * 10**9
    for p in [src, *src.rglob("*")]:
        os.utime(p, ns=(when, when), follow_symlinks=False)
    return src


@pytest.fixture
def root(source: Path, tmp_path: Path) -> Path:
    return clone(source, tmp_path / "run")


def _journal(root: Path) -> Path:
    (path,) = (root / ".ckptdoctor" / "journal").glob("*.json")
    return path


def _refused_as_invalid(root: Path) -> None:
    """`undo` and `fix` refuse the journal as they refuse any malformed one: exit code 2, the message, no change."""
    before = tree_state(root, mtimes=False)
    for command in ("undo", "fix"):
        code, out = run_cli(command, str(root))
        assert code == 2, out
        assert "cannot be read" in out and "move it away" in out and "bytes of memory" in out, out
    assert tree_state(root, mtimes=False) == before


# ---------------------------------------------------------------------------------------------------------------
# The fixer's own journals read back


def test_a_real_journal_loads_and_undoes(root: Path) -> None:
    before = tree_state(root)
    code, out = run_cli("fix", str(root))
    assert code in (0, 1) and "Fixed" in out, out
    data = _journal(root).read_bytes()
    (j,) = fixmod.load_journals(str(root))
    assert sorted((op.path, op.kind.value) for op in j.ops) == EXPECTED_OPS
    assert max(len(op.content or "") for op in j.ops) > 900_000  # the big trainer state is in it
    # Counting every `,`, `:` and `"` (those of the stored text too) gives ~8 times the size, inside the bound;
    # counting outside strings only shows the stored text costs nothing but its characters.
    naive = jmod.parse_memory(data, 1 << 62)
    assert 2 * len(data) < naive < 10 * len(data)
    assert jmod.parse_memory(data) < 2.1 * len(data)
    assert jmod.parse_problem(data) is None
    code, out = run_cli("undo", str(root))
    assert code == 0, out
    assert tree_state(root) == before


class _Killed(BaseException):
    """A kill in the middle of a fix: nothing of the fixer's catches it, so nothing is rolled back."""


def test_an_interrupted_real_journal_is_completed_and_undone(root: Path) -> None:
    before = tree_state(root)

    def crash(name: str) -> None:
        if name == "op:2":
            raise _Killed(name)

    with mock.patch.object(transaction, "crash_point", crash), pytest.raises(_Killed):
        run_cli("fix", str(root))
    (j,) = fixmod.load_journals(str(root))
    assert j.state == "applying" and [op.status for op in j.ops][:3] == ["done", "done", "pending"]
    _, out = run_cli("fix", str(root))
    assert f"completed interrupted transaction {j.txid}" in out, out
    assert run_cli("undo", "--txid", j.txid, str(root))[0] == 0
    assert tree_state(root) == before


def test_a_fix_whose_journal_could_not_be_read_back_is_refused(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The bound is lowered so a 1 MB journal is past it: the first journal write refuses, before any change.
    monkeypatch.setattr(jmod, "JOURNAL_MAX_MEMORY", 1 << 20)
    before = tree_state(root)
    code, out = run_cli("fix", str(root))
    assert code == 2 and "failed before any change" in out and "refuses to read" in out and "--select" in out, out
    assert "nothing was changed" in out
    assert tree_state(root) == before
    assert not list((root / ".ckptdoctor" / "journal").glob("*.json"))


def test_the_first_write_keeps_room_for_later_saves() -> None:
    """Statuses get shorter as a fix runs ("pending" -> "done"): a journal that passed its first write passes later."""
    ops = [journal_op(OpKind.QUARANTINE, f"c{i}", fixmod.Digest("file", 1, "0" * 64, 0o644)) for i in range(200)]
    j = fixmod.Journal(TXID, "/r", 1.0, "applying", ops)
    first = jmod._encode(j)
    for op in ops:
        op.status = "done"
    j.state = "applied"
    last = jmod._encode(j)
    assert len(last) < len(first)
    # the slack off: the ratio alone decides, with the first write's bytes just at the bound
    with mock.patch.object(jmod, "_MEMORY_SLACK", 0):
        need = jmod.parse_memory(first)
        with mock.patch.object(jmod, "_MEMORY_PER_BYTE", need / (len(first) - 3 * len(ops) - 16) * (1 + 1e-9)):
            assert jmod.parse_problem(first, shrink=3 * len(ops) + 16) is None
            assert jmod.parse_problem(last) is None


# ---------------------------------------------------------------------------------------------------------------
# Hostile journals: a valid journal carrying a few MB of cheap-to-write, costly-to-parse values


def _rep(unit: bytes, size: int) -> bytes:
    return b"[" + unit * (size // len(unit)) + b"0]"


SHAPES: dict[str, Callable[[int], bytes]] = {
    "empty-dicts": lambda n: _rep(b"{},", n),
    "empty-lists": lambda n: _rep(b"[],", n),
    "small-ints": lambda n: _rep(b"0,", n),
    "floats": lambda n: _rep(b"1.5,", n),
    "short-strings": lambda n: _rep(b'"ab",', n),
    "one-key-dicts": lambda n: _rep(b'{"a":0},', n),
    "dicts-of-dicts": lambda n: _rep(b'{"a":{}},', n),
    "one-item-lists": lambda n: _rep(b"[0],", n),
    "padded-dicts": lambda n: _rep(b"{},    ", n),
    "distinct-keys": lambda n: b"{" + b"".join(b'"%x":0,' % i for i in range(n // 9)) + b'"z":0}',
    "escaped-strings": lambda n: _rep(b'"\\"\\\\",', n),
    "deep-nesting": lambda n: b"[" * (n // 2) + b"]" * (n // 2),
}
EMOJI_TEXT = b'"\xf0\x9f\x98\x80' + b"a" * 2_000_000 + b'"'  # 4 bytes a character once decoded, twice over


def _hostile(root: Path, payload: bytes) -> Path:
    """A journal the fixer could have written (so only the payload is wrong) with ``payload`` under an extra key."""
    rel = "checkpoint-4/pytorch_model.bin"
    path = forge(root, [journal_op(OpKind.QUARANTINE, rel, fixmod.digest(str(root / rel)))], state="applying")
    text = path.read_bytes()
    assert text.endswith(b"}")
    path.write_bytes(text[:-1] + b', "padding": ' + payload + b"}")
    return path


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_a_hostile_journal_is_refused_as_invalid(root: Path, shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 MB stand for 500: without the 64 MiB slack the bound is 10 times the size, as for a large journal.
    monkeypatch.setattr(jmod, "_MEMORY_SLACK", 0)
    _hostile(root, SHAPES[shape](2_000_000))
    _refused_as_invalid(root)


def test_a_journal_past_the_absolute_bound_is_refused(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One long string with a character beyond U+FFFF: 8 times its size once parsed, under 10 times plus the slack
    # but past 2 GiB at 300 MB; the absolute bound lowered to 8 MiB stands for that.
    monkeypatch.setattr(jmod, "JOURNAL_MAX_MEMORY", 8 << 20)
    _hostile(root, EMOJI_TEXT)
    _refused_as_invalid(root)


def test_dense_json_inside_strings_costs_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rewrite of a compact JSON file is a journal full of `,` and `[` inside one string: counted outside strings,
    it is accepted even where every `,` counted would be 30 times its size."""
    monkeypatch.setattr(jmod, "_MEMORY_SLACK", 0)
    content = json.dumps([[0, {"a": [1, 2]}, '"q\\']] * 100_000, separators=(",", ":"))
    data = content.encode()
    after = fixmod.Digest("file", len(data), sha256_of(data), 0o644)
    op = fixmod.JournalOp(1, OpKind.REWRITE_JSON, "x.json", [], "t", after, after, content)
    doc = json.dumps(fixmod.Journal(TXID, "/r", 1.0, "applied", [op]).to_json(), indent=2).encode()
    assert jmod.parse_memory(doc, 1 << 62) > 20 * len(doc)  # naive
    assert jmod.parse_memory(doc) < 2.1 * len(doc)
    assert jmod.parse_problem(doc) is None
    assert jmod.Journal.from_json(jmod._parse(doc)).ops[0].content == content


# ---------------------------------------------------------------------------------------------------------------
# The estimate is what parsing takes


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_estimate_bounds_what_parsing_takes(shape: str) -> None:
    data = SHAPES[shape](100_000)
    estimate = jmod.parse_memory(data)  # outside strings: the tighter of the two
    tracemalloc.start()
    try:
        jmod._parse(data)
    except RecursionError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak <= estimate, (peak, estimate)


@pytest.mark.parametrize("value", [b"0", b"1.5", b'"ab"', b"{}", b"[]"])
@pytest.mark.parametrize("keys", [5462, 10923, 21846])  # just past the points where the dicts grow (2/3 full)
def test_the_estimate_bounds_dicts_as_they_grow(keys: int, value: bytes) -> None:
    data = b"[" + b"{" + b",".join(b'"%x":%s' % (i, value) for i in range(keys)) + b"}]"
    estimate = jmod.parse_memory(data)
    tracemalloc.start()
    jmod._parse(data)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak <= estimate, (peak, estimate)


def _outside_reference(data: bytes) -> bytes:
    """The bytes outside strings, by walking the JSON text one character at a time."""
    out, inside, escaped = bytearray(), False, False
    for b in data:
        if inside:
            if escaped:
                escaped = False
            elif b == ord("\\"):
                escaped = True
            elif b == ord('"'):
                inside = False
        elif b == ord('"'):
            inside = True
        else:
            out.append(b)
    return bytes(out)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet='ab,:[]{}"\\\n\u00e9\u4e2d\U0001f600', max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(alphabet='k,:"\\', max_size=3), inner,
                                                                max_size=4),
    max_leaves=20,
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(JSON_VALUES, st.integers(1, 9))
def test_counting_outside_strings_matches_a_json_walk(value: Any, chunk: int) -> None:
    data = json.dumps(value, ensure_ascii=False).encode()
    with mock.patch.object(jmod, "_SPLIT_CHUNK", chunk):  # quotes and escapes across chunk ends
        assert jmod._outside_cost(jmod._unescaped(data)) == jmod._values_cost(_outside_reference(data))
