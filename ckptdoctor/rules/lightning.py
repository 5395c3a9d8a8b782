"""Lightning rules (4xx, resumable training state): hazards of a PyTorch Lightning run that
``Trainer.fit(ckpt_path=...)`` meets, judged from the facts read from each ``.ckpt`` (``model.LightningFacts``) and the
folder listing, as ``ckptdoctor.stacks.lightning`` says Lightning picks and loads."""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ckptdoctor.findings import Applicability, FixOp, FixPlan, OpKind, Severity
from ckptdoctor.model import Run, Stack, Tree
from ckptdoctor.rules import Hit, rule
from ckptdoctor.stacks import lightning

if TYPE_CHECKING:
    from ckptdoctor.stacks.lightning import LightningPrediction


def _runs(tree: Tree) -> Iterator[Run]:
    return (r for r in tree.runs if r.stack is Stack.LIGHTNING)


@rule("CKD430", "lightning-last-stale", Severity.ERROR)
def lightning_last_stale(tree: Tree) -> Iterator[Hit]:
    """`fit(ckpt_path="last")` loads a `last.ckpt` older than the newest checkpoint in its folder.

    ## What it does
    In each folder of Lightning checkpoints, finds the file `fit(ckpt_path="last")` loads (the most recently
    modified `last*.ckpt`) and compares the optimizer steps its fit loop counts with those of every other `.ckpt`
    there.

    ## Why is this bad?
    The resume silently starts from the older state and trains the steps after it again. Lightning 2.6 rewrites
    `last.ckpt` only when the same `ModelCheckpoint` saved a top-k file at that step, so with `every_n_epochs`,
    two `ModelCheckpoint` callbacks sharing one `dirpath`, or `save_last="link"` pointing at the last file that
    callback saved, `last.ckpt` falls behind the files another save wrote.

    ## Example
    `ModelCheckpoint(dirpath=d, save_last=True, every_n_epochs=2)` beside `ModelCheckpoint(dirpath=d,
    every_n_train_steps=1, save_top_k=-1)`: after 3 epochs `last.ckpt` holds step 4 and `epoch=2-step=6.ckpt`
    step 6; `fit(ckpt_path="last")` restarts at step 4.

    ## Fix safety
    No automatic fix: which file should resume is yours to say. Resume with `fit(ckpt_path="<the newest file>")`,
    or give one `ModelCheckpoint` both the step cadence and `save_last=True`.

    ## References
    `src/lightning/pytorch/trainer/connectors/checkpoint_connector.py` `_CheckpointConnector._parse_ckpt_path`;
    `src/lightning/pytorch/callbacks/model_checkpoint.py` `ModelCheckpoint.on_train_epoch_end`,
    `_save_last_checkpoint`, `_find_last_checkpoints`.
    """
    for run in _runs(tree):
        files = lightning.run_files(run)
        pick = lightning.last_pick(files)
        top = lightning.newest(files)
        if pick is None or top is None:
            continue
        at, newest = lightning.step_of(pick), lightning.step_of(top)
        if at is None or newest is None or newest <= at:
            continue
        yield Hit(pick.path, f'`fit(ckpt_path="last")` loads `{pick.name}` at step {at}, but `{top.name}` in the '
                             f"same folder holds step {newest}: the resume trains {newest - at} steps again "
                             "(`_CheckpointConnector._parse_ckpt_path` takes the newest `last*.ckpt` by time)")


@rule("CKD431", "lightning-last-dangling", Severity.ERROR, fix=Applicability.UNSAFE)
def lightning_last_dangling(tree: Tree) -> Iterator[Hit]:
    """A `last.ckpt` link points at a file that is gone: `fit(ckpt_path="last")` trains from scratch.

    ## What it does
    Reports a symbolic link named as Lightning names its last checkpoint (`last.ckpt`, `last-v1.ckpt` ...)
    whose target does not exist.

    ## Why is this bad?
    `ModelCheckpoint(save_last="link")` makes `last.ckpt` a link to the last file it saved. When that file is
    removed (a top-k clean-up by hand, a copy or sync that kept links but not targets), Lightning's
    `_parse_ckpt_path` drops the link (its `exists` is false), warns "there is no last checkpoint available. No
    checkpoint will be loaded" and the resumed run trains from step 0: a warning in a log, not an error.

    ## Example
    `last.ckpt -> epoch=1-step=4.ckpt`, and `epoch=1-step=4.ckpt` was deleted.

    ## Fix safety
    Unsafe (`ckptdoctor fix --unsafe-fixes`): the link is moved into the quarantine (the link itself; its target is
    never followed), journaled and undoable with `ckptdoctor undo`. It changes what resumes: another `last-v<k>.ckpt`
    in the folder, when there is one, is what `fit(ckpt_path="last")` then loads; otherwise it still trains from
    scratch, and the message names the newest checkpoint to pass as `fit(ckpt_path=...)` or to link `last.ckpt` to.

    ## References
    `src/lightning/pytorch/trainer/connectors/checkpoint_connector.py` `_CheckpointConnector._parse_ckpt_path`;
    `src/lightning/pytorch/callbacks/model_checkpoint.py` `ModelCheckpoint._save_last_checkpoint`,
    `_link_checkpoint`.
    """
    from ckptdoctor.sources.local import BROKEN_LINK

    for p in tree.path_problems:
        name = posixpath.basename(p.path)
        if p.problem.message != BROKEN_LINK or not lightning.is_last_name(name):
            continue
        folder = posixpath.dirname(p.path)
        beside = [f for f in tree.all_files() if posixpath.dirname(f.path) == folder]
        top = lightning.newest(beside)
        newest = "" if top is None else f"; the newest checkpoint there is `{top.name}`"
        plan = FixPlan(f"Quarantine the dangling `{name}` link", Applicability.UNSAFE,
                       (FixOp(OpKind.QUARANTINE, p.path),))
        yield Hit(p.path, f"`{name}` is a link to a file that does not exist: `fit(ckpt_path=\"last\")` skips it, "
                          f"warns and trains from scratch (`_CheckpointConnector._parse_ckpt_path`){newest}", fix=plan)


@rule("CKD432", "lightning-loop-counters", Severity.WARNING)
def lightning_loop_counters(tree: Tree) -> Iterator[Hit]:
    """A Lightning checkpoint's `global_step` or `epoch` disagrees with its loops: the resume follows the loops.

    ## What it does
    Compares the checkpoint's top-level `global_step` and `epoch` with the fit loop's progress in `loops`
    (optimizer steps completed, epochs completed).

    ## Why is this bad?
    `fit(ckpt_path=...)` restores `trainer.global_step` and `current_epoch` from `loops` only
    (`restore_loops`); `global_step` and `epoch` are written for readers and ignored on resume. A script that
    edited `global_step` (to restart a schedule, or to merge runs) changed nothing the resume uses, and the
    schedule, logging and `max_steps` count from the loops' value.

    ## Example
    `global_step` set to 0 in a checkpoint whose loops count 2 optimizer steps: the resume starts at step 2.

    ## Fix safety
    No automatic fix. To restart counting, start a new fit from the weights (`LightningModule.load_from_checkpoint`)
    instead of editing the counters.

    ## References
    `src/lightning/pytorch/trainer/connectors/checkpoint_connector.py` `_CheckpointConnector.restore_loops`,
    `dump_checkpoint`; `src/lightning/pytorch/loops/training_epoch_loop.py` `_TrainingEpochLoop.global_step`.
    """
    for f in tree.all_files():
        lf = lightning.facts_of(f)
        if lf is None or not lf.has_loops:
            continue
        parts = []
        if lf.global_step is not None and lf.loop_steps is not None and lf.global_step != lf.loop_steps:
            parts.append(f"`global_step` is {lf.global_step} but the fit loop counts {lf.loop_steps} optimizer steps")
        if lf.epoch is not None and lf.loop_epoch is not None and lf.epoch != lf.loop_epoch:
            parts.append(f"`epoch` is {lf.epoch} but the fit loop counts {lf.loop_epoch} epochs")
        if parts:
            yield Hit(f.path, "; ".join(parts) + ": `fit(ckpt_path=...)` resumes at the loops' count "
                                                 "(`_CheckpointConnector.restore_loops`)")


@rule("CKD433", "lightning-weights-only", Severity.INFO)
def lightning_weights_only(tree: Tree) -> Iterator[Hit]:
    """A Lightning checkpoint holds only the model: `fit(ckpt_path=...)` raises `KeyError` on it.

    ## What it does
    Reports a Lightning `.ckpt` without `optimizer_states` or `lr_schedulers` (what
    `ModelCheckpoint(save_weights_only=True)` writes): the file `fit(ckpt_path="last")` would load, else the one
    holding the most steps, once per folder. An info in a scan (weights-only saves are a choice); `ckptdoctor gate`
    fails the resume that loads it.

    ## Why is this bad?
    `restore_training_state` raises `KeyError: 'Trying to restore optimizer state but checkpoint contains only the
    model...'` before the first step: the run cannot be continued from these files.

    ## Example
    `ModelCheckpoint(save_last=True, save_weights_only=True)`, then `trainer.fit(model, ckpt_path="last")`.

    ## Fix safety
    No automatic fix. Start a new fit from the weights (`Model.load_from_checkpoint(path)`, then `trainer.fit`
    without `ckpt_path`), and save full checkpoints for the runs you want to resume.

    ## References
    `src/lightning/pytorch/trainer/connectors/checkpoint_connector.py`
    `_CheckpointConnector.restore_optimizers_and_schedulers`; `src/lightning/pytorch/callbacks/model_checkpoint.py`
    `ModelCheckpoint` (`save_weights_only`).
    """
    for run in _runs(tree):
        files = lightning.run_files(run)
        f = lightning.last_pick(files) or lightning.newest(files)
        lf = None if f is None else lightning.facts_of(f)
        if f is None or lf is None or (lf.has_optimizer and lf.has_schedulers):
            continue
        yield Hit(f.path, "holds only the model (no `optimizer_states`/`lr_schedulers`: `save_weights_only`): "
                          "`fit(ckpt_path=...)` raises `KeyError` in "
                          "`_CheckpointConnector.restore_optimizers_and_schedulers`")


@rule("CKD434", "lightning-callback-paths-outside", Severity.WARNING)
def lightning_callback_paths_outside(tree: Tree) -> Iterator[Hit]:
    """A `ModelCheckpoint` state in this checkpoint tracks files outside its own `dirpath`.

    ## What it does
    Reads each `ModelCheckpoint` state stored in a Lightning `.ckpt` and checks that `best_model_path`,
    `best_k_models`, `last_model_path` and `kth_best_model_path` lie inside the state's `dirpath`.

    ## Why is this bad?
    On resume, `ModelCheckpoint.load_state_dict` restores `best_model_path` always, and the top-k paths when the
    `dirpath` matches. Paths outside it belong to another run (a copied folder whose state a script relocated
    by rewriting `dirpath`): `fit`/`test(ckpt_path="best")` then loads the other run's file, the top-k
    bookkeeping compares against files this run does not own, and on a remote file system (`s3://...`) its
    clean-up deletes them (`_should_remove_checkpoint` keeps only local files outside `dirpath`).

    ## Example
    A run copied from `a/` to `b/`, `dirpath` rewritten to `b/checkpoints`, `best_k_models` still naming
    `a/checkpoints/epoch=0-step=2.ckpt`: after resuming in `b/`, `best_model_path` is the file in `a/`.

    ## Fix safety
    No automatic fix. Resume with a `ModelCheckpoint` whose `dirpath` differs from the stored one (Lightning then
    restores only `best_model_path`), or rewrite every tracked path along with `dirpath`.

    ## References
    `src/lightning/pytorch/callbacks/model_checkpoint.py` `ModelCheckpoint.load_state_dict`, `state_dict`,
    `_should_remove_checkpoint`; `src/lightning/pytorch/trainer/connectors/checkpoint_connector.py`
    `_CheckpointConnector._parse_ckpt_path` (`"best"`).
    """
    for f in tree.all_files():
        lf = lightning.facts_of(f)
        if lf is None:
            continue
        for cb in lf.checkpoint_callbacks:
            if cb.dirpath is None:
                continue
            base = cb.dirpath.rstrip("/\\")
            tracked = [cb.best_model_path, cb.last_model_path, cb.kth_best_model_path, *cb.best_k_models]
            outside = sorted({p for p in tracked if p and not _inside(p, base)})
            if outside:
                more = f" (and {len(outside) - 1} more)" if len(outside) > 1 else ""
                yield Hit(f.path, f"`ModelCheckpoint` state tracks `{outside[0]}`{more}, outside its `dirpath` "
                                  f"`{base}`: `ModelCheckpoint.load_state_dict` restores it, and "
                                  '`ckpt_path="best"` and the top-k clean-up act on it')
                break


def _inside(path: str, folder: str) -> bool:
    sep = "\\" if "\\" in folder and "/" not in folder else "/"
    return path.startswith(folder + sep)


# ---------------------------------------------------------------------------------------------------------------
# Gate rules: a planned `fit(ckpt_path=...)` (``stacks.lightning.LightningPrediction``); ``resume.lightning`` runs
# them, and they say nothing about the Trainer's resume context.


def _prediction(ctx: object) -> LightningPrediction | None:
    from ckptdoctor.stacks.lightning import LightningPrediction

    return ctx if isinstance(ctx, LightningPrediction) else None


@rule("CKD435", "lightning-resume-raises", Severity.ERROR, gate_only=True)
def lightning_resume_raises(ctx: object) -> Iterator[Hit]:
    """The planned `Trainer.fit(ckpt_path=...)` raises before its first step.

    ## What it does
    Follows Lightning's resume for the planned `ckpt_path`, `max_epochs` and `max_steps` (`ckptdoctor gate RUN
    --ckpt-path ... --max-epochs ...`) and names the exception it meets: `KeyError` for a weights-only checkpoint,
    `ValueError` from a `OneCycleLR` asked to step past its `total_steps` (a finished run resumed with more epochs),
    `MisconfigurationException` for a checkpoint's epoch above `max_epochs`, `ValueError` for `ckpt_path="best"` in a
    new Trainer, `FileNotFoundError` for a path that is not there.

    ## Why is this bad?
    The job dies at start-up (a scheduler's `ValueError` only at the first step, after data loading), on every
    rank, with a message about the scheduler or the loops rather than about the plan.

    ## Example
    A run with `OneCycleLR(total_steps=trainer.estimated_stepping_batches)` finished its 1 epoch; resumed with
    `max_epochs=2`, the first step raises `ValueError: Tried to step 3 times. The specified number of total steps
    is 2`.

    ## Fix safety
    No automatic fix. For a finished `OneCycleLR`, start a new fit from the weights with a new schedule; for a
    weights-only file, `Model.load_from_checkpoint(path)` and `fit` without `ckpt_path`.

    ## References
    `src/lightning/pytorch/trainer/connectors/checkpoint_connector.py` `_CheckpointConnector._parse_ckpt_path`,
    `restore_loops`, `restore_optimizers_and_schedulers`; `torch/optim/lr_scheduler.py` `OneCycleLR.get_lr`.
    """
    p = _prediction(ctx)
    if p is not None and p.raises is not None:
        yield Hit(p.loaded.path if p.loaded is not None else ".", p.raises)


@rule("CKD436", "lightning-resume-from-scratch", Severity.ERROR, gate_only=True)
def lightning_resume_from_scratch(ctx: object) -> Iterator[Hit]:
    """The planned `fit(ckpt_path="last")` finds no checkpoint: it warns and trains from step 0.

    ## What it does
    Resolves the folder `fit(ckpt_path="last")` lists, as `ModelCheckpoint.__resolve_ckpt_dir` does for the planned
    Trainer: with the default logger and no `dirpath`, a new Trainer logs to the next `version_N`
    (`--logger-version` says which version it takes), and looks for an existing `last*.ckpt` there.

    ## Why is this bad?
    Lightning treats a missing last checkpoint as "set and forget before the first fit": a warning, then training
    from scratch, overwriting nothing and resuming nothing. The run you meant to continue is silently restarted.

    ## Example
    `lightning_logs/version_0/checkpoints/last.ckpt` exists; a new `Trainer(default_root_dir=...)` with the default
    logger takes `version_1`, and `fit(ckpt_path="last")` looks in `version_1/checkpoints`.

    ## Fix safety
    No automatic fix. Pass the file (`fit(ckpt_path=".../version_0/checkpoints/last.ckpt")`), give
    `ModelCheckpoint(dirpath=...)` a fixed folder, or the logger a fixed `version`.

    ## References
    `src/lightning/pytorch/callbacks/model_checkpoint.py` `ModelCheckpoint.__resolve_ckpt_dir`,
    `_find_last_checkpoints`; `src/lightning/pytorch/trainer/connectors/checkpoint_connector.py`
    `_CheckpointConnector._parse_ckpt_path`; `src/lightning/fabric/loggers/csv_logs.py` `CSVLogger._get_next_version`.
    """
    p = _prediction(ctx)
    if p is not None and p.from_scratch is not None:
        yield Hit(p.looks_in or ".", p.from_scratch)
