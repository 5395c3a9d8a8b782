"""The strict JSON reader, DeepSpeed's ``latest`` reader and DeepSpeed file names."""

from __future__ import annotations

import io
import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptdoctor.limits import Limits
from ckptdoctor.model import JsonFacts, ProblemKind, ReadOutcome, TextFacts
from ckptdoctor.readers.deepspeed import DeepSpeedName, parse_deepspeed_name, read_latest
from ckptdoctor.readers.jsonfiles import read_json


def _json(data: bytes, limits: Limits | None = None) -> ReadOutcome:
    if limits is None:
        return read_json(io.BytesIO(data), len(data))
    return read_json(io.BytesIO(data), len(data), limits)


def _trainer_state(**over: Any) -> dict[str, Any]:
    """A trainer_state.json dict as TrainerState (transformers 5.23) writes it (ANATOMY §1.8)."""
    state: dict[str, Any] = {
        "best_global_step": None,
        "best_metric": None,
        "best_model_checkpoint": None,
        "epoch": 1.0,
        "eval_steps": 500,
        "global_step": 8,
        "is_hyper_param_search": False,
        "is_local_process_zero": True,
        "is_world_process_zero": True,
        "log_history": [
            {"epoch": 0.5, "grad_norm": 1.25, "learning_rate": 5e-05, "loss": 2.5, "step": 4},
            {"epoch": 1.0, "grad_norm": float("nan"), "learning_rate": 2.5e-05, "loss": 2.1, "step": 8},
        ],
        "logging_steps": 4,
        "max_steps": 8,
        "num_input_tokens_seen": 0,
        "num_train_epochs": 1,
        "save_steps": 4,
        "stateful_callbacks": {
            "TrainerControl": {
                "args": {"should_save": True, "should_training_stop": True},
                "attributes": {},
            }
        },
        "total_flos": 123.0,
        "train_batch_size": 2,
        "trial_name": None,
        "trial_params": None,
    }
    state.update(over)
    return state


def _dump(state: dict[str, Any]) -> bytes:
    # TrainerState.save_to_json
    return (json.dumps(state, indent=2, sort_keys=True) + "\n").encode()


def _problem(out: ReadOutcome) -> tuple[ProblemKind, str]:
    assert out.content is None
    assert len(out.problems) == 1
    return out.problems[0].kind, out.problems[0].message


def test_trainer_state_with_nan_and_infinity() -> None:
    data = _dump(_trainer_state(best_metric=float("inf"), total_flos=float("-inf")))
    assert b"NaN" in data and b"Infinity" in data
    out = _json(data)
    assert out.problems == ()
    assert isinstance(out.content, JsonFacts)
    value = out.content.value
    assert value["global_step"] == 8
    assert math.isnan(value["log_history"][1]["grad_norm"])
    assert value["best_metric"] == math.inf and value["total_flos"] == -math.inf
    # json reuses one NaN object, so the comparison holds: the reader gives exactly what json.loads gives.
    assert value == json.loads(data)


@pytest.mark.parametrize(
    ("data", "fragments"),
    [
        # duplicate keys, located in the text
        (b'{\n  "global_step": 8,\n  "max_steps": 8,\n  "global_step": 12\n}\n', ["'global_step'", "line 4 column 3"]),
        (b'{"a": 1, "\\u0061": 2}', ["'a'", "line 1 column 10"]),  # the same key spelled with an escape
        # bytes that are not UTF-8 (transformers opens JSON with encoding="utf-8")
        (b'{\n  "name": "caf\xe9"\n}\n', ["UTF-8", "line 2 column 15"]),
        # a BOM: json.loads rejects it after a utf-8 decode, as transformers' load does
        (b"\xef\xbb\xbf{}", ["BOM", "line 1 column 1"]),
    ],
)
def test_invalid_json_names_line_and_column(data: bytes, fragments: list[str]) -> None:
    kind, msg = _problem(_json(data))
    assert kind is ProblemKind.INVALID_JSON
    for fragment in fragments:
        assert fragment in msg


def test_duplicate_key_nested_in_log_history() -> None:
    text = _dump(_trainer_state()).decode()
    text = text.replace('"loss": 2.1,', '"loss": 2.1,\n      "loss": 9.9,', 1)
    kind, msg = _problem(_json(text.encode()))
    assert kind is ProblemKind.INVALID_JSON
    line = next(i for i, s in enumerate(text.splitlines(), 1) if '"loss": 9.9' in s)
    assert f"'loss' at line {line} column 7" in msg


def test_same_key_in_sibling_objects_is_fine() -> None:
    out = _json(b'[{"a": 1, "b": {"a": 2}}, {"a": 3}, {"x": ["a", "a"]}]')
    assert out.problems == ()
    assert isinstance(out.content, JsonFacts)


def test_string_values_that_look_like_keys_are_not_keys() -> None:
    out = _json(b'{"a": "a", "b": "a, \\"a\\": {", "c": ["a", {"a": 1}]}')
    assert out.problems == (), out.problems


def test_truncated_trainer_state() -> None:
    data = _dump(_trainer_state())
    cut = data[: len(data) // 2]
    kind, msg = _problem(_json(cut))
    assert kind is ProblemKind.TRUNCATED
    assert msg.startswith("JSON ends mid-document at line") and "column" in msg


@pytest.mark.parametrize(
    "text", ['{"a": 1,}', '[1 1', '{"a": 1}t', '{"a": "\\uzz"}', "garbage", '{"a" 1', '{"a": 1}}']
)
def test_broken_json_that_is_not_cut_short_stays_invalid(text: str) -> None:
    kind, _ = _problem(_json(text.encode()))
    assert kind is ProblemKind.INVALID_JSON


def test_trailing_garbage_and_nul_padding() -> None:
    data = _dump(_trainer_state()) + b"\x00" * 16
    kind, msg = _problem(_json(data))
    assert kind is ProblemKind.INVALID_JSON and "Extra data" in msg


def test_deep_nesting_is_a_limit_not_a_recursion_error() -> None:
    data = b"[" * 200_000 + b"]" * 200_000
    kind, msg = _problem(_json(data))
    assert kind is ProblemKind.LIMIT and "500" in msg
    deep_objects = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    assert _problem(_json(deep_objects))[0] is ProblemKind.LIMIT
    # Unbalanced openers (a truncated deep file) are bounded too.
    assert _problem(_json(b"[" * 100_000))[0] is ProblemKind.LIMIT


def test_nesting_within_limit_parses() -> None:
    depth = 400
    out = _json(b"[" * depth + b"]" * depth)
    assert out.problems == ()
    small = Limits(nesting_depth=3)
    assert _json(b"[[[]]]", small).problems == ()
    assert _problem(_json(b"[[[[]]]]", small))[0] is ProblemKind.LIMIT
    # Brackets inside strings do not count.
    assert _json(b'["[[[[[[[[", "{{{{{{"]', small).problems == ()


@pytest.mark.parametrize(("extra", "ok"), [(2, True), (3, False)])
def test_depth_counted_across_long_documents(extra: int, ok: bool) -> None:
    # 8 levels, then 50 000 flat arrays (past the scanner's chunk size), then `extra` more levels at the end.
    flat = b"[]," * 50_000
    data = b"[" * 8 + flat + b"[" * extra + b"]" * extra + b"]" * 8
    out = _json(data, Limits(nesting_depth=10))
    assert (out.problems == ()) is ok
    if not ok:
        assert out.problems[0].kind is ProblemKind.LIMIT


def test_size_limit() -> None:
    data = _dump(_trainer_state())
    kind, msg = _problem(_json(data, Limits(json_bytes=100)))
    assert kind is ProblemKind.LIMIT and str(len(data)) in msg


def test_empty_json() -> None:
    assert _problem(_json(b""))[0] is ProblemKind.EMPTY


def test_huge_integer_literal() -> None:
    kind, _ = _problem(_json(b"1" * 5000))
    assert kind is ProblemKind.INVALID_JSON


def test_reads_from_the_start_whatever_the_position() -> None:
    f = io.BytesIO(b'{"a": 1}')
    f.read(3)
    out = read_json(f, 8)
    assert isinstance(out.content, JsonFacts) and out.content.value == {"a": 1}


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_never_raises_on_bytes(data: bytes) -> None:
    assert isinstance(_json(data), ReadOutcome)


@settings(max_examples=100, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3),
        max_leaves=20,
    )
)
def test_round_trip(value: Any) -> None:
    out = _json(json.dumps(value).encode())
    assert out.problems == ()
    assert isinstance(out.content, JsonFacts) and out.content.value == value


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed


def _latest(data: bytes, limits: Limits | None = None) -> ReadOutcome:
    if limits is None:
        return read_latest(io.BytesIO(data), len(data))
    return read_latest(io.BytesIO(data), len(data), limits)


def test_latest_stripped() -> None:
    assert _latest(b"global_step12").content == TextFacts("global_step12")
    assert _latest(b"  global_step12\n\n").content == TextFacts("global_step12")
    assert _latest(b"\n").content == TextFacts("")


def test_latest_problems() -> None:
    assert _latest(b"x" * 5000).problems[0].kind is ProblemKind.LIMIT
    assert _latest(b"global_step1", Limits(text_bytes=4)).problems[0].kind is ProblemKind.LIMIT
    assert _latest(b"global_step\xff").problems[0].kind is ProblemKind.MALFORMED
    assert _latest(b"\x00" * 12).problems[0].kind is ProblemKind.MALFORMED


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("mp_rank_00_model_states.pt", DeepSpeedName("model", None, 0, False)),
        ("mp_rank_01_model_states.pt", DeepSpeedName("model", None, 1, False)),
        ("zero_pp_rank_0_mp_rank_00_model_states.pt", DeepSpeedName("model", 0, 0, False)),
        ("zero_pp_rank_3_mp_rank_00_optim_states.pt", DeepSpeedName("optim", 3, 0, False)),
        ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", DeepSpeedName("optim", 0, 0, True)),
        ("bf16_zero_pp_rank_12_mp_rank_02_optim_states.pt", DeepSpeedName("optim", 12, 2, True)),
        ("optimizer.pt", None),
        ("mp_rank_00_model_states.pt.bak", None),
        ("expp_rank_0_mp_rank_00_optim_states.pt", None),
        ("zero_pp_rank_x_mp_rank_00_optim_states.pt", None),
        ("zero_pp_rank_\u0661_mp_rank_00_optim_states.pt", None),  # non-ASCII digits are not DeepSpeed's
    ],
)
def test_parse_deepspeed_name(name: str, expected: DeepSpeedName | None) -> None:
    assert parse_deepspeed_name(name) == expected
