"""Gate-only rules: hazards of one planned resume, emitted by ``ckptdoctor gate`` (``ckptdoctor.gate``).

They need what the user plans (epochs, learning rate, world size), which a scan does not know, so ``scan`` never runs
them; they are registered here so ``rules``, ``explain``, the README catalog and SARIF output document them.
"""

from __future__ import annotations

from collections.abc import Iterator

from ckptdoctor.findings import Severity
from ckptdoctor.model import Tree
from ckptdoctor.rules import Hit, rule


@rule("CKD407", "resume-trains-zero-steps", Severity.ERROR, gate_only=True)
def resume_trains_zero_steps(tree: Tree) -> Iterator[Hit]:
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
    yield from ()


@rule("CKD408", "resume-restarts-schedule", Severity.ERROR, gate_only=True)
def resume_restarts_schedule(tree: Tree) -> Iterator[Hit]:
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
    `src/transformers/trainer.py` `_load_optimizer_and_scheduler`, `create_scheduler`; ANATOMY §2.4, §2.6.
    """
    yield from ()


@rule("CKD409", "planned-lr-ignored", Severity.ERROR, gate_only=True)
def planned_lr_ignored(tree: Tree) -> Iterator[Hit]:
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
    `torch/optim/lr_scheduler.py` `LambdaLR.load_state_dict`; `Trainer._load_optimizer_and_scheduler`; ANATOMY §2.6.
    """
    yield from ()


@rule("CKD410", "resume-first-step-lr-zero", Severity.WARNING, gate_only=True)
def resume_first_step_lr_zero(tree: Tree) -> Iterator[Hit]:
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
    `Trainer._load_optimizer_and_scheduler`; `src/transformers/optimization.py`; ANATOMY §2.6.
    """
    yield from ()


@rule("CKD411", "resume-lr-jump", Severity.WARNING, gate_only=True)
def resume_lr_jump(tree: Tree) -> Iterator[Hit]:
    """The resumed learning rate jumps well above the last LR the run used.

    ## What it does
    Compares the predicted LRs of the first resumed steps with the last `learning_rate` logged before the
    checkpoint, when the run had finished its warm-up. A rise of more than 25% is reported.

    ## Why is this bad?
    A new `max_steps` (more epochs) rebuilds the schedule mid-way along a longer decay, and a restarted schedule
    starts from the full base LR: either way the LR goes back up after it had decayed, which can undo training
    (loss spikes, forgetting).

    ## Example
    A linear schedule at 1.25e-4 at its last step, resumed with 50% more epochs: the second resumed step runs at
    2.5e-4.

    ## Fix safety
    No fix: plan the new schedule on purpose, or resume with the run's own settings.

    ## References
    `Trainer.create_scheduler`, `LambdaLR.get_lr`; ANATOMY §2.6.
    """
    yield from ()


@rule("CKD412", "lr-schedule-unpredictable", Severity.WARNING, gate_only=True)
def lr_schedule_unpredictable(tree: Tree) -> Iterator[Hit]:
    """The gate cannot predict the learning rates of the resume.

    ## What it does
    Reports why the LR sequence is missing: a metric-driven schedule (`reduce_lr_on_plateau`, `greedy`), or an
    optimizer / scheduler state whose LRs could not be read.

    ## Why is this bad?
    The rest of the prediction stands, but nothing checked the LRs the resume will use.

    ## Example
    `lr_scheduler_type="reduce_lr_on_plateau"`: the LR changes with evaluation results.

    ## Fix safety
    No fix.

    ## References
    `src/transformers/optimization.py` `get_scheduler`.
    """
    yield from ()


@rule("CKD413", "resume-will-fail", Severity.ERROR, gate_only=True)
def resume_will_fail(tree: Tree) -> Iterator[Hit]:
    """The planned resume raises before training: no checkpoint, no state, no weights, a damaged file it loads, or
    an impossible schedule.

    ## What it does
    Follows `Trainer.train`'s resume path and names the exception it would raise: `get_last_checkpoint` finds no
    `checkpoint-N` folder; `trainer_state.json` is missing, invalid or has a null `train_batch_size`;
    `_load_from_checkpoint` finds no weights; a file the resume loads is cut short or broken (`config.json`, the
    weights or a shard, `optimizer.pt` and `scheduler.pt` when both are restored, `scaler.pt`, each rank's
    `rng_state`: `OSError`, `RuntimeError`, `SafetensorError`, `JSONDecodeError`, as measured with transformers
    5.23); DeepSpeed finds no `scheduler.pt`; `get_scheduler` rejects the planned schedule.

    ## Why is this bad?
    The job fails after it got its allocation, often on every rank, with an error that rarely says what to do.

    ## Example
    `checkpoint-1500/` from a preempted save, without `trainer_state.json`: `FileNotFoundError`.

    ## Fix safety
    No fix here; `ckptdoctor scan` and `ckptdoctor fix` handle most causes (quarantining a torn checkpoint).

    ## References
    `src/transformers/trainer.py` `train`, `_load_from_checkpoint`, `_load_optimizer_and_scheduler`;
    `trainer_utils.get_last_checkpoint`; `optimization.get_scheduler`.
    """
    yield from ()


@rule("CKD504", "world-size-mismatch", Severity.ERROR, gate_only=True)
def world_size_mismatch(tree: Tree) -> Iterator[Hit]:
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
    yield from ()
