"""The planned resume: the Plan, reading and checking planned TrainingArguments, and the values the resume will use.

``resolve`` says what each argument of the resumed run will be and where it came from (planned, the checkpoint's
``training_args.bin``, ``trainer_state.json``, ``scheduler.pt``, or transformers' default). Nothing here predicts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from ckptdoctor import schedules, trainer_view
from ckptdoctor.errors import UsageError
from ckptdoctor.facts import version_tuple as version_tuple  # re-exported: the gate has always named it here
from ckptdoctor.gaps import count_text
from ckptdoctor.model import frozen

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
    "save_safetensors": True,  # transformers 4.x (5.x has no such argument: it always prefers safetensors)
    "auto_find_batch_size": False,
}




# Integers beyond this cannot become a float: transformers' step and warm-up arithmetic overflows on them, and a
# prediction built on one says nothing. A max_steps this large is that crash (CKD413); a global_step, or a planned
# integer, is unusable input.
INT_LIMIT = 2**1023


class GateInputError(UsageError):
    """The gate cannot predict with what it was given (e.g. steps per epoch cannot be derived): a usage error."""


@frozen
class Plan:
    """How the resume is planned. ``None`` means "as the run was": read from the checkpoint itself.

    Fields carry ``TrainingArguments`` semantics (transformers 5.x): ``max_steps > 0`` overrides
    ``num_train_epochs``; ``warmup_steps < 1`` is a ratio of max_steps. Planning ``num_train_epochs`` without
    ``max_steps`` means an epoch-based run (``max_steps=-1``). ``steps_per_epoch`` counts optimizer updates
    (``ceil(len(train_dataloader) / gradient_accumulation_steps)``). ``grad_scaler`` says whether the resuming
    Trainer has a GradScaler (``trainer.accelerator.scaler is not None``; None: unknown): without one, a
    ``scaler.pt`` in the checkpoint makes ``_load_scaler`` raise AttributeError. ``save_safetensors`` is the
    resuming ``TrainingArguments``' (transformers 4.x only: False loads ``pytorch_model.bin``, not
    ``model.safetensors``). ``transformers_version`` is the version the resume runs under ("4.57"; None: the
    installed one, else the checkpoint's, see ``transformers_version``). ``save_total_limit`` is the resuming
    ``TrainingArguments``' (None: the run's own, from ``training_args.bin``; 0: no rotation) and ``numpy_version``
    the numpy the resume runs under ("1.26"; None: the installed one): CKD417 and CKD418 judge with them.
    """

    checkpoint: str | None = None
    num_train_epochs: float | None = None
    max_steps: int | None = None
    learning_rate: float | None = None
    lr_scheduler_type: str | None = None
    warmup_steps: float | None = None
    # transformers 4.x's warmup_ratio, used when warmup_steps is not above 0 (5.x has none: a planned ratio is its
    # warmup_steps below 1)
    warmup_ratio: float | None = None
    lr_scheduler_kwargs: Mapping[str, Any] | None = None
    steps_per_epoch: int | None = None
    world_size: int | None = None
    per_device_train_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    ignore_data_skip: bool | None = None
    grad_scaler: bool | None = None
    save_safetensors: bool | None = None
    auto_find_batch_size: bool | None = None
    transformers_version: str | None = None
    # torchtitan's `checkpoint.load_step` (-1: the latest step holding `.metadata`); only its gate reads it
    load_step: int | None = None
    save_total_limit: int | None = None
    numpy_version: str | None = None
    # the ZeRO stage of the resuming DeepSpeed config (a planned `deepspeed` dict's `zero_optimization.stage`)
    zero_stage: int | None = None
    lr_steps: int = DEFAULT_LR_STEPS
    fail_on: str = "error"


# The TrainingArguments that size an epoch: with the world size they make the train dataloader's length.
BATCH_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps")


PLAN_FIELDS = frozenset(
    ("num_train_epochs", "max_steps", "learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio",
     "lr_scheduler_kwargs",
     "steps_per_epoch", "world_size", "per_device_train_batch_size", "gradient_accumulation_steps",
     "ignore_data_skip", "grad_scaler", "save_safetensors", "auto_find_batch_size", "transformers_version",
     "load_step", "save_total_limit", "numpy_version")
)  # fmt: skip


def int_text(n: int) -> str:
    """``n`` for a message; one too long for Python to print (over 4,300 digits, from a pickle) by its size."""
    return count_text(n, grouped=False)


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

    Only the fields the resume arithmetic reads are taken; ``warmup_ratio`` (transformers 4) is kept, in place of
    ``warmup_steps``, when ``warmup_steps`` is 0 (``get_warmup_steps`` uses it only then). ``fp16`` false with
    ``bf16`` true is ``grad_scaler=False``:
    transformers then asks accelerate for bf16, which makes no GradScaler on any device (with both false the
    mixed precision is the launcher's ``ACCELERATE_MIXED_PRECISION``, possibly fp16: unknown). A ``deepspeed``
    config dict gives its ZeRO stage (``zero_stage``; a path to a config file is not read). A value of the
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
    if trainer_view.integer(args.get("max_steps")) is not None:
        out["max_steps"] = int(args["max_steps"])
    for key in BATCH_FIELDS:
        count = trainer_view.integer(args.get(key))
        if count is not None and count >= 1:
            out[key] = count
    if isinstance(args.get("lr_scheduler_type"), str):
        out["lr_scheduler_type"] = args["lr_scheduler_type"]
    limit = trainer_view.integer(args.get("save_total_limit"))
    if limit is not None and limit >= 0:
        out["save_total_limit"] = limit
    kwargs = parse_kwargs(args.get("lr_scheduler_kwargs"))
    if kwargs is not None:
        out["lr_scheduler_kwargs"] = kwargs
    for key in ("ignore_data_skip", "save_safetensors", "auto_find_batch_size"):
        if isinstance(args.get(key), bool):
            out[key] = args[key]
    ratio = trainer_view.number(args.get("warmup_ratio"))
    if ratio and not out.get("warmup_steps") and 0 < ratio < 1:
        out.pop("warmup_steps", None)
        out["warmup_ratio"] = ratio
    if args.get("fp16") is False and args.get("bf16") is True:
        out["grad_scaler"] = False
    ds = args.get("deepspeed")  # a config dict (a path to a JSON file is not read)
    zero = ds.get("zero_optimization") if isinstance(ds, Mapping) else None
    stage = trainer_view.integer(zero.get("stage")) if isinstance(zero, Mapping) else None
    if stage is not None and 0 <= stage <= 3:
        out["zero_stage"] = stage
    return out


def own_warmup(own: Mapping[str, Any]) -> Any:
    """The warm-up a ``plan_from_training_args`` mapping holds: ``warmup_steps``, else transformers 4's
    ``warmup_ratio`` (kept in its place when ``warmup_steps`` is 0); ``schedules.warmup_steps_for`` reads a value
    below 1 as a ratio of max_steps. None when neither is set."""
    return own.get("warmup_steps", own.get("warmup_ratio"))


def _check_training_args(args: Mapping[str, Any]) -> None:
    """``GateInputError`` for a planned ``TrainingArguments`` value that ``plan_from_training_args`` would skip."""
    brief = schedules.brief
    for key in ("num_train_epochs", "learning_rate", "warmup_steps", "warmup_ratio"):
        v = args.get(key)
        number = trainer_view.number(v)
        if v is not None and (number is None or not math.isfinite(number)):
            raise GateInputError(f"training_args {key} must be a finite number, not {brief(v)}")
    v = args.get("max_steps")
    if v is not None and trainer_view.integer(v) is None:
        raise GateInputError(f"training_args max_steps must be an integer, not {brief(v)}")
    for key in BATCH_FIELDS:
        v = args.get(key)
        if v is not None and (trainer_view.integer(v) is None or v < 1):
            raise GateInputError(f"training_args {key} must be an integer >= 1, not {brief(v)}")
    v = args.get("save_total_limit")
    if v is not None and trainer_view.integer(v) is None:
        raise GateInputError(f"training_args save_total_limit must be an integer, not {brief(v)}")
    v = args.get("lr_scheduler_type")
    if v is not None and not isinstance(v, str):
        raise GateInputError(f"training_args lr_scheduler_type must be a string, not {brief(v)}")
    for key in ("ignore_data_skip", "fp16", "bf16", "save_safetensors", "auto_find_batch_size"):
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
    for key in ("num_train_epochs", "learning_rate", "warmup_steps", "warmup_ratio"):
        v = values.get(key)
        number = trainer_view.number(v)
        if v is not None and (number is None or not math.isfinite(number)):
            raise GateInputError(f"{key} must be a finite number, not {brief(v)}")
    for key, low in (("max_steps", None), ("steps_per_epoch", 1), ("world_size", 1), ("load_step", -1),
                     ("per_device_train_batch_size", 1), ("gradient_accumulation_steps", 1)):
        v = values.get(key)
        if v is not None and (trainer_view.integer(v) is None or (low is not None and v < low) or abs(v) >= INT_LIMIT):
            raise GateInputError(f"{key} must be an integer{f' >= {low}' if low else ''} below 2**1023, not {brief(v)}")
    if values.get("lr_scheduler_type") is not None and not isinstance(values["lr_scheduler_type"], str):
        raise GateInputError(f"lr_scheduler_type must be a string, not {brief(values['lr_scheduler_type'])}")
    for key in ("ignore_data_skip", "grad_scaler", "save_safetensors", "auto_find_batch_size"):
        if values.get(key) is not None and not isinstance(values[key], bool):
            raise GateInputError(f"{key} must be True or False, not {brief(values[key])}")
    version = values.get("transformers_version")
    if version is not None and version_major(version) is None:
        raise GateInputError(f"transformers_version must be a version such as 4.57 or 5.23, not {brief(version)}")
    version = values.get("numpy_version")
    if version is not None and version_major(version) is None:
        raise GateInputError(f"numpy_version must be a version such as 1.26 or 2.3, not {brief(version)}")
    limit = values.get("save_total_limit")
    if limit is not None and (trainer_view.integer(limit) is None or limit < 0 or limit >= INT_LIMIT):
        raise GateInputError(f"save_total_limit must be an integer >= 0, not {brief(limit)}")
    raw = values.get("lr_scheduler_kwargs")
    if isinstance(raw, str) and not raw.strip():
        values.pop("lr_scheduler_kwargs")  # TrainingArguments reads an empty string as no kwargs
    elif raw is not None:
        kwargs = parse_kwargs(dict(raw) if isinstance(raw, Mapping) else raw)
        if kwargs is None:
            raise GateInputError(f"lr_scheduler_kwargs must be a mapping, not {brief(raw)}")
        values["lr_scheduler_kwargs"] = kwargs


def version_major(version: object) -> int | None:
    """The major number of a version string (``version_tuple``), or None."""
    v = version_tuple(version)
    return None if v is None else v[0]
