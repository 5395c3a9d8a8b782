"""The gate for a torchtitan run: what ``CheckpointManager.load(step=checkpoint.load_step)`` loads, and where it raises
or silently falls back (CKD514). Pure: it judges a scanned tree; ``resume_gate.api.run_gate`` hands it over.

torchtitan 0.3.0 ``torchtitan/components/checkpointer/dcp.py`` ``CheckpointManager._load``: ``load_step`` -1 takes
``_find_load_step`` (the highest ``step-N`` holding ``.metadata``; none: a fresh start); another value takes
``step-<load_step>`` and raises ``FileNotFoundError`` when that folder is absent; every state is loaded (the model
alone for step 0) with ``dcp.load``, which raises on a key the save lacks; the dataloader asserts that the
data-parallel degree is the saved one (``torchtitan/components/dataloader.py``
``ParallelAwareDataloader.load_state_dict``); training continues from the restored ``train_state.step`` up to
``training.steps``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ckptdoctor.findings import Finding, Severity
from ckptdoctor.gaps import count_text
from ckptdoctor.model import Checkpoint, Run, Stack, Tree, frozen
from ckptdoctor.rules import Hit, Selection, all_rules, evaluate, rule
from ckptdoctor.stacks import torchtitan as titan

if TYPE_CHECKING:  # the registry imports this module for every scan: the gate's planning only for a gate
    from ckptdoctor.resume_gate.plan import Plan

__all__ = ["TitanContext", "TitanVerdict", "applies", "judge"]

STACK = "torchtitan"  # the `--stack` value that selects this gate
RULE = "CKD514"


@frozen
class TitanContext:
    """What CKD514 judges: the tree, the plan, the torchtitan run (None: none in the tree) and the step folder
    ``load()`` takes (None: none; ``step`` is the step it asks for, -1 when it finds none)."""

    tree: Tree
    plan: Plan
    run: Run | None
    checkpoint: Checkpoint | None
    step: int
    allow_empty: bool = False  # `--allow-empty`: a folder with nothing saved yet starts afresh, and passes


@frozen
class TitanVerdict:
    """The predicted torchtitan resume: the step folder loaded (a path relative to the root, None: none), the step
    training continues from (``train_state.step``), ``training.steps`` planned, the steps left, what ``dcp.load``
    restores, and the findings."""

    checkpoint: str | None
    start_step: int | None
    max_steps: int | None
    steps_to_train: int | None
    loads: str | None
    findings: tuple[Finding, ...]


def _run(tree: Tree) -> Run | None:
    """The torchtitan run of ``tree``: the one at the root, else the first (``checkpoint.folder``) found."""
    runs = [r for r in tree.runs if r.stack is Stack.TORCHTITAN]
    return next((r for r in runs if r.path in ("", ".")), runs[0] if runs else None)


def applies(tree: Tree, stack: str | None) -> bool:
    """Whether the gate follows torchtitan's resume: ``--stack torchtitan``, or no ``--stack`` and the scanned run is
    torchtitan's (its ``checkpoint/step-N`` folders, ``ckptdoctor.stacks.torchtitan``)."""
    return stack == STACK or (stack is None and _run(tree) is not None)


def _context(tree: Tree, plan: Plan, allow_empty: bool) -> TitanContext:
    run = _run(tree)
    asked = plan.load_step if plan.load_step is not None else -1
    if run is None:
        return TitanContext(tree, plan, None, None, asked, allow_empty)
    if run.standalone and run.checkpoints:  # a step folder given directly: `load_step` names it
        ck = run.checkpoints[0]
        return TitanContext(tree, plan, run, ck, ck.step if ck.step is not None else asked, allow_empty)
    if asked == -1:
        pick = titan.load_pick(run)
        step = -1 if pick is None or pick.step is None else pick.step
        return TitanContext(tree, plan, run, pick, step, allow_empty)
    named = [ck for ck in run.checkpoints if ck.path.rsplit("/", 1)[-1] == f"step-{asked}"]
    return TitanContext(tree, plan, run, named[0] if named else None, asked, allow_empty)


@rule("CKD514", "torchtitan-load-fails", Severity.ERROR, gate_only=True)
def torchtitan_load_fails(ctx: object) -> Iterator[Hit]:
    """torchtitan's `CheckpointManager.load()` would raise, or start from scratch, on the planned resume.

    ## What it does
    `ckptdoctor gate` on a torchtitan run (or with `--stack torchtitan`) predicts what `load()` does with the
    planned `--checkpoint.load_step` (`--load-step`, default -1: the highest `step-N` holding `.metadata`) and the
    planned data-parallel degree (`--world-size`), and fails when it finds no step to load (the run silently
    trains from scratch), when the step asked for is not there or has no `.metadata`, when the step holds the
    model alone (`last_save_model_only`), or when the save's dataloader state is for another data-parallel degree.

    ## Why is this bad?
    Each is a crash on every rank after the job got its allocation (`FileNotFoundError: --checkpoint.load_step=N
    not found`, `RuntimeError: Missing key in checkpoint state_dict`, the dataloader's `AssertionError: dp_degree is
    inconsistent before and after checkpoint`), or, with no loadable step, hours of training repeated without a word.

    ## Example
    `ckptdoctor gate outputs/ --max-steps 2000` after a 1000-step run with the default `last_save_model_only`:
    `load()` picks `step-1000`, which holds the model only.

    ## Fix safety
    No automatic fix: pass `--checkpoint.load_step` of a full save (the gate's `--load-step`), keep the
    data-parallel degree, or restore the missing step.

    ## References
    torchtitan `torchtitan/components/checkpointer/dcp.py` (`CheckpointManager._load`, `_find_load_step`,
    `_states_to_load`), `torchtitan/components/dataloader.py` (`ParallelAwareDataloader.load_state_dict`);
    `torch/distributed/checkpoint/default_planner.py` (`create_default_local_load_plan`).
    """
    if not isinstance(ctx, TitanContext):
        return  # the Trainer's gate runs every gate rule on its own context: this one has nothing to say there
    run, ck, step = ctx.run, ctx.checkpoint, ctx.step
    where = run.path if run is not None else "."
    if run is None:
        if not ctx.allow_empty:
            yield Hit(".", "no torchtitan `step-N` folder here: `load()` finds no checkpoint and training starts "
                           "from scratch")
        return
    if ck is None:
        if step == -1 and not (ctx.allow_empty and not any(c.files for c in run.checkpoints)):
            yield Hit(where, "`load()` finds no `step-N` holding `.metadata` (`_find_load_step` returns -1): "
                             "training starts from scratch")
        else:
            yield Hit(where, f"`load()` raises `FileNotFoundError: --checkpoint.load_step={step} not found`: there "
                             f"is no `step-{step}` folder")
        return
    skipped = [c for c in run.checkpoints if ctx.plan.load_step in (None, -1) and c.step is not None
               and ck.step is not None and c.step > ck.step and not titan.loadable(c)]
    if skipped:
        newest = max(skipped, key=lambda c: c.step or 0)
        yield Hit(newest.path, f"`load()` falls back to `{ck.path.rsplit('/', 1)[-1]}`: `_find_load_step` skips "
                               f"`{newest.path.rsplit('/', 1)[-1]}`, which has no `.metadata` (a save cut short)")
    meta = titan.metadata(ck)
    if meta is None:
        yield Hit(ck.path, "`load()` asks `dcp.load` for this folder, which has no `.metadata` (torch.distributed."
                           "checkpoint writes it last): it raises")
        return
    missing = titan.missing_states(meta) if step != 0 else []
    if missing:
        yield Hit(ck.path, f"`load()` loads every state from this save, which lacks {', '.join(missing)} "
                           "(a `last_save_model_only` save): `dcp.load` raises `Missing key in checkpoint "
                           "state_dict`; give `--checkpoint.load_step` of a full save")
    planned = ctx.plan.world_size
    if planned is not None and step != 0 and "dataloader" not in missing:
        saved = titan.int_value(titan.item_value(ck, meta, "dataloader.world_size"))
        ranks = titan.dataloader_ranks(meta)
        if saved is None and ranks:
            saved = max(ranks) + 1
        if saved is not None and saved != planned:
            # count_text: a pickled world size may be too long for Python to print
            yield Hit(ck.path, f"the save's dataloader state is for data-parallel degree {count_text(saved)}, the "
                               f"resume runs {planned:,}: `ParallelAwareDataloader.load_state_dict` raises "
                               "`AssertionError: dp_degree is inconsistent before and after checkpoint`")


def judge(
    tree: Tree, plan: Plan, scanned: Sequence[Finding], selection: Selection, allow_empty: bool = False
) -> TitanVerdict:
    """Predict and judge ``CheckpointManager.load()`` for the torchtitan run in ``tree`` under ``plan``
    (``load_step``, ``max_steps`` as ``training.steps``, ``world_size`` as the data-parallel degree). The scan's
    findings about the step folder loaded are kept, as the Trainer's gate keeps those about its checkpoint.
    ``allow_empty``: a folder holding no save yet (a launcher gating before the first one) passes."""
    ctx = _context(tree, plan, allow_empty)
    # as the Trainer's gate runs its rules: unless ignored, whatever a select list says
    unselected = replace(selection, select=())
    rules = [r for r in all_rules() if r.code == RULE and unselected.enabled(replace(r, gate_only=False))]
    found = evaluate(rules, ctx, tree, selection)
    ck = ctx.checkpoint
    kept = [f for f in scanned if ck is not None and _in(f.path, ck.path)]
    findings = tuple(sorted([*kept, *found], key=Finding.sort_key))
    if ck is None or titan.metadata(ck) is None:
        return TitanVerdict(None if ck is None else ck.path, None, plan.max_steps, None, None, findings)
    meta = titan.metadata(ck)
    assert meta is not None
    model_only = ctx.step == 0
    start = titan.int_value(titan.item_value(ck, meta, "train_state.step")) if not model_only else 0
    steps = plan.max_steps
    todo = None if start is None or steps is None or any(f.rule == RULE for f in found) else max(0, steps - start)
    held = [s for s in titan.STATES if s not in titan.missing_states(meta)]
    loads = "model" if model_only else ", ".join(["model", *held])
    return TitanVerdict(ck.path, start, steps, todo, f"dcp.load: {loads}", findings)


def _in(path: str, folder: str) -> bool:
    return folder in ("", ".") or path == folder or path.startswith(folder + "/")
