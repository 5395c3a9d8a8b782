"""A trainer_state.json whose log_history extends one read before reuses the parsed entries, and decides exactly
as reading it whole would (the oracle: test_reader_cost's copy of the JSON reader before any fast path)."""

from __future__ import annotations

import io
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptdoctor.readers.jsonfiles as jsonfiles
from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import JsonFacts, ProblemKind, ReadOutcome
from ckptdoctor.readers.jsonfiles import read_json
from tests.helpers.json_values import _JSON_VALUES, assert_same_json_outcome


@pytest.fixture(autouse=True)
def fresh_histories() -> Iterator[None]:
    jsonfiles._histories.clear()
    yield
    jsonfiles._histories.clear()


@pytest.fixture
def any_size() -> Iterator[None]:
    """Take the log_history path for small documents too."""
    with mock.patch.object(jsonfiles, "_HISTORY_MIN", 0):
        yield


def read(data: bytes, limits: Limits = DEFAULT_LIMITS) -> ReadOutcome:
    return read_json(io.BytesIO(data), len(data), limits)


@pytest.fixture(scope="module")
def trainer_states(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """trainer_state.json of five checkpoints of one run, written by transformers' own TrainerState."""
    from transformers.trainer_callback import TrainerState

    folder = tmp_path_factory.mktemp("states")
    state = TrainerState(max_steps=5000, logging_steps=2, save_steps=1000, train_batch_size=8, num_train_epochs=1)
    out: list[bytes] = []
    for step in range(2, 5001, 2):
        lr = 5e-5 * (1 - step / 5000)
        state.log_history.append(
            {
                "epoch": step / 5000,
                "grad_norm": 1.0 / step,
                "learning_rate": lr,
                "loss": 3.0 - step / 4000,
                "step": step,
            }
        )
        if step % 1000 == 0:
            state.log_history.append({"epoch": step / 5000, "eval_loss": 2.5 - step / 5000, "step": step})
            state.global_step, state.epoch = step, step / 5000
            path = folder / f"checkpoint-{step}.json"
            state.save_to_json(str(path))
            out.append(path.read_bytes())
    return out


def test_each_checkpoint_parses_only_what_it_adds(trainer_states: list[bytes]) -> None:
    assert len(trainer_states[0]) > jsonfiles._HISTORY_MIN  # the real reader path, no patched threshold
    parsed: list[int] = []
    real = jsonfiles._parse_counting_keys

    def counting(text: str) -> Any:
        parsed.append(len(text))
        return real(text)

    with mock.patch.object(jsonfiles, "_parse_counting_keys", counting):
        outs = [assert_same_json_outcome(data) for data in trainer_states]
    histories = [o.content.value["log_history"] for o in outs if isinstance(o.content, JsonFacts)]
    assert [len(h) for h in histories] == [501, 1002, 1503, 2004, 2505]
    for older, newer in itertools.pairwise(histories):
        assert all(a is b for a, b in zip(older, newer, strict=False))  # shared, not copies
        assert newer is not older
    # After the first file, each parse is the short document around the history plus the 501 new entries.
    first, *rest = [a + b for a, b in zip(parsed[::2], parsed[1::2], strict=True)]
    assert first > len(trainer_states[0]) * 0.9
    assert all(n < len(trainer_states[0]) * 1.1 for n in rest)


def test_a_rescan_of_the_same_file_parses_only_the_short_document(trainer_states: list[bytes]) -> None:
    read(trainer_states[2])
    with mock.patch.object(jsonfiles, "_parse_counting_keys", wraps=jsonfiles._parse_counting_keys) as parse:
        again = assert_same_json_outcome(trainer_states[2])
    assert parse.call_count == 1 and len(parse.call_args[0][0]) < 1000
    assert isinstance(again.content, JsonFacts) and len(again.content.value["log_history"]) == 1503


@pytest.mark.parametrize("order", ["descending", "interleaved", "shuffled"])
def test_any_reading_order_gives_the_same_values(trainer_states: list[bytes], order: str) -> None:
    other_run = [s.replace(b'"loss": 2', b'"loss": 7') for s in trainer_states]
    if order == "descending":
        docs = trainer_states[::-1]
    elif order == "interleaved":
        docs = [d for pair in zip(trainer_states, other_run, strict=True) for d in pair]
    else:
        docs = [trainer_states[i] for i in (3, 0, 4, 1, 2)] + [other_run[i] for i in (2, 4, 0)]
    for data in docs:
        assert_same_json_outcome(data)


def test_a_rewritten_history_is_not_taken_from_an_earlier_one(trainer_states: list[bytes]) -> None:
    read(trainer_states[0])
    rewritten = trainer_states[1].replace(b'"loss": 2.9995', b'"loss": 1.5', 1)
    assert rewritten != trainer_states[1]
    out = assert_same_json_outcome(rewritten)
    assert isinstance(out.content, JsonFacts) and out.content.value["log_history"][0]["loss"] == 1.5


def _extend(base: bytes, entry: bytes) -> bytes:
    """``base`` with ``entry`` (raw text, may be damaged) added as the last log_history element."""
    i = base.rindex(b"\n  ]")
    return base[:i] + b",\n    " + entry + base[i:]


_BASE = json.dumps(
    {
        "best_metric": None,
        "global_step": 20,
        "log_history": [{"loss": 2.5, "note": 'q "x" [y] {z}: \\ é', "step": 10}, {"loss": 2.1, "step": 20}],
        "max_steps": 100,
        "stateful_callbacks": {"TrainerControl": {"args": {"should_save": True}, "attributes": {}}},
    },
    indent=2,
    sort_keys=True,
).encode()


@pytest.mark.usefixtures("any_size")
@pytest.mark.parametrize(
    ("entry", "kind"),
    [
        (b'{\n      "loss": 1.9,\n      "step": 30\n    }', None),
        (b'{\n      "loss": 1.9,\n      "loss": 1.8\n    }', ProblemKind.INVALID_JSON),  # repeated key
        (b'{"a": [[[[[[[[1]]]]]]]]}', ProblemKind.LIMIT),  # too deep only where the entry sits
        (b'{"note": "\xff"}', ProblemKind.INVALID_JSON),  # invalid UTF-8
        (b"{}", None),
        (b"", ProblemKind.INVALID_JSON),  # a trailing comma
        (b"{},", ProblemKind.INVALID_JSON),
        (b'{"x": 1}\n  ],\n  "log_history": [\n    {"y": 2}', ProblemKind.INVALID_JSON),  # the key twice
        (b'{"x": "ckptdoctor log_history placeholder"}', None),
        (b'{"x": 1}\n  ]\n}\n', ProblemKind.INVALID_JSON),
        (b"NaN", None),
    ],
)
def test_added_entries_are_checked_as_in_a_whole_file(entry: bytes, kind: ProblemKind | None) -> None:
    limits = Limits(nesting_depth=8)
    assert read(_BASE, limits).problems == ()
    out = assert_same_json_outcome(_extend(_BASE, entry), limits)
    assert [p.kind for p in out.problems] == ([kind] if kind else [])


@pytest.mark.usefixtures("any_size")
def test_the_placeholder_text_elsewhere_is_not_confused_with_the_history() -> None:
    doc = _BASE.replace(b'"max_steps": 100', b'"max_steps": "ckptdoctor log_history placeholder"')
    read(_BASE)
    assert_same_json_outcome(doc)
    assert_same_json_outcome(_extend(doc, b'{"step": 30}'))


@pytest.mark.usefixtures("any_size")
def test_a_history_shaped_array_that_is_not_the_top_level_one() -> None:
    """The opening line can be forged at any depth by choosing the indentation: the top object decides."""
    nested = b'{\n "x": {\n  "log_history": [\n    {"a": 1}\n  ]\n }, "log_history": 5\n}'
    outer = b'{\n "x": {\n  "log_history": [\n    {"a": 1},\n    {"b": 2}\n  ]\n }\n}'
    for doc in (nested, outer, nested):
        out = assert_same_json_outcome(doc)
        assert out.problems == ()


@pytest.mark.usefixtures("any_size")
def test_a_history_checked_against_one_limit_is_not_reused_under_a_tighter_one() -> None:
    deep = _extend(_BASE, b'{"a": [[1]]}')
    assert read(deep, Limits(nesting_depth=8)).problems == ()
    out = assert_same_json_outcome(_extend(deep, b'{"b": 1}'), Limits(nesting_depth=4))
    assert [p.kind for p in out.problems] == [ProblemKind.LIMIT]


@pytest.mark.usefixtures("any_size")
def test_every_truncation_and_edit_after_a_known_history() -> None:
    grown = _extend(_extend(_BASE, b'{\n      "loss": 1.9,\n      "step": 30\n    }'), b'{"x": [1, {"y": null}]}')
    limits = Limits(nesting_depth=5)
    for cut in range(len(_BASE) - 20, len(grown) + 1):
        jsonfiles._histories.clear()
        read(_BASE, limits)
        assert_same_json_outcome(grown[:cut], limits)
    for pos in range(len(_BASE) - 40, len(grown)):
        for byte in b'"\\{}[]:,\n':
            jsonfiles._histories.clear()
            read(_BASE, limits)
            assert_same_json_outcome(grown[:pos] + bytes([byte]) + grown[pos:], limits)
        jsonfiles._histories.clear()
        read(_BASE, limits)
        assert_same_json_outcome(grown[:pos] + grown[pos + 1 :], limits)


_EDIT = st.tuples(st.integers(0, 10_000), st.sampled_from(list(b'"\\{}[]:,x0 \n')), st.booleans())


@pytest.mark.usefixtures("any_size")
@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    entries=st.lists(st.dictionaries(st.text(max_size=4), _JSON_VALUES, max_size=3), min_size=1, max_size=6),
    others=st.dictionaries(st.text(max_size=6), _JSON_VALUES, max_size=3),
    cuts=st.lists(st.integers(0, 6), min_size=1, max_size=4),
    edits=st.lists(_EDIT, max_size=2),
    limit=st.integers(1, 7),
)
def test_growing_histories_read_as_whole_documents(
    entries: list[dict[str, Any]], others: dict[str, Any], cuts: list[int], edits: list[Any], limit: int
) -> None:
    jsonfiles._histories.clear()
    limits = Limits(nesting_depth=limit)
    for cut in sorted(cuts):
        data = json.dumps({**others, "log_history": entries[:cut]}, indent=2, sort_keys=True).encode()
        assert_same_json_outcome(data, limits)
    for where, byte, insert in edits:
        pos = len(data) - 1 - where % len(data)
        data = data[:pos] + bytes([byte]) + data[pos + (0 if insert else 1) :]
    assert_same_json_outcome(data, limits)


def test_the_remembered_text_is_bounded(trainer_states: list[bytes]) -> None:
    budget = len(trainer_states[3]) + len(trainer_states[4])
    with mock.patch.object(jsonfiles, "_HISTORY_BYTES", budget):
        for data in reversed(trainer_states):  # none extends a body read before it: each is parsed and kept
            read(data)
        assert 2 <= len(jsonfiles._histories) < len(trainer_states)  # the oldest went first
        assert sum(len(h.body) for h in jsonfiles._histories) <= budget
    jsonfiles.forget()
    with mock.patch.object(jsonfiles, "_HISTORY_BYTES", 1):
        read(trainer_states[4])
        read(trainer_states[3])
        assert len(jsonfiles._histories) == 1  # the newest is kept whatever its size


def test_a_body_extended_is_replaced_by_the_longer_one(trainer_states: list[bytes]) -> None:
    """A run's checkpoints keep one body between them, the newest, not one each (bench/RESULTS.md, issue 27)."""
    for data in trainer_states:
        read(data)
    assert len(jsonfiles._histories) == 1
    last = trainer_states[-1]
    assert last.find(jsonfiles._histories[0].body) > 0
    jsonfiles.forget()
    assert not jsonfiles._histories


def test_a_scan_of_a_long_run_shares_the_entries(tmp_path: Path, trainer_states: list[bytes]) -> None:
    from ckptdoctor.discover import discover

    for i, data in enumerate(trainer_states, 1):
        folder = tmp_path / f"checkpoint-{i * 1000}"
        folder.mkdir()
        (folder / "trainer_state.json").write_bytes(data)
    tree = discover(str(tmp_path))
    values = [f.content.value for r in tree.runs for ck in r.checkpoints for f in ck.files]  # type: ignore[union-attr]
    assert len(values) == 5
    firsts = {id(v["log_history"][0]) for v in values}
    assert len(firsts) == 1


@pytest.mark.parametrize("jobs", [1, 4])
def test_threads_read_the_same_values(tmp_path: Path, trainer_states: list[bytes], jobs: int) -> None:
    """Checkpoints read side by side by threads still agree with json.loads, whichever body each finds first."""
    from ckptdoctor.discover import discover

    for run in ("a", "b"):
        for i, data in enumerate(trainer_states, 1):
            folder = tmp_path / run / f"checkpoint-{i * 1000}"
            folder.mkdir(parents=True)
            other = data.replace(b'"loss": 2', b'"loss": 7')
            (folder / "trainer_state.json").write_bytes(data if run == "a" else other)
    tree = discover(str(tmp_path), jobs=jobs)
    files = [f for r in tree.runs for ck in r.checkpoints for f in ck.files]
    assert len(files) == 10
    for f in files:
        assert isinstance(f.content, JsonFacts)
        assert f.content.value == json.loads((tmp_path / f.path).read_bytes())


def test_an_opening_line_inside_a_nested_object_is_not_the_history() -> None:
    """Indentation can lie, and the top object's own "log_history" can equal the placeholder once an escape is
    decoded (found in review): the value and the depth check must still be the whole parse's."""
    pad = "x" * (jsonfiles._HISTORY_MIN + 10)
    escaped = '"ckptdoctor log_history placeholde\\u0072"'
    moved = '{\n  "a": {\n  "log_history": [\n{"step": 1}\n  ]},\n  "log_history": ' + escaped
    assert_same_json_outcome((moved + ',\n  "pad": "' + pad + '"\n}').encode())
    deep = "[" * 8 + "1" + "]" * 8  # fits at depth 2 under a limit of 10, not 5 levels further in
    nested = '{\n  "a": ' + '{"b": ' * 5 + '{\n  "log_history": [\n' + deep + "\n  ]}" + "}" * 5
    out = assert_same_json_outcome(
        (nested + ',\n  "log_history": ' + escaped + ',\n  "pad": "' + pad + '"\n}').encode(), Limits(nesting_depth=10)
    )
    assert [p.kind for p in out.problems] == [ProblemKind.LIMIT]
