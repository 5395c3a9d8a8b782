"""ckptdoctor.schedules against transformers.get_scheduler: every schedule, step by step, bit for bit."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from transformers import get_scheduler

from ckptdoctor import schedules

LR = 3e-4
STEP_RANGE = range(0, 40)

# (name, kwargs): the schedules a Trainer can build from lr_scheduler_type + lr_scheduler_kwargs
CASES: list[tuple[str, dict[str, Any]]] = [
    ("linear", {}),
    ("cosine", {}),
    ("cosine", {"num_cycles": 1.5}),
    ("cosine_with_restarts", {}),
    ("cosine_with_restarts", {"num_cycles": 3}),
    ("polynomial", {}),
    ("polynomial", {"power": 2.0, "lr_end": 1e-5}),
    ("constant", {}),
    ("constant_with_warmup", {}),
    ("inverse_sqrt", {}),
    ("inverse_sqrt", {"timescale": 7}),
    ("cosine_with_min_lr", {"min_lr": 1e-5}),
    ("cosine_with_min_lr", {"min_lr_rate": 0.1, "num_cycles": 0.75}),
    ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.05}),
    ("cosine_warmup_with_min_lr", {"min_lr": 2e-5, "warmup_lr_rate": 0.2}),
    ("warmup_stable_decay", {"num_decay_steps": 6}),
    ("warmup_stable_decay",
     {"num_decay_steps": 5, "warmup_type": "cosine", "decay_type": "linear", "min_lr_ratio": 0.1}),
    ("warmup_stable_decay",
     {"num_decay_steps": 4, "num_stable_steps": 3, "warmup_type": "1-sqrt", "decay_type": "1-sqrt"}),
]
STEPS = [(0, 1), (0, 10), (3, 10), (10, 10), (1, 25), (7, 30), (4, 5)]  # (warmup, training steps)


def _reference(name: str, warmup: int, total: int, kwargs: dict[str, Any]) -> torch.optim.lr_scheduler.LambdaLR:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    return get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total,
                         scheduler_specific_kwargs=dict(kwargs))


@pytest.mark.parametrize(("name", "kwargs"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)])
@pytest.mark.parametrize(("warmup", "total"), STEPS)
def test_factor_matches_transformers(name: str, kwargs: dict[str, Any], warmup: int, total: int) -> None:
    stable_given = "num_stable_steps" in kwargs
    if name == "warmup_stable_decay" and not stable_given and warmup + kwargs["num_decay_steps"] > total:
        pytest.skip("negative stable phase")
    ref = _reference(name, warmup, total, kwargs)
    ours = schedules.build(name, num_warmup_steps=warmup, num_training_steps=total, lr_init=LR, kwargs=kwargs)
    for step in STEP_RANGE:
        want, got = _outcome(ref.lr_lambdas[0], step), _outcome(ours.factor, step)
        assert got == want, (name, step)
        if isinstance(want, float | int):
            assert ours.lr(LR, step) == LR * want


def _outcome(fn: Any, step: int) -> object:
    """The factor, or the exception type both raise (polynomial divides by zero when warmup == training steps)."""
    try:
        return fn(step)
    except ArithmeticError as exc:
        return type(exc)


@pytest.mark.parametrize(("name", "kwargs"), CASES[:10], ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES[:10])])
def test_lambdalr_steps_match(name: str, kwargs: dict[str, Any]) -> None:
    """The LRs the real LambdaLR sets on the optimizer, step after step, with another base LR restored."""
    ref = _reference(name, 2, 12, kwargs)
    base = 7e-4
    ref.base_lrs = [base]  # what load_state_dict restores from scheduler.pt
    ours = schedules.build(name, num_warmup_steps=2, num_training_steps=12, lr_init=LR, kwargs=kwargs)
    for step in range(1, 20):
        ref.optimizer.step()
        ref.step()
        assert ref.optimizer.param_groups[0]["lr"] == ours.lr(base, step)


@pytest.mark.parametrize(("ws", "total", "want"), [(0, 10, 0), (3, 10, 3), (3.7, 10, 3), (0.25, 10, 3), (0.1, 7, 1),
                                                  (0.5, 8, 4), (1, 10, 1), (0.999, 3, 3)])
def test_warmup_steps_for(ws: float, total: int, want: int) -> None:
    from transformers import TrainingArguments

    args = TrainingArguments(output_dir="unused", warmup_steps=ws, report_to=[], use_cpu=True)
    assert args.get_warmup_steps(total) == want == schedules.warmup_steps_for(ws, total)


@pytest.mark.parametrize(
    ("name", "kwargs", "lr_init"),
    [
        ("polynomial", {"lr_end": 1e-3}, 1e-4),
        ("linear", {"num_cycles": 2}, 1e-4),
        ("cosine_with_min_lr", {}, 1e-4),
        ("cosine_with_min_lr", {"min_lr": 1e-6, "min_lr_rate": 0.1}, 1e-4),
        ("warmup_stable_decay", {}, 1e-4),
        ("warmup_stable_decay", {"num_decay_steps": 2, "decay_type": "step"}, 1e-4),
    ],
)
def test_build_raises_where_transformers_raises(name: str, kwargs: dict[str, Any], lr_init: float) -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr_init)
    with pytest.raises((ValueError, TypeError)):
        get_scheduler(name, opt, num_warmup_steps=1, num_training_steps=10, scheduler_specific_kwargs=kwargs)
    with pytest.raises(schedules.ScheduleError):
        schedules.build(name, num_warmup_steps=1, num_training_steps=10, lr_init=lr_init, kwargs=kwargs)


def test_kwargs_ignored_where_transformers_ignores_them() -> None:
    for name in ("constant", "constant_with_warmup"):
        s = schedules.build(name, num_warmup_steps=2, num_training_steps=10, lr_init=LR, kwargs={"num_cycles": 3})
        ref = _reference(name, 2, 10, {"num_cycles": 3})
        assert [s.factor(i) for i in range(12)] == [ref.lr_lambdas[0](i) for i in range(12)]


@pytest.mark.parametrize("name", [*schedules.METRIC_DRIVEN, "no_such_schedule"])
def test_unpredictable_schedules_raise(name: str) -> None:
    with pytest.raises(schedules.ScheduleError):
        schedules.build(name, num_warmup_steps=0, num_training_steps=10, lr_init=LR)


def test_supported_names_are_transformers_names() -> None:
    from transformers.trainer_utils import SchedulerType

    names = {s.value for s in SchedulerType}
    assert set(schedules.SUPPORTED) | set(schedules.METRIC_DRIVEN) == names
    assert not set(itertools.chain(schedules.SUPPORTED)) & set(schedules.METRIC_DRIVEN)
