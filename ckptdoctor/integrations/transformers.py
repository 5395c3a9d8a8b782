"""Run ``ckptdoctor gate`` from a transformers training script, right before ``trainer.train(resume_from_checkpoint)``.

Two ways, both reading the plan from the Trainer's own arguments and dataloader::

    from ckptdoctor.integrations.transformers import check_resume, gate_callback

    check_resume(trainer, resume_from_checkpoint=True)      # raises ResumeGateError when the gate fails
    trainer.train(resume_from_checkpoint=True)

    trainer.add_callback(gate_callback(resume_from_checkpoint=True))   # or: fail inside train(), before step one

transformers is imported only when a callback is built; ``check_resume`` needs nothing but the Trainer object.
"""

from __future__ import annotations

import os
from typing import Any

from ckptdoctor.gate import GateResult, gate, render_text


class ResumeGateError(RuntimeError):
    """The gate failed for the planned resume; ``result`` holds the prediction and its findings."""

    def __init__(self, result: GateResult) -> None:
        super().__init__("ckptdoctor gate failed for this resume:\n" + render_text(result))
        self.result = result


def _value(v: Any) -> Any:
    """An enum member's value (``SchedulerType.COSINE`` -> ``"cosine"``), anything else as is."""
    return getattr(v, "value", v)


def steps_per_epoch(dataloader: Any, gradient_accumulation_steps: int) -> int | None:
    """Optimizer updates per epoch as ``Trainer.set_initial_training_values`` counts them (None when unsized)."""
    try:
        n = len(dataloader)
    except TypeError:
        return None
    ga = max(1, int(gradient_accumulation_steps))
    return max(n // ga + int(n % ga > 0), 1)


def planned_from_args(args: Any, dataloader: Any = None) -> dict[str, Any]:
    """The gate's planned arguments from a ``TrainingArguments`` (and the train dataloader, for steps per epoch)."""
    planned: dict[str, Any] = {
        "learning_rate": float(args.learning_rate),
        "lr_scheduler_type": str(_value(args.lr_scheduler_type)),
        "warmup_steps": float(getattr(args, "warmup_steps", 0) or getattr(args, "warmup_ratio", 0) or 0),
        "lr_scheduler_kwargs": dict(args.lr_scheduler_kwargs or {}) if isinstance(args.lr_scheduler_kwargs, dict)
        else None,
        "ignore_data_skip": bool(args.ignore_data_skip),
        "world_size": int(args.world_size),
    }
    if args.max_steps > 0:
        planned["max_steps"] = int(args.max_steps)
    else:
        planned["num_train_epochs"] = float(args.num_train_epochs)
    if dataloader is not None:
        planned["steps_per_epoch"] = steps_per_epoch(dataloader, args.gradient_accumulation_steps)
    return planned


def _run(
    args: Any,
    dataloader: Any,
    resume_from_checkpoint: bool | str | os.PathLike[str],
    fail_on: str | None,
    lr_steps: int,
) -> GateResult:
    if isinstance(resume_from_checkpoint, bool):
        if not resume_from_checkpoint:
            raise ValueError("resume_from_checkpoint=False does not resume; there is nothing to gate")
        checkpoint = None
    else:
        checkpoint = os.fspath(resume_from_checkpoint)
    return gate(
        args.output_dir,
        checkpoint=checkpoint,
        fail_on=fail_on,
        lr_steps=lr_steps,
        **planned_from_args(args, dataloader),
    )


def check_resume(
    trainer: Any,
    resume_from_checkpoint: bool | str | os.PathLike[str] = True,
    *,
    fail_on: str | None = None,
    lr_steps: int = 5,
) -> GateResult:
    """Gate ``trainer.train(resume_from_checkpoint=...)`` before calling it; raise ``ResumeGateError`` on failure.

    Returns the prediction when it passes (``result.lr``, ``result.steps_to_train`` ...). ``fail_on`` defaults to
    the output_dir's settings file's fail-on, else ``"error"``, as ``ckptdoctor gate`` does.
    """
    result = _run(trainer.args, trainer.get_train_dataloader(), resume_from_checkpoint, fail_on, lr_steps)
    if result.failed:
        raise ResumeGateError(result)
    return result


def gate_callback(
    resume_from_checkpoint: bool | str | os.PathLike[str] = True, *, fail_on: str | None = None, lr_steps: int = 5
) -> Any:
    """A ``TrainerCallback`` that runs the gate in ``on_train_begin`` (after the checkpoint is chosen, before the
    first step) and raises ``ResumeGateError`` when it fails. Pass the same ``resume_from_checkpoint`` as to train.

    ``result`` on the callback holds the last prediction.
    """
    from transformers import TrainerCallback

    class GateCallback(TrainerCallback):
        """Fails ``trainer.train`` before its first optimizer step when the resume gate fails."""

        def __init__(self) -> None:
            self.result: GateResult | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.result = _run(args, kwargs.get("train_dataloader"), resume_from_checkpoint, fail_on, lr_steps)
            if self.result.failed:
                raise ResumeGateError(self.result)

    return GateCallback()
