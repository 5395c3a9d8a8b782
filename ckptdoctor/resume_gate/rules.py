"""Gate rules: hazards of one planned resume, judged by ``ckptdoctor gate`` over a ``ResumeContext``.

They need what the user plans (epochs, learning rate, world size), which a scan does not know, so ``scan`` never runs
them (``Selection.enabled`` refuses gate-only rules); they are registered like every other rule, so ``rules``,
``explain``, the README catalog and SARIF output document them. Each reads the frozen ``Prediction``
(``ckptdoctor.resume_gate.predict``) and the checkpoint; ``gate_findings`` runs them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ckptdoctor import trainer_view
from ckptdoctor.facts import plural, saved_world_size
from ckptdoctor.findings import Finding, Severity
from ckptdoctor.model import Checkpoint, ProblemKind, Tree, frozen
from ckptdoctor.rules import Hit, Rule, Selection, all_rules, evaluate, get_rule, rule

if TYPE_CHECKING:
    from ckptdoctor.resume_gate.plan import Plan
    from ckptdoctor.resume_gate.predict import Prediction, StepPlan
    from ckptdoctor.stacks.lightning import LightningPrediction

# Every scan imports this module (the registry documents these rules), and only the gate runs them: the plan,
# the prediction and the schedules are imported by the rules that read them, so a scan's start-up does not pay.

# The rules that say the resume raises before its first step (``Prediction.crash``): CKD413, and those that name a
# crash of their own kind (``Prediction.crash_rule``).
CRASH_RULES = frozenset({"CKD413", "CKD418", "CKD421"})
JUMP_FACTOR = 1.25  # an LR rise above this factor over the last LR used is a "large jump" (CKD411)
LR_RTOL = 1e-9


@frozen
class ResumeContext:
    """What a gate rule judges: the scanned tree, the plan, the checkpoint the resume loads (None: it finds none)
    and the prediction for it (None without a checkpoint)."""

    tree: Tree
    plan: Plan
    checkpoint: Checkpoint | None = None
    prediction: Prediction | None = None


def gate_findings(ctx: ResumeContext, selection: Selection) -> list[Finding]:
    """The gate rules' findings on ``ctx`` under ``selection``, made by the scan's own engine (``rules.evaluate``):
    a rule it leaves out is dropped, its severity override wins over the hit's own, and a rule that raises is an
    internal error finding (an error: the gate fails) while the other gate rules still run, as in a scan."""
    # Selection.enabled leaves every gate-only rule out of a scan; here the gate is what runs them. A select list
    # narrows the scan findings only: one written for `scan` (select = ["CKD1", "CKD2"]) must not silently turn
    # the gate's own judgement off. Ignoring a gate rule by code or prefix does.
    unselected = replace(selection, select=())
    gate_rules = [r for r in all_rules() if r.gate_only and unselected.enabled(replace(r, gate_only=False))]
    adapter = adapter_rule(ctx, unselected)
    return evaluate([*gate_rules, *adapter], ctx, ctx.tree, selection)


ADAPTER_RULE = "CKD201"


def adapter_rule(ctx: ResumeContext, selection: Selection) -> list[Rule]:
    """CKD201 for the file the resume really loads, as a rule of ``ctx`` (none when it has nothing to say): the
    gate judges it from its prediction (``Prediction.adapter``, the file the transformers version it follows reads,
    e.g. ``pytorch_model.bin`` under 4.x with ``save_safetensors=False``) in place of the scan's finding, which
    assumes ``model.safetensors`` first. Like the gate rules it runs unless ignored: a ``--select`` that leaves it
    out must not let a resume that restarts its adapter from scratch pass."""
    p, ck = ctx.prediction, ctx.checkpoint
    r = get_rule(ADAPTER_RULE)
    if p is None or ck is None or p.adapter is None or p.adapter.complete or r is None or not selection.enabled(r):
        return []
    from ckptdoctor.rules.weights import adapter_restore_hit

    loaded, adapter = ck, p.adapter

    def judge(_: ResumeContext) -> list[Hit]:
        # The gate reports without a fix plan: `ckptdoctor fix` repairs it from the scan's own CKD201.
        return [replace(adapter_restore_hit(loaded, adapter), fix=None)]

    return [replace(r, func=judge)]


def format_lrs(lrs: Sequence[float]) -> str:
    """LRs for a message or the text report: ``1e-05, 8e-06``."""
    return ", ".join(f"{x:.4g}" for x in lrs)


def _resumed(ctx: ResumeContext) -> tuple[Checkpoint, Prediction, StepPlan] | None:
    """The checkpoint, its prediction and step plan when the resume gets past loading its files (else None)."""
    p = ctx.prediction
    if ctx.checkpoint is None or p is None or p.steps is None:
        return None
    return ctx.checkpoint, p, p.steps


def _optimizer_name(ck: Checkpoint) -> str:
    """The optimizer file the resume restores the LR from (``optimizer.pt``, ``.bin``, MindNLP's ``optimizer.ckpt``)."""
    f = trainer_view.optimizer_file(ck)
    ds = trainer_view.deepspeed_view(ck) if f is None else None
    if ds is not None and ds.tag is not None:
        return f"{ds.tag}/zero_pp_rank_0_mp_rank_00_optim_states.pt"  # DeepSpeed's ZeRO partition of rank 0
    return ck.relname(f) if f is not None else "optimizer.pt"


def _in_folder(ck: Checkpoint, name: str) -> str:
    return name if ck.path in ("", ".") else f"{ck.path}/{name}"


@rule("CKD407", "resume-trains-zero-steps", Severity.ERROR, gate_only=True)
def resume_trains_zero_steps(ctx: ResumeContext) -> Iterator[Hit]:
    """The planned resume would train zero steps: the checkpoint is already at or past the planned end.

    ## What it does
    Recomputes `max_steps`, the epochs already trained and the batches to skip as `Trainer._inner_training_loop`
    will (`set_initial_training_values`, `_init_training_state`), from the checkpoint's `global_step` and the
    planned `num_train_epochs` / `max_steps` and steps per epoch.

    ## Why is this bad?
    `train()` returns at once, reports success, and (with a save at the end) rewrites the checkpoint: the job
    "finished" without training. It happens when a finished run is resumed with the same epochs, and when
    `resume_from_checkpoint=True` picks a stale higher checkpoint of an earlier, longer run.

    ## Example
    A run of 2 epochs x 4 steps ends at `checkpoint-8`; resuming it with `num_train_epochs=2` trains nothing.

    ## Fix safety
    No fix: raise `num_train_epochs` / `max_steps`, or resume from the checkpoint you meant.

    ## References
    `src/transformers/trainer.py` `set_initial_training_values`, `_init_training_state`, `_run_epoch`;
    `trainer_callback.DefaultFlowCallback.on_step_end`.
    """
    resumed = _resumed(ctx)
    if resumed is None or resumed[2].steps_to_train != 0:
        return
    ck, p, steps = resumed
    s, start = p.settings, p.start or 0
    span = (
        f"max_steps {steps.max_steps}" if s.max_steps > 0
        else f"{s.num_train_epochs:g} epochs x {s.steps_per_epoch} steps = max_steps {steps.max_steps}"
    )
    past = " (the checkpoint is past the planned end)" if start > steps.max_steps else ""
    yield Hit(ck.path, f"resume starts at global_step {start} with {span}{past}: train() returns after 0 steps, "
              "reporting success")


@rule("CKD408", "resume-restarts-schedule", Severity.ERROR, gate_only=True)
def resume_restarts_schedule(ctx: ResumeContext) -> Iterator[Hit]:
    """The resume would skip the optimizer and scheduler state: Adam restarts and the LR schedule starts over.

    ## What it does
    Applies `Trainer._load_optimizer_and_scheduler`'s test to the checkpoint the resume loads: optimizer state
    (`optimizer.pt`, `optimizer.bin` or an `optimizer*` folder) and `scheduler.pt` must both exist.

    ## Why is this bad?
    When either is missing both are skipped without a log line: fresh AdamW moments, and a new schedule from its
    step 0 (warm-up again, full base LR) while `global_step` continues. `save_only_model=True` checkpoints always
    resume this way.

    ## Example
    `checkpoint-500/` written with `save_only_model=True`: weights and `trainer_state.json`, no `optimizer.pt` and
    no `scheduler.pt`.

    ## Fix safety
    No fix: restore the missing files, or resume knowingly (the gate shows the LRs the restarted schedule uses).

    ## References
    `src/transformers/trainer.py` `Trainer._load_optimizer_and_scheduler` (both or neither, no log line),
    `Trainer.create_scheduler`; docs/gate.md.
    """
    resumed = _resumed(ctx)
    if resumed is None or resumed[1].restores or resumed[1].lr0 is None:
        return
    ck, p, _ = resumed
    has_sched = trainer_view.scheduler_file(ck) is not None
    sched = f"`{trainer_view.MS_SCHEDULER if trainer_view.is_mindnlp(ck) else trainer_view.SCHEDULER}`"
    have = "optimizer state" if trainer_view.has_optimizer_state(ck) else (sched if has_sched else "")
    missing = f"no {sched}" if have == "optimizer state" else (
        "no optimizer state" if have else f"no optimizer state and no {sched}")
    lead = f"has {have} but {missing}" if have else f"has {missing}"
    yield Hit(ck.path, f"{lead}: the resume restores neither; AdamW restarts from zero moments and the "
              f"`{p.settings.lr_scheduler_type}` schedule restarts at its step 0 (LR {p.lr0:.4g}) while global_step "
              f"continues at {p.start or 0}")


@rule("CKD409", "planned-lr-ignored", Severity.ERROR, gate_only=True)
def planned_lr_ignored(ctx: ResumeContext) -> Iterator[Hit]:
    """The planned `learning_rate` differs from the base LR the checkpoint imposes, and will be ignored.

    ## What it does
    Compares the planned `learning_rate` with the `base_lrs` stored in `scheduler.pt` (else the optimizer's
    `initial_lr`) when the resume restores optimizer and scheduler.

    ## Why is this bad?
    The scheduler is rebuilt for the new arguments and then `load_state_dict` overwrites its `base_lrs` with the
    checkpoint's, and the optimizer's LR comes from `optimizer.pt`: the new learning rate has no effect, without a
    warning. Polynomial and min-LR schedules even mix the two (their lambda divides by the new value).

    ## Example
    Resuming a run trained at 1e-3 with `learning_rate=5e-3` "to speed it up": every step still runs at 1e-3 x the
    schedule.

    ## Fix safety
    No fix: keep the checkpoint's LR, or change the LR on purpose (for instance by editing the optimizer's param
    groups in a callback after the resume).

    ## References
    `torch/optim/lr_scheduler.py` `LRScheduler.load_state_dict` (`__dict__.update`, restoring `base_lrs`);
    `src/transformers/trainer.py` `Trainer._load_optimizer_and_scheduler`, `Trainer.create_scheduler`;
    `src/transformers/optimization.py` `get_polynomial_decay_schedule_with_warmup`.
    """
    resumed = _resumed(ctx)
    if resumed is None:
        return
    ck, p, _ = resumed
    s, base = p.settings, p.base_lr
    if not p.restores or not p.lrs or base is None or math.isclose(s.learning_rate, base, rel_tol=LR_RTOL, abs_tol=0.0):
        return
    src = s.sources.get("learning_rate", "planned")
    yield Hit(_in_folder(ck, trainer_view.SCHEDULER), f"learning_rate {s.learning_rate:g} ({src}) is ignored: the "
              f"resume restores base LR {base:g} from the checkpoint; the first steps run at {format_lrs(p.lrs)}")


@rule("CKD410", "resume-first-step-lr-zero", Severity.WARNING, gate_only=True)
def resume_first_step_lr_zero(ctx: ResumeContext) -> Iterator[Hit]:
    """The first optimizer step after the resume runs at learning rate 0.

    ## What it does
    Predicts the LR of the first resumed step: the LR stored in `optimizer.pt` when the state is restored, else the
    restarted schedule's LR at its step 0.

    ## Why is this bad?
    A finished schedule stores LR 0, and resuming it with more epochs spends the first step at LR 0 before the new
    schedule takes over; a restarted schedule with warm-up does the same. Usually harmless, but it is a sign the
    resume is not continuing the schedule you think.

    ## Example
    The last checkpoint of a linear schedule, resumed with `num_train_epochs` raised from 2 to 3.

    ## Fix safety
    No fix: information about the planned resume.

    ## References
    `src/transformers/trainer.py` `Trainer._load_optimizer_and_scheduler` (the first step runs at the `lr` stored
    in `optimizer.pt`); `src/transformers/optimization.py` `get_linear_schedule_with_warmup`; docs/gate.md.
    """
    resumed = _resumed(ctx)
    if resumed is None or not resumed[1].lrs or resumed[1].lrs[0] != 0.0:
        return
    ck, p, _ = resumed
    why = (f"the LR stored in `{_optimizer_name(ck)}`" if p.restores and p.lr_not_restored is None
           else "the restarted schedule's warm-up")
    yield Hit(ck.path, f"the first resumed optimizer step (step {(p.start or 0) + 1}) runs at LR 0 ({why})")


@rule("CKD411", "resume-lr-jump", Severity.WARNING, gate_only=True)
def resume_lr_jump(ctx: ResumeContext) -> Iterator[Hit]:
    """The resumed learning rate jumps well above the last LR the run used, where the uninterrupted run would not.

    ## What it does
    Compares the predicted LRs of the first resumed steps with the last `learning_rate` logged before the
    checkpoint, and with the LR the same run would have used at those steps had it not been interrupted (its own
    schedule, `max_steps` and warm-up, from `trainer_state.json` and `training_args.bin`). A rise of more than 25%
    over both is reported; past the run's own `max_steps`, over the last LR alone. When the run's own schedule
    cannot be read, a rise during its warm-up is not reported.

    ## Why is this bad?
    A new `max_steps` (more epochs) rebuilds the schedule mid-way along a longer decay, and a restarted schedule
    starts from the full base LR: either way the LR goes back up after it had decayed, which can undo training
    (loss spikes, forgetting). A rise the run's own schedule makes (a `cosine_with_restarts` cycle, a warm-up) is
    not a jump: the uninterrupted run uses the same LRs.

    ## Example
    A linear schedule at 1.25e-4 at its last step, resumed with 50% more epochs: the second resumed step runs at
    2.5e-4.

    ## Fix safety
    No fix: plan the new schedule on purpose, or resume with the run's own settings.

    ## References
    `Trainer.create_scheduler`, `LambdaLR.get_lr`; `src/transformers/optimization.py`
    `_get_cosine_with_hard_restarts_schedule_with_warmup_lr_lambda`.
    """
    resumed = _resumed(ctx)
    ts = trainer_view.trainer_state(resumed[0]) if resumed is not None else None
    if resumed is None or ts is None or not resumed[1].lrs:
        return
    ck, p, steps = resumed
    lrs, start = p.lrs, p.start or 0
    logged = [(s, lr) for s, lr in ts.learning_rates() if s <= start]  # the LR the run last trained with
    if not logged or logged[-1][1] <= 0:
        return
    last = logged[-1]
    own = _uninterrupted(ck, ts, start, len(lrs))
    if own is None and _warming_up(ck, ts, start):
        return  # the run was still warming up and its schedule is unknown: a rising LR may be its own
    jumps = [i for i, lr in enumerate(lrs) if lr > last[1] * JUMP_FACTOR
             and (own is None or own[i] is None or lr > (own[i] or 0.0) * JUMP_FACTOR)]
    if jumps:
        i = max(jumps, key=lambda j: lrs[j])
        lr, ref = lrs[i], own[i] if own is not None else None
        new_max = steps.max_steps
        was = f", where the uninterrupted run uses {ref:.4g}" if ref is not None else ""
        changed = f" (the run's max_steps was {ts.max_steps}, the resume's is {new_max})" if ts.max_steps != new_max \
            else ""
        yield Hit(ck.path, f"LR rises from {last[1]:.4g} (logged at step {last[0]}) to {lr:.4g} at step "
                  f"{start + 1 + i}{was}: the resume does not continue the run's schedule{changed}")


def _uninterrupted(ck: Checkpoint, ts: trainer_view.TrainerStateView, start: int, n: int) -> list[float | None] | None:
    """The LRs the run itself, not interrupted, uses at the ``n`` optimizer steps after ``start`` (None for a step
    past its own ``max_steps``), from its own schedule; None when that schedule cannot be rebuilt."""
    from ckptdoctor import schedules
    from ckptdoctor.resume_gate.plan import INT_LIMIT, own_warmup, parse_kwargs, plan_from_training_args

    args = trainer_view.training_args(ck)
    total = ts.max_steps
    if not args or not isinstance(args.get("lr_scheduler_type"), str) or not total or not 0 < total < INT_LIMIT:
        return None
    sched_state = trainer_view.scheduler_state(ck)
    base = sched_state.base_lrs[0] if sched_state is not None and sched_state.base_lrs else None
    lr_init = trainer_view.number(args.get("learning_rate"))
    base = base if base is not None else lr_init
    if base is None or lr_init is None:
        return None
    try:
        warmup = schedules.warmup_steps_for(own_warmup(plan_from_training_args(args)) or 0.0, total)
        sched = schedules.build(args["lr_scheduler_type"], num_warmup_steps=warmup, num_training_steps=total,
                                lr_init=lr_init, kwargs=parse_kwargs(args.get("lr_scheduler_kwargs")))
        # the optimizer step after global_step g uses the scheduler at step g (LambdaLR steps after each update)
        return [sched.lr(base, start + i) if start + 1 + i <= total else None for i in range(n)]
    except (schedules.ScheduleError, ArithmeticError, TypeError, ValueError):
        return None


def _warming_up(ck: Checkpoint, ts: trainer_view.TrainerStateView, start: int) -> bool:
    """True when the run was still in its own warm-up at ``start`` (False when that cannot be computed)."""
    from ckptdoctor import schedules
    from ckptdoctor.resume_gate.plan import own_warmup, plan_from_training_args

    warmup = own_warmup(plan_from_training_args(trainer_view.training_args(ck) or {})) or 0.0
    try:
        return bool(ts.max_steps) and start < schedules.warmup_steps_for(warmup, ts.max_steps or 0)
    except (ArithmeticError, ValueError):
        return False  # its warm-up cannot be computed (NaN, inf, a ratio of an overflowing max_steps)


@rule("CKD412", "lr-schedule-unpredictable", Severity.WARNING, gate_only=True)
def lr_schedule_unpredictable(ctx: ResumeContext) -> Iterator[Hit]:
    """The gate cannot predict the learning rates of the resume.

    ## What it does
    Reports why the LR sequence is missing: a metric-driven schedule (`reduce_lr_on_plateau`, `greedy`), an
    optimizer / scheduler state whose LRs could not be read, a DeepSpeed config with its own `"scheduler"`
    (`WarmupLR`, `WarmupDecayLR`, ...: the engine restores and steps it in place of the Trainer's schedule; the
    first resumed LR, restored from the ZeRO optimizer state, is predicted), or a `trainer_state.json` too large to
    read (over the 256 MB limit: the resume loads it, but neither its steps nor its LRs are predicted).

    ## Why is this bad?
    The rest of the prediction stands, but nothing checked the LRs the resume will use.

    The first resumed LR of a metric-driven schedule is known and predicted: the LR `optimizer.pt` stores (the
    Trainer steps `ReduceLROnPlateau` and `GreedyLR` only after an evaluation, with its metrics).

    ## Example
    `lr_scheduler_type="reduce_lr_on_plateau"`: the LR changes with evaluation results.

    ## Fix safety
    No fix.

    ## References
    `src/transformers/optimization.py` `get_scheduler`, `GreedyLR`; `Trainer._evaluate` (steps the scheduler with
    the metrics); `torch/optim/lr_scheduler.py` `ReduceLROnPlateau.step`; `deepspeed/runtime/lr_schedules.py`,
    `src/transformers/integrations/deepspeed.py` `deepspeed_optim_sched` (a config "scheduler" is DeepSpeed's).
    """
    from ckptdoctor.resume_gate.predict import state_not_read

    if ctx.checkpoint is not None and ctx.prediction is not None and ctx.prediction.crash is None:
        unread = state_not_read(ctx.checkpoint)
        if unread is not None and ctx.prediction.start is None:
            yield Hit(ctx.checkpoint.path, f"`trainer_state.json` was not read ({unread}): the steps and LRs of the "
                      "resume are not predicted")
            return
    resumed = _resumed(ctx)
    if resumed is None:
        return
    ck, p, _ = resumed
    from ckptdoctor import schedules

    stype = p.settings.lr_scheduler_type
    if p.schedule_rejected is not None and stype in schedules.METRIC_DRIVEN:
        fresh = "the planned learning_rate (fresh optimizer)"
        where = f"the LR stored in `{_optimizer_name(ck)}`" if p.restores else fresh
        first = f"the first resumed step (step {(p.start or 0) + 1}) runs at {p.lrs[0]:.4g} ({where}); " if p.lrs \
            else ""
        yield Hit(ck.path, f"`{stype}`: {first}later steps keep it until an evaluation steps the scheduler with its "
                  "metrics, which lower (or, for greedy, raise) it: those LRs depend on evaluation results and "
                  "cannot be predicted")
    if p.ds_scheduler is not None:
        first = f"the first resumed step runs at {p.lrs[0]:.4g} (restored by DeepSpeed); " if p.lrs else ""
        yield Hit(ck.path, f"the DeepSpeed config names its own scheduler, `{p.ds_scheduler}`, which the engine "
                  f"restores and steps in place of `{stype}`: {first}the later LRs follow it and are not predicted")
    if p.lr_unreadable:
        yield Hit(ck.path, "cannot read the LR stored in `optimizer.pt` / `scheduler.pt`; LRs not predicted")


@rule("CKD413", "resume-will-fail", Severity.ERROR, gate_only=True)
def resume_will_fail(ctx: ResumeContext) -> Iterator[Hit]:
    """The planned resume raises before training: no checkpoint, no state, no weights, a damaged file it loads, or
    an impossible schedule.

    ## What it does
    Follows `Trainer.train`'s resume path and names the exception it would raise: `get_last_checkpoint` finds no
    `checkpoint-N` folder; `trainer_state.json` is missing, invalid or has a null `train_batch_size`;
    `_load_from_checkpoint` finds no weights; a file the resume loads is cut short or broken (`config.json`, the
    weights or a shard, `optimizer.pt` and `scheduler.pt` when both are restored, `scaler.pt`, each rank's
    `rng_state`: `OSError`, `RuntimeError`, `SafetensorError`, `JSONDecodeError`, as measured with transformers
    5.23); a DeepSpeed checkpoint has no `scheduler.pt` while its DeepSpeed config names neither an optimizer nor a
    scheduler (the Trainer then holds the schedule and loads that file; otherwise the engine restores its own), or
    holds an elastic ZeRO state without `base_optimizer_state_step` (DeepSpeed 0.19.8 asserts it: it is saved only
    for optimizers that keep `step` in their param groups, not torch's), or a ZeRO stage 0-2 save is resumed under
    a planned ZeRO-3 config (`deepspeed` in `--training-args`: stage 3 reads per-rank model-states files those
    stages do not write, and DeepSpeed asserts); `get_scheduler` rejects the planned schedule.

    ## Why is this bad?
    The job fails after it got its allocation, often on every rank, with an error that rarely says what to do.

    ## Example
    `checkpoint-1500/` from a preempted save, without `trainer_state.json`: `FileNotFoundError`.

    ## Fix safety
    No fix here; `ckptdoctor scan` and `ckptdoctor fix` handle most causes (quarantining a torn checkpoint).

    ## References
    `src/transformers/trainer.py` `train`, `_load_from_checkpoint`, `_load_optimizer_and_scheduler` (under
    DeepSpeed it loads `scheduler.pt` unless the scheduler is a `DeepSpeedSchedulerWrapper`);
    `trainer_utils.get_last_checkpoint`; `optimization.get_scheduler`; `deepspeed/runtime/zero/stage_1_and_2.py`
    `_restore_step_from_elastic_checkpoint`; `deepspeed/runtime/state_dict_factory.py` `SDLoaderBase.check_ckpt_list`.
    """
    ck, p = ctx.checkpoint, ctx.prediction
    if ck is None or p is None:
        yield Hit(".", _no_checkpoint(ctx))
        return
    from ckptdoctor import schedules
    from ckptdoctor.resume_gate.plan import int_text
    from ckptdoctor.resume_gate.predict import state_not_read

    s = p.settings
    if p.crash_rule is not None:
        return  # the rule that names this crash reports it (CKD418: a weights-only refusal)
    if p.crash is not None or (p.start is None and state_not_read(ck) is None):
        yield Hit(ck.path, p.crash or "`trainer_state.json` cannot be read: train() raises")
    elif p.step_error is not None:
        src, exc = s.sources, p.step_error
        yield Hit(ck.path, f"num_train_epochs {s.num_train_epochs:g} ({src.get('num_train_epochs', 'default')}), "
                  f"max_steps {int_text(s.max_steps)} ({src.get('max_steps', 'default')}), warmup_steps "
                  f"{s.warmup_steps:g} ({src.get('warmup_steps', 'default')}): train() raises {exc.type} computing "
                  f"max_steps and the warm-up steps ({exc.message})")
    elif p.schedule_rejected is not None and s.lr_scheduler_type not in schedules.METRIC_DRIVEN:
        yield Hit(ck.path, f"create_scheduler raises: {p.schedule_rejected}")
    elif p.schedule_error is not None:
        yield Hit(ck.path, f"create_scheduler raises {p.schedule_error.type} on lr_scheduler_kwargs "
                  f"{schedules.brief(dict(s.lr_scheduler_kwargs))}: {p.schedule_error.message}")
    elif p.lr_error is not None:
        yield Hit(ck.path, f"the `{s.lr_scheduler_type}` schedule raises {p.lr_error.type} within the first "
                  f"{p.lr_count} resumed steps")


def _no_checkpoint(ctx: ResumeContext) -> str:
    """What ``train()`` raises when the resume finds no checkpoint to load."""
    if ctx.plan.checkpoint is not None:
        # the scan could not open the root: transformers' os.path.isfile checks then find no weights file either
        missing = any(p.path in ("", ".") and p.problem.kind is ProblemKind.UNREADABLE for p in ctx.tree.path_problems)
        what = "no folder (the path is taken as given, from the working directory)" if missing else (
            "a folder with no weights file")
        return (f"resume_from_checkpoint={ctx.plan.checkpoint!r} names {what}: "
                "train() raises ValueError(\"Can't find a valid checkpoint at ...\")")
    return ("resume_from_checkpoint=True finds no `checkpoint-N` folder: train() raises "
            "ValueError(\"No valid checkpoint found in output directory\")")


@rule("CKD414", "resume-steps-unknown", Severity.WARNING, gate_only=True)
def resume_steps_unknown(ctx: ResumeContext) -> Iterator[Hit]:
    """The planned batch size, gradient accumulation or world size changes the steps per epoch, by an amount the
    checkpoint does not pin down.

    ## What it does
    When the plan changes `per_device_train_batch_size`, `gradient_accumulation_steps` or the world size, the
    Trainer recomputes the steps per epoch (and an epoch-based `max_steps`) from the new dataloader. The gate
    derives them from the run's recorded `train_batch_size` (`trainer_state.json`), its steps per epoch and
    gradient accumulation, and its world size: the dataset lengths these allow, split by the new arguments. It
    reports when a value it needs is not recorded, or when the dataset lengths the run allows give different steps
    per epoch under the plan. Then nothing about steps and LRs is predicted.

    ## Why is this bad?
    A guess would be a silent wrong answer: halving the batch size doubles the steps per epoch, so an epoch-based
    resume trains twice as many steps (and a restarted schedule runs on a different `max_steps`) than the run's own
    figures say.

    ## Example
    A run of 10 samples at batch 8 (2 steps per epoch: 9 to 16 samples) resumed at batch 3: 3 to 6 steps per epoch.

    ## Fix safety
    No fix: pass the new steps per epoch (`--steps-per-epoch`, `steps_per_epoch=`; `check_resume` reads them from
    the Trainer's dataloader).

    ## References
    `src/transformers/trainer.py` `set_initial_training_values`, `get_train_dataloader`; accelerate
    `data_loader.BatchSamplerShard.__len__`.
    """
    ck, p = ctx.checkpoint, ctx.prediction
    if ck is None or p is None or p.crash is not None or p.start is None or p.steps is not None:
        return
    note = p.settings.steps_per_epoch_note
    if p.settings.steps_per_epoch is None and note is not None:
        yield Hit(ck.path, f"{note}: steps and LRs not predicted; pass the new steps per epoch (--steps-per-epoch)")


@rule("CKD415", "planned-batch-size-ignored", Severity.WARNING, gate_only=True)
def planned_batch_size_ignored(ctx: ResumeContext) -> Iterator[Hit]:
    """The planned `per_device_train_batch_size` is not used: the resume keeps the checkpoint's batch size.

    ## What it does
    When the resume runs under transformers 4.x (`--transformers-version`, else the installed transformers, else
    the checkpoint's version), or under 5.x with `auto_find_batch_size=True` (planned, else the run's own
    `training_args.bin`), and the plan changes `per_device_train_batch_size`, reports that the resume keeps the
    run's `train_batch_size` from `trainer_state.json`. The gate predicts the steps and LRs at that batch size.

    ## Why is this bad?
    transformers 4.x's `Trainer.train` sets `self._train_batch_size = state.train_batch_size` whenever it resumes,
    and builds the train dataloader from it: the new batch size is silently dropped (only `compare_trainer_and_
    checkpoint_args` logs a warning), and so are the memory and the steps per epoch it was meant to change.
    transformers 5.x uses the planned batch size, except with `auto_find_batch_size`: then `Trainer.train` restores
    the checkpoint's `train_batch_size` and `find_executable_batch_size` starts `_inner_training_loop` at it.

    ## Example
    A run saved at batch 4 resumed with `per_device_train_batch_size=8` under transformers 4.57: every step still
    takes 4 samples, and an epoch still has the run's 4 steps.

    ## Fix safety
    No fix: resume under transformers 5.x, or set the new batch size after the resume started (or edit
    `train_batch_size` in `trainer_state.json` on purpose).

    ## References
    `src/transformers/trainer.py` (4.57 and 5.x) `Trainer.train` (`state.train_batch_size`), `_inner_training_loop`,
    `get_train_dataloader`, `compare_trainer_and_checkpoint_args`.
    """
    ck, p = ctx.checkpoint, ctx.prediction
    ignored = p.settings.ignored_batch_size if p is not None else None
    if ck is None or p is None or ignored is None:
        return
    from ckptdoctor.resume_gate.plan import int_text

    s = p.settings
    ts = trainer_view.trainer_state(ck)
    run = "?" if ts is None or ts.train_batch_size is None else int_text(ts.train_batch_size)
    why = " with auto_find_batch_size" if s.major >= 5 else ""
    yield Hit(_in_folder(ck, trainer_view.TRAINER_STATE),
              f"per_device_train_batch_size {int_text(ignored)} (planned) is not used: transformers "
              f"{s.transformers_version} ({s.sources.get('transformers_version', 'default')}){why} resumes at the "
              f"checkpoint's train_batch_size {run}")


@rule(
    "CKD504",
    "world-size-mismatch",
    Severity.ERROR,
    gate_only=True,
    severity_when=((Severity.WARNING, "only the per-rank RNG state files tell the saved world size"),),
)
def world_size_mismatch(ctx: ResumeContext) -> Iterator[Hit]:
    """The planned number of processes differs from the number that saved the checkpoint.

    ## What it does
    Counts the ranks that wrote the checkpoint (FSDP `.distcp` files, DeepSpeed ZeRO partitions, per-rank
    `rng_state_R.pth` files) and compares them with the planned world size. Sharded states are errors; RNG files
    alone are warnings.

    ## Why is this bad?
    DeepSpeed ZeRO needs one optimizer partition per rank and fails otherwise; FSDP sharded states reshard only
    through DCP. Each rank reads `rng_state_{rank}.pth` (or `rng_state.pth` alone): extra ranks, or a single
    process after a multi-rank run, continue with fresh random state and the run is no longer reproducible.

    ## Example
    A checkpoint written by 4 GPUs resumed on 2.

    ## Fix safety
    No fix: resume with the saved world size, or convert the checkpoint (`zero_to_fp32.py`, DCP resharding).

    ## References
    `deepspeed/runtime/engine.py` `load_checkpoint`; accelerate `load_fsdp_optimizer`; `Trainer._load_rng_state`.
    """
    ck, planned = ctx.checkpoint, ctx.plan.world_size
    if ck is None or ctx.prediction is None or planned is None:
        return
    saved = saved_world_size(ck)
    kind = "FSDP/DeepSpeed shards"
    sev = Severity.ERROR
    if saved is None:
        from ckptdoctor.resume_gate.resolve import run_world_size

        saved, kind, sev = run_world_size(ck), "RNG state files", Severity.WARNING
    if saved is None or saved == planned:
        return
    if sev == Severity.ERROR:
        tail = "the resume fails or must reshard"
    else:
        tail = "ranks without their own file continue with fresh random state"
    yield Hit(ck.path, f"saved by {saved} ranks ({kind}) but planned world size is {planned}: {tail}", sev)


def _stopped_early(ck: Checkpoint) -> tuple[int, int, str] | None:
    """``(global_step, max_steps, why)`` when ``ck``'s ``trainer_state.json`` says the run stopped itself before
    its end: the saved ``TrainerControl`` has ``should_training_stop`` set at a step below ``max_steps`` (at
    ``max_steps`` it is ``DefaultFlowCallback``'s ordinary end). ``why`` names the early-stopping callback's patience
    when its state is saved beside it."""
    ts = trainer_view.trainer_state(ck)
    callbacks = ts.raw.get("stateful_callbacks") if ts is not None else None
    if ts is None or ts.global_step is None or ts.max_steps is None or not isinstance(callbacks, dict):
        return None
    control = callbacks.get("TrainerControl")
    args = control.get("args") if isinstance(control, dict) else None
    if not isinstance(args, dict) or args.get("should_training_stop") is not True:
        return None
    if ts.global_step >= ts.max_steps:
        return None
    why = "`TrainerControl.should_training_stop` is saved as true"
    early = callbacks.get("EarlyStoppingCallback")
    if isinstance(early, dict):  # a list of states when several instances were saved: the flag alone says it
        patience = early.get("args", {}).get("early_stopping_patience") if isinstance(early.get("args"), dict) else None
        counter = (early.get("attributes", {}) if isinstance(early.get("attributes"), dict) else {}).get(
            "early_stopping_patience_counter")
        if isinstance(patience, int) and isinstance(counter, int):
            why = f"`EarlyStoppingCallback` stopped it: {counter} evaluations without improvement, patience {patience}"
    return ts.global_step, ts.max_steps, why


@rule("CKD420", "resume-trains-past-early-stop", Severity.WARNING, gate_only=True)
def resume_trains_past_early_stop(ctx: ResumeContext) -> Iterator[Hit]:
    """The run had stopped itself early (early stopping), and the planned resume trains past that point.

    ## What it does
    Reads the `stateful_callbacks` of the checkpoint's `trainer_state.json`: when the saved `TrainerControl` has
    `should_training_stop` true at a `global_step` below the run's `max_steps`, a callback (usually
    `EarlyStoppingCallback`) ended the run there. If the planned resume would train any step, says so, with the
    number of steps left in the schedule.

    ## Why is this bad?
    A resume does not honour the stop. `Trainer.train` starts every run with a fresh `TrainerControl`, and even
    with `restore_callback_states_from_checkpoint=True` (which restores the saved `TrainerControl` and the
    callback's patience counter) `CallbackHandler.on_train_begin` sets `should_training_stop` back to false. So
    a job scheduler that restarts a finished early-stopped job, or a user who resumes "to be safe", trains on from
    the point the run had judged best to stop: at least until the next evaluation trips the callback again, and to
    the end of the schedule if the resuming script has no early stopping. The extra steps overwrite the newest
    checkpoint and may move `best_model_checkpoint`.

    ## Example
    A run of 40 steps with `EarlyStoppingCallback(early_stopping_patience=1)` stops itself at step 12 and saves
    `checkpoint-12`; `trainer.train(resume_from_checkpoint=True)` with the same script trains steps 13 to 20 and
    stops again at the next evaluation.

    ## Fix safety
    No fix: if the run is done, do not resume it (use `best_model_checkpoint`); if you mean to train on, pass a
    larger patience and expect the schedule to continue from step 12.

    ## References
    huggingface/transformers#10290 ("Trainer train continues after resume_from_checkpoint on a checkpoint with early
    stop"), huggingface/transformers#28544 ("Early stopping patience does not work when resuming from checkpoint");
    `src/transformers/trainer_callback.py` `EarlyStoppingCallback.on_evaluate`, `EarlyStoppingCallback.state`,
    `TrainerControl.state`, `CallbackHandler.on_train_begin`; `src/transformers/trainer.py`
    `Trainer._load_callback_state`.
    """
    resumed = _resumed(ctx)
    if resumed is None or resumed[2].steps_to_train <= 0:
        return
    ck, _, steps = resumed
    stopped = _stopped_early(ck)
    if stopped is None:
        return
    at, planned_end, why = stopped
    yield Hit(_in_folder(ck, trainer_view.TRAINER_STATE),
              f"the run stopped itself early at global_step {at} of max_steps {planned_end} ({why}); the resume "
              f"resets the stop flag at train begin and trains past it: up to {steps.steps_to_train} more steps, to "
              f"max_steps {steps.max_steps}, unless an early-stopping callback stops it again at an evaluation")


def _rotation_order(version: str) -> str:
    """How ``version``'s checkpoint rotation orders `checkpoint-*` folders: ``"mtime"`` (>= 4.52 and 5.x, falling
    back to the step number when the newest and oldest folder are less than a second apart), ``"mtime-only"``
    (<= 4.37, no fallback) or ``"step"`` (4.38-4.51)."""
    from ckptdoctor.facts import version_tuple

    v = version_tuple(version)
    if v is None or v >= (4, 52):
        return "mtime"
    return "mtime-only" if v <= (4, 37) else "step"


@frozen
class Rotation:
    """What the resume's first save deletes with ``save_total_limit``, and the folders it keeps."""

    limit: int
    deleted: tuple[Checkpoint, ...]
    kept: tuple[Checkpoint, ...]


def next_rotation(ck: Checkpoint, tree: Tree, limit: int, order: str) -> Rotation | None:
    """The rotation after the resume's first save (a new `checkpoint-N`, the newest of all), as
    `trainer_utils.rotate_checkpoints` makes it: None when nothing is deleted or the ordering is by step."""
    run = next((r for r in tree.runs if any(c.path == ck.path for c in r.checkpoints)), None)
    if run is None or order == "step":
        return None
    prefix = "" if run.path in ("", ".") else run.path + "/"
    folders = [c for c in run.checkpoints if c.step is not None and c.path == prefix + c.path.rsplit("/", 1)[-1]]
    if len(folders) + 1 <= limit:
        return None
    by_time = sorted(folders, key=lambda c: (c.folder_mtime, c.path))
    if order == "mtime" and len({c.folder_mtime for c in folders}) == 1:
        # The fallback to step order needs the newest folder, the new save, within a second of the oldest: only a
        # filesystem that reports one fixed time for every folder gets there after the seconds a resume takes.
        by_time = sorted(folders, key=lambda c: (c.step or 0, c.path))
    ts = trainer_view.trainer_state(ck)
    best = ts.best_model_checkpoint.rstrip("/").rsplit("/", 1)[-1] if ts and ts.best_model_checkpoint else None
    protected = {c.path for c in folders if best is not None and c.path.rsplit("/", 1)[-1] == best}
    keep = max(limit, len(protected) + 1)  # + the new save, the most recent, always kept
    remaining, deleted = len(folders) + 1, []
    for c in by_time:
        if remaining <= keep:
            break
        if c.path not in protected:
            deleted.append(c)
            remaining -= 1
    if not deleted:
        return None
    return Rotation(limit, tuple(deleted), tuple(c for c in folders if c not in deleted))


@rule("CKD417", "rotation-deletes-newer-checkpoint", Severity.WARNING, gate_only=True)
def rotation_deletes_newer_checkpoint(ctx: ResumeContext) -> Iterator[Hit]:
    """The resume's first save will delete a checkpoint newer (by step) than one it keeps: rotation goes by mtime.

    ## What it does
    With the planned `save_total_limit` (`--save-total-limit`), else the one saved in the checkpoint's
    `training_args.bin`, plays the rotation that follows the
    resume's first save as the resuming transformers does it: the `checkpoint-*` folders of the run ordered by their
    own modification time (5.x and 4.52 on, unless the filesystem reports one time for every folder; 4.37 and
    older always; 4.38 to 4.51 order by step number and never trip), the new save and `best_model_checkpoint`
    protected, the oldest deleted down to the limit. Names the folders that would be deleted when one of them has
    a higher step than a folder that is kept.

    ## Why is this bad?
    A folder's time changes when it is copied without its times (`cp -r`, a restore from backup or object storage,
    `rsync` without `-t`) or touched. Such a folder counts as recent, so the rotation deletes the real newest
    checkpoints instead, including the one the resume started from, and keeps the stale copy. The deletion is
    `shutil.rmtree(..., ignore_errors=True)`: no message.

    ## Example
    `checkpoint-2` is restored from a backup next to `checkpoint-4`, with `save_total_limit=2`; the resume from
    `checkpoint-4` saves `checkpoint-6` and deletes `checkpoint-4`, keeping `checkpoint-2`.

    ## Fix safety
    No fix: restore the folders' times (`touch -d` to their `trainer_state.json`'s), move the stale copy out of the
    output directory, or raise `save_total_limit` for the resume.

    ## References
    huggingface/transformers#26961 ("Wrong checkpoint got deleted when use_mtime=True"),
    huggingface/transformers#37260 ("fix: use mtime by default in Trainer._rotate_checkpoints with automatic
    fallback"); `src/transformers/trainer_utils.py` `sort_checkpoints` and `rotate_checkpoints` (`use_mtime=True`,
    the one-second fallback), `src/transformers/trainer.py` `Trainer._save_checkpoint`.
    """
    resumed = _resumed(ctx)
    if resumed is None or resumed[2].steps_to_train <= 0:
        return
    ck, p, _ = resumed
    if trainer_view.is_mindnlp(ck):
        return  # MindNLP's Trainer rotates with its own code
    limit = ctx.plan.save_total_limit  # planned (--save-total-limit), else the arguments that saved the checkpoint
    if limit is None:
        limit = trainer_view.integer((trainer_view.training_args(ck) or {}).get("save_total_limit"))
    if limit is None or limit <= 0:
        return
    rot = next_rotation(ck, ctx.tree, limit, _rotation_order(p.settings.transformers_version))
    if rot is None:
        return
    kept_low = min((c.step for c in rot.kept if c.step is not None), default=None)
    newer = [c for c in rot.deleted if c.step is not None and kept_low is not None and c.step > kept_low]
    if not newer:
        return
    names = ", ".join(f"`{c.path}`" for c in rot.deleted)
    kept = ", ".join(f"`{c.path}`" for c in sorted(rot.kept, key=lambda c: c.step or 0))
    own = " (the checkpoint this resume starts from)" if any(c.path == ck.path for c in rot.deleted) else ""
    yield Hit(ck.path, f"with save_total_limit {limit}, the resume's first save deletes {names}{own} and keeps "
                       f"{kept}: transformers {p.settings.transformers_version} rotates by folder modification time, "
                       "and a lower-numbered folder was modified later (copied or touched)")


@rule("CKD418", "weights-only-load-refused", Severity.ERROR, gate_only=True)
def weights_only_load_refused(ctx: ResumeContext) -> Iterator[Hit]:
    """A file the planned resume loads names a pickle global that `torch.load(weights_only=True)` refuses.

    ## What it does
    For every file the resume reads with `torch.load(weights_only=True)` (a `.bin` weights file or adapter, the
    optimizer, scheduler and scaler states, the RNG state of each planned rank), compares the globals its pickle
    names with what that load admits: torch's weights-only allowlist, plus, for the RNG state only,
    transformers' `safe_globals()` (numpy's `_reconstruct` under the *resuming* numpy's module name, `numpy.ndarray`,
    `numpy.dtype`, `numpy.dtypes.UInt32DType`). The resuming numpy is the one planned (`--numpy-version`), else
    the one installed beside ckptdoctor (its metadata; numpy 2 when none is). This is a loadability verdict, not a
    security one: the file may be harmless (CKD6xx judge that) and still be refused. The gate's prediction says
    the resume raises at the first refused file (no steps are trained).

    ## Why is this bad?
    The resume raises `UnpicklingError: Weights only load failed ... Unsupported global: GLOBAL ...` before its
    first step, and no argument of the Trainer turns it off (transformers 5 passes `weights_only=True` itself;
    `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD` does not override an explicit argument). Two ways users meet it:
    `rng_state.pth` written under numpy 1.x names `numpy.core.multiarray._reconstruct`, which `safe_globals()`
    admits only under numpy 1.x (numpy 2 registers `numpy._core.multiarray._reconstruct`); and an LR schedule whose
    lambda returns numpy floats puts `numpy._core.multiarray.scalar` into `optimizer.pt` and `scheduler.pt`, which
    nothing admits.

    ## Example
    A run trained in an image with numpy 1.26, resumed after an upgrade to numpy 2: the RNG load raises on
    `numpy.core.multiarray._reconstruct`. A `LambdaLR(optimizer, lambda s: np.float64(...))` passed to the
    Trainer: the optimizer load raises on `numpy._core.multiarray.scalar`.

    ## Fix safety
    No automatic fix (rewriting a pickle means loading it). Resume under the numpy that wrote the RNG state, or
    delete `rng_state.pth` (the resume then only loses RNG reproducibility); for numpy scalars, make the lambda
    return a Python `float`, or load and re-save the file yourself if you trust it.

    ## References
    `torch/_weights_only_unpickler.py` `_get_allowed_globals` and `Unpickler.load` (the `Unsupported global`
    error); `src/transformers/trainer_pt_utils.py` `safe_globals`; `src/transformers/trainer.py`
    `Trainer._load_rng_state`, `Trainer._load_optimizer_and_scheduler`, `Trainer._load_scaler`,
    `Trainer._load_from_checkpoint`; modelscope/ms-swift#5070 ("恢复训练报错": `Unsupported global: GLOBAL
    numpy._core.multiarray._reconstruct` on resume), huggingface/transformers#37162 ("Fix load of rng state for
    resuming training from checkpoint"), deepmodeling/deepmd-kit#4147 (a numpy-float learning rate refused as
    `numpy.core.multiarray.scalar`).
    """
    p = ctx.prediction
    for r in p.refused if p is not None else ():
        more = f" (and {plural(len(r.refused) - 1, 'other')})" if len(r.refused) > 1 else ""
        admits = (f"neither torch's weights-only allowlist nor transformers' safe_globals() under numpy "
                  f"{r.numpy_major} admits" if r.rng else "torch's weights-only allowlist does not admit")
        yield Hit(r.file.path, f"{r.reader} loads `{r.name}` with weights_only=True and raises UnpicklingError: "
                               f"it names `{r.refused[0]}`{more}, which {admits}")


# The fields of `TrainerState` (`src/transformers/trainer_callback.py`), read from the releases: 4.40.2 has these;
# 4.41 adds `stateful_callbacks`; 4.50 adds `best_global_step` (4.41.0, 4.49.0, 4.50.0, 4.57.6 and 5.24.0 read).
# `TrainerState.load_from_json` is `cls(**json.loads(text))` in all of them: a key the resuming version lacks raises.
_STATE_FIELDS_440 = frozenset({
    "epoch", "global_step", "max_steps", "logging_steps", "eval_steps", "save_steps", "train_batch_size",
    "num_train_epochs", "num_input_tokens_seen", "total_flos", "log_history", "best_metric", "best_model_checkpoint",
    "is_local_process_zero", "is_world_process_zero", "is_hyper_param_search", "trial_name", "trial_params",
})
_STATE_ADDED = (((4, 41), "stateful_callbacks"), ((4, 50), "best_global_step"))
# From 4.49 (4.49.0, 4.50.0, 4.57.6, 5.24.0 read; 4.41.0 assigns without reading) `Trainer._save_checkpoint` reads
# `state.stateful_callbacks[name]` for `TrainerControl` and every stateful callback before it writes the state.
_SAVE_READS_CALLBACK_STATES = (4, 49)


def state_incompatibility(raw: dict[str, object], version: tuple[int, int]) -> tuple[list[str], bool]:
    """What ``version`` cannot take from a ``trainer_state.json`` body: the keys its ``TrainerState`` does not have
    (``load_from_json`` raises TypeError; only the keys added since 4.40 are judged below 4.40), and whether its first
    save raises ``KeyError: 'TrainerControl'`` (the state holds no saved ``TrainerControl``)."""
    known = set(_STATE_FIELDS_440) | {name for since, name in _STATE_ADDED if version >= since}
    if version < (4, 40):
        unknown = [name for _, name in _STATE_ADDED if name in raw]
    else:
        unknown = sorted(k for k in raw if k not in known)
    callbacks = raw.get("stateful_callbacks")
    control_missing = not isinstance(callbacks, dict) or "TrainerControl" not in callbacks
    return unknown, version >= _SAVE_READS_CALLBACK_STATES and control_missing


@rule("CKD419", "trainer-state-version-incompatible", Severity.ERROR, gate_only=True)
def trainer_state_version_incompatible(ctx: ResumeContext) -> Iterator[Hit]:
    """The checkpoint's `trainer_state.json` was written by a transformers the resuming version cannot read back.

    ## What it does
    Compares the keys of `trainer_state.json` with the fields of `TrainerState` in the transformers version the
    resume runs under (`--transformers-version`, else the installed one), from a table read from the releases
    (4.40 has none of `stateful_callbacks` and `best_global_step`; 4.41 adds the first, 4.50 the second), and
    checks whether the state holds the saved `TrainerControl` that the first save of 4.49 and later reads.

    ## Why is this bad?
    `TrainerState.load_from_json` builds the state with `TrainerState(**json)`: a key the resuming version does not
    know raises `TypeError: TrainerState.__init__() got an unexpected keyword argument 'best_global_step'` at the
    start of `train()` (a 4.50+ or 5.x state resumed by 4.40). The other way round is worse: a state written by 4.40
    has no `stateful_callbacks`, so 4.49 and later load it, train until the first save, and raise `KeyError:
    'TrainerControl'` in `Trainer._save_checkpoint` after the weights and optimizer are written and before the
    state is: the new checkpoint folder is torn, and the compute since the resume is lost.

    ## Example
    A run trained with transformers 4.40 in an old image, resumed after an upgrade to 5.x.

    ## Fix safety
    No automatic fix. For an older reader, remove the keys it does not know from a copy of `trainer_state.json`;
    for a 4.40 state resumed by 4.49 or later, add `"stateful_callbacks": {"TrainerControl": {"args":
    {"should_training_stop": false, "should_epoch_stop": false, "should_save": false, "should_evaluate": false,
    "should_log": false}, "attributes": {}}}`; or resume with the version that wrote it.

    ## References
    `src/transformers/trainer_callback.py` `TrainerState` (its fields) and `TrainerState.load_from_json`;
    `src/transformers/trainer.py` `Trainer._save_checkpoint` (the `stateful_callbacks[cb_name]` lookup) and
    `Trainer.train`; hiyouga/LlamaFactory#4406 ("TrainerState.__init__() got an unexpected keyword argument
    'stateful_callbacks'").
    """
    ck, p = ctx.checkpoint, ctx.prediction
    # a crash another rule names (CKD418, CKD421) comes after TrainerState.load_from_json: this one comes first
    if ck is None or p is None or (p.steps is None and p.crash_rule is None):
        return
    steps_to_train = p.steps.steps_to_train if p.steps is not None else 0
    ts = trainer_view.trainer_state(ck)
    from ckptdoctor.facts import version_tuple

    version = version_tuple(p.settings.transformers_version)
    if ts is None or version is None or trainer_view.is_mindnlp(ck):  # MindNLP's Trainer has its own state code
        return
    unknown, save_raises = state_incompatibility(ts.raw, version)
    where = _in_folder(ck, trainer_view.TRAINER_STATE)
    wrote = ts.raw.get("transformers_version") or trainer_view.json_value(ck.file("config.json"))
    by = f"written by transformers {wrote.get('transformers_version')}, " if isinstance(wrote, dict) and isinstance(
        wrote.get("transformers_version"), str) else ""
    tv = p.settings.transformers_version
    if unknown:
        yield Hit(where, f"{by}it holds {', '.join(f'`{k}`' for k in unknown)}, which transformers {tv}'s "
                         f"TrainerState does not have: train() raises TypeError (\"unexpected keyword argument "
                         f"'{unknown[0]}'\") at its start")
    elif save_raises and steps_to_train > 0:
        yield Hit(where, f"{by}it holds no saved `TrainerControl` in `stateful_callbacks`: transformers {tv} trains "
                         "until its first save, then raises KeyError: 'TrainerControl' in _save_checkpoint, leaving "
                         "that checkpoint without its trainer_state.json")


@rule("CKD421", "saved-key-layout-not-restored", Severity.ERROR, gate_only=True,
      severity_when=[(Severity.INFO, "a transform ckptdoctor does not model would rename saved keys: not checked")])
def saved_key_layout_not_restored(ctx: ResumeContext) -> Iterator[Hit]:
    """The resuming transformers builds the model in another key layout than the one the checkpoint was saved in:
    the resume restores only part of the weights (or, from an older release, crashes at the optimizer load).

    ## What it does
    Looks up the checkpoint's `config.json` `architectures` (else `model_type`) in a table generated from the
    transformers releases (`ckptdoctor/key_layouts.json`, written by `bench/make_key_layouts.py` from 4.40, 4.51,
    4.52, 4.57, 5.0 and 5.24; the nearest release at or below the resuming one is used): the vision-language
    classes of 4.52 to 4.57 whose `_checkpoint_conversion_mapping` `save_pretrained` reverses, and the conversion
    mappings of transformers 5 (mixture-of-experts models such as Mixtral, Qwen2-MoE, DeepSeek). It converts the
    keys of the weights file the resume loads as `from_pretrained` would, and counts the live model's tensors the
    file restores under their own name ("restores N of M tensors"). When the checkpoint was written by a release
    whose live layout was the saved one (`config.json` `transformers_version`, e.g. 4.57) and the conversion
    merges tensors, the restored `optimizer.pt` holds another parameter count than the resuming model has.

    The keys are converted as `core_model_loading.rename_source_key` does: every renaming in turn (a
    `PrefixChange`, which adds or removes a prefix, is one), then the first converter that matches; a converter that
    splits one saved tensor (`Chunk`: gte's `attention.qkv_proj` into `self_attn.q_proj`, `k_proj`, `v_proj`)
    counts every live tensor it makes. A transform that renames keys by code of its own (`GroupWeightRename`,
    `Inkling2IndexOffsetWeightRename`, `LayerPairCollapse`) is not modelled; the table records the regex a key must
    match for that code to change it, so the keys it leaves alone are still converted exactly. Where it would rename
    saved keys, the rule reports what is certain ("restores at most N of the file's M tensors, and at least K live
    tensors keep their initial values") when the other keys already show tensors missing, else says, at level
    info, that the layout was not checked and why, instead of staying silent.

    ## Why is this bad?
    `Trainer._load_from_checkpoint` loads the file with `model.load_state_dict(state_dict, strict=False)`: no key
    conversion runs. transformers 5 saves Mixtral with per-expert keys (`block_sparse_moe.experts.0.w1.weight`) and
    builds it with fused ones (`mlp.experts.gate_up_proj`): the router and the experts (6 of 21 tensors of a 2-layer
    model) keep their random initial values, and the only sign is a "missing keys" log line; the run trains on
    from noise in those layers while its step count and LR say it resumed. A Mixtral checkpoint written by 4.57
    resumed under 5.x goes further and raises `ValueError` at the optimizer load.

    ## Example
    `trainer.train(resume_from_checkpoint=True)` on a `MixtralForCausalLM` run under transformers 5.24: "restores
    15 of 21 tensors"; the same checkpoint loaded with `from_pretrained` is complete.

    ## Fix safety
    No fix. Resume under the release that matches the saved layout's live model (4.51 or earlier for the 4.52-4.57
    vision-language classes; a 4.x release for a 5.x mixture-of-experts checkpoint), or rebuild the model with
    `from_pretrained(checkpoint)` and start a new run from it (the optimizer state is lost).

    ## References
    huggingface/transformers#43701 and its pull request huggingface/transformers#44366 ("Fix resume_from_checkpoint
    key mismatch for models with _checkpoint_conversion_mapping": `Trainer._load_from_checkpoint` applies no
    conversion; closed unmerged at the time of writing);
    `src/transformers/conversion_mapping.py` `_build_checkpoint_conversion_mapping`,
    `src/transformers/core_model_loading.py` `rename_source_key`, `WeightTransform.rename_source_key`, `PrefixChange`,
    `WeightConverter.convert`, `revert_weight_conversion`, `src/transformers/modeling_utils.py`
    `PreTrainedModel.save_pretrained` (the reversed mapping; 4.52-4.57: `VLMS`, `_checkpoint_conversion_mapping`),
    `src/transformers/trainer.py` `Trainer._load_from_checkpoint`, `Trainer._load_optimizer_and_scheduler`.
    """
    ck, p = ctx.checkpoint, ctx.prediction
    layout = p.layout if p is not None else None
    if ck is None or p is None or layout is None:
        return
    tv = p.settings.transformers_version
    if layout.unmodelled and (not layout.missing or layout.release == ""):  # not a verdict: what was not checked
        yield Hit(_in_folder(ck, layout.file),
                  f"the saved key layout of `{layout.architecture}` was not checked against the one transformers {tv} "
                  f"builds: {', '.join(layout.unmodelled_by)} would rename {plural(layout.unmodelled, 'saved key')} "
                  "by code of its own that ckptdoctor does not model; whether the resume restores every tensor (and "
                  "the optimizer state's parameter count) is not known", severity=Severity.INFO)
        return
    if layout.unmodelled:  # what is known is enough: some live tensors no saved key names
        shown = ", ".join(f"`{k}`" for k in layout.missing[:3]) + (", ..." if len(layout.missing) > 3 else "")
        yield Hit(_in_folder(ck, layout.file),
                  f"transformers {tv} builds `{layout.architecture}` in another key layout than the one saved (table "
                  f"of transformers {layout.release}): the resume's load_state_dict(strict=False) restores at most "
                  f"{layout.restored + layout.unmodelled:,} of the file's {plural(layout.saved, 'tensor')}, and at "
                  f"least {plural(len(layout.missing), 'live tensor')} ({shown}) keep their initial values, with only "
                  f"a missing-keys log line ({', '.join(layout.unmodelled_by)} renames "
                  f"{plural(layout.unmodelled, 'other saved key')} by code ckptdoctor does not model)")
        return
    if layout.restored == layout.total:  # the keys load as saved; the optimizer state has another layout's count
        yield Hit(_in_folder(ck, layout.file), f"transformers {tv} builds `{layout.architecture}` with the saved "
                  f"keys, but {layout.optimizer_crash}")
        return
    missing = ", ".join(f"`{k}`" for k in layout.missing[:3]) + (", ..." if layout.total - layout.restored > 3 else "")
    tail = (f"; then {layout.optimizer_crash}" if layout.optimizer_crash is not None else
            ": those tensors keep their initial values, with only a missing-keys log line")
    yield Hit(_in_folder(ck, layout.file),
              f"transformers {tv} builds `{layout.architecture}` in another key layout than the one saved (table of "
              f"transformers {layout.release}): the resume's load_state_dict(strict=False) restores "
              f"{layout.restored:,} of {plural(layout.total, 'tensor')}, not {missing}{tail}")


@rule("CKD423", "deepspeed-lr-not-restored", Severity.WARNING, gate_only=True)
def deepspeed_lr_not_restored(ctx: ResumeContext) -> Iterator[Hit]:
    """A DeepSpeed resume does not restore the optimizer's learning rate: its first step runs at the restarted
    schedule's step-0 LR instead of the LR the run had reached.

    ## What it does
    Reads the ZeRO optimizer partition of the tag folder `latest` names (`zero_pp_rank_0_mp_rank_00_optim_states.pt`)
    and predicts the LR the first resumed step uses. A rigid state (DeepSpeed's default) holds the base optimizer's
    whole `state_dict`, param groups included, and `engine.load_checkpoint` restores its LR. An elastic one (ZeRO
    stage 1 or 2 with `"elastic_checkpoint": true`) holds per-parameter tensors only: DeepSpeed restores those and
    the step, never the param groups, so the LR stays where the freshly built schedule put it at its step 0 (0 with a
    warm-up, the full base LR without one). The schedule's own state (`scheduler.pt`, or the engine's
    `lr_scheduler` when the DeepSpeed config names an optimizer) is restored, and takes over from the second step.

    ## Why is this bad?
    The first resumed step runs at another LR than the uninterrupted run: the full base LR after a decay is a jump
    that can spike the loss; LR 0 is a lost step. Nothing is logged.

    ## Example
    ZeRO-2 with `"elastic_checkpoint": true` and DeepSpeed's Adam, a linear schedule without warm-up at LR 5e-4 at
    step 500 of 1000: the first resumed step runs at 1e-3.

    ## Fix safety
    No fix. Save rigid checkpoints (the default) when the run may resume on the same number of ranks.

    ## References
    `deepspeed/runtime/zero/stage_1_and_2.py` `DeepSpeedZeroOptimizer.state_dict` (elastic: `_get_base_optimizer_state`,
    no param groups) and `_load_legacy_checkpoint` / `_restore_base_optimizer_state` (restores `state` and `step`
    only); `deepspeed/runtime/engine.py` `DeepSpeedEngine.load_checkpoint`; `src/transformers/integrations/deepspeed.py`
    `deepspeed_load_checkpoint`; huggingface/transformers#27710 ("Resume training with deepspeed resets learning
    rate").
    """
    resumed = _resumed(ctx)
    if resumed is None:
        return
    ck, p, _ = resumed
    if p.lr_not_restored is None or not p.lrs:
        return
    saved = "" if p.saved_lr is None else f", not at {p.saved_lr:.4g} (the LR the run had reached)"
    if p.saved_lr is not None and math.isclose(p.lrs[0], p.saved_lr, rel_tol=LR_RTOL, abs_tol=0.0):
        return  # the fresh schedule happens to start where the run was (a constant schedule)
    yield Hit(ck.path, f"{p.lr_not_restored}: the first resumed optimizer step (step {(p.start or 0) + 1}) runs at "
              f"{p.lrs[0]:.4g}, the restarted schedule's step-0 LR{saved}")


# ---------------------------------------------------------------------------------------------------------------
# PyTorch Lightning: a planned `fit(ckpt_path=...)` (``stacks.lightning.LightningPrediction``);
# ``resume_gate.lightning``
# runs these, and they say nothing about the Trainer's resume context (``ResumeContext``).


def _prediction(ctx: object) -> LightningPrediction | None:
    from ckptdoctor.stacks.lightning import LightningPrediction

    return ctx if isinstance(ctx, LightningPrediction) else None


@rule("CKD445", "lightning-resume-raises", Severity.ERROR, gate_only=True)
def lightning_resume_raises(ctx: object) -> Iterator[Hit]:
    """The planned `Trainer.fit(ckpt_path=...)` raises before its first step.

    ## What it does
    Follows Lightning's resume for the planned `ckpt_path`, `max_epochs` and `max_steps` (`ckptdoctor gate RUN
    --ckpt-path ... --max-epochs ...`) and names the exception it meets: `KeyError` for a weights-only checkpoint,
    `ValueError` from a `OneCycleLR` asked to step past its `total_steps` (a finished run resumed with more epochs),
    `MisconfigurationException` for a checkpoint's epoch above `max_epochs`, `ValueError` for `ckpt_path="best"` in a
    new Trainer, `FileNotFoundError` for a path that is not there.

    A checkpoint keeps each scheduler's `state_dict()` but not the `interval` it was stepped at, so the scheduler's
    own count tells it: `last_epoch` equal to the optimizer steps the loops count is `interval="step"` (the resume
    steps it once per optimizer step), equal to the epochs done is `interval="epoch"` (once per epoch the resume
    finishes). When it matches neither (a `frequency` above 1), only a schedule already used up is reported.

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
    `restore_loops`, `restore_optimizers_and_schedulers`, `dump_checkpoint` (`lr_schedulers`);
    `src/lightning/pytorch/loops/training_epoch_loop.py` `_TrainingEpochLoop._update_learning_rates`;
    `torch/optim/lr_scheduler.py` `OneCycleLR.get_lr`.
    """
    p = _prediction(ctx)
    if p is not None and p.raises is not None:
        yield Hit(p.loaded.path if p.loaded is not None else ".", p.raises)


@rule("CKD446", "lightning-resume-from-scratch", Severity.ERROR, gate_only=True)
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


@rule("CKD449", "lightning-resume-undetermined", Severity.ERROR, gate_only=True)
def lightning_resume_undetermined(ctx: object) -> Iterator[Hit]:
    """The planned `fit(ckpt_path="last")` may load one of several files that resume differently.

    ## What it does
    Where `fit(ckpt_path="last")` looks, finds the `last*.ckpt` files that share the newest modification time (the
    scan's CKD448), predicts the planned resume from each, and fails when they differ: in the step the fit starts
    at, the steps it trains, or whether it raises. The finding names each candidate and what it would do. Tied
    files that resume alike (one step, one outcome) leave the prediction standing: whichever loads, the run
    continues the same way.

    ## Why is this bad?
    `_CheckpointConnector._parse_ckpt_path` collects the candidates in a set, maps each to its modification time and
    takes the `max`: among equal times the first one met wins, and a set of strings is ordered by hashes that
    Python seeds anew in every process. No one prediction can be made, and the job may continue from a state other
    than the one you meant, or from different states on a retry.

    ## Example
    `last.ckpt` (step 10, an earlier fit) and `last-v1.ckpt` (step 4, a later fit) unpacked from one archive with
    the same time: resumed with `max_epochs=6`, Lightning 2.6.6 started at step 10 under one `PYTHONHASHSEED` and at
    step 4 under another.

    ## Fix safety
    No automatic fix. Pass the file to resume (`--ckpt-path`, `fit(ckpt_path=...)`), or remove the `last*.ckpt` you
    do not want (or `touch` the one you do) so that "last" is one file.

    ## References
    `src/lightning/pytorch/trainer/connectors/checkpoint_connector.py` `_CheckpointConnector._parse_ckpt_path`;
    `src/lightning/pytorch/callbacks/model_checkpoint.py` `ModelCheckpoint._find_last_checkpoints`.
    """
    p = _prediction(ctx)
    if p is None or not p.candidates:
        return
    each = " or ".join(_candidate(c) for c in p.candidates)
    yield Hit(p.looks_in or ".", f'`fit(ckpt_path="last")` may load {each}: they share one modification time, and '
                                 "`_CheckpointConnector._parse_ckpt_path` takes whichever its set of candidates "
                                 "yields first, which changes with each process's hash seed; pass the file to "
                                 "resume as `ckpt_path`")


def _candidate(p: LightningPrediction) -> str:
    """One tied file and what the planned resume from it does (``CKD449``)."""
    name = "?" if p.loaded is None else p.loaded.name
    if p.raises is not None:
        return f"`{name}` (the fit raises: {p.raises})"
    start = "an unknown step" if p.start_step is None else f"step {p.start_step}"
    trains = "" if p.steps_to_train is None else f", trains {p.steps_to_train} steps"
    return f"`{name}` (resumes at {start}{trains})"
