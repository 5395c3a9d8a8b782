"""`ckptdoctor gate` on hostile numbers: whatever `training_args.bin`, `trainer_state.json` or the plan hold (NaN,
+-inf, 1e308, -1, 0, 400- and 5,000-digit integers, bools, strings, nested lists), the gate returns a `GateResult`
or raises `GateInputError`, and the CLI exits 0, 1 or 2: never a traceback, never a hang.

The checkpoint is built once, as the Trainer writes it: weights, optimizer and scheduler by torch
(tests/helpers/builders.py), `training_args.bin` by `torch.save` of a real `TrainingArguments`, `trainer_state.json`
by a real `TrainerState.save_to_json`. Each example rewrites those two files with hostile values.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")
from transformers import TrainerState, TrainingArguments  # noqa: E402

from ckptdoctor import schedules  # noqa: E402
from ckptdoctor.cli import main  # noqa: E402
from ckptdoctor.render.gate import render_text, summary  # noqa: E402
from ckptdoctor.resume_gate import GateInputError, GateResult, gate  # noqa: E402
from tests.helpers.builders import make_run, trainer_state  # noqa: E402

HUGE = 10**5000  # past Python's 4,300-digit print limit; a pickle (LONG4) carries it, JSON cannot
EXTREMES: list[Any] = [
    math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -1, 0, 1, 2**63, 2**1023, 2**1024, 10**400, -(10**400),
    HUGE, True, False, None, "x", "", "nan", [], [1, [2, [3]]], {"a": 1}, {"num_cycles": math.nan},
]
NUMBERS = st.one_of(
    st.sampled_from(EXTREMES),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(),
    st.integers(min_value=-(10**30), max_value=10**30),
)
VALUES = st.one_of(NUMBERS, st.text(max_size=4), st.lists(NUMBERS, max_size=3))
# What trainer_state.json can hold: json.dumps cannot write an integer past the 4,300-digit limit.
JSON_NUMBERS = st.one_of(
    st.sampled_from([x for x in EXTREMES if x is not HUGE]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(10**400), max_value=10**400),
)
JSON_VALUES = st.one_of(JSON_NUMBERS, st.text(max_size=4), st.lists(JSON_NUMBERS, max_size=3))
ARG_FIELDS = ("num_train_epochs", "max_steps", "warmup_steps", "warmup_ratio", "learning_rate", "ignore_data_skip")
KWARG_KEYS = ("num_cycles", "power", "lr_end", "min_lr", "min_lr_rate", "timescale", "num_decay_steps",
              "num_stable_steps", "warmup_type", "decay_type", "min_lr_ratio", "warmup_lr_rate")
STATE_FIELDS = ("global_step", "max_steps", "num_train_epochs", "epoch", "train_batch_size", "logging_steps")
PLAN_FIELDS = ("num_train_epochs", "max_steps", "learning_rate", "warmup_steps", "steps_per_epoch", "world_size")
SCHEDULES = (*schedules.SUPPORTED, *schedules.METRIC_DRIVEN, "bogus")


@dataclasses.dataclass
class Run:
    """The built run and the pristine objects each example starts from."""

    out: Path
    ck: Path
    args: TrainingArguments
    state: TrainerState


@pytest.fixture(scope="module")
def num_run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    out = make_run(tmp_path_factory.mktemp("numbers") / "out", steps=(4,))
    ck = out / "checkpoint-4"
    args = TrainingArguments(output_dir=str(out), learning_rate=1e-3, num_train_epochs=1, per_device_train_batch_size=2,
                             logging_steps=1, save_steps=2, report_to=[], use_cpu=True)
    fields = {f.name for f in dataclasses.fields(TrainerState)}
    state = TrainerState(**{k: v for k, v in trainer_state(4, 8).items() if k in fields})
    return Run(out, ck, args, state)


def write(run: Run, args_edits: dict[str, Any], state_edits: dict[str, Any], log_edits: dict[str, Any]) -> None:
    """The checkpoint's training_args.bin and trainer_state.json, as the Trainer writes them, with the edits."""
    args = copy.copy(run.args)
    for name, value in args_edits.items():
        object.__setattr__(args, name, value)
    torch.save(args, run.ck / "training_args.bin")
    state = copy.deepcopy(run.state)
    for name, value in state_edits.items():
        setattr(state, name, _spliced(value))
    if log_edits and state.log_history:
        state.log_history[-1].update({k: _spliced(v) for k, v in log_edits.items()})
    path = run.ck / "trainer_state.json"
    state.save_to_json(str(path))
    text = path.read_text()
    if '"__HUGE__"' in text:  # json.dumps refuses a 5,000-digit integer: spliced in as text, as a hostile writer would
        path.write_text(text.replace('"__HUGE__"', "1" + "0" * 5000))


def _spliced(value: Any) -> Any:
    return "__HUGE__" if isinstance(value, int) and value == HUGE else value


# The work bound of one gate call: the schedule evaluated at the LRs it prints (DEFAULT_LR_STEPS) plus the few points
# the checks compare (LambdaLR's step 0, the run's last logged step, the uninterrupted run's LRs). A gate that walked
# a huge max_steps would evaluate the schedule once per step; counted, not timed (a loaded machine breaks timings).
WALK_BOUND = 64


@dataclasses.dataclass
class Walked:
    """How many times a schedule's ``lr_lambda`` was evaluated."""

    count: int = 0


@contextlib.contextmanager
def schedule_steps() -> Iterator[Walked]:
    """Count ``Schedule.factor`` calls (every LR the gate computes goes through it) while the block runs."""
    walked = Walked()
    real = schedules.Schedule.factor

    def factor(self: schedules.Schedule, step: int) -> float:
        walked.count += 1
        return real(self, step)

    with mock.patch.object(schedules.Schedule, "factor", factor):
        yield walked


def check_api(run: Run, **plan: Any) -> GateResult | None:
    """gate() returns a result whose every output renders, or raises GateInputError; nothing else."""
    try:
        result = gate(run.out, **plan)
    except GateInputError as exc:
        assert str(exc) and "\n" not in str(exc)
        return None
    assert isinstance(result, GateResult)
    json.dumps(result.to_json(), allow_nan=False)
    render_text(result)
    summary(result)
    assert result.exit_code in (0, 1)
    return result


def check_cli(run: Run, *options: str) -> int:
    result = CliRunner().invoke(main, ["gate", str(run.out), *options])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code in (0, 1, 2) and "Traceback" not in result.output, result.output
    if result.exit_code == 2:
        assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1, result.stderr
    return result.exit_code


@st.composite
def hostile(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    args = draw(st.dictionaries(st.sampled_from(ARG_FIELDS), VALUES, max_size=3))
    if draw(st.booleans()):
        args["lr_scheduler_type"] = draw(st.sampled_from(SCHEDULES))
        args["lr_scheduler_kwargs"] = draw(st.dictionaries(st.sampled_from(KWARG_KEYS), VALUES, max_size=3))
    state = draw(st.dictionaries(st.sampled_from(STATE_FIELDS), JSON_VALUES, max_size=2))
    log = draw(st.dictionaries(st.sampled_from(("learning_rate", "step")), JSON_VALUES, max_size=2))
    plan = draw(st.dictionaries(st.sampled_from(PLAN_FIELDS), VALUES, max_size=2))
    return args, state, log, plan


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=hostile(), fmt=st.sampled_from(["text", "json", "sarif", "github"]))
def test_hostile_numbers_never_traceback(
    num_run: Run, case: tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]], fmt: str
) -> None:
    args, state, log, plan = case
    write(num_run, args, state, log)
    with schedule_steps() as walked:
        check_api(num_run)
        check_api(num_run, **plan)
        check_cli(num_run, "--format", fmt)
    assert walked.count <= 3 * WALK_BOUND, walked.count  # a huge max_steps must not make the gate walk its steps


# ---------------------------------------------------------------------------------------------------------------
# The paths found by reading the gate (ckptdoctor/resume_gate/), each pinned


@pytest.mark.parametrize("own", [math.nan, math.inf, -math.inf, 10**400], ids=["nan", "inf", "-inf", "10**400"])
def test_the_runs_own_unusable_warmup_does_not_stop_the_jump_check(num_run: Run, own: float) -> None:
    """`_jump` asks whether the run was still warming up from its own training_args.bin; that warm-up may be NaN."""
    write(num_run, {"warmup_steps": own, "max_steps": 8}, {}, {})
    result = check_api(num_run, warmup_steps=0, max_steps=64)  # the new schedule is at 59/64 of the base LR at step 5
    assert result is not None and "CKD411" in {f.rule for f in result.findings}  # the rise is judged anyway
    assert check_cli(num_run, "--warmup-steps", "0", "--max-steps", "64") == 0


@pytest.mark.parametrize("own", [math.nan, math.inf, 10**400], ids=["nan", "inf", "10**400"])
def test_an_unusable_warmup_of_the_run_is_a_finding(num_run: Run, own: float) -> None:
    write(num_run, {"warmup_steps": own}, {}, {})
    result = check_api(num_run)
    assert result is not None and result.verdict == "fail"
    (finding,) = [f for f in result.findings if f.rule == "CKD413"]
    assert "warmup_steps" in finding.message and "train() raises" in finding.message
    assert check_cli(num_run) == 1


@pytest.mark.parametrize("value", [2**1023, 10**400, HUGE], ids=["2**1023", "10**400", "10**5000"])
def test_a_max_steps_beyond_any_float_is_the_crash_transformers_has(num_run: Run, value: int) -> None:
    """get_warmup_steps' ceil(max_steps x ratio) (or the schedule's lambda) raises OverflowError in train()."""
    write(num_run, {"max_steps": value}, {}, {})
    result = check_api(num_run)
    assert result is not None and (result.verdict, result.max_steps, result.lr) == ("fail", None, ())
    (finding,) = [f for f in result.findings if f.rule == "CKD413"]
    shown = f"<an integer of {value.bit_length():,} bits>" if value == HUGE else str(value)  # too long to print
    assert f"max_steps {shown} (training_args.bin)" in finding.message and "OverflowError" in finding.message
    assert check_cli(num_run, "--format", "json") == 1


def test_a_global_step_beyond_any_float_is_unusable_input(num_run: Run) -> None:
    write(num_run, {}, {"global_step": 10**400}, {})
    with pytest.raises(GateInputError, match=r"global_step \(1000+\) is beyond any float"):
        gate(num_run.out, steps_per_epoch=4)
    assert check_cli(num_run) == 2


@pytest.mark.parametrize("value", [10**400, HUGE], ids=["10**400", "10**5000"])
@pytest.mark.parametrize("field", ["num_train_epochs", "epoch", "max_steps", "global_step"])
def test_a_trainer_state_number_beyond_any_float(num_run: Run, field: str, value: int) -> None:
    write(num_run, {}, {field: value}, {})
    check_api(num_run)
    check_cli(num_run)


def test_a_logged_lr_beyond_any_float_reads_as_infinite(num_run: Run) -> None:
    """A resume never reads the logged LRs back; the gate compares with them (CKD411) and reads this one as inf."""
    write(num_run, {}, {}, {"learning_rate": 10**400})
    assert gate(num_run.out).verdict in ("pass", "fail")
    assert check_cli(num_run) in (0, 1)


def test_a_scheduler_number_beyond_any_float_never_tracebacks(num_run: Run) -> None:
    write(num_run, {}, {}, {})
    path = num_run.ck / "scheduler.pt"
    original = path.read_bytes()
    state = torch.load(path, weights_only=True)
    try:
        torch.save({**state, "base_lrs": [10**400]}, path)
        try:  # read as inf (trainer_view.number), the prediction goes on or the input is refused: never a traceback
            gate(num_run.out)
        except GateInputError as exc:
            assert "beyond any float" in str(exc)
        assert check_cli(num_run) in (0, 1, 2)
    finally:
        path.write_bytes(original)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_cycles": HUGE},
        {"num_cycles": [[[[1]]]]},
        {"power": 10**400},
        {"lr_end": HUGE},
        {HUGE: 1},
    ],
    ids=["num_cycles 10**5000", "num_cycles nested", "power 10**400", "lr_end 10**5000", "key 10**5000"],
)
def test_scheduler_kwargs_too_large_to_print(num_run: Run, kwargs: dict[Any, Any]) -> None:
    write(num_run, {"lr_scheduler_type": "polynomial", "lr_scheduler_kwargs": kwargs}, {}, {})
    result = check_api(num_run, max_steps=16)
    assert result is not None
    assert check_cli(num_run, "--format", "json", "--max-steps", "16") in (0, 1)


def test_a_huge_planned_max_steps_trains_without_walking_its_steps(num_run: Run) -> None:
    write(num_run, {"warmup_steps": 2}, {}, {})  # an integer warm-up: no float of max_steps in the warm-up either
    with schedule_steps() as walked:
        result = check_api(num_run, max_steps=2**1000, lr_scheduler_type="constant", lr_steps=100_000)
    assert result is not None and result.steps_to_train == 2**1000 - 4 and len(result.lr) == 100_000
    assert walked.count <= 100_000 + WALK_BOUND, walked.count  # the LRs asked for, not the 2**1000 steps
    with pytest.raises(GateInputError, match="max_steps must be an integer below 2\\*\\*1023"):
        gate(num_run.out, max_steps=2**1023)
    assert check_cli(num_run, "--max-steps", "9" * 400) == 2


@pytest.mark.parametrize(
    "content",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"num_train_epochs": ' + "9" * 400 + "}",
        '{"num_train_epochs": ' + "9" * 5000 + "}",
        '{"lr_scheduler_kwargs": "' + "[" * 100_000 + '"}',
        '{"max_steps": ' + "9" * 400 + "}",
    ],
    ids=["nested 10**5", "epochs 400 digits", "epochs 5000 digits", "kwargs nested 10**5", "max_steps 400 digits"],
)
def test_hostile_training_args_json_is_a_usage_error(num_run: Run, tmp_path: Path, content: str) -> None:
    write(num_run, {}, {}, {})
    path = tmp_path / "args.json"
    path.write_text(content)
    assert check_cli(num_run, "--training-args", str(path)) in (0, 2)


def test_the_runs_own_warmup_ratio_counts_where_the_uninterrupted_schedule_is_rebuilt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A transformers 4 run with `warmup_steps=0, warmup_ratio=0.1` warms up for 10 of its 100 steps: the jump
    rule's view of the run (``_warming_up``, ``_uninterrupted``) reads that ratio as the plan does."""
    import dataclasses

    from ckptdoctor import trainer_view
    from ckptdoctor.resume_gate import rules as gate_rules

    args = {"warmup_steps": 0, "warmup_ratio": 0.1, "lr_scheduler_type": "linear", "learning_rate": 0.1}
    monkeypatch.setattr(trainer_view, "training_args", lambda ck: args)
    monkeypatch.setattr(trainer_view, "scheduler_state", lambda ck: None)
    fields = {f.name: None for f in dataclasses.fields(trainer_view.TrainerStateView)}
    ts = trainer_view.TrainerStateView(**{**fields, "max_steps": 100, "log_history": ()})
    assert gate_rules._warming_up(None, ts, 5)  # type: ignore[arg-type]
    assert not gate_rules._warming_up(None, ts, 10)  # type: ignore[arg-type]
    lrs = gate_rules._uninterrupted(None, ts, 0, 2)  # type: ignore[arg-type]
    assert lrs is not None and lrs[0] == 0.0 and lrs[1] == pytest.approx(0.01)


def test_a_huge_world_size_names_only_the_rng_files_the_checkpoint_holds(num_run: Run) -> None:
    """The gate lists the RNG states a resume on ``world_size`` processes loads: `rng_state_{r}.pth` for each rank.
    A world size of 10**10 (hostile arguments) made a list of a name per rank: 22 GB before the kernel killed the
    process (found by test_hostile_numbers_never_traceback). Only the ranks' files the checkpoint holds are named."""
    from ckptdoctor.resume_gate import predict

    write(num_run, {}, {}, {})
    seen: list[int | None] = []
    real = predict.weights_only_loads

    def loads(*args: Any) -> Any:
        seen.append(args[-1])
        return real(*args)

    with mock.patch.object(predict, "weights_only_loads", loads):
        result = check_api(num_run, world_size=10**10, max_steps=100)
    assert result is not None and 10**10 in seen
