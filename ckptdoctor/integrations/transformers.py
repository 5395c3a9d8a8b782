"""Run ``ckptdoctor gate`` from a transformers training script, right before ``trainer.train(resume_from_checkpoint)``.

Two ways, both reading the plan from the Trainer's own arguments and dataloader::

    from ckptdoctor.integrations.transformers import check_resume, gate_callback

    check_resume(trainer, resume_from_checkpoint=True)      # raises ResumeGateError when the gate fails
    trainer.train(resume_from_checkpoint=True)

    trainer.add_callback(gate_callback(resume_from_checkpoint=True))   # or: fail inside train(), before step one

transformers is imported only when a callback is built; ``check_resume`` needs nothing but the Trainer object.
``check_resume`` is the complete check; the callback runs after ``train()`` has loaded the checkpoint's files (see
``gate_callback``). Warnings of a passing gate go to the ``ckptdoctor`` logger.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from ckptdoctor.findings import Severity
from ckptdoctor.render.gate import finding_line, render_text
from ckptdoctor.resume_gate import GateResult, gate

logger = logging.getLogger("ckptdoctor")


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


def planned_from_args(args: Any, dataloader: Any = None, accelerator: Any = None) -> dict[str, Any]:
    """The gate's planned arguments from a ``TrainingArguments`` (and the train dataloader, for steps per epoch;
    the Trainer's accelerator, for whether it has a GradScaler: ``_load_scaler`` needs one for ``scaler.pt``)."""
    planned: dict[str, Any] = {
        "learning_rate": float(args.learning_rate),
        "lr_scheduler_type": str(_value(args.lr_scheduler_type)),
        "warmup_steps": float(getattr(args, "warmup_steps", 0) or 0),
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
    if accelerator is not None:  # accelerate makes a GradScaler only for fp16 off CPU; the Trainer uses this one
        planned["grad_scaler"] = getattr(accelerator, "scaler", None) is not None
    # the gate follows the resume path of the transformers this Trainer runs on (4.x reads save_safetensors)
    version = getattr(sys.modules.get("transformers"), "__version__", None)
    if isinstance(version, str):
        planned["transformers_version"] = version
    ratio = getattr(args, "warmup_ratio", None)  # 4.x only
    if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio > 0:
        planned["warmup_ratio"] = float(ratio)
    if isinstance(getattr(args, "auto_find_batch_size", None), bool):
        planned["auto_find_batch_size"] = args.auto_find_batch_size
    if isinstance(getattr(args, "save_safetensors", None), bool):
        planned["save_safetensors"] = args.save_safetensors
    if isinstance(getattr(args, "per_device_train_batch_size", None), int):  # 4.x does not use a new one: CKD415
        planned["per_device_train_batch_size"] = args.per_device_train_batch_size
    return planned


def _run(
    args: Any,
    dataloader: Any,
    resume_from_checkpoint: bool | str | os.PathLike[str],
    fail_on: str | None,
    lr_steps: int,
    rules: Mapping[str, Any],
    accelerator: Any = None,
) -> GateResult:
    if isinstance(resume_from_checkpoint, bool):
        if not resume_from_checkpoint:
            raise ValueError("resume_from_checkpoint=False does not resume; there is nothing to gate")
        checkpoint = None
    else:
        checkpoint = os.fspath(resume_from_checkpoint)
    result = gate(
        args.output_dir,
        checkpoint=checkpoint,
        checkpoint_in_run=False,  # train() takes the path as given (from the working directory), never in output_dir
        fail_on=fail_on,
        lr_steps=lr_steps,
        **rules,
        **planned_from_args(args, dataloader, accelerator),
    )
    return settled(result)


def settled(result: GateResult) -> GateResult:
    """``result`` when it passes, its errors and warnings logged (a pass can still carry warnings: CKD410 LR 0,
    CKD411 a jump); raises ``ResumeGateError`` when it fails. Every integration ends its check here."""
    if result.failed:
        raise ResumeGateError(result)
    for f in result.findings:
        if f.severity in (Severity.ERROR, Severity.WARNING):
            logger.warning("%s", finding_line(f))
    return result


def check_resume(
    trainer: Any,
    resume_from_checkpoint: bool | str | os.PathLike[str] = True,
    *,
    fail_on: str | None = None,
    lr_steps: int = 5,
    select: Sequence[str] = (),
    ignore: Sequence[str] = (),
    config: bool = True,
) -> GateResult:
    """Gate ``trainer.train(resume_from_checkpoint=...)`` before calling it; raise ``ResumeGateError`` on failure.

    The complete check: every file the resume loads, the step arithmetic and the LRs. ``resume_from_checkpoint``
    is resolved exactly as ``train()`` resolves it: True is the last ``checkpoint-N`` in ``args.output_dir``; a path
    is taken as given, from the working directory (not inside output_dir), and one that is not there is CKD413
    (train() raises ``ValueError: Can't find a valid checkpoint``). Returns the prediction when it passes
    (``result.lr``, ``result.steps_to_train`` ...); findings of severity warning or error that did not fail it are
    logged, one line each, on the ``ckptdoctor`` logger at WARNING. ``fail_on``, ``select``, ``ignore`` and
    ``config`` are ``gate()``'s: ``fail_on`` defaults to the output_dir's settings file's fail-on, else ``"error"``.
    """
    rules = {"select": select, "ignore": ignore, "config": config}
    return _run(trainer.args, _resumed_dataloader(trainer, resume_from_checkpoint), resume_from_checkpoint, fail_on,
                lr_steps, rules, getattr(trainer, "accelerator", None))


def _resumed_dataloader(trainer: Any, resume_from_checkpoint: bool | str | os.PathLike[str]) -> Any:
    """The train dataloader the resume will iterate. transformers 4.x's ``train()`` first sets
    ``self._train_batch_size = state.train_batch_size`` from the checkpoint's ``trainer_state.json`` (5.x only
    with ``auto_find_batch_size``), so then it is built at that batch size, as ``train()`` will build it."""
    from ckptdoctor.resume_gate.plan import version_major

    batch = None
    major = version_major(getattr(sys.modules.get("transformers"), "__version__", None)) or 5
    if major < 5 or getattr(trainer.args, "auto_find_batch_size", False) is True:
        from transformers.trainer_utils import get_last_checkpoint

        last = cast(Callable[[str], "str | None"], get_last_checkpoint)  # the folder train() resumes from
        folder = (last(trainer.args.output_dir) if resume_from_checkpoint is True
                  else None if resume_from_checkpoint is False else os.fspath(resume_from_checkpoint))
        try:
            with open(os.path.join(folder or "", "trainer_state.json"), encoding="utf-8") as fh:
                batch = json.load(fh).get("train_batch_size")
        except (OSError, ValueError, AttributeError):  # no or a broken state: train() raises, the gate says why
            batch = None
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1 or not hasattr(trainer, "_train_batch_size"):
        return trainer.get_train_dataloader()
    kept = trainer._train_batch_size
    trainer._train_batch_size = batch
    try:
        return trainer.get_train_dataloader()
    finally:
        trainer._train_batch_size = kept


def gate_callback(
    resume_from_checkpoint: bool | str | os.PathLike[str] = True, *, fail_on: str | None = None, lr_steps: int = 5,
    select: Sequence[str] = (), ignore: Sequence[str] = (), config: bool = True,
) -> Any:
    """A ``TrainerCallback`` that runs the gate in ``on_train_begin`` and raises ``ResumeGateError`` when it fails,
    before the first optimizer step. Pass the same ``resume_from_checkpoint`` as to ``train()``.

    It is not the complete check: ``train()`` loads the weights, ``trainer_state.json``, the optimizer, scheduler
    and scaler state *before* ``on_train_begin`` (transformers 5.23 ``Trainer.train`` and
    ``_inner_training_loop``), so a damaged file among them surfaces as transformers' own exception
    (``SafetensorError``, ``RuntimeError``, ``json.JSONDecodeError`` ...), never ``ResumeGateError``. What it
    catches is the rest: the schedule and LR problems (CKD407-412), CKD504, a damaged RNG file (loaded in the first
    epoch), and the scan findings about the checkpoint. ``check_resume`` before ``train()`` checks everything.

    It judges with the train dataloader ``train()`` built (the ``train_dataloader`` of the callback's arguments):
    under transformers 4.x, and under 5.x with ``auto_find_batch_size``, that one is at the checkpoint's
    ``train_batch_size``, the batch size ``check_resume`` builds its own at, so both predict the same steps.

    The callback cannot see ``train()``'s argument: a ``state.global_step`` of 0 at ``on_train_begin`` means no
    checkpoint was loaded (a fresh run), and then it passes without gating, leaving ``result`` None. Otherwise
    ``result`` holds the last prediction; warnings that did not fail it are logged as ``check_resume`` logs them.
    """
    from transformers import TrainerCallback

    rules = {"select": select, "ignore": ignore, "config": config}  # as check_resume's

    class GateCallback(TrainerCallback):
        """Fails ``trainer.train`` before its first optimizer step when the resume gate fails."""

        def __init__(self) -> None:
            self.result: GateResult | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.result = None
            if not state.global_step:  # a fresh run: train() loaded no checkpoint, there is no resume to judge
                return
            self.result = _run(args, kwargs.get("train_dataloader"), resume_from_checkpoint, fail_on, lr_steps, rules)

    return GateCallback()
