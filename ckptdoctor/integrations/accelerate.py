"""Run ``ckptdoctor gate`` from an accelerate training script, right before ``Accelerator.load_state()``::

    from ckptdoctor.integrations.accelerate import check_load_state

    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.register_for_checkpointing(ema)
    check_load_state(accelerator)          # raises ResumeGateError when load_state() would fail or go back
    accelerator.load_state()

It reads what the program prepared and registered from the ``Accelerator`` (its models, optimizers, schedulers,
GradScaler and ``register_for_checkpointing`` objects, the process index) and predicts ``load_state`` with them:
the save it picks, the files it restores, where it raises (CKD432), an older state picked (CKD430). accelerate is
not imported here: only the object passed in is read.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ckptdoctor.integrations.transformers import ResumeGateError, settled
from ckptdoctor.resume_gate import GateResult
from ckptdoctor.resume_gate.accelerate import judge
from ckptdoctor.resume_gate.api import gate_options, rule_selection
from ckptdoctor.resume_gate.plan import Plan
from ckptdoctor.stacks.accelerate import Registered

__all__ = ["ResumeGateError", "check_load_state", "registered"]

# `DistributedType` values whose `load_state` loads the model and optimizer through the engine (DeepSpeed,
# Megatron-LM) or by its own names (FSDP): the counts of files are then not one per prepared object.
_OWN_LOADERS = ("DEEPSPEED", "FSDP", "MEGATRON_LM")


def registered(accelerator: Any) -> Registered:
    """What ``accelerator.load_state`` will look for: one file per prepared model, optimizer and scheduler (plain
    data parallel or one process), ``scaler.pt`` with a GradScaler, the ``register_for_checkpointing`` objects."""
    own = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type)) in _OWN_LOADERS
    return Registered(
        models=None if own else len(accelerator._models),
        optimizers=None if own else len(accelerator._optimizers),
        schedulers=None if own else len(accelerator._schedulers),
        scaler=getattr(accelerator, "scaler", None) is not None,
        custom=len(accelerator._custom_objects),
        process_index=int(accelerator.process_index),
    )


def check_load_state(
    accelerator: Any,
    input_dir: str | os.PathLike[str] | None = None,
    *,
    max_steps: int | None = None,
    fail_on: str | None = None,
    select: Sequence[str] = (),
    ignore: Sequence[str] = (),
    config: bool = True,
) -> GateResult:
    """Gate ``accelerator.load_state(input_dir)`` before calling it; raise ``ResumeGateError`` when it fails.

    ``input_dir`` None is ``load_state()`` with automatic checkpoint naming (``project_dir/checkpoints``, the save
    with the highest number); without automatic naming that raises ``ValueError``, as ``load_state()`` does. A
    folder is taken as given. ``max_steps`` is the planned end (in scheduler steps): ``result.steps_to_train`` is
    then predicted. Returns the prediction when it passes (``result.checkpoint``, ``result.restores``,
    ``result.start_step``); warnings and errors that did not fail it are logged on the ``ckptdoctor`` logger.
    ``fail_on``, ``select``, ``ignore`` and ``config`` are ``ckptdoctor.gate()``'s.
    """
    if input_dir is None:
        if not accelerator.project_configuration.automatic_checkpoint_naming:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        target, folder = os.fspath(accelerator.project_dir), False
    else:
        target, folder = os.path.expanduser(os.fspath(input_dir)), True
    from ckptdoctor.scanner import scan
    from ckptdoctor.settings.selection import warn_kept

    options = gate_options(select=select, ignore=ignore, fail_on=fail_on, no_config=not config, on_kept=warn_kept)
    selection, cfg_fail_on = rule_selection(target, options)
    plan = Plan(checkpoint=target if folder else None, max_steps=max_steps,
                fail_on=options.fail_on or cfg_fail_on or "error")
    report = scan(target, selection=selection)
    fields = judge(report.trees[0], plan, run=target, scanned=report.findings, selection=selection,
                   registered=registered(accelerator))
    result = GateResult(**fields, fail_on_from_settings=options.fail_on is None and cfg_fail_on is not None)
    return settled(result)

