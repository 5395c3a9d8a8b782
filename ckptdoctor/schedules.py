"""transformers' learning-rate schedules as pure functions, to predict a resume's LRs without torch.

Each factor function repeats the arithmetic of its ``_get_*_lr_lambda`` in ``src/transformers/optimization.py``
(transformers 5.23) operation for operation, so ``base_lr * factor(step)`` equals ``LambdaLR.get_lr()`` bit for
bit; ``build`` mirrors ``get_scheduler`` (which keyword arguments reach which schedule, and when it raises).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import field
from typing import Any

from ckptdoctor.model import frozen

# Names ``TrainingArguments.lr_scheduler_type`` accepts whose LR depends on the step alone.
SUPPORTED = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
)
# Names whose LR follows an evaluation metric, so no static prediction exists.
METRIC_DRIVEN = ("reduce_lr_on_plateau", "greedy")


class ScheduleError(ValueError):
    """The schedule cannot be built: ``get_scheduler`` would raise, or the name is unknown or metric-driven."""


def brief(value: Any, limit: int = 200) -> str:
    """``repr(value)`` for a message, at most ``limit`` characters; never raises (a value read from a checkpoint
    may hold an integer over Python's 4,300-digit print limit, or lists nested past the recursion limit)."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        return f"<unprintable {type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def warmup_steps_for(warmup_steps: float, num_training_steps: int) -> int:
    """``TrainingArguments.get_warmup_steps`` (5.x): a value below 1 is a ratio of the training steps, rounded up.

    Raises where transformers raises, with the same error: ``ValueError`` for a NaN, ``OverflowError`` for an
    infinite value or a ratio of a step count beyond any float. Callers decide what that means for them.
    """
    if warmup_steps >= 1:
        return int(warmup_steps)
    return math.ceil(num_training_steps * warmup_steps)


def _warmup(step: float, warmup: float) -> float:
    return float(step) / float(max(1, warmup))


def _constant(step: int) -> float:
    return 1  # transformers returns the int 1; base_lr * 1 is the same float


def _constant_with_warmup(step: int, *, num_warmup_steps: int) -> float:
    if step < num_warmup_steps:
        return float(step) / float(max(1.0, num_warmup_steps))
    return 1.0


def _linear(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    return max(0.0, float(num_training_steps - step) / float(max(1, num_training_steps - num_warmup_steps)))


def _cosine(
    step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float, min_lr_rate: float
) -> float:
    # transformers defines this lambda twice; the second (min-lr) definition wins, so plain cosine runs it too.
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    factor = 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    return max(0, factor * (1 - min_lr_rate) + min_lr_rate)


def _cosine_with_restarts(step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: int) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    progress = float(step - num_warmup_steps) / float(max(1, num_training_steps - num_warmup_steps))
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((float(num_cycles) * progress) % 1.0))))


def _polynomial(
    step: int, *, num_warmup_steps: int, num_training_steps: int, lr_end: float, power: float, lr_init: float
) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    if step > num_training_steps:
        return lr_end / lr_init
    lr_range = lr_init - lr_end
    decay_steps = num_training_steps - num_warmup_steps
    pct_remaining = 1 - (step - num_warmup_steps) / decay_steps
    decay: float = lr_range * pct_remaining**power + lr_end
    return decay / lr_init


def _inverse_sqrt(step: int, *, num_warmup_steps: int, timescale: int) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    shift = timescale - num_warmup_steps
    return 1.0 / math.sqrt((step + shift) / timescale)


def _cosine_warmup_with_min_lr(
    step: int,
    *,
    num_warmup_steps: int,
    num_training_steps: int,
    num_cycles: float,
    min_lr_rate: float,
    warmup_lr_rate: float | None,
) -> float:
    cur, warm, total = float(step), float(num_warmup_steps), float(num_training_steps)
    if cur < warm:
        if warmup_lr_rate is None:
            return (cur + 1.0) / max(1.0, warm)
        rate = float(warmup_lr_rate)
        return rate + (1.0 - rate) * cur / max(1, warm - 1)
    progress = (cur - warm + 1.0) / max(1.0, total - warm)
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0, factor * (1 - min_lr_rate) + min_lr_rate)


def _wsd_shape(kind: str, progress: float, *, warmup: bool, num_cycles: float) -> float:
    if kind == "linear":
        return progress if warmup else 1.0 - progress
    if kind == "cosine":
        if warmup:
            return 0.5 * (1.0 - math.cos(math.pi * progress))
        return 0.5 * (1.0 + math.cos(math.pi * float(num_cycles) * 2.0 * progress))
    return 1.0 - math.sqrt(1.0 - progress) if warmup else 1.0 - math.sqrt(progress)  # "1-sqrt"


def _wsd(
    step: int,
    *,
    num_warmup_steps: int,
    num_stable_steps: int,
    num_decay_steps: int,
    warmup_type: str,
    decay_type: str,
    min_lr_ratio: float,
    num_cycles: float,
) -> float:
    if step < num_warmup_steps:
        progress = float(step) / float(max(1, num_warmup_steps))
        factor = _wsd_shape(warmup_type, progress, warmup=True, num_cycles=num_cycles)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    if step < num_warmup_steps + num_stable_steps:
        return 1.0
    if step < num_warmup_steps + num_stable_steps + num_decay_steps:
        progress = float(step - num_warmup_steps - num_stable_steps) / float(max(1, num_decay_steps))
        factor = _wsd_shape(decay_type, progress, warmup=False, num_cycles=num_cycles)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    return min_lr_ratio


@frozen
class Schedule:
    """One LR schedule as ``get_scheduler`` would build it: ``factor(step)`` is ``lr_lambda(step)``."""

    name: str
    num_warmup_steps: int
    num_training_steps: int
    params: Mapping[str, Any] = field(default_factory=dict)  # the lambda's bound keyword arguments
    func: Callable[..., float] = field(default=_constant, repr=False, compare=False)

    def factor(self, step: int) -> float:
        """The multiplier of the base LR after ``step`` scheduler steps (``LambdaLR.last_epoch == step``)."""
        return self.func(step, **self.params)

    def lr(self, base_lr: float, step: int) -> float:
        """``LambdaLR.get_lr()`` for one param group: ``base_lr * lambda(step)``."""
        return base_lr * self.factor(step)


# Keyword arguments each schedule function accepts beyond the optimizer, steps and last_epoch, with defaults.
_KWARGS: dict[str, dict[str, Any]] = {
    "linear": {},
    "cosine": {"num_cycles": 0.5},
    "cosine_with_restarts": {"num_cycles": 1},
    "polynomial": {"lr_end": 1e-7, "power": 1.0},
    "inverse_sqrt": {"timescale": None},
    "cosine_with_min_lr": {"num_cycles": 0.5, "min_lr": None, "min_lr_rate": None},
    "cosine_warmup_with_min_lr": {"num_cycles": 0.5, "min_lr": None, "min_lr_rate": None, "warmup_lr_rate": None},
    "warmup_stable_decay": {
        "num_decay_steps": None,
        "num_stable_steps": None,
        "warmup_type": "linear",
        "decay_type": "cosine",
        "min_lr_ratio": 0,
        "num_cycles": 0.5,
    },
}


def _merge(name: str, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    allowed = _KWARGS[name]
    unknown = sorted(set(kwargs) - set(allowed) - {"last_epoch"})
    if unknown:
        raise ScheduleError(f"{name} does not accept {', '.join(unknown)} (TypeError in get_scheduler)")
    return {**allowed, **{k: v for k, v in kwargs.items() if k != "last_epoch"}}


def _min_lr_rate(name: str, kw: Mapping[str, Any], lr_init: float) -> float:
    min_lr, rate = kw["min_lr"], kw["min_lr_rate"]
    if min_lr is not None and rate is not None:
        raise ScheduleError(f"{name}: only one of min_lr or min_lr_rate may be set")
    if min_lr is not None:
        return float(min_lr) / lr_init
    if rate is None:
        raise ScheduleError(f"{name}: one of min_lr or min_lr_rate must be set in lr_scheduler_kwargs")
    return float(rate)


def build(
    name: str,
    *,
    num_warmup_steps: int,
    num_training_steps: int,
    lr_init: float,
    kwargs: Mapping[str, Any] | None = None,
    major: int = 5,
) -> Schedule:
    """The schedule ``get_scheduler(name, optimizer, num_warmup_steps, num_training_steps, kwargs)`` would build.

    ``lr_init`` is ``optimizer.defaults["lr"]`` (the Trainer's ``learning_rate`` argument), which polynomial and the
    min-lr schedules fold into their lambda. Raises ``ScheduleError`` where transformers raises, and for the
    metric-driven schedules, whose LR cannot be predicted from the step. ``major`` is the transformers major version
    that builds it: 4.x's ``get_scheduler`` passes ``inverse_sqrt`` no kwargs (its ``timescale`` is always the
    default), and 4.x has no ``greedy`` (``SchedulerType`` raises ValueError on the name).
    """
    kw = dict(kwargs or {})
    n_warm, n_total = num_warmup_steps, num_training_steps
    if major < 5 and name == "greedy":
        raise ScheduleError(f"unknown lr_scheduler_type {brief(name)} (transformers 4.x has no greedy schedule)")
    if major < 5 and name == "inverse_sqrt":
        kw = {}  # src/transformers/optimization.py (4.57) get_scheduler: schedule_func(optimizer, num_warmup_steps)
    if name in METRIC_DRIVEN:
        raise ScheduleError(f"{name} changes the LR from evaluation metrics; it cannot be predicted")
    if name == "constant":  # get_scheduler passes neither steps nor kwargs
        return Schedule(name, 0, n_total, {}, _constant)
    if name == "constant_with_warmup":  # only num_warmup_steps; kwargs are dropped
        return Schedule(name, n_warm, n_total, {"num_warmup_steps": n_warm}, _constant_with_warmup)
    if name not in _KWARGS:
        raise ScheduleError(f"unknown lr_scheduler_type {brief(name)}")
    k = _merge(name, kw)
    steps = {"num_warmup_steps": n_warm, "num_training_steps": n_total}
    if name == "linear":
        return Schedule(name, n_warm, n_total, steps, _linear)
    if name == "cosine":
        return Schedule(name, n_warm, n_total, {**steps, "num_cycles": k["num_cycles"], "min_lr_rate": 0.0}, _cosine)
    if name == "cosine_with_restarts":
        return Schedule(name, n_warm, n_total, {**steps, "num_cycles": k["num_cycles"]}, _cosine_with_restarts)
    if name == "polynomial":
        if not lr_init > k["lr_end"]:
            raise ScheduleError(
                f"polynomial: lr_end ({brief(k['lr_end'])}) must be smaller than initial lr ({brief(lr_init)})"
            )
        params = {**steps, "lr_end": k["lr_end"], "power": k["power"], "lr_init": lr_init}
        return Schedule(name, n_warm, n_total, params, _polynomial)
    if name == "inverse_sqrt":
        timescale = k["timescale"] if k["timescale"] is not None else (n_warm or 10_000)
        return Schedule(name, n_warm, n_total, {"num_warmup_steps": n_warm, "timescale": timescale}, _inverse_sqrt)
    if name == "cosine_with_min_lr":
        params = {**steps, "num_cycles": k["num_cycles"], "min_lr_rate": _min_lr_rate(name, k, lr_init)}
        return Schedule(name, n_warm, n_total, params, _cosine)
    if name == "cosine_warmup_with_min_lr":
        rate = _min_lr_rate(name, k, lr_init)
        params = {**steps, "num_cycles": k["num_cycles"], "min_lr_rate": rate, "warmup_lr_rate": k["warmup_lr_rate"]}
        return Schedule(name, n_warm, n_total, params, _cosine_warmup_with_min_lr)
    return _build_wsd(n_warm, n_total, k)


def _build_wsd(n_warm: int, n_total: int, k: Mapping[str, Any]) -> Schedule:
    if k["num_decay_steps"] is None:
        raise ScheduleError("warmup_stable_decay needs num_decay_steps in lr_scheduler_kwargs")
    for kind in ("warmup_type", "decay_type"):
        if k[kind] not in ("linear", "cosine", "1-sqrt"):
            raise ScheduleError(f"warmup_stable_decay: unknown {kind} {brief(k[kind])}")
    stable = k["num_stable_steps"]
    if stable is None:
        stable = n_total - n_warm - k["num_decay_steps"]
    params = {
        "num_warmup_steps": n_warm,
        "num_stable_steps": stable,
        "num_decay_steps": k["num_decay_steps"],
        "warmup_type": k["warmup_type"],
        "decay_type": k["decay_type"],
        "min_lr_ratio": k["min_lr_ratio"],
        "num_cycles": k["num_cycles"],
    }
    return Schedule("warmup_stable_decay", n_warm, n_total, params, _wsd)
