"""PyTorch Lightning as a stack: how its checkpoints look and how ``Trainer.fit(ckpt_path=...)`` loads them.

``Trainer.save_checkpoint`` and ``ModelCheckpoint`` (src/lightning/pytorch/callbacks/model_checkpoint.py) write one
``.ckpt`` file per save with ``torch.save``: a dict holding ``epoch``, ``global_step``, ``pytorch-lightning_version``,
``state_dict``, ``loops``, ``callbacks``, ``optimizer_states``, ``lr_schedulers`` and, when the module called
``save_hyperparameters``, ``hparams_name`` and ``hyper_parameters`` (the module's init arguments as given: an
``argparse.Namespace`` stays one). ``ModelCheckpoint`` writes into its ``dirpath``, by default
``<default_root_dir>/lightning_logs/version_<n>/checkpoints/``, names files ``epoch=<e>-step=<s>.ckpt`` and keeps
``last.ckpt`` when ``save_last`` is set.

The resume, ``Trainer.fit(model, ckpt_path=..., weights_only=None)``, goes through
``_CheckpointConnector.resume_start`` (src/lightning/pytorch/trainer/connectors/checkpoint_connector.py) to
``Strategy.load_checkpoint`` and ``lightning.fabric.utilities.cloud_io._load``, which calls ``torch.load`` with the
``weights_only`` given: None for a local path, so torch's default, True since torch 2.6. That load refuses any
global outside torch's weights-only allowlist.
"""

from __future__ import annotations

from typing import Any

from ckptdoctor.model import GlobalRef, Opaque

# The key every Lightning checkpoint holds (`_CheckpointConnector.dump_checkpoint`).
VERSION_KEY = "pytorch-lightning_version"
SUFFIX = ".ckpt"


def checkpoint_version(value: Any) -> str | None:
    """The Lightning version that wrote a ``.ckpt`` whose unpickled top-level value is ``value`` (the reader's plain
    rebuild), or None when it is no Lightning checkpoint."""
    if isinstance(value, dict):
        v = value.get(VERSION_KEY)
        if isinstance(v, str):
            return v
    return None


def where_global(value: Any, dotted: str) -> str | None:
    """The top-level key of a Lightning checkpoint under which the global ``dotted`` is first met (for the message:
    ``hyper_parameters``), or None."""
    if not isinstance(value, dict):
        return None
    for key, item in value.items():
        if isinstance(key, str) and _names(item, dotted, 0):
            return key
    return None


def _names(v: Any, dotted: str, depth: int) -> bool:
    """Whether ``v`` (a plain rebuild: dicts, lists, tuples, Opaque calls, GlobalRefs) mentions ``dotted``."""
    if depth > 64:
        return False
    if isinstance(v, GlobalRef):
        return v.dotted == dotted
    if isinstance(v, Opaque):
        return (v.func is not None and v.func.dotted == dotted) or _names(v.args, dotted, depth + 1) or _names(
            v.state, dotted, depth + 1)
    if isinstance(v, dict):
        return any(_names(k, dotted, depth + 1) or _names(x, dotted, depth + 1) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return any(_names(x, dotted, depth + 1) for x in v)
    return False
