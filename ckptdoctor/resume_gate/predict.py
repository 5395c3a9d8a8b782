"""The resume's prediction: what ``trainer.train(resume_from_checkpoint=...)`` will do, as plain arithmetic.

The prediction follows transformers 5.x's resume path (``src/transformers/trainer.py``) step by step:
``get_last_checkpoint``; the weights branch of ``_load_from_checkpoint``; ``TrainerState.load_from_json``;
``set_initial_training_values`` and ``_init_training_state`` (max_steps, epochs already trained, batches skipped);
``create_scheduler`` for the new max_steps, then ``_load_optimizer_and_scheduler`` (both or neither); then
``_run_epoch``, whose first optimizer step uses the LR restored into the optimizer and whose later steps use
``base_lr * lambda(last_epoch)``. Under transformers 4.x (``ResolvedArgs.transformers_version``) it follows 4.57's
differences: the full-weights file ``save_safetensors`` picks, the checkpoint's batch size
(``resolve``) and ``get_scheduler``'s kwargs (``schedules.build``).
Nothing is loaded or executed: the checkpoint is read by the scanner, the schedules are ``ckptdoctor.schedules``.
It makes no findings: the gate rules (``ckptdoctor.resume_gate.rules``) judge the frozen ``Prediction``.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

from ckptdoctor import key_layouts, schedules, trainer_view
from ckptdoctor.facts import plural, version_tuple
from ckptdoctor.model import Checkpoint, FileFacts, FileKind, ProblemKind, Tree, frozen
from ckptdoctor.resume_gate.plan import INT_LIMIT, GateInputError, Plan, int_text
from ckptdoctor.resume_gate.resolve import ResolvedArgs, installed_version, resolve

# ---------------------------------------------------------------------------------------------------------------
# What torch.load(weights_only=True) refuses among the files the resume loads (issue 24, item 3): the resume raises
# UnpicklingError on the first one; CKD418 names each. A loadability verdict, not a security one (CKD6xx judge that).

# torch's weights-only unpickler (`torch/_weights_only_unpickler.py` `_get_allowed_globals`, torch 2.6-2.13): the
# globals it admits with no `safe_globals` at all. Dtypes, legacy storage and tensor classes and quantization
# schemes are admitted by name pattern below.
_TORCH_ADMITS = frozenset({
    "collections.OrderedDict", "collections.Counter", "torch.nn.parameter.Parameter",
    "torch.serialization._get_layout", "torch.Size", "torch.Tensor", "torch.device", "_codecs.encode",
    "builtins.bytearray", "builtins.set", "builtins.complex", "torch._tensor._rebuild_from_type_v2",
    "torch.storage.UntypedStorage", "torch.storage.TypedStorage",
    *(f"torch._utils._rebuild_{f}" for f in (
        "parameter", "parameter_with_state", "qtensor", "tensor", "tensor_v2", "tensor_v3", "sparse_tensor",
        "meta_tensor_no_storage", "nested_tensor", "wrapper_subclass", "device_tensor_from_numpy",
        "device_tensor_from_cpu_tensor")),
})
_TORCH_ADMITS_RE = re.compile(
    r"^torch\.(?:[A-Z]\w*Storage|(?:cuda\.)?[A-Z]\w*Tensor|per_(?:tensor|channel)_\w+|"
    r"(?:u?int\d+|float\w*|bfloat16|complex\d+|c?float|c?double|c?half|half|short|long|int|bool|bits\w+|q\w+))$")
# transformers' `safe_globals()` (`src/transformers/trainer_pt_utils.py`, 4.47 on), around the RNG load only: numpy's
# array rebuild under the resuming numpy's own module name, `numpy.ndarray`, `numpy.dtype` and the uint32 dtype class.
_NUMPY_CORE = {1: "numpy.core", 2: "numpy._core"}
_RNG_SAFE = ("numpy.ndarray", "numpy.dtype", "numpy.dtypes.UInt32DType")


def weights_only_admits(name: str, rng_safe_globals: bool, numpy_major: int) -> bool:
    """Whether ``torch.load(weights_only=True)`` admits the pickle global ``name`` (``module.qualname``): torch's
    own allowlist, plus transformers' ``safe_globals()`` when the load runs inside it (the RNG state's)."""
    if name in _TORCH_ADMITS or _TORCH_ADMITS_RE.match(name):
        return True
    if rng_safe_globals:
        return name in _RNG_SAFE or name == f"{_NUMPY_CORE.get(numpy_major, 'numpy._core')}.multiarray._reconstruct"
    return False




@frozen
class Refusal:
    """A file the resume loads with ``weights_only=True`` that names a global the load refuses."""

    file: FileFacts
    name: str  # its name in the checkpoint folder
    reader: str  # what loads it (``Trainer._load_rng_state`` inside ``safe_globals()``, ...)
    refused: tuple[str, ...]  # the refused globals, in the order the pickle names them
    rng: bool  # the load runs inside transformers' ``safe_globals()``
    numpy_major: int  # the resuming numpy's major version

    @property
    def crash(self) -> str:
        """What the resume raises on this file, for ``Prediction.crash``."""
        return (f"`{self.name}` names `{self.refused[0]}`, which weights_only=True refuses: train() raises "
                f"UnpicklingError in {self.reader}")


_RNG_RANK = re.compile(r"rng_state_(\d+)\.pth", re.ASCII)  # `Trainer._save_rng_state` with more than one process


def weights_only_loads(
    ck: Checkpoint, version: tuple[int, int], weights_file: str | None, restores: bool, rng_ranks: int | None
) -> list[tuple[FileFacts, str, bool]]:
    """Each file the planned resume reads with ``torch.load(weights_only=True)``, in the order it reads them, what
    reads it, and whether transformers' ``safe_globals()`` is around that load (transformers 5.x:
    `Trainer._load_from_checkpoint`, `_load_optimizer_and_scheduler`, `_load_scaler`, `_load_rng_state`; peft
    `torch_load` for `adapter_model.bin`). ``rng_ranks``: the ranks whose RNG state is loaded (None: the resume
    trains no step, and loads none)."""
    out: list[tuple[FileFacts, str, bool]] = []
    if trainer_view.is_mindnlp(ck):
        return out  # MindNLP loads its state with MindSpore, not torch.load
    rng_safe = version >= (4, 47)  # 4.36-4.46 load the RNG state with no safe_globals() around it

    def add(name: str, reader: str, rng: bool = False) -> None:
        f = ck.file(name)
        if f is not None:
            out.append((f, reader, rng))

    wf = weights_file
    if wf is not None and wf.endswith(".bin"):
        add(wf, "peft `torch_load`" if wf == trainer_view.ADAPTER_BIN else "`Trainer._load_from_checkpoint`")
    elif wf == trainer_view.BIN_INDEX:
        for shard in sorted(set((trainer_view.weight_map(ck.file(wf)) or {}).values()) if ck.file(wf) else ()):
            add(shard, "`load_sharded_checkpoint`")
    if restores:
        opt = trainer_view.optimizer_file(ck)
        if opt is not None:
            add(ck.relname(opt), "`Trainer._load_optimizer_and_scheduler`")
        if loads_scheduler_pt(ck):
            add(trainer_view.SCHEDULER, "`Trainer._load_optimizer_and_scheduler`")
    add("scaler.pt", "`Trainer._load_scaler`")
    if rng_ranks is not None:
        if rng_ranks <= 1:
            names = ["rng_state.pth"]
        else:  # the ranks' files this checkpoint holds, rank by rank: a world size from hostile arguments (10**10)
            # must not make a list of a name per rank (it took 22 GB before the kernel killed the process)
            held = {int(m[1]) for f in ck.files if (m := _RNG_RANK.fullmatch(ck.relname(f)))}
            names = [f"rng_state_{r}.pth" for r in sorted(held) if r < rng_ranks]
        for name in names:
            add(name, "`Trainer._load_rng_state`" + (" inside `safe_globals()`" if rng_safe else ""), rng_safe)
    return out


def refusals(
    ck: Checkpoint,
    version: tuple[int, int],
    torch_version: tuple[int, int] | None,
    numpy_major: int,
    weights_file: str | None,
    restores: bool,
    rng_ranks: int | None,
) -> tuple[Refusal, ...]:
    """The files of ``weights_only_loads`` whose pickle names a global the load refuses, in load order. Under
    transformers 4.x with torch below 2.6 there are none (4.x passes no weights_only to most loads, and torch < 2.6
    defaults it to False)."""
    if version < (5, 0) and torch_version is not None and torch_version < (2, 6):
        return ()
    from ckptdoctor.pickle_verdict.judge import file_pickle

    out: list[Refusal] = []
    for f, reader, rng in weights_only_loads(ck, version, weights_file, restores, rng_ranks):
        pf = file_pickle(f)
        if pf is None:
            continue
        refused = tuple(g.dotted for g in pf.globals if not weights_only_admits(g.dotted, rng, numpy_major))
        if refused:
            out.append(Refusal(f, ck.relname(f), reader, refused, rng, numpy_major))
    return tuple(out)


@frozen
class StepPlan:
    """How far the resumed loop runs: ``Trainer.set_initial_training_values`` and ``_init_training_state``."""

    max_steps: int
    num_train_epochs: int  # the loop's epoch count
    epochs_trained: int
    steps_to_train: int


def resume_steps(
    global_step: int, steps_per_epoch: int, max_steps: int, num_train_epochs: float, ignore_data_skip: bool = False
) -> StepPlan:
    """The resumed loop's extent, exactly as transformers 5.x computes and runs it.

    ``max_steps`` is the argument (``> 0`` wins over epochs). The loop runs epochs ``epochs_trained ..
    num_train_epochs - 1``, skipping ``global_step % steps_per_epoch`` updates of the first, and stops after the
    first step that reaches ``max_steps`` (so a checkpoint at or past the end still trains one step when the loop
    has updates left, and none when it has not).
    """
    upe = steps_per_epoch
    if max_steps > 0:
        total = max_steps
        loop_epochs = max_steps // upe + int(max_steps % upe > 0)
    else:
        total = math.ceil(num_train_epochs * upe)
        loop_epochs = math.ceil(num_train_epochs)
    epochs_trained = global_step // upe
    skip = 0 if ignore_data_skip else global_step % upe
    available = (loop_epochs - epochs_trained) * upe - skip if loop_epochs > epochs_trained else 0
    steps = min(available, max(total - global_step, 1)) if available > 0 else 0
    return StepPlan(total, loop_epochs, epochs_trained, steps)


@frozen
class Raised:
    """An exception the resume would raise: its type's name and its message."""

    type: str
    message: str

    @classmethod
    def of(cls, exc: BaseException) -> Raised:
        """The name and message of ``exc``."""
        return cls(type(exc).__name__, str(exc))


@frozen
class Prediction:
    """What the resume of one checkpoint does under a plan, as far as it gets.

    Fields past the point where the resume raises keep their defaults: ``crash`` (a file the resume loads before
    its first step, said as what raises where) or ``step_error`` leave ``steps`` None; a schedule that cannot be
    built (``schedule_rejected``: get_scheduler's own refusal; ``schedule_error``: another exception) leaves
    ``lr0`` None; ``lrs`` are empty when no LR is predicted (``lr_unreadable``, ``lr_error`` or ``lr_count`` 0).
    """

    branch: str  # the weights branch of _load_from_checkpoint (trainer_view.weights_branch)
    start: int | None  # global_step the resume starts at; None: trainer_state.json cannot be read
    settings: ResolvedArgs
    crash: str | None = None
    step_error: Raised | None = None  # the max_steps / warm-up arithmetic raises
    steps: StepPlan | None = None
    warmup: int | None = None  # warm-up steps of the resumed schedule
    restores: bool = False  # optimizer and scheduler state are restored from the checkpoint
    base_lr: float | None = None  # the schedule's base LR: the checkpoint's when restored, else the planned one
    schedule_rejected: str | None = None
    schedule_error: Raised | None = None
    lr0: float | None = None  # the resumed schedule's LR at its step 0
    lr_count: int = 0  # how many resumed steps' LRs are predicted
    lr_unreadable: bool = False  # restored, but the LR stored in optimizer.pt / scheduler.pt cannot be read
    lr_error: Raised | None = None  # the schedule raises within the first lr_count steps
    lrs: tuple[float, ...] = ()
    # branch "full" beside an adapter: what load_state_dict(strict=False) of that file restores of the adapter
    adapter: trainer_view.AdapterRestore | None = None
    weights_file: str | None = None  # the file the weights load reads (weights_file), when one file says it
    crash_rule: str | None = None  # the rule that names ``crash`` when it is not CKD413's (CKD418)
    refused: tuple[Refusal, ...] = ()  # the files the resume loads that weights_only=True refuses, in load order
    # the weights file's keys against the live model's layout under the resuming transformers (None: they agree)
    layout: LayoutRestore | None = None
    # DeepSpeed: why the first resumed step does not run at the LR the checkpoint was saved with (an elastic ZeRO
    # checkpoint restores no param groups), and that saved LR; the DeepSpeed scheduler that drives every later LR
    # (the config's own "scheduler": ``lrs`` then holds the first step's LR only)
    lr_not_restored: str | None = None
    saved_lr: float | None = None
    ds_scheduler: str | None = None


def resume_checkpoint(tree: Tree) -> tuple[Checkpoint | None, str | None]:
    """The checkpoint the resume of ``tree`` loads (``get_last_checkpoint``'s pick in the root run, or the
    standalone checkpoint the root is), and the root run's pick, which the scan may not have read (a link out)."""
    root_run = next((r for r in tree.runs if r.path in ("", ".")), None)
    if root_run is None:
        return None, None
    ck: Checkpoint | None = None
    if root_run.resume_pick is not None:
        ck = next((c for c in root_run.checkpoints if c.path == root_run.resume_pick), None)
    elif root_run.standalone and root_run.checkpoints:
        ck = next((c for c in root_run.checkpoints if c.path in ("", ".")), root_run.checkpoints[0])
    return ck, root_run.resume_pick


def predict(ck: Checkpoint, plan: Plan, label: str) -> Prediction:
    """Predict the resume from ``ck`` under ``plan``; ``label`` names the checkpoint in errors.

    Raises ``GateInputError`` when steps per epoch can neither be read from the checkpoint nor were planned, or
    when the checkpoint's global_step is beyond any float (other numbers past float range read as infinities,
    ``trainer_view.number``).
    """
    ts = trainer_view.trainer_state(ck)
    branch = trainer_view.weights_branch(ck)
    # TrainerState.global_step defaults to 0; with no readable state the resume never gets a start step
    start = (ts.global_step or 0) if ts is not None else None
    settings = resolve(plan, ck, ts)
    # transformers 4.x loads safetensors only when the resuming save_safetensors is True (5.x always prefers them)
    prefer_safe = settings.save_safetensors or settings.major >= 5 or trainer_view.is_mindnlp(ck)
    crash = settings.args_error or _crash(ck, ts, branch, prefer_safe)
    if trainer_view.is_mindnlp(ck):
        settings = _mindnlp_settings(settings, ts)
    if start is not None and abs(start) >= INT_LIMIT:
        raise GateInputError(f"`{label}`: global_step ({int_text(start)}) is beyond any float: nothing can be "
                             "predicted from it")
    found = Prediction(branch, start, settings, crash, adapter=trainer_view.adapter_restore(ck, prefer_safe),
                       weights_file=weights_file(ck, branch, prefer_safe))
    if crash is not None or start is None:
        return found
    if settings.steps_per_epoch is None:
        if settings.steps_per_epoch_note is not None:  # a planned batch change it cannot size: CKD414 says so
            return found
        raise GateInputError(
            f"cannot derive steps per epoch from `{label}`'s trainer_state.json; pass --steps-per-epoch"
        )
    try:
        if abs(settings.max_steps) >= INT_LIMIT:
            # What transformers' first float of it raises (the warm-up steps, or the schedule's lambda); checked here
            # so that no prediction carries a step count too long to print or too costly to compute with.
            raise OverflowError("int too large to convert to float")
        steps = resume_steps(start, settings.steps_per_epoch, settings.max_steps, settings.num_train_epochs,
                             settings.ignore_data_skip)
        warmup = schedules.warmup_steps_for(settings.warmup_steps, steps.max_steps)
    except (ArithmeticError, ValueError) as exc:
        # transformers does the same arithmetic (math.ceil of epochs x steps, of max_steps x a warm-up ratio) and
        # raises the same error on an infinite, NaN or float-overflowing value read from the checkpoint.
        return replace(found, step_error=Raised.of(exc))
    crash = _state_crash(ck, branch, steps.steps_to_train, plan.world_size, plan.grad_scaler, plan.zero_stage)
    if crash is not None:  # a file the resume loads before its first step cannot be loaded: nothing is restored
        return replace(found, crash=crash)
    restores = trainer_view.is_deepspeed(ck) or (
        trainer_view.has_optimizer_state(ck) and trainer_view.scheduler_file(ck) is not None
    )
    refused = _refused(ck, plan, settings, found.weights_file, restores, steps.steps_to_train)
    if refused:  # torch.load(weights_only=True) raises on the first refused file: nothing is trained
        return replace(found, crash=refused[0].crash, crash_rule="CKD418", refused=refused, restores=restores)
    layout = key_layout(ck, settings.transformers_version, found.weights_file, restores)
    found = replace(found, layout=layout)
    if layout is not None and layout.optimizer_crash is not None:
        return replace(found, crash=layout.optimizer_crash, crash_rule="CKD421", restores=restores)
    base = _base_lr(ck) if restores else settings.learning_rate
    found = replace(found, steps=steps, warmup=warmup, restores=restores, base_lr=base)
    return _predict_lrs(found, ck, steps, warmup, plan.lr_steps)


def numpy_major(plan: Plan) -> tuple[int, str]:
    """The major version of the numpy the resume runs under, and whence: planned (``Plan.numpy_version``), else the
    one installed beside ckptdoctor (its metadata), else 2."""
    planned = version_tuple(plan.numpy_version)
    if planned is not None:
        return planned[0], "planned"
    installed = version_tuple(installed_version("numpy"))
    return (installed[0], "installed") if installed is not None else (2, "default")


def _refused(
    ck: Checkpoint, plan: Plan, s: ResolvedArgs, weights: str | None, restores: bool, steps_to_train: int
) -> tuple[Refusal, ...]:
    """The files this resume loads with ``weights_only=True`` that the load refuses (``weights_only.refusals``)."""
    version = version_tuple(s.transformers_version) or (5, 0)
    rng_ranks = (plan.world_size or 1) if steps_to_train > 0 else None
    return refusals(ck, version, version_tuple(installed_version("torch")), numpy_major(plan)[0], weights, restores,
                    rng_ranks)


def _mindnlp_settings(s: ResolvedArgs, ts: trainer_view.TrainerStateView | None) -> ResolvedArgs:
    """MindNLP writes no ``training_args.bin``: a warm-up nobody planned is read from the run's logged LRs (its
    LambdaLR logs ``base_lr * step / warmup_steps`` during warm-up) instead of defaulting to 0."""
    if s.sources.get("warmup_steps") != "default" or ts is None:
        return s
    warmup = trainer_view.logged_warmup_steps(ts, s.learning_rate)
    if warmup is None:
        return s
    return replace(s, warmup_steps=float(warmup), sources={**s.sources, "warmup_steps": "trainer_state.json"})


def _predict_lrs(p: Prediction, ck: Checkpoint, steps: StepPlan, warmup: int, lr_steps: int) -> Prediction:
    """``p`` with the resumed schedule and the LRs of the first ``lr_steps`` resumed optimizer steps."""
    s = p.settings
    ds = trainer_view.deepspeed_view(ck) if p.restores else None
    if ds is not None and ds.ds_scheduler is not None:
        # DeepSpeed's own scheduler (the config's "scheduler") replaces the Trainer's: the engine restores its
        # state and steps it; the first step runs at the LR the optimizer state restores
        first = _first_lr(ck) if ds.rigid else None
        n = 1 if first is not None and min(lr_steps, steps.steps_to_train) > 0 else 0
        return replace(p, ds_scheduler=ds.ds_scheduler, lr_count=n, lrs=(first,) if n and first is not None else ())
    try:
        sched = schedules.build(s.lr_scheduler_type, num_warmup_steps=warmup, num_training_steps=steps.max_steps,
                                lr_init=s.learning_rate, kwargs=s.lr_scheduler_kwargs, major=s.major)
        lr0 = sched.lr(s.learning_rate, 0)  # LambdaLR.__init__ evaluates the lambda at step 0: create_scheduler raises
    except schedules.ScheduleError as exc:
        p = replace(p, schedule_rejected=str(exc))
        if s.lr_scheduler_type in schedules.METRIC_DRIVEN and min(lr_steps, steps.steps_to_train) > 0:
            # ReduceLROnPlateau and GreedyLR change the LR only when stepped with an evaluation's metrics: the first
            # resumed step runs at the LR restored into the optimizer (a fresh one: the planned learning_rate)
            first = _first_lr(ck) if p.restores else s.learning_rate
            return p if first is None else replace(p, lr_count=1, lrs=(first,))
        return p
    except (ArithmeticError, TypeError, ValueError) as exc:  # kwargs of the wrong type or size, as get_scheduler
        return replace(p, schedule_error=Raised.of(exc))
    n = max(0, min(lr_steps, steps.steps_to_train))
    p = replace(p, lr0=lr0, lr_count=n)
    if n == 0:
        return p
    first = _first_lr(ck) if p.restores else None
    if ds is not None and ds.rigid is False:
        # an elastic ZeRO 1/2 state restores per-parameter tensors only: the param groups keep the LR the fresh
        # schedule set at its step 0, and the scheduler's restored state applies from the second step on
        first = lr0
        p = replace(p, saved_lr=trainer_view.checkpoint_lr(ck) if ds.engine_scheduler is False else _ds_last_lr(ds),
                    lr_not_restored=f"`{ds.tag}/` holds an elastic ZeRO optimizer state (`elastic_checkpoint: "
                    "true`), whose param groups DeepSpeed does not restore")
    base = p.base_lr
    if p.restores and (first is None or base is None):
        return replace(p, lr_unreadable=True)
    start = p.start or 0
    last_epoch = start
    sched_state = _scheduler_state(ck)
    if sched_state is not None and sched_state.last_epoch is not None:
        last_epoch = sched_state.last_epoch
    try:
        if p.restores:
            assert first is not None and base is not None
            lrs = [first] + [sched.lr(base, last_epoch + i) for i in range(1, n)]
        else:
            lrs = [sched.lr(s.learning_rate, i) for i in range(n)]
    except (ArithmeticError, TypeError, ValueError) as exc:  # e.g. num_cycles "x": LambdaLR's float() raises too
        return replace(p, lr_error=Raised.of(exc))
    return replace(p, lrs=tuple(lrs))


# ---------------------------------------------------------------------------------------------------------------
# What raises before the first step

# What the real loaders raise on a file the scan could not read (transformers 5.23, torch 2.13, safetensors 0.8):
# tests/gate/test_gate_damage.py resumes a real Trainer on each kind of damage. torch's zip reader (miniz) looks for the
# end-of-central-directory record in the last 4 KiB and then reads backwards: a cut archive no longer than that
# raises RuntimeError ("failed finding central directory"), a longer one OSError [Errno 22] (a seek before byte 0).
_ZIP_TAIL_SCAN = 4096
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")
_BROKEN = (ProblemKind.TRUNCATED, ProblemKind.MALFORMED, ProblemKind.INVALID_JSON, ProblemKind.UNREADABLE)


def _load_error(f: FileFacts) -> tuple[str, str] | None:
    """Why the loader of ``f`` raises and what it raises (``("is truncated", "OSError")``), or None when the scan
    found nothing that stops it (damage the loader tolerates, such as a JSON key given twice, is not a crash)."""
    name = f.name.lower()
    if f.kind is FileKind.EMPTY:
        if name.endswith(".json"):
            return "is empty (0 bytes)", "json.JSONDecodeError"
        if name.endswith(".safetensors"):
            return "is empty (0 bytes)", "SafetensorError"
        if name.endswith(_TORCH_SUFFIXES):
            return "is empty (0 bytes)", "EOFError"
        return None
    problem = next((p for p in f.problems if p.kind in _BROKEN), None)
    if problem is None:
        return None
    what = "is truncated" if problem.kind is ProblemKind.TRUNCATED else "is corrupt"
    if problem.kind is ProblemKind.UNREADABLE:
        return "cannot be read", "OSError"
    # MindNLP's `scheduler.json` is a zip archive, read as one (the torch branch below)
    if f.kind is FileKind.JSON or (name.endswith(".json") and not (
            f.kind is FileKind.TORCH_ZIP and name == trainer_view.MS_SCHEDULER)):
        # the scan also rejects a repeated key and bad UTF-8 (INVALID_JSON with another message): json.load does not
        if problem.kind is ProblemKind.TRUNCATED or problem.message.startswith("invalid JSON at line"):
            return what, "json.JSONDecodeError"
        return None
    if f.kind is FileKind.SAFETENSORS or name.endswith(".safetensors"):
        return what, "SafetensorError"
    if f.kind in (FileKind.TORCH_ZIP, FileKind.TORCH_LEGACY) or name.endswith(_TORCH_SUFFIXES):
        if f.kind is FileKind.TORCH_ZIP and f.content is None and problem.kind is ProblemKind.TRUNCATED:
            return what, "RuntimeError" if f.size <= _ZIP_TAIL_SCAN else "OSError"
        return what, "RuntimeError"
    return None


def _damaged(ck: Checkpoint, name: str, loader: str) -> str | None:
    """What raises when the file ``name`` that ``loader`` loads is unreadable (None when it loads)."""
    f = ck.file(name)
    bad = _load_error(f) if f is not None else None
    if bad is None:
        return None
    return f"`{name}` {bad[0]}: train() raises {bad[1]} in {loader}"


def _mindnlp_damaged(ck: Checkpoint, name: str, loader: str) -> str | None:
    """``_damaged`` for a file MindNLP loads (its exception types are not modelled, only that it raises)."""
    f = ck.file(name)
    bad = _load_error(f) if f is not None else None
    broken = next((p for p in f.problems if p.kind in _BROKEN), None) if f is not None else None
    if bad is None and f is not None and f.kind is FileKind.MINDSPORE and broken is not None:
        bad = ("is truncated" if broken.kind is ProblemKind.TRUNCATED else "is corrupt", "")
    return None if bad is None else f"`{name}` {bad[0]}: train() raises in {loader}"


def _shard_names(ck: Checkpoint) -> list[str] | None:
    """The shards ``load_sharded_checkpoint`` opens (the safetensors index first), or None when its index is
    unusable (its own crash). Names that are not plain paths inside the folder are left to the scan rules."""
    wm = trainer_view.weight_map(ck.file(trainer_view.SAFE_INDEX) or ck.file(trainer_view.BIN_INDEX))
    if wm is None:
        return None
    return sorted(n for n in set(wm.values()) if n and not n.startswith("/") and ".." not in n.split("/"))


def _index(ck: Checkpoint, prefer_safe: bool) -> str:
    """The index ``load_sharded_checkpoint(prefer_safe=...)`` reads: the safetensors one when it exists and is
    preferred or alone (transformers 4.x passes ``prefer_safe=args.save_safetensors``; 5.x leaves it True)."""
    safe = ck.file(trainer_view.SAFE_INDEX) is not None
    return trainer_view.SAFE_INDEX if safe and (prefer_safe or ck.file(trainer_view.BIN_INDEX) is None) else (
        trainer_view.BIN_INDEX)


def weights_file(ck: Checkpoint, branch: str, prefer_safe: bool = True) -> str | None:
    """The file the weights load reads: the full-weights file ``_load_from_checkpoint`` picks (transformers 4.x
    reads ``model.safetensors`` only when ``save_safetensors`` is True: ``prefer_safe``), the sharded checkpoint's
    index, or the adapter file peft's ``load_peft_weights`` picks (``adapter_model.safetensors`` first); None for
    FSDP, DeepSpeed, adapter sub-folders and MindNLP."""
    if trainer_view.is_mindnlp(ck):
        return None
    if branch == "full":
        loaded = trainer_view.loaded_weight_file(ck, prefer_safe)
        # none there: 4.x with save_safetensors=False still reads pytorch_model.bin, and raises (CKD413)
        return trainer_view.BIN_WEIGHTS if loaded is None else ck.relname(loaded)
    if branch == "sharded":
        return _index(ck, prefer_safe)
    if branch == "adapter" and not trainer_view.adapter_subdirs(ck):
        if ck.file(trainer_view.ADAPTER_SAFE) is not None:
            return trainer_view.ADAPTER_SAFE
        return trainer_view.ADAPTER_BIN
    return None


def _weights_crash(ck: Checkpoint, branch: str, prefer_safe: bool = True) -> str | None:
    """What ``_load_from_checkpoint`` raises on a damaged file it reads: config.json, then the weights branch's."""
    if branch == "deepspeed":
        return None  # deepspeed_load_checkpoint reads its own global_step*/ files (not modelled here)
    crash = _damaged(ck, "config.json", "_load_from_checkpoint (PreTrainedConfig.from_json_file)")
    if crash is not None or branch not in ("full", "sharded"):
        return crash  # adapter and FSDP weights are read by peft and accelerate: not modelled here
    if branch == "full":
        if ck.file(trainer_view.SAFE_WEIGHTS) is not None and prefer_safe:
            return _damaged(ck, trainer_view.SAFE_WEIGHTS, "_load_from_checkpoint (safetensors.torch.load_file)")
        if trainer_view.is_mindnlp(ck):
            return _mindnlp_damaged(ck, trainer_view.MS_WEIGHTS, "_load_from_checkpoint (mindspore.load_checkpoint)")
        if ck.file(trainer_view.BIN_WEIGHTS) is None:
            # transformers 4.x with save_safetensors=False: `torch.load(weights_file)` on a folder holding only
            # model.safetensors
            return ("save_safetensors=False: transformers 4.x's _load_from_checkpoint reads `pytorch_model.bin`, "
                    "not `model.safetensors`, and there is none: train() raises FileNotFoundError in "
                    "_load_from_checkpoint (torch.load)")
        return _damaged(ck, trainer_view.BIN_WEIGHTS, "_load_from_checkpoint (torch.load)")
    index = _index(ck, prefer_safe)
    crash = _damaged(ck, index, "load_sharded_checkpoint (json.load)")
    loader = "safetensors.torch.load_file" if index == trainer_view.SAFE_INDEX else "torch.load"
    for shard in _shard_names(ck) or ():
        if ck.file(shard) is None:
            return (f"`{shard}` (listed in `{index}`) is missing: train() raises FileNotFoundError in "
                    f"load_sharded_checkpoint ({loader})")
        crash = crash or _damaged(ck, shard, f"load_sharded_checkpoint ({loader})")
    return crash


def _crash(
    ck: Checkpoint, ts: trainer_view.TrainerStateView | None, branch: str, prefer_safe: bool = True
) -> str | None:
    """What makes ``train()`` raise before the first step, in the order it would happen (None: nothing): the
    weights and ``trainer_state.json`` that ``train()`` loads first (``_state_crash`` has the rest)."""
    if branch == "none":
        return "no weights file to load: train() raises ValueError(\"Can't find a valid checkpoint at ...\")"
    crash = _weights_crash(ck, branch, prefer_safe)
    if crash is not None:
        return crash
    state = ck.file(trainer_view.TRAINER_STATE)
    if state is None:
        return "no `trainer_state.json`: train() raises FileNotFoundError in TrainerState.load_from_json"
    if ts is None:
        if state_not_read(ck) is not None:
            return None  # nothing says json.load fails on it: CKD412 says the steps and LRs are not predicted
        bad = _load_error(state)
        if bad is not None:
            return f"`trainer_state.json` {bad[0]}: train() raises {bad[1]} in TrainerState.load_from_json"
        return "`trainer_state.json` is not a valid JSON object: train() raises in TrainerState.load_from_json"
    if "train_batch_size" in ts.raw and ts.raw["train_batch_size"] is None:
        return "`train_batch_size` is null: train() raises TypeError in compare_trainer_and_checkpoint_args"
    if trainer_view.is_deepspeed(ck) and loads_scheduler_pt(ck) and ck.file(trainer_view.SCHEDULER) is None:
        return ("DeepSpeed checkpoint without `scheduler.pt`, and its DeepSpeed config names no optimizer or scheduler "
                "(the Trainer holds the schedule and loads that file): _load_optimizer_and_scheduler raises "
                "FileNotFoundError")
    return None


def loads_scheduler_pt(ck: Checkpoint) -> bool:
    """Whether the resume of ``ck`` loads ``scheduler.pt``: always outside DeepSpeed; under DeepSpeed only when the
    Trainer holds the schedule, that is when the DeepSpeed config names neither an "optimizer" nor a "scheduler"
    (else the Trainer's scheduler is accelerate's ``DeepSpeedSchedulerWrapper``, which the engine saves and
    restores itself, and ``_load_optimizer_and_scheduler`` skips it). A config that cannot be read counts as the
    Trainer's, the default of a Trainer run."""
    ds = trainer_view.deepspeed_view(ck)
    return ds is None or ds.engine_scheduler is not True


def deepspeed_load_crash(ck: Checkpoint, zero_stage: int | None = None) -> str | None:
    """What ``engine.load_checkpoint`` raises on ``ck`` before any step (DeepSpeed 0.19.8), None when nothing
    says it does. A resume planned under ZeRO-3 (``zero_stage``) of a stage 0-2 save: stage 3 reads each rank's
    ``zero_pp_rank_R_mp_rank_00_model_states.pt``, which those stages do not write, and the state-dict loader
    asserts its file list is not empty. An elastic ZeRO 1/2 partition without ``base_optimizer_state_step``:
    DeepSpeed saves that step only when the optimizer keeps ``step`` in its param groups (its own Adam does, torch's
    optimizers keep it per parameter), and `_restore_step_from_elastic_checkpoint` asserts it is there."""
    ds = trainer_view.deepspeed_view(ck)
    if ds is None:
        return None
    if zero_stage == 3 and ds.zero_stage is not None and ds.zero_stage < 3 and ds.tag is not None:
        return (f"`{ds.tag}/` was saved under ZeRO stage {ds.zero_stage}, and the resume runs ZeRO-3, which reads "
                "`zero_pp_rank_R_mp_rank_00_model_states.pt` files that stage does not write: train() raises "
                "AssertionError in DeepSpeed's state-dict loader (`check_ckpt_list`, deepspeed_load_checkpoint)")
    if ds.rigid is not False or ds.elastic_step is not False:
        return None
    return (f"`{ds.tag}/` holds an elastic ZeRO optimizer state (`elastic_checkpoint: true`) without "
            "`base_optimizer_state_step` (its optimizer keeps `step` per parameter, as torch's do): train() raises "
            "AssertionError in DeepSpeed's `_restore_step_from_elastic_checkpoint` (deepspeed_load_checkpoint)")


def state_not_read(ck: Checkpoint) -> str | None:
    """Why ``trainer_state.json`` was not read, when a resource limit stopped the reader (a file over
    ``Limits.json_bytes``), else None. ``json.load`` reads such a file: the resume is unpredicted, not failing."""
    state = ck.file(trainer_view.TRAINER_STATE)
    return next((p.message for p in state.problems if p.kind is ProblemKind.LIMIT), None) if state else None


def _state_crash(
    ck: Checkpoint, branch: str, steps_to_train: int, world_size: int | None, grad_scaler: bool | None = None,
    zero_stage: int | None = None,
) -> str | None:
    """What raises after the step arithmetic and before the first optimizer step: a damaged ``optimizer.pt`` or
    ``scheduler.pt`` that ``_load_optimizer_and_scheduler`` loads (both exist), ``scaler.pt`` (``_load_scaler``:
    any one when the resume has no GradScaler, ``grad_scaler`` False; a damaged one otherwise), and the RNG file
    ``_load_rng_state`` loads when the first epoch runs (each rank its ``rng_state_R.pth`` when more than one
    process runs; a missing one only logs)."""
    if trainer_view.is_mindnlp(ck):
        # MindNLP loads both state files when both exist, and has no scaler or RNG file
        if trainer_view.optimizer_file(ck) is None or trainer_view.scheduler_file(ck) is None:
            return None
        loader = "MindNLP's _load_optimizer_and_scheduler"
        return (_mindnlp_damaged(ck, trainer_view.MS_OPTIMIZER, loader)
                or _mindnlp_damaged(ck, trainer_view.MS_SCHEDULER, loader))
    loader = "_load_optimizer_and_scheduler (torch.load)"
    if branch == "deepspeed":
        crash = deepspeed_load_crash(ck, zero_stage)
        if crash is None and loads_scheduler_pt(ck):
            crash = _damaged(ck, trainer_view.SCHEDULER, loader)
    elif trainer_view.has_optimizer_state(ck) and ck.file(trainer_view.SCHEDULER) is not None:
        crash = None
        if branch != "fsdp":  # FSDP reads its optimizer through accelerate; every other resume reads optimizer.pt
            if ck.file("optimizer.pt") is None:
                return ("optimizer state without `optimizer.pt` (`optimizer.bin` or an `optimizer*` folder is read "
                        "only under FSDP): train() raises FileNotFoundError in " + loader)
            crash = _damaged(ck, "optimizer.pt", loader)
        crash = crash or _damaged(ck, trainer_view.SCHEDULER, loader)
    else:
        crash = None
    scaler = ck.file("scaler.pt")
    bad = _load_error(scaler) if scaler is not None else None
    # `accelerator.scaler.load_state_dict(torch.load(...))` whenever the file exists: without a GradScaler (no fp16,
    # or fp16 on CPU) the attribute lookup on None raises before torch.load runs, whatever the file holds
    if crash is None and scaler is not None and grad_scaler is False:
        state = f"`scaler.pt` {bad[0]}" if bad is not None else "`scaler.pt` (saved by an fp16 run) is there"
        crash = (f"{state} and the resume has no GradScaler: train() raises AttributeError in _load_scaler "
                 "('NoneType' object has no attribute 'load_state_dict')")
    elif crash is None and bad is not None and grad_scaler:
        crash = f"`scaler.pt` {bad[0]}: train() raises {bad[1]} in _load_scaler (torch.load)"
    elif crash is None and bad is not None:
        crash = (f"`scaler.pt` {bad[0]}: train() raises in _load_scaler: AttributeError when the resume runs "
                 f"without a GradScaler (no fp16), else {bad[1]} from torch.load")
    if crash is not None or steps_to_train <= 0:
        return crash
    ranks = world_size or 1
    for f in ck.files:
        m = trainer_view.RNG_RE.match(ck.relname(f))
        rank = None if m is None else (-1 if m.group(1) is None else int(m.group(1)))
        if rank is not None and (rank == -1 if ranks == 1 else 0 <= rank < ranks):
            crash = crash or _damaged(ck, ck.relname(f), "_load_rng_state (torch.load)")
    return crash


# ---------------------------------------------------------------------------------------------------------------
# The LRs the checkpoint holds


def _scheduler_state(ck: Checkpoint) -> trainer_view.SchedulerView | None:
    """The LambdaLR state the resume restores: ``scheduler.pt``, or under DeepSpeed with the schedule in the engine
    (``loads_scheduler_pt`` False) the engine's saved ``lr_scheduler``."""
    ds = trainer_view.deepspeed_view(ck)
    if ds is not None and not loads_scheduler_pt(ck):
        return ds.scheduler
    return trainer_view.scheduler_state(ck)


def _ds_last_lr(ds: trainer_view.DeepSpeedView) -> float | None:
    """The LR the engine's saved LambdaLR last set (``_last_lr[0]``)."""
    return ds.scheduler.last_lr[0] if ds.scheduler is not None and ds.scheduler.last_lr else None


def _first_lr(ck: Checkpoint) -> float | None:
    """The LR the first resumed step uses: ``optimizer.pt``'s group 0 (under DeepSpeed, the ZeRO partition's param
    group 0), else what the checkpoint otherwise holds."""
    ds = trainer_view.deepspeed_view(ck)
    if ds is not None:
        if ds.lr is not None:
            return ds.lr
        if not loads_scheduler_pt(ck):
            return _ds_last_lr(ds)
    opt = trainer_view.optimizer_state(ck)
    if opt is not None and opt.groups and opt.groups[0].lr is not None:
        return opt.groups[0].lr
    return trainer_view.checkpoint_lr(ck)


def _base_lr(ck: Checkpoint) -> float | None:
    """``base_lrs[0]`` that ``LambdaLR.load_state_dict`` restores, else the optimizer's ``initial_lr``."""
    sched = _scheduler_state(ck)
    if sched is not None and sched.base_lrs:
        return sched.base_lrs[0]
    opt = trainer_view.optimizer_state(ck)
    if opt is not None and opt.groups:
        return opt.groups[0].initial_lr
    return None


# ---------------------------------------------------------------------------------------------------------------
# The saved key layout against the live model's (issue 24, item 5)


@frozen
class LayoutRestore:
    """What ``load_state_dict(state_dict, strict=False)`` of the weights file restores when the resuming transformers
    builds the model in another key layout than the one ``save_pretrained`` wrote (``ckptdoctor/key_layouts.json``)."""

    file: str  # the weights file (or index) the resume loads
    architecture: str  # config.json's class name (or model type) the table matched
    release: str  # the transformers release of the table whose layout was used
    restored: int  # live tensors whose name the file holds
    total: int  # the live model's tensors, as the file's keys become under the release's conversion
    missing: tuple[str, ...]  # live tensors left at their initial values, in name order
    saved_changed: int  # saved keys the conversion renames or merges
    optimizer_crash: str | None  # the optimizer load's crash: the state holds another layout's parameter count
    # saved keys a transform ``key_layouts`` does not model would rename (under the resuming release, or the writing
    # one when the optimizer's count is in question): restored or not, nothing here says. ``missing`` then holds only
    # live tensors no saved key names (certainly left at their initial values), ``total`` counts each unknown as one.
    unmodelled: int = 0
    unmodelled_by: tuple[str, ...] = ()  # which transforms, as "`Kind` (transformers X's conversion of `name`)"
    saved: int = 0  # the file's tensors


def key_layout(ck: Checkpoint, version: str, weights: str | None, restores: bool) -> LayoutRestore | None:
    """What the resume under transformers ``version`` restores of the model from ``weights`` when that release
    builds the checkpoint's architecture (``config.json``) in another key layout than the saved one, and whether
    the optimizer load then raises (the release that wrote the checkpoint trained another parameter count: its
    ``transformers_version`` converts other keys, or none). None when nothing differs, or nothing says it does (no
    table entry, an unmodelled conversion, unreadable keys)."""
    config = trainer_view.json_value(ck.file("config.json"))
    if not isinstance(config, dict) or weights is None:
        return None
    names = key_layouts.model_names(config)
    saved = key_layouts.saved_keys(ck, weights)
    if not names or not saved:
        return None
    wrote = config.get("transformers_version")
    shown = names[0]
    resumed = key_layouts.convert(version, names, saved)
    written = key_layouts.convert(wrote, names, saved) if isinstance(wrote, str) else None
    unsure = [c for c in (resumed, written) if c is not None and c.unmodelled]
    by = tuple(dict.fromkeys(f"`{k}` (transformers {c.release}'s conversion of `{c.name}`)" for c in unsure
                             for k in c.unmodelled_kinds))
    # the live model's tensor count under each release, from one counting path (``Conversion.live_count``)
    live_r = len(saved) if resumed is None else resumed.live_count
    live_w = len(saved) if written is None else written.live_count
    crash = None
    opt = trainer_view.optimizer_state(ck) if restores else None
    if (opt is not None and isinstance(wrote, str) and version_tuple(wrote) is not None and live_r != live_w
            and not unsure):  # an unmodelled renaming may merge: the counts are then not known to differ
        opt_name = ck.relname(trainer_view.optimizer_file(ck) or ck.files[0])
        crash = (f"`{opt_name}` holds state for {plural(opt.param_count, 'parameter')} (as transformers {wrote} built "
                 f"`{shown}`), and transformers {version} builds it with {opt.param_count + live_r - live_w:,}: "
                 "train() raises ValueError (\"loaded state dict contains a parameter group that doesn't match the "
                 "size of optimizer's group\") in _load_optimizer_and_scheduler")
    if resumed is None and crash is None and not unsure:
        return None
    if resumed is None:  # the resuming release loads the saved keys as they are: only the optimizer differs
        return LayoutRestore(weights, shown, "", len(saved), len(saved), (), 0, crash, len(written.unmodelled)
                             if written is not None else 0, by, len(saved))
    if resumed.unmodelled:
        restored = len(saved) - len(resumed.changed) - len(resumed.unmodelled)
        missing = tuple(t for t in resumed.targets if t not in set(saved))
        return LayoutRestore(weights, shown, resumed.release, restored, resumed.live_count, missing,
                             len(resumed.changed), crash, len(resumed.unmodelled), by, len(saved))
    restored = len(saved) - len(resumed.changed)
    return LayoutRestore(weights, shown, resumed.release, restored, resumed.live_count, resumed.targets,
                         len(resumed.changed), crash, 0, by, len(saved))
