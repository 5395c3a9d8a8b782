r"""PyTorch Lightning as a stack: how its checkpoints look and how ``Trainer.fit(ckpt_path=...)`` loads them.

Layout. ``Trainer.save_checkpoint`` and ``ModelCheckpoint`` (src/lightning/pytorch/callbacks/model_checkpoint.py)
write one ``.ckpt`` file per save with ``torch.save``: a dict holding ``epoch``, ``global_step``,
``pytorch-lightning_version``, ``state_dict``, ``loops``, ``callbacks``, ``optimizer_states``, ``lr_schedulers`` (the
last two not with ``save_weights_only=True``) and, when the module called ``save_hyperparameters``, ``hparams_name``
and ``hyper_parameters`` (the module's init arguments as given: an ``argparse.Namespace`` stays one).
``ModelCheckpoint`` writes into its ``dirpath``; without one, ``__resolve_ckpt_dir`` takes the first logger's
``<save_dir>/<name>/version_<n>/checkpoints`` (the default logger: ``<default_root_dir>/lightning_logs/version_<n>/``,
``n`` one above the highest existing version for a new Trainer), or ``<default_root_dir>/checkpoints`` without a
logger. Files are named ``epoch=<e>-step=<s>.ckpt``; with ``save_last`` it writes ``last.ckpt`` (``last-v<k>.ckpt``
when a ``last.ckpt`` it did not write is there) only when it saved a top-k file at the same step, and
``save_last="link"`` makes it a symbolic link to the last file saved. ``ModelCheckpoint.state_dict`` stores its
``dirpath`` and the absolute paths it tracks (``best_model_path``, ``best_k_models``, ``last_model_path``).

What ``fit(ckpt_path=...)`` picks (``_CheckpointConnector._parse_ckpt_path``,
src/lightning/pytorch/trainer/connectors/checkpoint_connector.py):

- ``None`` with a model: nothing is loaded; the fit starts at step 0.
- ``"last"``: every ``ModelCheckpoint``'s ``_find_last_checkpoints`` lists its (resolved) folder for ``.ckpt`` files
  whose stem matches ``^last(-(\d+))?``; those that exist (a dangling link does not) are candidates, and the most
  recently modified one loads. None: it warns ("there is no last checkpoint available. No checkpoint will be
  loaded") and trains from scratch.
- ``"best"``: the first ``ModelCheckpoint``'s ``best_model_path`` (after a restore, the one in the checkpoint's
  callback state); none is a ``ValueError``.
- a path: that file.

What it needs from the file (``_CheckpointConnector.restore_training_state``): ``loops`` (the fit loop's progress:
``trainer.global_step`` and ``current_epoch`` resume from it, not from ``global_step``/``epoch``; a current epoch
above ``max_epochs`` raises ``MisconfigurationException``), ``optimizer_states`` and ``lr_schedulers`` (missing:
``KeyError``, "checkpoint contains only the model"), and each callback's state (``ModelCheckpoint.load_state_dict``
restores the tracked paths only when the ``dirpath`` stored equals its own, ``best_model_path`` always). The load
itself goes through ``Strategy.load_checkpoint`` to ``lightning.fabric.utilities.cloud_io._load``, which calls
``torch.load`` with the ``weights_only`` given: None for a local path, so torch's default, True since torch 2.6.
The facts read from each ``.ckpt`` are ``model.LightningFacts`` (``readers.lightning``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ckptdoctor.model import FileFacts, FileKind, GlobalRef, LightningFacts, Opaque, Run, TorchFacts

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
    last = [f for f in files if is_last_name(f.name)]
    return max(sorted(last, key=lambda f: f.path), key=lambda f: f.mtime, default=None)


def run_files(run: Run) -> list[FileFacts]:
    """The files directly in ``run``'s folder (a ``ModelCheckpoint`` folder: what ``_find_last_checkpoints`` lists)."""
    return [f for ck in run.checkpoints for f in ck.files if f.path.rsplit("/", 1)[0] == run.path or (
        run.path in ("", ".") and "/" not in f.path)]


def is_last_name(name: str) -> bool:
    """Whether ``name`` is one ``_find_last_checkpoints`` matches: ``.ckpt`` with a stem ``last(-N)?...``."""
    return name.endswith(SUFFIX) and _LAST_RE.match(name[: -len(SUFFIX)]) is not None


def facts_of(f: FileFacts) -> LightningFacts | None:
    """The Lightning facts of ``f`` (None: no Lightning checkpoint)."""
    return f.content.lightning if isinstance(f.content, TorchFacts) else None


def step_of(f: FileFacts) -> int | None:
    """The optimizer step a resume from ``f`` starts at: its fit loop's count (``global_step`` without loops)."""
    lf = facts_of(f)
    if lf is None:
        return None
    return lf.loop_steps if lf.loop_steps is not None else lf.global_step


def newest(files: Sequence[FileFacts]) -> FileFacts | None:
    """The Lightning checkpoint among ``files`` that holds the most optimizer steps (the newest by mtime among
    equals); None when there is none."""
    stepped = [(s, f.mtime, f.path, f) for f in files if (s := step_of(f)) is not None]
    return max(stepped, key=lambda t: t[:3])[3] if stepped else None


def resume_text(run: Run) -> str:
    """What ``fit(ckpt_path="last")`` loads from ``run`` (a folder of Lightning checkpoints)."""
    pick = last_pick(run_files(run))
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
