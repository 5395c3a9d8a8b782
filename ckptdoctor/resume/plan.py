"""The planned resume: the Plan, reading and checking planned TrainingArguments, and the values the resume will use.

``resolve`` says what each argument of the resumed run will be and where it came from (planned, the checkpoint's
``training_args.bin``, ``trainer_state.json``, ``scheduler.pt``, or transformers' default). Nothing here predicts.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ckptdoctor import schedules, trainer_view
from ckptdoctor.errors import UsageError
from ckptdoctor.model import Checkpoint, FileFacts, FileKind, JsonFacts, frozen_value

DEFAULT_LR_STEPS = 5
MAX_LR_STEPS = 100_000  # a prediction is read by people and scripts; more would only take minutes and gigabytes
# TrainingArguments defaults (transformers 5.23) of the fields the resume arithmetic reads.
ARG_DEFAULTS: dict[str, Any] = {
    "num_train_epochs": 3.0,
    "max_steps": -1,
    "learning_rate": 5e-5,
    "lr_scheduler_type": "linear",
    "warmup_steps": 0.0,
    "lr_scheduler_kwargs": None,
    "ignore_data_skip": False,
    "save_safetensors": True,  # transformers 4.x (5.x has no such argument: it always prefers safetensors)
    "auto_find_batch_size": False,
}
PRINTABLE_BITS = 4000  # about 1,200 digits: well under Python's 4,300-digit int-to-str limit
# Integers beyond this cannot become a float: transformers' step and warm-up arithmetic overflows on them, and a
# prediction built on one says nothing. A max_steps this large is that crash (CKD413); a global_step, or a planned
# integer, is unusable input.
INT_LIMIT = 2**1023


class GateInputError(UsageError):
    """The gate cannot predict with what it was given (e.g. steps per epoch cannot be derived): a usage error."""


@frozen_value
@dataclass(frozen=True, slots=True, eq=False, repr=False)
class Plan:
    """How the resume is planned. ``None`` means "as the run was": read from the checkpoint itself.

    Fields carry ``TrainingArguments`` semantics (transformers 5.x): ``max_steps > 0`` overrides
    ``num_train_epochs``; ``warmup_steps < 1`` is a ratio of max_steps. Planning ``num_train_epochs`` without
    ``max_steps`` means an epoch-based run (``max_steps=-1``). ``steps_per_epoch`` counts optimizer updates
    (``ceil(len(train_dataloader) / gradient_accumulation_steps)``). ``grad_scaler`` says whether the resuming
    Trainer has a GradScaler (``trainer.accelerator.scaler is not None``; None: unknown): without one, a
    ``scaler.pt`` in the checkpoint makes ``_load_scaler`` raise AttributeError. ``save_safetensors`` is the
    resuming ``TrainingArguments``' (transformers 4.x only: False loads ``pytorch_model.bin``, not
    ``model.safetensors``). ``transformers_version`` is the version the resume runs under ("4.57"; None: the
    installed one, else the checkpoint's, see ``transformers_version``).
    """

    checkpoint: str | None = None
    num_train_epochs: float | None = None
    max_steps: int | None = None
    learning_rate: float | None = None
    lr_scheduler_type: str | None = None
    warmup_steps: float | None = None
    # transformers 4.x's warmup_ratio, used when warmup_steps is not above 0 (5.x has none: a planned ratio is its
    # warmup_steps below 1)
    warmup_ratio: float | None = None
    lr_scheduler_kwargs: Mapping[str, Any] | None = None
    steps_per_epoch: int | None = None
    world_size: int | None = None
    per_device_train_batch_size: int | None = None
    gradient_accumulation_steps: int | None = None
    ignore_data_skip: bool | None = None
    grad_scaler: bool | None = None
    save_safetensors: bool | None = None
    auto_find_batch_size: bool | None = None
    transformers_version: str | None = None
    lr_steps: int = DEFAULT_LR_STEPS
    fail_on: str = "error"


# The TrainingArguments that size an epoch: with the world size they make the train dataloader's length.
BATCH_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps")
PLAN_FIELDS = frozenset(
    ("num_train_epochs", "max_steps", "learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio",
     "lr_scheduler_kwargs",
     "steps_per_epoch", "world_size", "per_device_train_batch_size", "gradient_accumulation_steps",
     "ignore_data_skip", "grad_scaler", "save_safetensors", "auto_find_batch_size", "transformers_version")
)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Reading planned values


def int_text(n: int) -> str:
    """``n`` for a message; one too long for Python to print (over 4,300 digits, from a pickle) by its size."""
    return str(n) if n.bit_length() <= PRINTABLE_BITS else f"<an integer of {n.bit_length():,} bits>"


def parse_kwargs(v: Any) -> dict[str, Any] | None:
    """``lr_scheduler_kwargs`` as TrainingArguments accepts it: a dict, a JSON object string, or None/empty."""
    if isinstance(v, str) and v.strip():
        try:
            v = json.loads(v)
        except (ValueError, RecursionError):  # not JSON, a 5,000-digit number, or arrays nested 10^5 deep
            return None
    if isinstance(v, dict):
        return {k if isinstance(k, str) else schedules.brief(k): x for k, x in v.items()}
    return None


def plan_from_training_args(args: Mapping[str, Any], *, strict: bool = False) -> dict[str, Any]:
    """Planned values from a ``TrainingArguments``-like mapping (``args.to_dict()``, a JSON config file).

    Only the fields the resume arithmetic reads are taken; ``warmup_ratio`` (transformers 4) is kept, in place of
    ``warmup_steps``, when ``warmup_steps`` is 0 (``get_warmup_steps`` uses it only then). ``fp16`` false with
    ``bf16`` true is ``grad_scaler=False``:
    transformers then asks accelerate for bf16, which makes no GradScaler on any device (with both false the
    mixed precision is the launcher's ``ACCELERATE_MIXED_PRECISION``, possibly fp16: unknown). A value of the
    wrong type is skipped, as for the checkpoint's own ``training_args.bin``; with ``strict`` (values the user
    planned) it, or a number that is not finite, raises ``GateInputError`` naming the key. A missing or null key is
    never an error.
    """
    if strict:
        _check_training_args(args)
    out: dict[str, Any] = {}
    for key in ("num_train_epochs", "learning_rate", "warmup_steps"):
        value = trainer_view.number(args.get(key))
        if value is not None:
            out[key] = value
    if trainer_view._int(args.get("max_steps")) is not None:
        out["max_steps"] = int(args["max_steps"])
    for key in BATCH_FIELDS:
        count = trainer_view._int(args.get(key))
        if count is not None and count >= 1:
            out[key] = count
    if isinstance(args.get("lr_scheduler_type"), str):
        out["lr_scheduler_type"] = args["lr_scheduler_type"]
    kwargs = parse_kwargs(args.get("lr_scheduler_kwargs"))
    if kwargs is not None:
        out["lr_scheduler_kwargs"] = kwargs
    for key in ("ignore_data_skip", "save_safetensors", "auto_find_batch_size"):
        if isinstance(args.get(key), bool):
            out[key] = args[key]
    ratio = trainer_view.number(args.get("warmup_ratio"))
    if ratio and not out.get("warmup_steps") and 0 < ratio < 1:
        out.pop("warmup_steps", None)
        out["warmup_ratio"] = ratio
    if args.get("fp16") is False and args.get("bf16") is True:
        out["grad_scaler"] = False
    return out


def own_warmup(own: Mapping[str, Any]) -> Any:
    """The warm-up a ``plan_from_training_args`` mapping holds: ``warmup_steps``, else transformers 4's
    ``warmup_ratio`` (kept in its place when ``warmup_steps`` is 0); ``schedules.warmup_steps_for`` reads a value
    below 1 as a ratio of max_steps. None when neither is set."""
    return own.get("warmup_steps", own.get("warmup_ratio"))


_YAML_NUMBERS = ("num_train_epochs", "learning_rate", "warmup_steps", "warmup_ratio")


@dataclass(frozen=True)
class ArgsFile:
    """A ``--training-args`` file as read: its ``TrainingArguments`` mapping, and its ``FileFacts`` when it holds
    pickle streams (a ``training_args.bin``), whose verdict the gate reports as a scan would (None for JSON/YAML)."""

    args: dict[str, Any]
    facts: FileFacts | None = None


# What ``torch.load`` unpickles: the kinds a ``training_args.bin`` can be (and a bare pickle of the arguments).
_PICKLE_KINDS = frozenset({FileKind.TORCH_ZIP, FileKind.TORCH_LEGACY, FileKind.PICKLE})
_OPEN = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def read_training_args(path: str) -> ArgsFile:
    """The ``TrainingArguments`` a launcher holds in the file ``path``, as a mapping for ``plan_from_training_args``.

    The file is opened once and sniffed and read by ``ckptdoctor.readers``, as a scan reads it. A
    ``training_args.bin`` (``torch.save`` of ``TrainingArguments``, what ``Trainer._save`` writes) is read exactly
    as a scan reads the checkpoint's own: its pickle walked opcode by opcode, never loaded
    (``trainer_view.training_args``); its facts are kept (path: ``path`` as given) for the gate to judge.
    Anything else is JSON (``args.to_json_string()``), or YAML when PyYAML is importable (a YAML 1.1 parser reads
    ``2e-5`` as a string: such strings of the float fields become numbers, as ``HfArgumentParser`` makes them).
    Raises ``GateInputError`` saying why the file cannot be used.
    """
    from ckptdoctor.readers import read_open_file

    try:
        fd = os.open(os.path.realpath(path), _OPEN)
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):  # click checked it exists; a FIFO or device is never read
                raise GateInputError(f"{path}: not a regular file")
            facts = read_open_file(fh, FileFacts(path, st.st_size, st.st_mtime, FileKind.OTHER))
            if facts.kind in _PICKLE_KINDS:
                args = trainer_view._training_args(facts)
                if args is None:
                    why = facts.problems[0].message if facts.problems else "it holds no TrainingArguments state"
                    raise GateInputError(f"{path}: cannot read it as a training_args.bin: {why}{_unsafe(facts)}")
                return ArgsFile(args, facts)
            if isinstance(facts.content, JsonFacts) and isinstance(facts.content.value, dict):
                return ArgsFile(facts.content.value)  # parsed by the JSON reader already
            fh.seek(0)
            data = fh.read(_ARGS_FILE_CAP + 1)
    except OSError as exc:
        raise GateInputError(f"{path}: {exc.strerror or exc}") from None
    if len(data) > _ARGS_FILE_CAP:
        raise GateInputError(f"{path}: over {_ARGS_FILE_CAP // 2**20} MiB: not a TrainingArguments file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise GateInputError(f"{path}: neither a training_args.bin nor UTF-8 JSON or YAML") from None
    try:
        loaded = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: arrays nested 10^5 deep
        loaded = _yaml(path, text, exc)
    if not isinstance(loaded, dict):
        raise GateInputError(f"{path}: not a mapping of TrainingArguments (a JSON or YAML object)")
    return ArgsFile(loaded)


def _unsafe(facts: FileFacts) -> str:
    """What loading a file that is no TrainingArguments could run, as CKD601 says it (empty when nothing): an
    unusable --training-args is a usage error, and the user should not try ``torch.load`` on it to see why."""
    from ckptdoctor.pickle_analysis import file_pickle, judge

    pf = file_pickle(facts)
    unsafe = judge(pf).unsafe if pf is not None else ()
    return f"; and loading it can run code: its pickle names {', '.join(unsafe[:8])}" if unsafe else ""


_ARGS_FILE_CAP = 16 * 2**20  # a TrainingArguments JSON is a few KiB


def _yaml(path: str, text: str, json_error: BaseException) -> Any:
    """``text`` read as YAML when PyYAML is importable (never a dependency of ckptdoctor), else the JSON error."""
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:
        raise GateInputError(f"{path}: not JSON ({json_error or type(json_error).__name__}); YAML is read only when "
                             "PyYAML is installed") from None
    try:
        loaded = yaml.safe_load(text)  # safe_load builds plain values only: no tags that construct objects
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        raise GateInputError(f"{path}: neither JSON nor YAML ({_first_line(exc)})") from None
    if isinstance(loaded, dict):
        for key in _YAML_NUMBERS:
            v = loaded.get(key)
            if isinstance(v, str):
                with contextlib.suppress(ValueError):  # else left as is: the strict check names it
                    loaded[key] = float(v)
    return loaded


def _first_line(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__).splitlines()[0]


def _check_training_args(args: Mapping[str, Any]) -> None:
    """``GateInputError`` for a planned ``TrainingArguments`` value that ``plan_from_training_args`` would skip."""
    brief = schedules.brief
    for key in ("num_train_epochs", "learning_rate", "warmup_steps", "warmup_ratio"):
        v = args.get(key)
        number = trainer_view.number(v)
        if v is not None and (number is None or not math.isfinite(number)):
            raise GateInputError(f"training_args {key} must be a finite number, not {brief(v)}")
    v = args.get("max_steps")
    if v is not None and trainer_view._int(v) is None:
        raise GateInputError(f"training_args max_steps must be an integer, not {brief(v)}")
    for key in BATCH_FIELDS:
        v = args.get(key)
        if v is not None and (trainer_view._int(v) is None or v < 1):
            raise GateInputError(f"training_args {key} must be an integer >= 1, not {brief(v)}")
    v = args.get("lr_scheduler_type")
    if v is not None and not isinstance(v, str):
        raise GateInputError(f"training_args lr_scheduler_type must be a string, not {brief(v)}")
    for key in ("ignore_data_skip", "fp16", "bf16", "save_safetensors", "auto_find_batch_size"):
        v = args.get(key)
        if v is not None and not isinstance(v, bool):
            raise GateInputError(f"training_args {key} must be true or false, not {brief(v)}")
    v = args.get("lr_scheduler_kwargs")
    if v is not None and parse_kwargs(v) is None and not (isinstance(v, str) and not v.strip()):
        raise GateInputError(f"training_args lr_scheduler_kwargs must be a mapping or a JSON object, not {brief(v)}")


def check_plan(values: dict[str, Any]) -> None:
    """Planned values of the wrong type or range are the caller's mistake: ``GateInputError``, never a traceback
    from deep in the arithmetic. ``lr_scheduler_kwargs`` given as a JSON object string becomes a dict."""
    brief = schedules.brief
    for key in ("num_train_epochs", "learning_rate", "warmup_steps", "warmup_ratio"):
        v = values.get(key)
        number = trainer_view.number(v)
        if v is not None and (number is None or not math.isfinite(number)):
            raise GateInputError(f"{key} must be a finite number, not {brief(v)}")
    for key, low in (("max_steps", None), ("steps_per_epoch", 1), ("world_size", 1),
                     ("per_device_train_batch_size", 1), ("gradient_accumulation_steps", 1)):
        v = values.get(key)
        if v is not None and (trainer_view._int(v) is None or (low is not None and v < low) or abs(v) >= INT_LIMIT):
            raise GateInputError(f"{key} must be an integer{f' >= {low}' if low else ''} below 2**1023, not {brief(v)}")
    if values.get("lr_scheduler_type") is not None and not isinstance(values["lr_scheduler_type"], str):
        raise GateInputError(f"lr_scheduler_type must be a string, not {brief(values['lr_scheduler_type'])}")
    for key in ("ignore_data_skip", "grad_scaler", "save_safetensors", "auto_find_batch_size"):
        if values.get(key) is not None and not isinstance(values[key], bool):
            raise GateInputError(f"{key} must be True or False, not {brief(values[key])}")
    version = values.get("transformers_version")
    if version is not None and version_major(version) is None:
        raise GateInputError(f"transformers_version must be a version such as 4.57 or 5.23, not {brief(version)}")
    raw = values.get("lr_scheduler_kwargs")
    if isinstance(raw, str) and not raw.strip():
        values.pop("lr_scheduler_kwargs")  # TrainingArguments reads an empty string as no kwargs
    elif raw is not None:
        kwargs = parse_kwargs(dict(raw) if isinstance(raw, Mapping) else raw)
        if kwargs is None:
            raise GateInputError(f"lr_scheduler_kwargs must be a mapping, not {brief(raw)}")
        values["lr_scheduler_kwargs"] = kwargs


# ---------------------------------------------------------------------------------------------------------------
# What the resume will run with


@frozen_value
@dataclass(frozen=True, slots=True, eq=False, repr=False)
class Settings:
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


_VERSION_RE = re.compile(r"(\d+)(?:\.\d+)*")


def version_major(version: object) -> int | None:
    """The major number of a transformers version string ("4.57.6", "5.23.0.dev0", "4.57"), or None."""
    m = _VERSION_RE.match(version.strip()) if isinstance(version, str) else None
    return int(m.group(1)) if m is not None and len(m.group(1)) <= 4 else None


@functools.cache
def installed_transformers() -> str | None:
    """The version of the transformers installed beside ckptdoctor, from its distribution metadata: transformers
    itself is never imported (the gate reads, it does not load a training stack)."""
    from importlib import metadata

    try:
        return metadata.version("transformers")
    except (metadata.PackageNotFoundError, ValueError):
        return None


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
    config = trainer_view._json(ck.file("config.json"))
    for name, doc in (("config.json", config), (trainer_view.TRAINER_STATE, ts.raw if ts is not None else None)):
        found = doc.get("transformers_version") if isinstance(doc, dict) else None
        # a version is a few characters: a file's megabyte of text in that key is not one, and is not echoed
        if isinstance(found, str) and len(found) <= 64 and version_major(found) is not None:
            return found, name
    return "5", "default"


def resolve(plan: Plan, ck: Checkpoint, ts: trainer_view.TrainerStateView | None) -> Settings:
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
    max_steps = pick("max_steps", planned_max, trainer_view._int(args.get("max_steps")),
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
        run_device = trainer_view._int(args.get("per_device_train_batch_size")) or ts.train_batch_size
        if plan.per_device_train_batch_size != run_device:
            ignored_batch = plan.per_device_train_batch_size
        plan = replace(plan, per_device_train_batch_size=None)
    upe, sources["steps_per_epoch"], upe_note = plan.steps_per_epoch, "planned", None
    if upe is None:
        upe, sources["steps_per_epoch"], upe_note = derive_steps_per_epoch(plan, ck, ts, args)
    return Settings(
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
    device0 = trainer_view._int(args.get("per_device_train_batch_size"))
    accum0 = trainer_view._int(args.get("gradient_accumulation_steps")) or (1 if args else None)
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
