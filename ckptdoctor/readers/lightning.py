"""The facts of a PyTorch Lightning ``.ckpt`` that its resume reads, pulled from the pickle's plain rebuild.

``_CheckpointConnector.dump_checkpoint`` (src/lightning/pytorch/trainer/connectors/checkpoint_connector.py) writes a
dict holding ``pytorch-lightning_version``, ``epoch``, ``global_step``, ``loops``, ``callbacks`` and, unless
``save_weights_only``, ``optimizer_states`` and ``lr_schedulers``. ``restore_training_state`` reads the loops (the
step and epoch the resumed fit starts at come from them, not from ``global_step``), the optimizers and schedulers
(``KeyError`` when absent) and each callback's state (``ModelCheckpoint.load_state_dict``). Never raises.
"""

from __future__ import annotations

from typing import Any

from ckptdoctor.gaps import PRINTABLE_BITS
from ckptdoctor.model import CheckpointCallbackState, LightningFacts, PickleFacts, SchedulerState

VERSION_KEY = "pytorch-lightning_version"
# `_TrainingEpochLoop.global_step`: automatic optimization counts `optim_progress.optimizer.step.total.completed`,
# manual optimization `optim_step_progress.total.completed` (src/lightning/pytorch/loops/training_epoch_loop.py)
_AUTO = ("epoch_loop.automatic_optimization.optim_progress", "optimizer", "step", "total", "completed")
_MANUAL = ("epoch_loop.manual_optimization.optim_step_progress", "total", "completed")
_EPOCH = ("epoch_progress", "current", "completed")
_EPOCH_PROCESSED = ("epoch_progress", "current", "processed")


def lightning_facts(pickle: PickleFacts | None) -> LightningFacts | None:
    """The Lightning facts of a torch file whose main pickle is ``pickle``; None when it is no Lightning checkpoint."""
    value = None if pickle is None else pickle.value
    if not isinstance(value, dict) or not isinstance(value.get(VERSION_KEY), str):
        return None
    loops = value.get("loops")
    fit = _at(loops, ("fit_loop",))
    auto, manual = _int(_at(fit, _AUTO)), _int(_at(fit, _MANUAL))
    steps = None if auto is None and manual is None else (auto or 0) + (manual or 0)
    scheds = value.get("lr_schedulers")
    return LightningFacts(
        version=value[VERSION_KEY],
        global_step=_int(value.get("global_step")),
        epoch=_int(value.get("epoch")),
        has_loops=isinstance(fit, dict),
        loop_steps=steps,
        loop_epoch=_int(_at(fit, _EPOCH)),
        loop_epochs_processed=_int(_at(fit, _EPOCH_PROCESSED)),
        has_optimizer="optimizer_states" in value,
        has_schedulers="lr_schedulers" in value,
        schedulers=tuple(_scheduler(s) for s in scheds) if isinstance(scheds, list) else (),
        checkpoint_callbacks=_callbacks(value.get("callbacks")),
    )


def _scheduler(state: Any) -> SchedulerState:
    if not isinstance(state, dict):
        return SchedulerState(None, None)
    # OneCycleLR's state_dict is the only one holding `total_steps` (torch/optim/lr_scheduler.py `OneCycleLR`)
    return SchedulerState(_int(state.get("last_epoch")), _int(state.get("total_steps")))


def _callbacks(callbacks: Any) -> tuple[CheckpointCallbackState, ...]:
    """Each ``ModelCheckpoint`` state in ``callbacks`` (keyed by ``Callback.state_key``: the class name first)."""
    if not isinstance(callbacks, dict):
        return ()
    out = []
    for key, state in callbacks.items():
        if not isinstance(key, str) or not key.startswith("ModelCheckpoint") or not isinstance(state, dict):
            continue
        best_k = state.get("best_k_models")
        out.append(CheckpointCallbackState(
            key, _str(state.get("dirpath")), _str(state.get("best_model_path")), _str(state.get("last_model_path")),
            _str(state.get("kth_best_model_path")),
            tuple(k for k in best_k if isinstance(k, str)) if isinstance(best_k, dict) else ()))
    return tuple(out)


def _at(value: Any, keys: tuple[str, ...]) -> Any:
    for k in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(k)
    return value


def _int(v: Any) -> int | None:
    # an integer too long to print (a pickle's 5,000-digit step) is no count a message could name: not read
    return v if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() <= PRINTABLE_BITS else None


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) and v else None
