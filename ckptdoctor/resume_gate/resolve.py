"""Resolving a planned resume: each TrainingArguments value the prediction uses (``ResolvedArgs``) taken from the
plan, else the checkpoint's own ``training_args.bin``, else transformers' default, with where it came from; and the
steps per epoch, world size and transformers version the resume runs under."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import field, replace
from typing import Any

from ckptdoctor import trainer_view
from ckptdoctor.model import Checkpoint, frozen
from ckptdoctor.resume_gate.plan import (
    ARG_DEFAULTS,
    Plan,
    int_text,
    own_warmup,
    parse_kwargs,
    plan_from_training_args,
    version_major,
)


@frozen
class ResolvedArgs:
    """The arguments the prediction used, and where each came from (planned, training_args.bin, ... default)."""

    num_train_epochs: float
    max_steps: int  # the argument: > 0 overrides num_train_epochs
    learning_rate: float
    lr_scheduler_type: str
    warmup_steps: float
    lr_scheduler_kwargs: Mapping[str, Any]
    ignore_data_skip: bool
    steps_per_epoch: int | None
    sources: Mapping[str, str] = field(default_factory=dict)
    # How steps_per_epoch was derived from a planned batch size, gradient accumulation or world size; when it is
    # None (sources says "unknown"), why it cannot be known (CKD414).
    steps_per_epoch_note: str | None = None
    # The transformers version whose resume path is followed (sources["transformers_version"] says whence), and the
    # resuming save_safetensors (read by transformers 4.x only).
    transformers_version: str = "5"
    save_safetensors: bool = True
    # transformers 4.x (and 5.x with auto_find_batch_size) resumes at the checkpoint's train_batch_size: the planned
    # per-device batch size it ignores.
    ignored_batch_size: int | None = None
    auto_find_batch_size: bool = False
    # Why the resuming TrainingArguments cannot even be built (4.x: a warmup_steps that is not an integer): CKD413.
    args_error: str | None = None

    @property
    def major(self) -> int:
        """The major version of ``transformers_version`` (5 when it cannot be read)."""
        return version_major(self.transformers_version) or 5


def steps_per_epoch_of(ts: trainer_view.TrainerStateView) -> int | None:
    """Optimizer updates per epoch of the run that wrote ``ts``, or None when the state does not pin it down.

    ``epoch`` is ``epochs_done + batches_done / batches_per_epoch``, so ``global_step / epoch`` is exact whenever
    gradient accumulation divides the epoch; else ``max_steps / num_train_epochs`` of an epoch-based run.
    """
    g, ep = ts.global_step, ts.epoch
    try:  # the state is whatever the file says: a 400-digit global_step or an infinite epoch count must not raise
        if g and ep and ep > 0:
            est = g / ep
            r = round(est)
            if r >= 1 and abs(est - r) <= 1e-6 * r:
                return r
        if ts.max_steps and ts.num_train_epochs and ts.num_train_epochs > 0:
            ratio = ts.max_steps / ts.num_train_epochs
            if ratio >= 1 and ratio.is_integer():
                return int(ratio)
    except (ArithmeticError, ValueError):
        return None
    return None


@functools.cache
def installed_version(dist: str) -> str | None:
    """The version of the distribution ``dist`` installed beside ckptdoctor, from its metadata: the package itself is
    never imported (the gate reads, it does not load a training stack); None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except (metadata.PackageNotFoundError, ValueError):
        return None


def installed_transformers() -> str | None:
    """The version of the transformers installed beside ckptdoctor (``installed_version``)."""
    return installed_version("transformers")


def transformers_version(
    plan: Plan, ck: Checkpoint, ts: trainer_view.TrainerStateView | None
) -> tuple[str, str]:
    """The transformers version the resume runs under, and where it came from: planned (``--transformers-version``),
    else the installed one, else the one that wrote the checkpoint (``config.json``'s ``transformers_version``, or
    ``trainer_state.json``'s), else "5" (``default``: the resume path the gate follows unless told otherwise)."""
    if plan.transformers_version is not None:
        return plan.transformers_version.strip(), "planned"
    installed = installed_transformers()
    if installed is not None and version_major(installed) is not None:
        return installed, "installed"
    config = trainer_view.json_value(ck.file("config.json"))
    for name, doc in (("config.json", config), (trainer_view.TRAINER_STATE, ts.raw if ts is not None else None)):
        found = doc.get("transformers_version") if isinstance(doc, dict) else None
        # a version is a few characters: a file's megabyte of text in that key is not one, and is not echoed
        if isinstance(found, str) and len(found) <= 64 and version_major(found) is not None:
            return found, name
    return "5", "default"


def resolve(plan: Plan, ck: Checkpoint, ts: trainer_view.TrainerStateView | None) -> ResolvedArgs:
    """The arguments the resume will run with: planned values first, then the checkpoint's ``training_args.bin``,
    then ``trainer_state.json`` / ``scheduler.pt``, then transformers' defaults; and the transformers version whose
    resume path they follow."""
    args = trainer_view.training_args(ck) or {}
    sources: dict[str, str] = {}
    version, sources["transformers_version"] = transformers_version(plan, ck, ts)
    major = version_major(version) or 5

    def pick(name: str, planned: Any, from_args: Any, fallback: tuple[Any, str] | None = None) -> Any:
        if planned is not None:
            sources[name] = "planned"
            return planned
        if from_args is not None:
            sources[name] = "training_args.bin"
            return from_args
        if fallback is not None and fallback[0] is not None:
            sources[name] = fallback[1]
            return fallback[0]
        sources[name] = "default"
        return ARG_DEFAULTS[name]

    sched = trainer_view.scheduler_state(ck)
    planned_max = plan.max_steps if plan.max_steps is not None else (-1 if plan.num_train_epochs is not None else None)
    max_steps = pick("max_steps", planned_max, trainer_view.integer(args.get("max_steps")),
                     (ts.max_steps if ts else None, "trainer_state.json"))
    epochs = pick("num_train_epochs", plan.num_train_epochs, trainer_view.number(args.get("num_train_epochs")),
                  (ts.num_train_epochs if ts else None, "trainer_state.json"))
    lr = pick("learning_rate", plan.learning_rate, trainer_view.number(args.get("learning_rate")),
              (sched.base_lrs[0] if sched and sched.base_lrs else None, "scheduler.pt"))
    stype = args.get("lr_scheduler_type")
    stype = pick("lr_scheduler_type", plan.lr_scheduler_type, stype if isinstance(stype, str) else None)
    own = plan_from_training_args(args) if args else {}
    run_warmup = own_warmup(own)
    planned_warmup, args_error = plan.warmup_steps, None
    if plan.warmup_ratio is not None and (planned_warmup is None or (major < 5 and not planned_warmup > 0)):
        # 4.x's get_warmup_steps: warmup_steps when above 0, else ceil(max_steps x warmup_ratio); the gate keeps a
        # ratio as a warmup_steps below 1, 5.x's form of it (schedules.warmup_steps_for)
        planned_warmup = plan.warmup_ratio
    elif major < 5 and planned_warmup is not None and not float(planned_warmup).is_integer():
        # 4.x's TrainingArguments.__post_init__ refuses it: a ratio below 1 is 5.x's reading only
        args_error = (f"warmup_steps {planned_warmup:g} (planned) is not an integer: transformers {version}'s "
                      "TrainingArguments raises ValueError(\"warmup_steps must be of type int and must be 0 or a "
                      "positive integer.\") before train() starts (a ratio is warmup_ratio there)")
    warmup = pick("warmup_steps", planned_warmup, run_warmup)
    kw = pick("lr_scheduler_kwargs", plan.lr_scheduler_kwargs, parse_kwargs(args.get("lr_scheduler_kwargs")))
    skip_flag = args.get("ignore_data_skip")
    ignore = pick("ignore_data_skip", plan.ignore_data_skip, skip_flag if isinstance(skip_flag, bool) else None)
    own_safe = args.get("save_safetensors")
    safe = pick("save_safetensors", plan.save_safetensors, own_safe if isinstance(own_safe, bool) else None)
    own_auto = args.get("auto_find_batch_size")
    auto = pick("auto_find_batch_size", plan.auto_find_batch_size, own_auto if isinstance(own_auto, bool) else None)
    ignored_batch = None
    if (major < 5 or auto) and plan.per_device_train_batch_size is not None and ts is not None and ts.train_batch_size:
        # transformers 4.x's train() sets `self._train_batch_size = state.train_batch_size` on every resume, 5.x's
        # only with auto_find_batch_size (then `_inner_training_loop` gets it from find_executable_batch_size): the
        # dataloader is built at the checkpoint's batch size, whatever per_device_train_batch_size says
        run_device = trainer_view.integer(args.get("per_device_train_batch_size")) or ts.train_batch_size
        if plan.per_device_train_batch_size != run_device:
            ignored_batch = plan.per_device_train_batch_size
        plan = replace(plan, per_device_train_batch_size=None)
    upe, sources["steps_per_epoch"], upe_note = plan.steps_per_epoch, "planned", None
    if upe is None:
        upe, sources["steps_per_epoch"], upe_note = derive_steps_per_epoch(plan, ck, ts, args)
    return ResolvedArgs(
        num_train_epochs=float(epochs),
        max_steps=int(max_steps),
        learning_rate=float(lr),
        lr_scheduler_type=str(stype),
        warmup_steps=float(warmup),
        lr_scheduler_kwargs=dict(kw or {}),
        ignore_data_skip=bool(ignore),
        steps_per_epoch=upe,
        sources=sources,
        steps_per_epoch_note=upe_note,
        transformers_version=version,
        save_safetensors=bool(safe),
        ignored_batch_size=ignored_batch,
        auto_find_batch_size=bool(auto),
        args_error=args_error,
    )


def run_world_size(ck: Checkpoint) -> int | None:
    """How many processes saved ``ck``: its FSDP / DeepSpeed shards, else its RNG files (``rng_state.pth``: 1;
    ``rng_state_R.pth``: the highest R + 1); None when nothing says."""
    from ckptdoctor.facts import saved_world_size

    saved = saved_world_size(ck)
    if saved is not None:
        return saved
    matches = map(trainer_view.RNG_RE.match, map(ck.relname, ck.files))
    ranks = {-1 if m.group(1) is None else int(m.group(1)) for m in matches if m}
    if not ranks:
        return None
    return 1 if ranks == {-1} else max(ranks) + 1


def updates_per_epoch(samples: int, batch: int, world: int, accumulation: int, drop_last: bool) -> int:
    """Optimizer updates per epoch of ``samples`` examples: the DataLoader's batches (``drop_last`` floors them),
    each process's share of them (accelerate's ``BatchSamplerShard.__len__`` with even batches), then
    ``Trainer.set_initial_training_values``' ``max(ceil(len_dataloader / gradient_accumulation_steps), 1)``."""
    batches = samples // batch if drop_last else -(-samples // batch)
    per_rank = batches // world if drop_last or batches % world == 0 else batches // world + 1
    return max(-(-per_rank // accumulation), 1)


def derive_steps_per_epoch(
    plan: Plan, ck: Checkpoint, ts: trainer_view.TrainerStateView | None, args: Mapping[str, Any]
) -> tuple[int | None, str, str | None]:
    """Steps per epoch of the resume when it is not planned: ``(value, source, note)``.

    With the run's batch size, gradient accumulation and world size it is the run's own (``trainer_state.json``).
    When the plan changes one of them, the Trainer recomputes it from the new dataloader: the run's recorded
    ``train_batch_size`` (``per_device_train_batch_size x max(1, n_gpu)``), its ``gradient_accumulation_steps``
    (``training_args.bin``) and world size (its shard or RNG files) turn its steps per epoch into the range of
    dataset lengths that give them, and the new arguments turn that range into the new steps per epoch. When the
    range gives more than one value, or a run value is not recorded, the value is None and the note says why.
    """
    upe0 = steps_per_epoch_of(ts) if ts else None
    wanted = (plan.per_device_train_batch_size, plan.gradient_accumulation_steps, plan.world_size)
    if all(v is None for v in wanted):
        return upe0, "trainer_state.json" if upe0 is not None else "unknown", None
    batch0 = ts.train_batch_size if ts else None
    device0 = trainer_view.integer(args.get("per_device_train_batch_size"))
    accum0 = trainer_view.integer(args.get("gradient_accumulation_steps")) or (1 if args else None)
    world0 = run_world_size(ck)
    unknown: list[str] = []
    batch1 = batch0
    if plan.per_device_train_batch_size is not None and plan.per_device_train_batch_size != device0:
        if batch0 is None or device0 is None or device0 < 1 or batch0 % device0:
            unknown.append("the run's train_batch_size (trainer_state.json) and per_device_train_batch_size "
                           "(training_args.bin)")
        else:  # the run's n_gpu factor (DataParallel) is kept: only the per-device batch is planned
            batch1 = plan.per_device_train_batch_size * (batch0 // device0)
    accum1 = plan.gradient_accumulation_steps or accum0
    if plan.gradient_accumulation_steps is not None and accum0 is None:
        unknown.append("the run's gradient_accumulation_steps (training_args.bin)")
    world1 = plan.world_size or world0
    if plan.world_size is not None and world0 is None:
        unknown.append("the run's world size (no RNG or shard files)")
    if not unknown and (batch1, accum1, world1) == (batch0, accum0, world0):
        return upe0, "trainer_state.json" if upe0 is not None else "unknown", None
    if upe0 is None:
        unknown.append("the run's steps per epoch (trainer_state.json)")
    if batch0 is None or batch0 < 1:
        unknown.append("the run's train_batch_size (trainer_state.json)")
    if accum1 is None:
        unknown.append("the run's gradient_accumulation_steps (training_args.bin)")
    change = _change(plan, device0, accum0, world0)
    if unknown:
        return None, "unknown", f"{change} changes the steps per epoch, and {', '.join(dict.fromkeys(unknown))} " \
            "cannot be read"
    assert upe0 is not None and batch0 is not None and accum1 is not None and batch1 is not None
    accum0, world0, world1 = accum0 or 1, world0 or 1, world1 or 1
    drop = args.get("dataloader_drop_last") is True
    low, high = _samples_for(upe0, batch0, world0, accum0, drop)
    run = (f"the run's {upe0} steps per epoch at train_batch_size {batch0}, gradient_accumulation_steps {accum0}, "
           f"world size {world0} mean {low:,}" + (f" to {high:,} samples" if high != low else " samples"))
    if low > high:
        return None, "unknown", f"{change} changes the steps per epoch, and no dataset length gives the run's " \
            f"{upe0} steps per epoch at train_batch_size {batch0}"
    first, last = (updates_per_epoch(n, batch1, world1, accum1, drop) for n in (low, high))
    if first != last:
        return None, "unknown", f"{change} changes the steps per epoch: {run}, which give {first} to {last} steps " \
            "per epoch"
    return first, "derived", f"{change}: {run}, {first} steps per epoch"


def _change(plan: Plan, device0: int | None, accum0: int | None, world0: int | None) -> str:
    """What the plan changes, for a message: ``per_device_train_batch_size 8 -> 4``."""
    def text(v: int | None) -> str:
        return "?" if v is None else int_text(v)

    parts = [f"{name} {text(old)} -> {int_text(new)}" for name, old, new in (
        ("per_device_train_batch_size", device0, plan.per_device_train_batch_size),
        ("gradient_accumulation_steps", accum0, plan.gradient_accumulation_steps),
        ("world size", world0, plan.world_size),
    ) if new is not None and new != old]
    return "planned " + ", ".join(parts) if parts else "the plan"


def _samples_for(updates: int, batch: int, world: int, accumulation: int, drop_last: bool) -> tuple[int, int]:
    """The dataset lengths whose epoch makes ``updates`` optimizer updates (``updates_per_epoch`` never decreases
    with the length, so they form one range); ``low > high`` when none does."""
    def first_reaching(target: int) -> int:
        lo, hi = 1, (target + 1) * accumulation * world * batch + world * batch  # hi always reaches the target
        while lo < hi:
            mid = (lo + hi) // 2
            if updates_per_epoch(mid, batch, world, accumulation, drop_last) >= target:
                hi = mid
            else:
                lo = mid + 1
        return lo

    low = first_reaching(updates)
    if updates_per_epoch(low, batch, world, accumulation, drop_last) != updates:
        return low, low - 1
    return low, first_reaching(updates + 1) - 1
