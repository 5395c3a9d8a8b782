"""Training-state rules: trainer_state.json, optimizer and scheduler, RNG, and the LR history."""

from __future__ import annotations

import itertools
import posixpath
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from ckptdoctor import key_layouts, trainer_view
from ckptdoctor.facts import (
    SiblingRuns,
    plural,
    run_history,
    same_history,
    saved_shard_tensors,
    saved_world_size,
)
from ckptdoctor.findings import Applicability, FixOp, FixPlan, OpKind, Severity
from ckptdoctor.gaps import listed, missing_below
from ckptdoctor.model import (
    Checkpoint,
    FileFacts,
    FileKind,
    FolderRole,
    JsonFacts,
    ProblemKind,
    Run,
    RunHistory,
    Stack,
    TensorInfo,
    Tree,
)
from ckptdoctor.rules import Hit, rule
from ckptdoctor.stacks import accelerate, lightning

# Fields transformers' TrainerState needs to resume (missing ones fall back to defaults that break the resume).
REQUIRED_STATE_FIELDS = ("global_step", "max_steps", "log_history")


def _checkpoints(tree: Tree) -> Iterator[tuple[Checkpoint, bool]]:
    for run in tree.runs:
        for ck in run.checkpoints:
            if ck.role in (FolderRole.CHECKPOINT, FolderRole.MODEL):
                yield ck, run.resume_pick == ck.path or run.standalone


def _path_of(f: FileFacts | None) -> str | None:
    """A file's path for ``Hit.file`` (None when it is not there)."""
    return None if f is None else f.path


@rule("CKD401", "lr-schedule-finished", Severity.INFO, superseded_by_gate=True)
def lr_schedule_finished(tree: Tree) -> Iterator[Hit]:
    """The checkpoint ends a finished schedule: `global_step >= max_steps` and the stored LR is 0.

    ## What it does
    Reads `global_step` / `max_steps` from `trainer_state.json` and the LR stored in `scheduler.pt` /
    `optimizer.pt`.

    ## Why is this bad?
    Resuming with the same arguments trains nothing, silently. With more epochs, the first resumed step runs at
    LR 0 (restored from the optimizer) and the schedule then continues mid-way along a *new* decay, not from the
    start. A fresh Trainer on these weights instead jumps back to the initial LR. Each is a surprise if unplanned.

    ## Example
    The last `checkpoint-N` of every finished run with the default linear schedule.

    ## Fix safety
    No fix: this is information. Use `ckptdoctor gate` to see the LRs a planned resume would use.

    ## References
    `src/transformers/optimization.py` `get_linear_schedule_with_warmup`, `get_cosine_schedule_with_warmup` (end at
    0); `src/transformers/trainer.py` `Trainer._load_optimizer_and_scheduler`, `Trainer.create_scheduler`;
    `torch/optim/lr_scheduler.py` `LRScheduler.load_state_dict`.
    """
    for ck, _ in _checkpoints(tree):
        ts = trainer_view.trainer_state(ck)
        if ts is None or ts.global_step is None or not ts.max_steps or ts.global_step < ts.max_steps:
            continue
        lr = trainer_view.checkpoint_lr(ck)
        if lr == 0.0:
            yield Hit(
                ck.path,
                f"schedule finished: global_step {ts.global_step} of max_steps {ts.max_steps} with LR 0; resuming with "
                "the same arguments trains nothing, with more epochs the first step runs at LR 0",
                file=_path_of(ck.file(trainer_view.TRAINER_STATE)),
            )


@rule("CKD402", "trainer-state-invalid", Severity.ERROR)
def trainer_state_invalid(tree: Tree) -> Iterator[Hit]:
    """`trainer_state.json` is not valid JSON, or lacks fields a resume needs.

    ## What it does
    Parses `trainer_state.json` strictly (duplicate keys rejected) and checks `global_step`, `max_steps` and
    `log_history` are present with the right types, and `train_batch_size` is not null.

    ## Why is this bad?
    `train()` loads the file unconditionally: invalid JSON raises `JSONDecodeError`; a null `train_batch_size` raises
    `TypeError` in `compare_trainer_and_checkpoint_args`; a missing `global_step` silently restarts at step 0.

    ## Example
    A state file cut off by a crash (it is written in place with `open(..., "w")`).

    ## Fix safety
    No automatic fix: restore it from a copy, or quarantine the checkpoint and resume from the previous one.

    ## References
    `src/transformers/trainer_callback.py` `TrainerState.load_from_json`;
    `trainer_utils.compare_trainer_and_checkpoint_args`.
    """
    for ck, _ in _checkpoints(tree):
        f = ck.file(trainer_view.TRAINER_STATE)
        if f is None:
            continue
        if not isinstance(f.content, JsonFacts):
            if any(p.kind is ProblemKind.LIMIT for p in f.problems):
                continue  # not read, so not judged: CKD001 says so (a file over the size limit is not invalid)
            reasons = [p.message for p in f.problems] or ["it is empty" if f.kind == FileKind.EMPTY else "unreadable"]
            yield Hit(f.path, "not valid JSON: " + "; ".join(reasons))
            continue
        value = f.content.value
        if not isinstance(value, dict):
            yield Hit(f.path, "is not a JSON object")
            continue
        problems = [f"no `{k}`" for k in REQUIRED_STATE_FIELDS if k not in value]
        for key in ("global_step", "max_steps"):
            v = value.get(key)
            if key in value and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                problems.append(f"`{key}` is {v!r}, not a non-negative integer")
        if "log_history" in value and not isinstance(value.get("log_history"), list):
            problems.append("`log_history` is not a list")
        if "train_batch_size" in value and value["train_batch_size"] is None:
            problems.append("`train_batch_size` is null (transformers >= 4.40 raises TypeError on resume)")
        if problems:
            yield Hit(f.path, "; ".join(problems))


@rule("CKD403", "optimizer-state-incomplete", Severity.WARNING)
def optimizer_state_incomplete(tree: Tree) -> Iterator[Hit]:
    """Only one of the optimizer and scheduler files exists, so a resume silently restores neither.

    ## What it does
    Checks that optimizer state (`optimizer.pt`, `optimizer.bin` or an `optimizer*` folder) and `scheduler.pt` are
    both present or both absent; in a MindNLP checkpoint, `optimizer.ckpt` and `scheduler.json`.

    In a DeepSpeed checkpoint the engine saves the optimizer state (`global_stepN/`), and `scheduler.pt` is the
    Trainer's when the run's DeepSpeed config names neither an `"optimizer"` nor a `"scheduler"`: without it there
    the resume does not skip but raises `FileNotFoundError`. With either in the config, the engine saves and
    restores the schedule itself and no `scheduler.pt` is written.

    ## Why is this bad?
    `Trainer._load_optimizer_and_scheduler` restores them only when both exist, and otherwise skips both without a
    log line: fresh Adam moments and a schedule restarted at step 0 (warm-up again) while `global_step` continues.

    ## Example
    `scheduler.pt` removed by a cleanup script that kept `optimizer.pt`.

    ## Fix safety
    No automatic fix: restore the missing file, or accept a restarted schedule knowingly.

    ## References
    `src/transformers/trainer.py` `Trainer._load_optimizer_and_scheduler` (loads both only when the optimizer
    state and `scheduler.pt` both exist, else skips both without a log line; under DeepSpeed it loads
    `scheduler.pt` unless the scheduler is accelerate's `DeepSpeedSchedulerWrapper`), `_save_optimizer_and_scheduler`;
    `src/transformers/integrations/deepspeed.py` `deepspeed_optim_sched`. MindNLP 0.4:
    `mindnlp/engine/trainer/base.py` `Trainer._load_optimizer_and_scheduler` (the same both-or-neither test).
    """
    for ck, _ in _checkpoints(tree):
        if ck.file(trainer_view.TRAINER_STATE) is None:
            continue
        if trainer_view.is_deepspeed(ck):
            ds = trainer_view.deepspeed_view(ck)
            if ds is not None and ds.engine_scheduler is False and ck.file(trainer_view.SCHEDULER) is None:
                yield Hit(ck.path, f"DeepSpeed state in `{ds.tag}/` but no `scheduler.pt`, which its DeepSpeed "
                          "config leaves to the Trainer (no \"optimizer\" or \"scheduler\" in it): a resume raises "
                          "FileNotFoundError in _load_optimizer_and_scheduler")
            continue
        opt, sched = trainer_view.has_optimizer_state(ck), trainer_view.scheduler_file(ck) is not None
        if opt != sched:
            sched_name = f"`{trainer_view.MS_SCHEDULER if trainer_view.is_mindnlp(ck) else trainer_view.SCHEDULER}`"
            opt_name = f"`{trainer_view.MS_OPTIMIZER}`" if trainer_view.is_mindnlp(ck) else "optimizer state"
            have, missing = (opt_name, sched_name) if opt else (sched_name, opt_name)
            yield Hit(ck.path, f"has {have} but no {missing}: a resume restores neither and restarts the LR schedule")


@rule("CKD404", "rng-state-missing", Severity.INFO)
def rng_state_missing(tree: Tree) -> Iterator[Hit]:
    """No RNG state, or fewer per-rank RNG files than the ranks that saved the checkpoint.

    ## What it does
    Looks for `rng_state.pth` (one process) or `rng_state_{rank}.pth` (one per rank) in checkpoints that hold
    optimizer state (a `save_only_model` checkpoint never has RNG files). MindNLP checkpoints are skipped: its
    Trainer neither saves nor loads RNG state (`_load_rng_state` calls are commented out in its `train` loop).

    ## Why is this bad?
    The resume logs one INFO line and goes on with fresh random state: dropout masks and data order differ from the
    uninterrupted run, so the resumed losses are not reproducible.

    ## Example
    A 4-rank FSDP checkpoint holding `rng_state_0.pth` to `rng_state_2.pth` only.

    ## Fix safety
    No fix: the state is gone; resume works, just not bit-for-bit.

    ## References
    `src/transformers/trainer.py` `_load_rng_state`.
    """
    for ck, _ in _checkpoints(tree):
        if not (trainer_view.has_optimizer_state(ck) or trainer_view.is_deepspeed(ck) or trainer_view.is_fsdp(ck)):
            continue
        if ck.file(trainer_view.TRAINER_STATE) is None or trainer_view.is_mindnlp(ck):
            continue  # a torn save: CKD102 says more; MindNLP has no RNG file to miss
        rng = trainer_view.RNG_RE
        ranks = {int(m.group(1) or 0) for name, _ in ck.top_files() if (m := rng.match(name))}
        world = saved_world_size(ck)
        if not ranks:
            yield Hit(ck.path, "no `rng_state*.pth`: a resume continues with fresh random state")
        elif world is not None and world > 1:
            count, missing = missing_below(world, ranks)  # counted: `world` comes from a file name
            if count:
                names = listed(count, missing, lambda r: f"`rng_state_{r}.pth`")
                yield Hit(ck.path, f"saved by {world} ranks but {names} {'is' if count == 1 else 'are'} missing")


def _trainable_tensors(ck: Checkpoint) -> tuple[str, tuple[TensorInfo, ...]] | None:
    """The tensors a resume would train: the root adapter's, else the full weights' (one file, or what the shards
    hold by their own headers).

    With adapter files present the optimizer belongs to the adapter even when a stub shadows it (CKD201 reports
    the stub), so the adapter is what the optimizer is compared with.
    """
    branch = "adapter" if trainer_view.has_adapter(ck) else trainer_view.weights_branch(ck)
    if branch == "sharded":
        # The shards' headers, not the index: an index that drops a shard makes the resume keep those tensors
        # fresh (CKD205), while the optimizer still matches the model the shards were saved from.
        sharded = saved_shard_tensors(ck)
        return None if sharded is None else ("full", sharded)
    if branch == "adapter":
        f = ck.file(trainer_view.ADAPTER_SAFE) or ck.file(trainer_view.ADAPTER_BIN)
    elif branch == "full":
        f = trainer_view.loaded_weight_file(ck)
    else:
        return None
    ts = trainer_view.tensors_of(f)
    if f is None or ts is None:
        return None
    return branch, ts


def _shape_list(shapes: Counter[tuple[int, ...]]) -> str:
    return ", ".join(f"{list(shape)} x{n}" for shape, n in sorted(shapes.items())[:3])


def _in_checkpoint_mismatch(ck: Checkpoint) -> str | None:
    """The optimizer's parameter count or state shapes against the trainable tensors of the same checkpoint.

    The optimizer was built on the live model of the transformers that wrote the checkpoint; where that release
    saves another key layout than it trains (5.x mixture-of-experts: per-expert tensors saved, fused ones live), the
    weights are compared in the live layout: its tensor count, and the shapes of the tensors it only renames or
    leaves alone; the fused ones count as any shape (the table does not say how a merge reshapes). The layout is
    looked up only when the saved tensors disagree: a clean checkpoint of any other model never loads the table.
    """
    trainable = _trainable_tensors(ck)
    if trainable is None:
        return None  # nothing to compare with: the optimizer state (costly to build) is not needed
    opt = trainer_view.optimizer_state(ck)
    if opt is None or not opt.groups:
        return None
    branch, tensors = trainable
    if _all_empty(tensors):
        return None  # no tensors, or only empty (ZeRO-3 style) ones: CKD210 reports it, and nothing is left to compare
    problem = _optimizer_against(opt, branch, tensors, None)
    layout = key_layouts.written_layout(ck, [t.name for t in tensors]) if problem and branch == "full" else None
    return problem if layout is None else _optimizer_against(opt, branch, tensors, layout)


@trainer_view.per_object
def _all_empty(tensors: tuple[TensorInfo, ...]) -> bool:
    """Whether every tensor is empty (or there are none): by the tuple's identity, which a run's alike checkpoints
    share (the shards' headers, ``saved_shard_tensors``)."""
    return all(0 in t.shape for t in tensors)


def _optimizer_against(opt: trainer_view.OptimizerView, branch: str, tensors: tuple[TensorInfo, ...],
                       layout: key_layouts.Conversion | None) -> str | None:
    """What disagrees between the optimizer state and ``tensors`` (seen in the writer's live ``layout``, if any)."""
    live_count = layout.live_count if layout is not None else len(tensors)
    problems: list[str] = []
    count = opt.param_count
    if branch == "adapter" and count != len(tensors):
        problems.append(
            f"the optimizer holds {plural(count, 'parameter')} but the adapter {plural(len(tensors), 'tensor')}"
        )
    elif branch == "full" and count > live_count:
        problems.append(
            f"the optimizer holds {plural(count, 'parameter')} but the weights only {plural(live_count, 'tensor')}"
            + (f" (in the layout transformers {layout.release} trains `{layout.model}` in)" if layout else "")
        )
    # the state shapes and the tensors are often the very objects of the run's previous checkpoint (the readers and
    # the verdict cache share alike values): compared once
    shapes = _shapes_against((opt.state_shapes, branch, tensors, layout))
    if shapes is not None:
        problems.append(shapes)
    return "; ".join(problems) or None


@trainer_view.per_parts
def _shapes_against(parts: tuple[Any, ...]) -> str | None:
    """The optimizer states (``exp_avg`` shapes) no trainable tensor has the shape of, in ``_optimizer_against``'s
    words; ``parts``: the optimizer view's state shapes, the branch, the tensors and the live layout (or None)."""
    state_by_param, branch, tensors, layout = parts
    fused = frozenset(layout.fused) if layout is not None else frozenset()
    state_shapes = Counter(s["exp_avg"] for s in state_by_param.values() if "exp_avg" in s)
    available = Counter(t.shape for t in tensors if t.name not in fused)
    extra = state_shapes - available
    n_extra = sum(extra.values())
    unshaped = layout.fused_live if layout is not None else 0
    if n_extra <= unshaped:
        return None
    unmatched = available - state_shapes
    where = "the adapter has" if branch == "adapter" else "the weights have"
    fused_note = "" if layout is None else (
        f", more than the {plural(unshaped, 'tensor')} transformers {layout.release} fuses from "
        f"{plural(len(fused), 'saved one')} for `{layout.model}` (their live shapes are not compared)")
    return (
        f"{plural(n_extra, 'optimizer state')} {'has a shape' if n_extra == 1 else 'have shapes'} no trainable "
        f"tensor has ({_shape_list(extra)}){fused_note}"
        + (f"; {where} {_shape_list(unmatched)} instead" if unmatched else "")
    )


def _lora_layout(ck: Checkpoint) -> tuple[str, int | None] | None:
    """The root adapter's ``target_modules`` (as sorted text) and ``r``: what its optimizer state was built for."""
    f = ck.file(trainer_view.ADAPTER_CONFIG)
    cfg = f.content.value if f is not None and isinstance(f.content, JsonFacts) else None
    if not isinstance(cfg, dict) or "target_modules" not in cfg:
        return None
    tm = cfg["target_modules"]
    modules = ", ".join(sorted(str(m) for m in tm)) if isinstance(tm, list) else repr(tm)
    r = cfg.get("r")
    return f"[{modules}]", r if isinstance(r, int) and not isinstance(r, bool) else None


def _adapter_tensors(ck: Checkpoint) -> frozenset[tuple[str, tuple[int, ...]]] | None:
    ts = trainer_view.tensors_of(ck.file(trainer_view.ADAPTER_SAFE) or ck.file(trainer_view.ADAPTER_BIN))
    return None if ts is None else frozenset((t.name, t.shape) for t in ts)


def _resumed_with_other_adapter(run: Run) -> Iterator[Hit]:
    """Consecutive checkpoints of one run whose LoRA layout changed: a resume loaded Adam state of other modules.

    The shapes can agree (``q_proj,v_proj`` -> ``k_proj,v_proj``), so no single checkpoint shows the mismatch; the
    evidence is two checkpoints whose log_history tells one story but whose adapters differ.
    """
    cks = sorted(
        (c for c in run.checkpoints if c.role == FolderRole.CHECKPOINT and c.step is not None),
        key=lambda c: c.step or 0,
    )
    for older, newer in itertools.pairwise(cks):
        a, b = _lora_layout(older), _lora_layout(newer)
        ts_a, ts_b = trainer_view.trainer_state(older), trainer_view.trainer_state(newer)
        if a is None or b is None or a == b or ts_a is None or ts_b is None:
            continue
        if not (trainer_view.has_optimizer_state(older) and trainer_view.scheduler_file(older) is not None):
            continue  # the Trainer restores the optimizer only when both files exist
        if _adapter_tensors(older) == _adapter_tensors(newer) or _in_checkpoint_mismatch(newer) is not None:
            continue  # same tensors under another config (CKD302), or a copied adapter (reported in-checkpoint)
        if not same_history(ts_a, ts_b):
            continue  # another run in the same output_dir (CKD101's concern), not a resume of this one
        (mods_a, r_a), (mods_b, r_b) = a, b
        yield Hit(
            newer.path,
            f"resumed from `{older.path}` with another adapter: its optimizer state was saved for target_modules "
            f"{mods_a} (r={r_a}) but `{newer.path}` trains {mods_b} (r={r_b}), and log_history continues the same "
            "run, so the restored Adam moments were applied to other parameters",
            file=_path_of(trainer_view.optimizer_file(newer)),
        )


@rule("CKD405", "optimizer-param-mismatch", Severity.ERROR)
def optimizer_param_mismatch(tree: Tree) -> Iterator[Hit]:
    """The optimizer state's parameters disagree with the trainable tensors the checkpoint holds.

    ## What it does
    Compares `optimizer.pt`'s (MindNLP: `optimizer.ckpt`'s) parameter count and per-parameter state shapes
    (`exp_avg`) with the adapter tensors (LoRA) or the full weights. Across the checkpoints of one run, it also
    reports a checkpoint whose adapter (`target_modules` or `r` in `adapter_config.json`) differs from the previous
    checkpoint's while their `log_history` tells one story: the run was resumed with another adapter, from
    optimizer state built for the old one.

    The optimizer was built on the live model of the transformers that wrote the checkpoint (`config.json`
    `transformers_version`), which is not always the layout the weights were saved in: transformers 5 trains a
    mixture-of-experts model such as Mixtral with fused experts (`mlp.experts.gate_up_proj`, one tensor per layer)
    but saves them per expert (`block_sparse_moe.experts.0.w1.weight`, ...). For such a model the weights are
    compared in the writer's live layout, from the same table CKD421 uses (`ckptdoctor/key_layouts.json`): the
    parameter count against the live model's tensor count, and the state shapes against the tensors the conversion
    leaves alone or only renames. The fused tensors' live shapes are not compared (the table names the tensors a
    merge makes, not how it reshapes them): states up to their number may have any shape. A clean checkpoint of
    such a model is therefore silent here; whether a resume restores it is CKD421's question (`ckptdoctor gate`).

    ## Why is this bad?
    `Optimizer.load_state_dict` checks only group sizes. When LoRA target modules change between save and resume,
    the overlapping tensors load and the old Adam moments are applied to other parameters; fused AdamW does not
    even check shapes (observed silent stepping, then heap corruption).

    ## Example
    Resuming a run after replacing `q_proj` with `k_proj` in `target_modules`: the shapes agree, so `k_proj`
    silently gets `q_proj`'s Adam moments; or an `r=4` adapter copied over an `r=2` one next to the `r=2` run's
    `optimizer.pt`; or a Mixtral checkpoint holding the `optimizer.pt` of a run with another hidden size or number
    of experts (the attention or router shapes differ, whatever the fused experts hold).

    ## Fix safety
    No automatic fix: resume without optimizer state knowingly, or restore the original adapter config.

    ## References
    `torch/optim/optimizer.py` `Optimizer.load_state_dict` (checks group count and sizes only);
    `torch/optim/adam.py` `_fused_adam` (no shape check); `src/transformers/trainer.py`
    `Trainer.get_decay_parameter_names` (how the Trainer groups parameters); transformers 5:
    `src/transformers/conversion_mapping.py` `_build_checkpoint_conversion_mapping` (which models are saved in
    another layout), `src/transformers/core_model_loading.py` `revert_weight_conversion` (called by
    `PreTrainedModel.save_pretrained` in `src/transformers/modeling_utils.py`: the per-expert keys saved).
    """
    for ck, _ in _checkpoints(tree):
        problem = _in_checkpoint_mismatch(ck)
        if problem is not None:
            f = trainer_view.optimizer_file(ck)
            yield Hit(f.path if f else ck.path, problem)
    for run in tree.runs:
        yield from _resumed_with_other_adapter(run)


def _scheduler_type(ck: Checkpoint) -> str | None:
    args = trainer_view.training_args(ck)
    t = args.get("lr_scheduler_type") if args else None
    return t if isinstance(t, str) else None


@rule("CKD406", "lr-jump-in-history", Severity.WARNING)
def lr_jump_in_history(tree: Tree) -> Iterator[Hit]:
    """The logged learning rate jumps up after it had started to decay: a resume restarted the schedule.

    ## What it does
    Scans `log_history`'s `learning_rate` values of the newest checkpoint of each run for an increase after the
    decay began (warm-up increases are fine; `cosine_with_restarts` runs are skipped).

    ## Why is this bad?
    A jump means a previous resume rebuilt the schedule: a missing `scheduler.pt`, changed `max_steps` or warm-up,
    or a fresh Trainer on old weights. The run did not train with the schedule you configured.

    ## Example
    LR 2.1e-5 at step 900, 5.0e-5 at step 920 after a resume without `scheduler.pt`.

    ## Fix safety
    No fix: the history is what happened. Use `ckptdoctor gate` before the next resume.

    ## References
    `src/transformers/trainer.py` `Trainer._load_optimizer_and_scheduler`, `Trainer.create_scheduler`;
    `torch/optim/lr_scheduler.py` `LRScheduler.load_state_dict` (the rebuilt schedule takes the old `last_epoch`);
    docs/gate.md.
    """
    for run in tree.runs:
        cks = [c for c in run.checkpoints if c.role == FolderRole.CHECKPOINT and c.step is not None]
        if not cks:
            continue
        ck = max(cks, key=lambda c: c.step or 0)
        ts = trainer_view.trainer_state(ck)
        if ts is None or _scheduler_type(ck) == "cosine_with_restarts":
            continue
        lrs = ts.learning_rates()
        decaying = False
        for (s0, a), (s1, b) in itertools.pairwise(lrs):
            if b < a * (1 - 1e-9):
                decaying = True
            elif decaying and b > a * 1.05 + 1e-15:
                yield Hit(
                    ck.path + "/trainer_state.json" if ck.path not in ("", ".") else "trainer_state.json",
                    f"learning_rate jumps from {a:.3g} at step {s0} to {b:.3g} at step {s1} after decay had begun",
                )
                break


@rule("CKD416", "lightning-resume-refused", Severity.ERROR)
def lightning_resume_refused(tree: Tree) -> Iterator[Hit]:
    """`Trainer.fit(ckpt_path=...)` cannot load this Lightning checkpoint: it names a class the weights-only load
    refuses.

    ## What it does
    Reads the pickle of each PyTorch Lightning `.ckpt` (opcode by opcode, never loading it) and lists the globals
    outside what `torch.load(weights_only=True)` accepts by default: torch's tensors, storages and dtypes,
    `OrderedDict`, `Counter`, `set`, `bytearray`, `complex`.

    ## Why is this bad?
    Lightning 2.6 resumes with `torch.load(..., weights_only=None)` for a local path, so torch's default applies,
    `weights_only=True` since torch 2.6, and the load raises `UnpicklingError: Weights only load failed ...
    Unsupported global: GLOBAL argparse.Namespace`. The run cannot continue from this file as it is, although
    Lightning wrote it itself.

    ## Example
    A `LightningModule` whose `__init__(self, args)` takes the parsed `argparse.Namespace` and calls
    `self.save_hyperparameters()`: `hyper_parameters` holds the `Namespace` object in every checkpoint.

    ## Fix safety
    No automatic fix. If you trust the file, resume as Lightning's `Trainer.fit` documents for a trusted checkpoint
    holding more than tensors: `trainer.fit(model, ckpt_path=..., weights_only=False)`, or allow just the class:
    `torch.serialization.add_safe_globals([argparse.Namespace])` before `fit`. For the next runs, pass plain
    values (`save_hyperparameters(vars(args))`, which Lightning stores as a dict).

    ## References
    `src/lightning/pytorch/trainer/trainer.py` `Trainer.fit` (`weights_only`);
    `src/lightning/pytorch/trainer/connectors/checkpoint_connector.py` `_CheckpointConnector.resume_start`;
    `src/lightning/fabric/utilities/cloud_io.py` `_load`; `torch/_weights_only_unpickler.py` `_get_allowed_globals`.
    """
    from ckptdoctor.pickle_verdict.judge import file_pickle
    from ckptdoctor.pickle_verdict.policy import weights_only_accepts
    from ckptdoctor.stacks import lightning

    for f in tree.all_files():
        if f.kind not in (FileKind.TORCH_ZIP, FileKind.TORCH_LEGACY) or not f.name.endswith(lightning.SUFFIX):
            continue
        pf = file_pickle(f)
        version = None if pf is None else lightning.checkpoint_version(pf.value)
        if pf is None or version is None:
            continue
        refused = [g.dotted for g in pf.globals if not weights_only_accepts(g)]
        if not refused:
            continue
        where = lightning.where_global(pf.value, refused[0])
        held = f" (in `{where}`)" if where else ""
        names = ", ".join(f"`{d}`" for d in refused[:4]) + (", ..." if len(refused) > 4 else "")
        yield Hit(f.path, f"`Trainer.fit(ckpt_path=...)` raises `UnpicklingError`: Lightning loads it with "
                          f"`torch.load(weights_only=True)`, which refuses {names}{held}")


def accelerate_newer(run: Run) -> tuple[Checkpoint, int, Checkpoint, int] | None:
    """When ``load_state()`` picks an older state than another save of the automatic-naming ``run`` holds:
    ``(pick, its scheduler step, the newest, its step)`` by ``scheduler.bin``'s ``last_epoch``; else None."""
    pick = accelerate.picked(run) if accelerate.is_automatic(run) else None
    if pick is None or pick.stack is not Stack.ACCELERATE:
        return None
    at = accelerate.scheduler_step(pick)
    if at is None:
        return None
    steps = [(s, ck) for ck in run.checkpoints if ck.stack is Stack.ACCELERATE
             and (s := accelerate.scheduler_step(ck)) is not None]
    step, newest = max(steps, key=lambda t: (t[0], t[1].path))
    return (pick, at, newest, step) if step > at else None


@rule("CKD430", "accelerate-older-state-picked", Severity.ERROR)
def accelerate_older_state_picked(tree: Tree) -> Iterator[Hit]:
    """`Accelerator.load_state()` picks a save whose scheduler is behind another save's: it resumes an older state.

    ## What it does
    In automatic checkpoint naming's `checkpoints/` folder, compares the folder `load_state()` picks (the highest
    number) with every other save by the steps its learning-rate scheduler was stepped (`last_epoch` in
    `scheduler.bin`, read from the pickle stream without loading it), and fires when another save is further on.

    ## Why is this bad?
    `load_state()` does not restore `ProjectConfiguration.iteration`: a program that resumes and then calls
    `save_state()` writes `checkpoint_0`, `checkpoint_1` ... again, beside the older, higher-numbered saves.
    Rotation (`total_limit`) deletes by the same number, so it deletes the newest saves first, and the next
    `load_state()` silently takes the highest number: an older state, whose steps are trained again. (Without
    `total_limit`, the resumed program's first `save_state()` raises `ValueError: Checkpoint directory ...
    checkpoint_0 (0) already exists` instead, while `checkpoint_0` is still there.)

    ## Example
    `total_limit=3`; a first run saved `checkpoint_1` to `checkpoint_3` (scheduler at steps 2, 3, 4). A resumed run
    saved step 5 as `checkpoint_0` (deleting `checkpoint_1`): `load_state()` now picks `checkpoint_3`, at step 4.

    ## Fix safety
    No automatic fix: renaming saves changes what resumes. Load the newest save by name
    (`accelerator.load_state("checkpoints/checkpoint_0")`) and, after every `load_state()`, set
    `accelerator.project_configuration.iteration` to one past the highest `checkpoint_<i>` so later saves number on.

    ## References
    `src/accelerate/accelerator.py` `Accelerator.load_state` (the pick; `iteration` is not restored),
    `Accelerator.save_state` (`checkpoint_{self.save_iteration}`, the `total_limit` rotation);
    `src/accelerate/utils/dataclasses.py` `ProjectConfiguration`.
    """
    for run in tree.runs:
        found = accelerate_newer(run)
        if found is None:
            continue
        pick, at, newest, step = found
        name = newest.path.rsplit("/", 1)[-1]
        yield Hit(pick.path, f"`load_state()` picks this save, its scheduler at step {at}, but `{name}` holds step "
                             f"{step}: the resume silently takes the older state (`load_state()` does not restore "
                             "`project_configuration.iteration`, so saves after a resume restart at `checkpoint_0`)",
                  file=f"{pick.path}/scheduler.bin")


@rule("CKD431", "accelerate-custom-checkpoints-mismatch", Severity.WARNING,
      severity_when=((Severity.ERROR, "`load_state()` would open a `custom_checkpoint_<i>.pkl` that is not there"),))
def accelerate_custom_checkpoints_mismatch(tree: Tree) -> Iterator[Hit]:
    """The `custom_checkpoint_<i>.pkl` files of an accelerate save do not fit one set of registered objects.

    ## What it does
    `save_state()` writes one `custom_checkpoint_<i>.pkl` per object given to `register_for_checkpointing`,
    numbered from 0. An error when the numbers have a gap (`load_state()` opens 0 to n-1 for n files, so one is
    missing whatever is registered); a warning when saves of one run hold different counts (the program registered
    other objects at some point: one count or the other makes `load_state()` raise).

    ## Why is this bad?
    `load_state()` counts the files, raises `RuntimeError: Number of custom checkpoints in folder ... does not
    match the number of registered objects` unless the count equals the objects the resuming program registered,
    then loads each by index (`FileNotFoundError` for a gap).

    ## Example
    `checkpoint_2/` holds `custom_checkpoint_0.pkl` and `custom_checkpoint_2.pkl`; or `checkpoint_1/` holds one
    custom file and `checkpoint_2/` two, after an EMA object was registered mid-run.

    ## Fix safety
    No fix: only the resuming program knows which objects it registers (the gate and
    `ckptdoctor.integrations.accelerate.check_load_state` compare the count with it).

    ## References
    `src/accelerate/accelerator.py` `Accelerator.load_state` (the count), `Accelerator.register_for_checkpointing`;
    `src/accelerate/checkpointing.py` `save_custom_state`, `load_custom_state`.
    """
    for run in tree.runs:
        folders = [ck for ck in run.checkpoints if ck.stack is Stack.ACCELERATE]
        counts = {ck.path: len(accelerate.saved(accelerate.top_names(ck)).custom) for ck in folders}
        # only complete saves (the custom files come after the RNG state; a cut save is CKD121's)
        whole = [ck.path for ck in folders if 0 in accelerate.saved(accelerate.top_names(ck)).ranks]
        usual = Counter(counts[p] for p in whole).most_common(1)[0][0] if whole else 0
        for ck in folders:
            gaps = accelerate.custom_gaps(accelerate.top_names(ck))
            if gaps:
                lost = ", ".join(f"`custom_checkpoint_{i}.pkl`" for i in gaps)
                yield Hit(ck.path, f"{plural(counts[ck.path], 'custom checkpoint file')} but no {lost}: "
                                   "`load_state()` loads them by index from 0 and raises `FileNotFoundError`",
                          Severity.ERROR)
            elif ck.path in whole and counts[ck.path] != usual:
                yield Hit(ck.path, f"{plural(counts[ck.path], 'custom checkpoint file')} where the run's other saves "
                                   f"hold {usual}: `load_state()` raises `RuntimeError` unless exactly "
                                   f"{counts[ck.path]} objects are registered with `register_for_checkpointing`")


@rule("CKD422", "run-started-from-checkpoint", Severity.WARNING)
def run_started_from_checkpoint(tree: Tree) -> Iterator[Hit]:
    """The run was started from another run's checkpoint as a new run instead of resuming it: its optimizer state,
    LR schedule (warm-up included) and `global_step` started over.

    ## What it does
    Says what the files show, at the confidence they show it:
    - transformers 4.x (4.40 measured) writes the path given to `from_pretrained` into `config.json`
      `_name_or_path`: a path ending in another run's `checkpoint-N` means the model was built from that
      checkpoint's weights. That is what the file says.
    - transformers 4.57 and 5.x write no such path. When the scan holds a sibling run with the same weight layout
      whose checkpoints are older, which learned (its logged loss fell by 2% or more), and whose first logged step
      this run's first log shares, this run's first logged loss starting nearer to where the sibling ended than to
      where it began is evidence, not proof, that it started from the sibling's weights: the finding says "likely".

    ## Why is this bad?
    Passing a checkpoint as the model (`model_name_or_path=.../checkpoint-500`) instead of
    `resume_from_checkpoint` loads the weights only. AdamW restarts from zero moments, the schedule warms up again
    from step 0 to the full learning rate, and the data order restarts: the loss often jumps, and the run trains
    for its whole `max_steps` again. Nothing warns.

    ## Example
    `AutoModelForCausalLM.from_pretrained("run-a/checkpoint-8")` passed to a new `Trainer(output_dir="run-b")`,
    then `trainer.train()`: `run-b`'s log starts at step 1 at the full learning rate, at `run-a`'s last loss.

    ## Fix safety
    No fix: if you meant to continue `run-a`, resume it with `trainer.train(resume_from_checkpoint=...)` (its
    optimizer and schedule are restored); if starting over on those weights was the plan, ignore this.

    ## References
    huggingface/transformers#1923 ("Step restarts from step 0 when reload from an existing checkpoint?": a
    checkpoint loaded as the model, not resumed), huggingface/transformers#23099 ("learning rate resets on
    resumption from checkpoint": `from_pretrained('/checkpoint-38000')` then a new `Trainer`),
    huggingface/transformers#33336 ("Training Resumes with Increased Loss Despite Checkpoint Loading");
    `src/transformers/modeling_utils.py`
    `PreTrainedModel.from_pretrained` (sets `config._name_or_path`), `src/transformers/configuration_utils.py`
    `PretrainedConfig.to_dict` (4.x writes `_name_or_path`), `src/transformers/trainer.py` `Trainer.train`
    (`resume_from_checkpoint`), `Trainer._load_optimizer_and_scheduler`.
    """
    current = [h for run in tree.runs if (h := run_history(run, tree.root)) is not None]
    return started_hits(current, tree.siblings)


def started_hits(current: list[RunHistory], judged: Sequence[RunHistory]) -> Iterator[Hit]:
    """CKD422's findings on the runs ``current`` of a tree, beside the runs of the same root ``judged`` before it
    (a scan that judges run by run; ``Tree.siblings``): each pair is judged once, when the later of the two is
    here, and a finding may then name a run judged before. Each run is looked up in an index (``SiblingRuns``),
    not compared with every other."""
    here = {h.path for h in current}
    siblings = judged if isinstance(judged, SiblingRuns) else SiblingRuns(judged)
    ours = SiblingRuns(current)  # a tree judged whole holds all its runs: looked up the same way
    for mine in current:
        if mine.named is not None:
            yield Hit(mine.where, f"`_name_or_path` names `{mine.named}`: this run was built from that checkpoint's "
                                  "weights as a new run (global_step from 0, a fresh optimizer, the LR schedule and "
                                  "its warm-up restarted), not resumed from it")
            continue
        # the first that fits, here before the runs judged before
        other = ours.source_of(mine, skip=(mine.path,)) or siblings.source_of(mine, skip=here)
        if other is not None:
            yield Hit(mine.where, _likely_started(mine, other))
    # a run judged before that one of these was started from (the first of these it fits), in the order judged,
    # unless a run judged before these fits it too: that run's part (or its own) has said so already, and a run
    # gets one finding however many later siblings it fits, as when its root is judged whole
    firsts: dict[int, tuple[RunHistory, RunHistory]] = {}
    told: dict[int, bool] = {}
    for other in current:
        for at, mine in siblings.started_from(other, skip=here):
            if at not in told:
                told[at] = siblings.source_of(mine, skip=(*here, mine.path)) is not None
            if not told[at]:
                firsts.setdefault(at, (mine, other))
    for at in sorted(firsts):
        mine, other = firsts[at]
        yield Hit(mine.where, _likely_started(mine, other))


def _likely_started(mine: RunHistory, other: RunHistory) -> str:
    (first_step, first), (start_step, start), (late_step, late) = mine.losses[0], other.losses[0], other.losses[-1]
    return (f"its first logged loss ({first:.4g} at step {first_step}) starts near where sibling run `{other.path}` "
            f"ended ({late:.4g} at step {late_step}, from {start:.4g} at step {start_step}), while its steps count "
            f"from the start: it was likely started from `{other.path}`'s weights as a new run (a fresh optimizer, "
            "the LR schedule and its warm-up restarted), not resumed. Inferred from the logged losses: transformers "
            "4.57 and 5.x record no source path")


# ---------------------------------------------------------------------------------------------------------------
# PyTorch Lightning: what `Trainer.fit(ckpt_path=...)` meets in a run (`stacks.lightning`, `model.LightningFacts`)


def _lightning_runs(tree: Tree) -> Iterator[Run]:
    """The runs PyTorch Lightning wrote (``stacks.lightning``)."""
    return (r for r in tree.runs if r.stack is Stack.LIGHTNING)


@rule("CKD440", "lightning-last-stale", Severity.ERROR)
def lightning_last_stale(tree: Tree) -> Iterator[Hit]:
    """`fit(ckpt_path="last")` loads a `last.ckpt` older than the newest checkpoint in its folder.

    ## What it does
    In each folder of Lightning checkpoints, finds the file `fit(ckpt_path="last")` loads (the most recently
    modified `last*.ckpt`) and compares the optimizer steps its fit loop counts with those of the other `.ckpt`
    files there that were saved at the same time or after it.

    Files holding more steps that were saved *before* it are not its future: a later fit wrote it (a new `Trainer`
    in the same `dirpath`, or a resume from an earlier file), and `"last"` resumes that later run, which is what
    Lightning means by last. This rule stays silent on them; CKD447 says when the earlier run's own `last*.ckpt` is
    still there to be chosen.

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
    for run in _lightning_runs(tree):
        v = lightning.last_ahead(lightning.run_files(run))
        if v is None or v.after is None:
            continue  # no one file "last" loads (CKD448 when several tie), or nothing after it holds more steps
        (top, newest), pick, at = v.after, v.pick, v.at
        yield Hit(pick.path, f'`fit(ckpt_path="last")` loads `{pick.name}` at step {at}, but `{top.name}`, saved '
                             f"after it in the same folder, holds step {newest}: the resume trains {newest - at} "
                             "steps again (`_CheckpointConnector._parse_ckpt_path` takes the newest `last*.ckpt` by "
                             "modification time)")


@rule("CKD447", "lightning-earlier-run-last", Severity.INFO)
def lightning_earlier_run_last(tree: Tree) -> Iterator[Hit]:
    """Two runs' `last*.ckpt` files share one folder: `fit(ckpt_path="last")` picks between them by modification
    time alone.

    ## What it does
    In each folder of Lightning checkpoints, reports the `last*.ckpt` that `fit(ckpt_path="last")` loads when
    another `last*.ckpt` beside it holds more optimizer steps but was saved before it: the later run's last
    checkpoint beside an earlier run's. An info: Lightning loads the later run's file, as "last" means.

    ## Why is this bad?
    A new `Trainer` whose `ModelCheckpoint` writes into a `dirpath` that already holds `last.ckpt` saves its own as
    `last-v1.ckpt` (the version counter; Lightning warns "Checkpoint directory ... exists and is not empty"), and
    the files of both runs stay. `_CheckpointConnector._parse_ckpt_path` gathers every `last*.ckpt` and loads the
    most recently modified one: nothing else says which run a file belongs to. A copy, sync or archive that does not
    keep modification times (`cp -r`, many object-store downloads) can make it load the earlier run's file; and to
    continue the earlier run you must name its file, since "last" no longer finds it.

    ## Example
    `fit` for 5 epochs into `d` (`last.ckpt` at step 10), then a new `Trainer` with the same
    `ModelCheckpoint(dirpath=d, save_last=True)` fits 2 epochs from scratch (`last-v1.ckpt` at step 4):
    `fit(ckpt_path="last")` resumes the second run at step 4.

    ## Fix safety
    No automatic fix. Keep each run in its own `dirpath` (or move the earlier run's files away); to continue the
    earlier run, pass its file: `fit(ckpt_path="d/last.ckpt")`.

    ## References
    `src/lightning/pytorch/trainer/connectors/checkpoint_connector.py` `_CheckpointConnector._parse_ckpt_path`;
    `src/lightning/pytorch/callbacks/model_checkpoint.py` `ModelCheckpoint._find_last_checkpoints`,
    `_save_last_checkpoint` (`enable_version_counter`), `__warn_if_dir_not_empty`.
    """
    for run in _lightning_runs(tree):
        v = lightning.last_ahead(lightning.run_files(run))
        if v is None or v.earlier_last is None:
            continue
        (other, theirs), pick, at = v.earlier_last, v.pick, v.at
        yield Hit(pick.path, f'`fit(ckpt_path="last")` loads `{pick.name}` (step {at}), saved by a later fit than '
                             f"`{other.name}` beside it (step {theirs}, saved before it): Lightning chooses between "
                             "them by modification time alone (`_CheckpointConnector._parse_ckpt_path`), so a copy "
                             f"that does not keep modification times can make it load `{other.name}`; to continue "
                             "the earlier run, pass its file as `ckpt_path`")


@rule("CKD448", "lightning-last-ambiguous", Severity.WARNING)
def lightning_last_ambiguous(tree: Tree) -> Iterator[Hit]:
    """Several `last*.ckpt` files share the newest modification time: which one `fit(ckpt_path="last")` loads
    changes from one process to the next.

    ## What it does
    In each folder of Lightning checkpoints, reports two or more `last*.ckpt` files that hold different optimizer
    steps and share the newest modification time.

    ## Why is this bad?
    `_CheckpointConnector._parse_ckpt_path` collects the candidates in a set, maps each to its modification time
    and takes the `max`: among equal times the first one met wins, and a set of strings is ordered by their hashes,
    which Python seeds anew in every process. Two resumes of the same folder can start from different states.
    Equal times come from archives and copies that keep whole seconds (`zip`, `tar`, some syncs), or from a script
    that set them.

    ## Example
    `last.ckpt` (step 10) and `last-v1.ckpt` (step 4) extracted from one archive with the same time:
    `fit(ckpt_path="last")` loaded `last.ckpt` under `PYTHONHASHSEED=0` and `last-v1.ckpt` under 1.

    ## Fix safety
    No automatic fix. Pass the file to resume as `fit(ckpt_path=...)`, or remove the `last*.ckpt` you do not want
    (or `touch` the one you do). `ckptdoctor gate` fails on such a folder (CKD449) when the planned resume from the
    tied files differs, naming what each would do.

    ## References
    `src/lightning/pytorch/trainer/connectors/checkpoint_connector.py` `_CheckpointConnector._parse_ckpt_path`;
    `src/lightning/pytorch/callbacks/model_checkpoint.py` `ModelCheckpoint._find_last_checkpoints`.
    """
    for run in _lightning_runs(tree):
        files = lightning.run_files(run)
        tied = lightning.tied_lasts(files)
        pick = lightning.last_pick(files)
        if not tied or pick is None:
            continue
        held = ", ".join(f"`{f.name}` (" + ("no step read" if (n := lightning.step_of(f)) is None else f"step {n}")
                         + ")" for f in tied)
        yield Hit(pick.path, f"{held} share one modification time: `fit(ckpt_path=\"last\")` loads whichever its "
                             "set of candidates yields first, which changes with each process's hash seed "
                             "(`_CheckpointConnector._parse_ckpt_path`)")


@rule("CKD441", "lightning-last-dangling", Severity.ERROR, fix=Applicability.UNSAFE)
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


@rule("CKD442", "lightning-loop-counters", Severity.WARNING)
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


@rule("CKD443", "lightning-weights-only", Severity.INFO)
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
    for run in _lightning_runs(tree):
        files = lightning.run_files(run)
        f = lightning.last_pick(files) or lightning.newest(files)
        lf = None if f is None else lightning.facts_of(f)
        if f is None or lf is None or (lf.has_optimizer and lf.has_schedulers):
            continue
        yield Hit(f.path, "holds only the model (no `optimizer_states`/`lr_schedulers`: `save_weights_only`): "
                          "`fit(ckpt_path=...)` raises `KeyError` in "
                          "`_CheckpointConnector.restore_optimizers_and_schedulers`")


@rule("CKD444", "lightning-callback-paths-outside", Severity.WARNING)
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
            outside = sorted({p for p in tracked if p and not _inside_folder(p, base)})
            if outside:
                more = f" (and {len(outside) - 1} more)" if len(outside) > 1 else ""
                yield Hit(f.path, f"`ModelCheckpoint` state tracks `{outside[0]}`{more}, outside its `dirpath` "
                                  f"`{base}`: `ModelCheckpoint.load_state_dict` restores it, and "
                                  '`ckpt_path="best"` and the top-k clean-up act on it')
                break


def _inside_folder(path: str, folder: str) -> bool:
    sep = "\\" if "\\" in folder and "/" not in folder else "/"
    return path.startswith(folder + sep)
