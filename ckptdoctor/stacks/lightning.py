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

import re
from collections.abc import Sequence
from typing import Any

from ckptdoctor.model import FileFacts, FileKind, GlobalRef, Opaque, Run, TorchFacts

# The key every Lightning checkpoint holds (`_CheckpointConnector.dump_checkpoint`).
VERSION_KEY = "pytorch-lightning_version"
SUFFIX = ".ckpt"
# `ModelCheckpoint._find_last_checkpoints`: `CHECKPOINT_NAME_LAST` ("last"), optionally `-<n>` (a version suffix when
# `last.ckpt` already existed), as the file's stem.
_LAST_RE = re.compile(r"^last(-(\d+))?")


def signed(f: FileFacts) -> bool:
    """Whether ``f`` is a Lightning checkpoint: a ``.ckpt`` torch file whose pickle is a dict holding the version."""
    if not f.name.endswith(SUFFIX) or f.kind not in (FileKind.TORCH_ZIP, FileKind.TORCH_LEGACY):
        return False
    c = f.content
    return isinstance(c, TorchFacts) and c.pickle is not None and checkpoint_version(c.pickle.value) is not None


def last_pick(files: Sequence[FileFacts]) -> FileFacts | None:
    """The file ``fit(ckpt_path="last")`` loads among one ``ModelCheckpoint`` folder's ``files``: the ``.ckpt`` files
    whose stem matches ``last(-N)?``, the most recently modified (``_CheckpointConnector._parse_ckpt_path``);
    None when there is none (Lightning then warns and trains from scratch)."""
    last = [f for f in files if f.name.endswith(SUFFIX) and _LAST_RE.match(f.name[: -len(SUFFIX)])]
    return max(sorted(last, key=lambda f: f.path), key=lambda f: f.mtime, default=None)


def resume_text(run: Run) -> str:
    """What ``fit(ckpt_path="last")`` loads from ``run`` (a folder of Lightning checkpoints)."""
    files = [f for ck in run.checkpoints for f in ck.files if f.path.rsplit("/", 1)[0] == run.path or (
        run.path in ("", ".") and "/" not in f.path)]
    pick = last_pick(files)
    if pick is None:
        return 'Lightning; `fit(ckpt_path="last")` finds no `last.ckpt` and trains from scratch'
    return f'Lightning; `fit(ckpt_path="last")` loads `{pick.name}`'


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
