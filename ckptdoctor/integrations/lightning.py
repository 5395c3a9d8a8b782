"""Run ``ckptdoctor gate`` from a PyTorch Lightning script, before ``trainer.fit(model, ckpt_path=...)`` loads anything.

Two ways, both reading the plan from the Trainer itself (its ``max_epochs``, ``max_steps``, the folder its
``ModelCheckpoint`` looks in, its logger's version)::

    from ckptdoctor.integrations.lightning import check_resume, gate_callback

    check_resume(trainer, ckpt_path="last")          # raises ResumeGateError when the gate fails
    trainer.fit(model, ckpt_path="last")

    trainer = L.Trainer(..., callbacks=[ModelCheckpoint(...), gate_callback(ckpt_path="last")])
    trainer.fit(model, ckpt_path="last")             # or: fail in the fit's `setup`, before the checkpoint loads

Lightning is imported only when the callback is built; ``check_resume`` needs nothing but the Trainer object. The
callback's ``setup`` hook runs before ``_CheckpointConnector._restore_modules_and_callbacks`` and
``restore_training_state`` (src/lightning/pytorch/trainer/trainer.py ``Trainer._run``), so it checks the same as
``check_resume``. Warnings of a passing gate go to the ``ckptdoctor`` logger.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from ckptdoctor.integrations.transformers import ResumeGateError, settled
from ckptdoctor.resume_gate import GateResult, gate

__all__ = ["ResumeGateError", "check_resume", "gate_callback", "planned_from_trainer"]

_VERSION_DIR = re.compile(r"(?:^|[/\\])version_(\d+)[/\\]checkpoints[/\\]?$")


def planned_from_trainer(trainer: Any, ckpt_path: str | os.PathLike[str] | None) -> tuple[str, dict[str, Any]]:
    """The folder to gate and the planned ``fit(ckpt_path=...)`` arguments of a Lightning ``trainer``.

    The folder is the first ``ModelCheckpoint``'s ``dirpath`` when it was given, else ``default_root_dir`` (where the
    default logger's ``lightning_logs/version_N/checkpoints`` are); the logger version is the one a
    ``version_N/checkpoints`` dirpath names, else the first logger's (for a new default logger: the next free
    version, which ``ModelCheckpoint`` will look in)."""
    callback = getattr(trainer, "checkpoint_callback", None)
    dirpath = getattr(callback, "dirpath", None)
    run_dir = os.fspath(dirpath) if dirpath else os.fspath(trainer.default_root_dir)
    planned: dict[str, Any] = {"ckpt_path": "none" if ckpt_path is None else os.fspath(ckpt_path)}
    max_epochs, max_steps = getattr(trainer, "max_epochs", None), getattr(trainer, "max_steps", None)
    if isinstance(max_epochs, int) and not isinstance(max_epochs, bool):
        planned["max_epochs"] = max_epochs
    if isinstance(max_steps, int) and not isinstance(max_steps, bool) and max_steps != -1:
        planned["max_steps"] = max_steps
    m = _VERSION_DIR.search(run_dir)
    version: Any = int(m.group(1)) if m else None
    loggers = getattr(trainer, "loggers", None) or []
    if version is None and not dirpath and loggers:
        version = getattr(loggers[0], "version", None)  # a default logger computes its next version here
    if isinstance(version, int) and not isinstance(version, bool):
        planned["logger_version"] = version
    return run_dir, planned


def check_resume(
    trainer: Any,
    ckpt_path: str | os.PathLike[str] | None = "last",
    *,
    fail_on: str | None = None,
    select: Sequence[str] = (),
    ignore: Sequence[str] = (),
    config: bool = True,
) -> GateResult:
    """Gate ``trainer.fit(model, ckpt_path=ckpt_path)`` before calling it; raise ``ResumeGateError`` on failure.

    Predicts which file ``fit`` loads ("last", "best", a path, None), the step it resumes at and the steps it trains
    under the Trainer's ``max_epochs``/``max_steps``, and fails where Lightning raises (CKD445), trains from scratch
    (CKD446) or loads the wrong state (CKD440 ...). Returns the prediction when it passes; findings of severity
    warning or error that did not fail it are logged on the ``ckptdoctor`` logger. ``fail_on``, ``select``,
    ``ignore`` and ``config`` are ``gate()``'s.
    """
    run_dir, planned = planned_from_trainer(trainer, ckpt_path)
    if planned["ckpt_path"] == "none":
        raise ValueError("ckpt_path=None does not resume; there is nothing to gate")
    result = gate(run_dir, stack="lightning", fail_on=fail_on, select=select, ignore=ignore, config=config,
                  **planned)
    return settled(result)


def gate_callback(
    ckpt_path: str | os.PathLike[str] | None = "last", *, fail_on: str | None = None, select: Sequence[str] = (),
    ignore: Sequence[str] = (), config: bool = True,
) -> Any:
    """A Lightning ``Callback`` that runs ``check_resume`` in its ``setup`` hook for ``stage="fit"`` and raises
    ``ResumeGateError`` when it fails, before the checkpoint is loaded. Pass the same ``ckpt_path`` as to ``fit``
    (None: a fresh fit, nothing is gated). ``result`` holds the last prediction."""
    from lightning.pytorch.callbacks import Callback

    class GateCallback(Callback):  # type: ignore[misc]
        """Fails ``trainer.fit`` before it loads a checkpoint when the resume gate fails."""

        def __init__(self) -> None:
            self.result: GateResult | None = None

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            self.result = None
            if stage != "fit" or ckpt_path is None:
                return
            self.result = check_resume(trainer, ckpt_path, fail_on=fail_on, select=select, ignore=ignore,
                                       config=config)

    return GateCallback()
