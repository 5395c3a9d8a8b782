"""The planned resume: the Plan, reading and checking planned TrainingArguments, and the values the resume will use.

``resolve`` says what each argument of the resumed run will be and where it came from (planned, the checkpoint's
``training_args.bin``, ``trainer_state.json``, ``scheduler.pt``, or transformers' default). Nothing here predicts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptdoctor import schedules, trainer_view
from ckptdoctor.errors import UsageError
from ckptdoctor.model import Checkpoint

DEFAULT_LR_STEPS = 5
MAX_LR_STEPS = 100_000  # a prediction is read by people and scripts; more would only take minutes and gigabytes
# TrainingArguments defaults (transformers 5.23) of the fields the resume arithmetic reads.
ARG_DEFAULTS: dict[str, Any] = {
    "num_train_epochs": 3.0,
    "max_steps": -1,
    "learning_rate": 5e-5,
    "lr_scheduler_type": "linear",
    "warmup_steps": 0.0,
    "lr_scheduler_kwargs": None,
    "ignore_data_skip": False,
}
PRINTABLE_BITS = 4000  # about 1,200 digits: well under Python's 4,300-digit int-to-str limit
# Integers beyond this cannot become a float: transformers' step and warm-up arithmetic overflows on them, and a
# prediction built on one says nothing. A max_steps this large is that crash (CKD413); a global_step, or a planned
# integer, is unusable input.
INT_LIMIT = 2**1023


class GateInputError(UsageError):
    """The gate cannot predict with what it was given (e.g. steps per epoch cannot be derived): a usage error."""


@dataclass(frozen=True, slots=True)
class Plan:
    """How the resume is planned. ``None`` means "as the run was": read from the checkpoint itself.

    Fields carry ``TrainingArguments`` semantics (transformers 5.x): ``max_steps > 0`` overrides
    ``num_train_epochs``; ``warmup_steps < 1`` is a ratio of max_steps. Planning ``num_train_epochs`` without
    ``max_steps`` means an epoch-based run (``max_steps=-1``). ``steps_per_epoch`` counts optimizer updates
    (``ceil(len(train_dataloader) / gradient_accumulation_steps)``). ``grad_scaler`` says whether the resuming
    Trainer has a GradScaler (``trainer.accelerator.scaler is not None``; None: unknown): without one, a
    ``scaler.pt`` in the checkpoint makes ``_load_scaler`` raise AttributeError.
    """

    checkpoint: str | None = None
    num_train_epochs: float | None = None
    max_steps: int | None = None
    learning_rate: float | None = None
    lr_scheduler_type: str | None = None
    warmup_steps: float | None = None
    lr_scheduler_kwargs: Mapping[str, Any] | None = None
    steps_per_epoch: int | None = None
    world_size: int | None = None
    ignore_data_skip: bool | None = None
    grad_scaler: bool | None = None
    lr_steps: int = DEFAULT_LR_STEPS
    fail_on: str = "error"


PLAN_FIELDS = frozenset(
    ("num_train_epochs", "max_steps", "learning_rate", "lr_scheduler_type", "warmup_steps", "lr_scheduler_kwargs",
     "steps_per_epoch", "world_size", "ignore_data_skip", "grad_scaler")
)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Reading planned values


def int_text(n: int) -> str:
    """``n`` for a message; one too long for Python to print (over 4,300 digits, from a pickle) by its size."""
    return str(n) if n.bit_length() <= PRINTABLE_BITS else f"<an integer of {n.bit_length():,} bits>"


def parse_kwargs(v: Any) -> dict[str, Any] | None:
    """``lr_scheduler_kwargs`` as TrainingArguments accepts it: a dict, a JSON object string, or None/empty."""
    if isinstance(v, str) and v.strip():
        try:
            v = json.loads(v)
        except (ValueError, RecursionError):  # not JSON, a 5,000-digit number, or arrays nested 10^5 deep
            return None
    if isinstance(v, dict):
        return {k if isinstance(k, str) else schedules.brief(k): x for k, x in v.items()}
    return None


def plan_from_training_args(args: Mapping[str, Any], *, strict: bool = False) -> dict[str, Any]:
    """Planned values from a ``TrainingArguments``-like mapping (``args.to_dict()``, a JSON config file).

    Only the fields the resume arithmetic reads are taken; ``warmup_ratio`` (transformers 4) becomes a
    ``warmup_steps`` ratio when ``warmup_steps`` is 0. ``fp16`` false with ``bf16`` true is ``grad_scaler=False``:
    transformers then asks accelerate for bf16, which makes no GradScaler on any device (with both false the
    mixed precision is the launcher's ``ACCELERATE_MIXED_PRECISION``, possibly fp16: unknown). A value of the
    wrong type is skipped, as for the checkpoint's own ``training_args.bin``; with ``strict`` (values the user
    planned) it, or a number that is not finite, raises ``GateInputError`` naming the key. A missing or null key is
    never an error.
    """
    if strict:
        _check_training_args(args)
    out: dict[str, Any] = {}
    for key in ("num_train_epochs", "learning_rate", "warmup_steps"):
        value = trainer_view.number(args.get(key))
        if value is not None:
            out[key] = value
    if trainer_view._int(args.get("max_steps")) is not None:
        out["max_steps"] = int(args["max_steps"])
    if isinstance(args.get("lr_scheduler_type"), str):
        out["lr_scheduler_type"] = args["lr_scheduler_type"]
    kwargs = parse_kwargs(args.get("lr_scheduler_kwargs"))
    if kwargs is not None:
        out["lr_scheduler_kwargs"] = kwargs
    if isinstance(args.get("ignore_data_skip"), bool):
        out["ignore_data_skip"] = args["ignore_data_skip"]
    ratio = trainer_view.number(args.get("warmup_ratio"))
    if ratio and not out.get("warmup_steps") and 0 < ratio < 1:
        out["warmup_steps"] = ratio
    if args.get("fp16") is False and args.get("bf16") is True:
        out["grad_scaler"] = False
    return out


def _check_training_args(args: Mapping[str, Any]) -> None:
    """``GateInputError`` for a planned ``TrainingArguments`` value that ``plan_from_training_args`` would skip."""
    brief = schedules.brief
    for key in ("num_train_epochs", "learning_rate", "warmup_steps", "warmup_ratio"):
        v = args.get(key)
        number = trainer_view.number(v)
        if v is not None and (number is None or not math.isfinite(number)):
            raise GateInputError(f"training_args {key} must be a finite number, not {brief(v)}")
    v = args.get("max_steps")
    if v is not None and trainer_view._int(v) is None:
        raise GateInputError(f"training_args max_steps must be an integer, not {brief(v)}")
    v = args.get("lr_scheduler_type")
    if v is not None and not isinstance(v, str):
        raise GateInputError(f"training_args lr_scheduler_type must be a string, not {brief(v)}")
    for key in ("ignore_data_skip", "fp16", "bf16"):
        v = args.get(key)
        if v is not None and not isinstance(v, bool):
            raise GateInputError(f"training_args {key} must be true or false, not {brief(v)}")
    v = args.get("lr_scheduler_kwargs")
    if v is not None and parse_kwargs(v) is None and not (isinstance(v, str) and not v.strip()):
        raise GateInputError(f"training_args lr_scheduler_kwargs must be a mapping or a JSON object, not {brief(v)}")


def check_plan(values: dict[str, Any]) -> None:
    """Planned values of the wrong type or range are the caller's mistake: ``GateInputError``, never a traceback
    from deep in the arithmetic. ``lr_scheduler_kwargs`` given as a JSON object string becomes a dict."""
    brief = schedules.brief
    for key in ("num_train_epochs", "learning_rate", "warmup_steps"):
        v = values.get(key)
        number = trainer_view.number(v)
        if v is not None and (number is None or not math.isfinite(number)):
            raise GateInputError(f"{key} must be a finite number, not {brief(v)}")
    for key, low in (("max_steps", None), ("steps_per_epoch", 1), ("world_size", 1)):
        v = values.get(key)
        if v is not None and (trainer_view._int(v) is None or (low is not None and v < low) or abs(v) >= INT_LIMIT):
            raise GateInputError(f"{key} must be an integer{f' >= {low}' if low else ''} below 2**1023, not {brief(v)}")
    if values.get("lr_scheduler_type") is not None and not isinstance(values["lr_scheduler_type"], str):
        raise GateInputError(f"lr_scheduler_type must be a string, not {brief(values['lr_scheduler_type'])}")
    for key in ("ignore_data_skip", "grad_scaler"):
        if values.get(key) is not None and not isinstance(values[key], bool):
            raise GateInputError(f"{key} must be True or False, not {brief(values[key])}")
    raw = values.get("lr_scheduler_kwargs")
    if isinstance(raw, str) and not raw.strip():
        values.pop("lr_scheduler_kwargs")  # TrainingArguments reads an empty string as no kwargs
    elif raw is not None:
        kwargs = parse_kwargs(dict(raw) if isinstance(raw, Mapping) else raw)
        if kwargs is None:
            raise GateInputError(f"lr_scheduler_kwargs must be a mapping, not {brief(raw)}")
        values["lr_scheduler_kwargs"] = kwargs


# ---------------------------------------------------------------------------------------------------------------
# What the resume will run with


@dataclass(frozen=True, slots=True)
class Settings:
    """The arguments the prediction used, and where each came from (planned, training_args.bin, ... default)."""

    num_train_epochs: float
    max_steps: int  # the argument: > 0 overrides num_train_epochs
    learning_rate: float
    lr_scheduler_type: str
    warmup_steps: float
    lr_scheduler_kwargs: Mapping[str, Any]
    ignore_data_skip: bool
    steps_per_epoch: int | None
    sources: Mapping[str, str] = field(default_factory=dict)


def steps_per_epoch_of(ts: trainer_view.TrainerStateView) -> int | None:
    """Optimizer updates per epoch of the run that wrote ``ts``, or None when the state does not pin it down.

    ``epoch`` is ``epochs_done + batches_done / batches_per_epoch``, so ``global_step / epoch`` is exact whenever
    gradient accumulation divides the epoch; else ``max_steps / num_train_epochs`` of an epoch-based run.
    """
    g, ep = ts.global_step, ts.epoch
    try:  # the state is whatever the file says: a 400-digit global_step or an infinite epoch count must not raise
        if g and ep and ep > 0:
            est = g / ep
            r = round(est)
            if r >= 1 and abs(est - r) <= 1e-6 * r:
                return r
        if ts.max_steps and ts.num_train_epochs and ts.num_train_epochs > 0:
            ratio = ts.max_steps / ts.num_train_epochs
            if ratio >= 1 and ratio.is_integer():
                return int(ratio)
    except (ArithmeticError, ValueError):
        return None
    return None


def resolve(plan: Plan, ck: Checkpoint, ts: trainer_view.TrainerStateView | None) -> Settings:
    """The arguments the resume will run with: planned values first, then the checkpoint's ``training_args.bin``,
    then ``trainer_state.json`` / ``scheduler.pt``, then transformers' defaults."""
    args = trainer_view.training_args(ck) or {}
    sources: dict[str, str] = {}

    def pick(name: str, planned: Any, from_args: Any, fallback: tuple[Any, str] | None = None) -> Any:
        if planned is not None:
            sources[name] = "planned"
            return planned
        if from_args is not None:
            sources[name] = "training_args.bin"
            return from_args
        if fallback is not None and fallback[0] is not None:
            sources[name] = fallback[1]
            return fallback[0]
        sources[name] = "default"
        return ARG_DEFAULTS[name]

    sched = trainer_view.scheduler_state(ck)
    planned_max = plan.max_steps if plan.max_steps is not None else (-1 if plan.num_train_epochs is not None else None)
    max_steps = pick("max_steps", planned_max, trainer_view._int(args.get("max_steps")),
                     (ts.max_steps if ts else None, "trainer_state.json"))
    epochs = pick("num_train_epochs", plan.num_train_epochs, trainer_view.number(args.get("num_train_epochs")),
                  (ts.num_train_epochs if ts else None, "trainer_state.json"))
    lr = pick("learning_rate", plan.learning_rate, trainer_view.number(args.get("learning_rate")),
              (sched.base_lrs[0] if sched and sched.base_lrs else None, "scheduler.pt"))
    stype = args.get("lr_scheduler_type")
    stype = pick("lr_scheduler_type", plan.lr_scheduler_type, stype if isinstance(stype, str) else None)
    own_warmup = plan_from_training_args(args).get("warmup_steps") if args else None
    warmup = pick("warmup_steps", plan.warmup_steps, own_warmup)
    kw = pick("lr_scheduler_kwargs", plan.lr_scheduler_kwargs, parse_kwargs(args.get("lr_scheduler_kwargs")))
    skip_flag = args.get("ignore_data_skip")
    ignore = pick("ignore_data_skip", plan.ignore_data_skip, skip_flag if isinstance(skip_flag, bool) else None)
    upe = plan.steps_per_epoch
    sources["steps_per_epoch"] = "planned"
    if upe is None:
        upe = steps_per_epoch_of(ts) if ts else None
        sources["steps_per_epoch"] = "trainer_state.json" if upe is not None else "unknown"
    return Settings(
        num_train_epochs=float(epochs),
        max_steps=int(max_steps),
        learning_rate=float(lr),
        lr_scheduler_type=str(stype),
        warmup_steps=float(warmup),
        lr_scheduler_kwargs=dict(kw or {}),
        ignore_data_skip=bool(ignore),
        steps_per_epoch=upe,
        sources=sources,
    )
