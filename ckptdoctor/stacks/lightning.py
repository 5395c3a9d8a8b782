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

import dataclasses
from collections.abc import Sequence
from typing import Any

from ckptdoctor.model import (
    Checkpoint,
    FileFacts,
    FileKind,
    GlobalRef,
    LightningFacts,
    Opaque,
    Run,
    SchedulerState,
    Stack,
    TorchFacts,
    Tree,
    frozen,
)
from ckptdoctor.patterns import lazy

# The key every Lightning checkpoint holds (`_CheckpointConnector.dump_checkpoint`).
VERSION_KEY = "pytorch-lightning_version"
SUFFIX = ".ckpt"
# `ModelCheckpoint._find_last_checkpoints`: `CHECKPOINT_NAME_LAST` ("last"), optionally `-<n>` (a version suffix when
# `last.ckpt` already existed), as the file's stem.
_LAST_RE = lazy(r"^last(-(\d+))?")


def signed(f: FileFacts) -> bool:
    """Whether ``f`` is a Lightning checkpoint: a ``.ckpt`` torch file whose pickle is a dict holding the version."""
    if not f.name.endswith(SUFFIX) or f.kind not in (FileKind.TORCH_ZIP, FileKind.TORCH_LEGACY):
        return False
    c = f.content
    return isinstance(c, TorchFacts) and c.pickle is not None and checkpoint_version(c.pickle.value) is not None


def last_pick(files: Sequence[FileFacts]) -> FileFacts | None:
    """The file ``fit(ckpt_path="last")`` loads among one ``ModelCheckpoint`` folder's ``files``: the ``.ckpt`` files
    whose stem matches ``last(-N)?``, the most recently modified (``_CheckpointConnector._parse_ckpt_path``);
    None when there is none (Lightning then warns and trains from scratch). Among files of one modification time
    Lightning's choice is arbitrary (``tied_lasts``); this one is the first of them by path."""
    last = [f for f in files if is_last_name(f.name)]
    return max(sorted(last, key=lambda f: f.path), key=lambda f: f.mtime, default=None)


def tied_lasts(files: Sequence[FileFacts]) -> list[FileFacts]:
    """The ``last*.ckpt`` files ``fit(ckpt_path="last")`` cannot choose between: two or more sharing the newest
    modification time while they hold different steps (``_parse_ckpt_path`` takes ``max`` over a dict built from a
    set of paths, so among equal times the one it meets first wins, and a set of strings is ordered by their
    hashes, which change from one process to the next). Empty when the choice is determined."""
    pick = last_pick(files)
    if pick is None:
        return []
    tied = sorted((f for f in files if is_last_name(f.name) and f.mtime == pick.mtime), key=lambda f: f.path)
    return tied if len({step_of(f) for f in tied}) > 1 else []


@frozen
class LastAhead:
    """The file ``fit(ckpt_path="last")`` loads in one folder, its step, and what holds more steps beside it: the
    one holding the most among those saved at the same time or after it (its future: CKD440), and the
    ``last*.ckpt`` holding the most among those saved before it (an earlier run's: CKD447); each with its step."""

    pick: FileFacts
    at: int
    after: tuple[FileFacts, int] | None
    earlier_last: tuple[FileFacts, int] | None


def last_ahead(files: Sequence[FileFacts]) -> LastAhead | None:
    """``LastAhead`` of one ``ModelCheckpoint`` folder's ``files``; None when "last" loads no one known file (none,
    or several of one time: ``tied_lasts``) or its step cannot be read."""
    pick = last_pick(files)
    at = None if pick is None else step_of(pick)
    if pick is None or at is None or tied_lasts(files):
        return None
    before, after = ahead_of(pick, files)

    def most(among: list[FileFacts]) -> tuple[FileFacts, int] | None:
        top = newest(among)
        n = None if top is None else step_of(top)
        return None if top is None or n is None else (top, n)

    return LastAhead(pick, at, most(after), most([f for f in before if is_last_name(f.name)]))


def ahead_of(pick: FileFacts, files: Sequence[FileFacts]) -> tuple[list[FileFacts], list[FileFacts]]:
    """The Lightning checkpoints among ``files`` holding more optimizer steps than ``pick``, split by modification
    time: those written before it, then those written at the same time or after it.

    Within one history the step count only grows with time, so a file written before ``pick`` that holds more
    steps is not in ``pick``'s past: ``pick`` was saved by a later fit (a new ``Trainer`` in the same ``dirpath``, or
    a resume from an earlier file). A file ahead of ``pick`` saved after it can be ``pick``'s own future: the
    stale ``last.ckpt``. Equal times prove no order and count as after."""
    at = step_of(pick)
    if at is None:
        return [], []
    ahead = [f for f in files if f is not pick and (s := step_of(f)) is not None and s > at]
    return [f for f in ahead if f.mtime < pick.mtime], [f for f in ahead if f.mtime >= pick.mtime]


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
    """What ``fit(ckpt_path="last")`` loads from ``run`` (a folder of Lightning checkpoints), and whose step the
    report shows when that is not the file loaded (``shown_file``)."""
    files = run_files(run)
    pick = last_pick(files)
    if pick is None:
        top = newest(files)
        shown = "" if top is None else f"; the step shown is `{top.name}`'s, the most steps here"
        return 'Lightning; `fit(ckpt_path="last")` finds no `last.ckpt` and trains from scratch' + shown
    tied = sorted((f for f in files if is_last_name(f.name) and f.mtime == pick.mtime), key=lambda f: f.path)
    if len(tied) > 1:
        alike = "no step shown" if tied_lasts(files) else "each at the same step"
        return ('Lightning; `fit(ckpt_path="last")` loads one of ' + ", ".join(f"`{f.name}`" for f in tied)
                + f" (one modification time; {alike})")
    return f'Lightning; `fit(ckpt_path="last")` loads `{pick.name}`'


def shown_file(files: Sequence[FileFacts]) -> FileFacts | None:
    """The ``.ckpt`` whose counters the report shows for a folder of Lightning checkpoints: the file
    ``fit(ckpt_path="last")`` loads (the folder's resume, as a Trainer run's row marks its pick); with no
    ``last*.ckpt``, the one holding the most steps (the file to pass as ``ckpt_path`` to continue); None when "last"
    may load one of several files holding different steps (``tied_lasts``)."""
    pick = last_pick(files)
    if pick is None:
        return newest(files)
    return None if tied_lasts(files) else pick


def shown_steps(ck: Checkpoint) -> tuple[int | None, int | None]:
    """The step and the ``global_step`` the report shows for ``ck``, a folder of Lightning checkpoints: those of
    ``shown_file`` among the files directly in it. The step is the optimizer steps its fit loop counts, where
    ``fit`` resumes (``_CheckpointConnector.restore_loops``), ``global_step`` the top-level key (they differ only
    in an edited file: CKD442); (None, None) when no one file is shown."""
    f = shown_file([f for f in ck.files if "/" not in ck.relname(f)])
    lf = None if f is None else facts_of(f)
    return (None, None) if f is None or lf is None else (step_of(f), lf.global_step)


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


# ---------------------------------------------------------------------------------------------------------------
# What a planned `fit(ckpt_path=...)` does (the gate's prediction: pure, from the tree)

_VERSION_RE = lazy(r"^(?:(.*)/)?version_(\d+)/checkpoints$")
# Lightning's `Trainer(max_epochs=None, max_steps=-1)` trains 1000 epochs (`_FitLoop` defaults, trainer.py)
DEFAULT_MAX_EPOCHS = 1000


@frozen
class LightningPlan:
    """The planned resume: ``fit(ckpt_path=ckpt_path)`` under a Trainer with ``max_epochs``/``max_steps`` (None:
    Lightning's defaults) whose logger takes ``logger_version`` (None: the default logger, the next
    ``version_N``; it matters only for runs in that layout)."""

    ckpt_path: str = "last"  # "last", "best", "none" or a path
    max_epochs: int | None = None
    max_steps: int | None = None
    logger_version: int | None = None
    steps_per_epoch: int | None = None


@frozen
class LightningPrediction:
    """What ``fit(ckpt_path=...)`` does: the folder "last" looks in, the file it loads (None: none), the step and
    epoch it starts at, the steps it trains (None: unknown), and why it trains from scratch or raises (None: it
    does not)."""

    plan: LightningPlan
    looks_in: str | None
    loaded: FileFacts | None
    start_step: int | None
    start_epoch: int | None
    steps_to_train: int | None
    max_steps: int | None
    from_scratch: str | None = None
    raises: str | None = None
    # "last" may load any of these files (several `last*.ckpt` of the newest modification time) and they resume
    # differently: each one's own prediction; `loaded` is then None, as nothing says which one loads
    candidates: tuple[LightningPrediction, ...] = ()


def lightning_runs(tree: Tree) -> list[Run]:
    """The Lightning runs of ``tree``."""
    return [r for r in tree.runs if r.stack is Stack.LIGHTNING]


def predict(tree: Tree, plan: LightningPlan, path_file: FileFacts | None = None) -> LightningPrediction:
    """Predict ``fit(ckpt_path=plan.ckpt_path)`` on the Lightning runs of ``tree`` (``path_file``: the file a path
    ``ckpt_path`` names, found in the tree; None when it is not there)."""
    runs = lightning_runs(tree)
    if plan.ckpt_path == "none":
        return LightningPrediction(plan, None, None, 0, 0, None, plan.max_steps)
    if plan.ckpt_path == "best":
        why = ('`fit(ckpt_path="best")` raises `ValueError`: a new Trainer\'s `ModelCheckpoint` has no '
               "`best_model_path` before the checkpoint is restored (`_CheckpointConnector._parse_ckpt_path`)")
        return LightningPrediction(plan, None, None, None, None, None, plan.max_steps, raises=why)
    if plan.ckpt_path != "last":
        if path_file is None:
            return LightningPrediction(plan, None, None, None, None, None, plan.max_steps, raises=(
                f"`fit(ckpt_path={plan.ckpt_path!r})` raises `FileNotFoundError`: no such checkpoint"))
        return _from_file(plan, None, path_file)
    if not runs:
        return LightningPrediction(plan, None, None, 0, 0, None, plan.max_steps, from_scratch=(
            '`fit(ckpt_path="last")` finds no Lightning checkpoint folder here: it warns and trains from scratch'))
    run = max(runs, key=_run_order)
    looks_in = run.path
    m = _VERSION_RE.match(run.path)
    if m is not None:
        base = f"{m.group(1)}/" if m.group(1) else ""
        versions = [int(v.group(2)) for r in runs if (v := _VERSION_RE.match(r.path)) and v.group(1) == m.group(1)]
        version = plan.logger_version if plan.logger_version is not None else max(versions) + 1
        looks_in = f"{base}version_{version}/checkpoints"
        run = next((r for r in runs if r.path == looks_in), None)  # type: ignore[assignment]
        if run is None:
            why = (f'`fit(ckpt_path="last")` looks in `{looks_in}`'
                   + (": a new Trainer's default logger takes the next version" if plan.logger_version is None
                      else "") + ", which holds no `last*.ckpt`: it warns and trains from scratch "
                   "(`ModelCheckpoint.__resolve_ckpt_dir`, `_CheckpointConnector._parse_ckpt_path`)")
            return LightningPrediction(plan, looks_in, None, 0, 0, None, plan.max_steps, from_scratch=why)
    files = run_files(run)
    pick = last_pick(files)
    if pick is None:
        why = (f'`fit(ckpt_path="last")` finds no `last*.ckpt` that exists in `{looks_in}`: it warns and trains from '
               "scratch (`_CheckpointConnector._parse_ckpt_path`)")
        return LightningPrediction(plan, looks_in, None, 0, 0, None, plan.max_steps, from_scratch=why)
    tied = [f for f in files if is_last_name(f.name) and f.mtime == pick.mtime]
    if len(tied) > 1:  # Lightning's pick among them follows the hash seed: one prediction only if all resume alike
        each = tuple(_from_file(plan, looks_in, f) for f in sorted(tied, key=lambda f: f.path))
        if len({_outcome(c) for c in each}) > 1:
            return LightningPrediction(plan, looks_in, None, None, None, None, plan.max_steps, candidates=each)
    return _from_file(plan, looks_in, pick)


def _outcome(p: LightningPrediction) -> tuple[Any, ...]:
    """What a resume from ``p.loaded`` does, as far as it matters to the run: where it starts, how much it trains,
    whether and how it fails (two tied files that agree in all of it resume alike, whichever loads)."""
    return p.start_step, p.start_epoch, p.steps_to_train, p.raises, p.from_scratch


def _run_order(run: Run) -> tuple[int, float]:
    m = _VERSION_RE.match(run.path)
    return (int(m.group(2)) if m else -1, max((ck.mtime for ck in run.checkpoints), default=0.0))


def _from_file(plan: LightningPlan, looks_in: str | None, f: FileFacts) -> LightningPrediction:
    lf = facts_of(f)
    if lf is None:
        return LightningPrediction(plan, looks_in, f, None, None, None, plan.max_steps, raises=(
            f"`{f.name}` is no Lightning checkpoint that could be read: `fit(ckpt_path=...)` cannot restore it"))
    start = lf.loop_steps if lf.loop_steps is not None else lf.global_step
    epoch = lf.loop_epoch if lf.loop_epoch is not None else lf.epoch
    max_epochs = plan.max_epochs if plan.max_epochs is not None else (
        DEFAULT_MAX_EPOCHS if plan.max_steps in (None, -1) else -1)
    base = LightningPrediction(plan, looks_in, f, start, epoch, None, plan.max_steps)
    if not (lf.has_optimizer and lf.has_schedulers):
        return dataclasses.replace(base, raises=(
            "`fit(ckpt_path=...)` raises `KeyError`: the checkpoint holds only the model (`save_weights_only`), "
            "and `_CheckpointConnector.restore_optimizers_and_schedulers` needs `optimizer_states`"))
    if epoch is not None and max_epochs != -1 and epoch > max_epochs:
        return dataclasses.replace(base, raises=(
            f"`fit` raises `MisconfigurationException`: the checkpoint's current_epoch {epoch} is above "
            f"max_epochs {max_epochs} (`_CheckpointConnector.restore_loops`)"))
    done = lf.loop_epochs_processed if lf.loop_epochs_processed is not None else epoch
    steps = _steps(plan, start, done, max_epochs)
    base = dataclasses.replace(base, start_epoch=done)
    base = dataclasses.replace(base, steps_to_train=steps)
    spe = _steps_per_epoch(plan, start, done)
    for s in lf.schedulers:
        if s.total_steps is None or s.last_epoch is None or start is None:
            continue
        room = s.total_steps - s.last_epoch
        pace = scheduler_pace(s, lf)
        if pace == "step":
            more = steps
            how = 'each optimizer step: its `last_epoch` counts the optimizer steps, as `interval="step"` does'
        elif pace == "epoch":
            more = None if steps is None or spe is None or done is None else (start + steps) // spe - done
            how = 'once an epoch: its `last_epoch` counts the epochs done, as `interval="epoch"` does'
        else:  # stepped at a pace the counters do not tell: only a schedule already used up is sure to raise
            if room > 0 or steps == 0:
                continue
            more = None
            how = ("its `last_epoch` matches neither the optimizer steps nor the epochs done, so its `interval` "
                   "and `frequency` are unknown; any further step raises")
        if (more is None and room <= 0 and steps != 0) or (more is not None and more > room):
            return dataclasses.replace(base, raises=(
                f"`fit` raises `ValueError` from `OneCycleLR.step`: it was built for {s.total_steps} steps and has "
                f"taken {s.last_epoch}; the resume steps it " + ("again" if more is None else f"{more} more times")
                + f" ({how})"))
    return base


def scheduler_pace(s: SchedulerState, lf: LightningFacts) -> str | None:
    """How often the run that saved ``lf`` stepped the scheduler ``s``, told by its count, since the checkpoint
    keeps no ``interval`` (``dump_checkpoint`` stores each scheduler's ``state_dict()`` only): "step" when its
    ``last_epoch`` equals the optimizer steps the fit loop counts (``interval="step"``), "epoch" when it equals the
    epochs whose batches all ran (``interval="epoch"``: ``_TrainingEpochLoop`` steps it after an epoch's last batch,
    before the epoch-end save), "step" when both agree (one step an epoch: either counts alike); None when neither
    (a ``frequency`` above 1, a scheduler stepped by hand)."""
    if s.last_epoch is None:
        return None
    if lf.loop_steps is not None and s.last_epoch == lf.loop_steps:
        return "step"
    if lf.loop_epochs_processed is not None and s.last_epoch == lf.loop_epochs_processed:
        return "epoch"
    return None


def _steps_per_epoch(plan: LightningPlan, start: int | None, epoch: int | None) -> int | None:
    """The planned steps per epoch, else the run's own, when its ``start`` steps fill its ``epoch`` done epochs
    evenly; None when unknown."""
    if plan.steps_per_epoch is not None:
        return plan.steps_per_epoch
    if start is not None and epoch and start % epoch == 0:
        return start // epoch
    return None


def _steps(plan: LightningPlan, start: int | None, epoch: int | None, max_epochs: int) -> int | None:
    """The optimizer steps the resumed fit takes from step ``start`` with ``epoch`` epochs done: the first of
    ``max_steps`` and ``max_epochs`` reached."""
    if start is None:
        return None
    limits = []
    if plan.max_steps not in (None, -1):
        limits.append(max(0, plan.max_steps - start))
    spe = _steps_per_epoch(plan, start, epoch)
    if max_epochs != -1:
        if spe is None or epoch is None:
            return None  # the epoch bound is unknown: which limit stops the fit cannot be said
        limits.append(max(0, max_epochs * spe - start))
    return min(limits) if limits else None
