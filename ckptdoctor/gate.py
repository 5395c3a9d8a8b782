"""The pre-resume gate: predict what ``trainer.train(resume_from_checkpoint=...)`` will do, and judge it first.

The prediction follows transformers 5.x's resume path step by step (ANATOMY §2): ``get_last_checkpoint``; the
weights branch of ``_load_from_checkpoint``; ``TrainerState.load_from_json``; ``set_initial_training_values`` and
``_init_training_state`` (max_steps, epochs already trained, batches skipped); ``create_scheduler`` for the new
max_steps, then ``_load_optimizer_and_scheduler`` (both or neither); then ``_run_epoch``, whose first optimizer
step uses the LR restored into the optimizer and whose later steps use ``base_lr * lambda(last_epoch)``.
Nothing is loaded or executed: the checkpoint is read by the scanner, the schedules are ``ckptdoctor.schedules``.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import click

from ckptdoctor import schedules, trainer_view
from ckptdoctor.cli import rule_options
from ckptdoctor.findings import Finding, Severity
from ckptdoctor.model import Checkpoint, FileFacts, FileKind, PathProblem, ProblemKind, ReadProblem, Tree
from ckptdoctor.rules import Selection, all_rules, get_rule, security_codes
from ckptdoctor.rules.training import saved_world_size
from ckptdoctor.scanner import Report
from ckptdoctor.settings import FAIL_ON

SCHEMA = "ckptdoctor.gate/1"
DEFAULT_LR_STEPS = 5
MAX_LR_STEPS = 100_000  # a prediction is read by people and scripts; more would only take minutes and gigabytes
JUMP_FACTOR = 1.25  # an LR rise above this factor over the last LR used is a "large jump" (CKD411)
LR_RTOL = 1e-9
# TrainingArguments defaults (transformers 5.23) of the fields the resume arithmetic reads.
ARG_DEFAULTS: dict[str, Any] = {
    "num_train_epochs": 3.0,
    "max_steps": -1,
    "learning_rate": 5e-5,
    "lr_scheduler_type": "linear",
    "warmup_steps": 0.0,
    "lr_scheduler_kwargs": None,
    "ignore_data_skip": False,
}
_RNG_RE = re.compile(r"^rng_state(?:_(\d+))?\.pth$")


class GateInputError(ValueError):
    """The gate cannot predict with what it was given (e.g. steps per epoch cannot be derived): a usage error."""


@dataclass(frozen=True, slots=True)
class Plan:
    """How the resume is planned. ``None`` means "as the run was": read from the checkpoint itself.

    Fields carry ``TrainingArguments`` semantics (transformers 5.x): ``max_steps > 0`` overrides
    ``num_train_epochs``; ``warmup_steps < 1`` is a ratio of max_steps. Planning ``num_train_epochs`` without
    ``max_steps`` means an epoch-based run (``max_steps=-1``). ``steps_per_epoch`` counts optimizer updates
    (``ceil(len(train_dataloader) / gradient_accumulation_steps)``). ``grad_scaler`` says whether the resuming
    Trainer has a GradScaler (``trainer.accelerator.scaler is not None``; None: unknown): without one, a
    ``scaler.pt`` in the checkpoint makes ``_load_scaler`` raise AttributeError.
    """

    checkpoint: str | None = None
    num_train_epochs: float | None = None
    max_steps: int | None = None
    learning_rate: float | None = None
    lr_scheduler_type: str | None = None
    warmup_steps: float | None = None
    lr_scheduler_kwargs: Mapping[str, Any] | None = None
    steps_per_epoch: int | None = None
    world_size: int | None = None
    ignore_data_skip: bool | None = None
    grad_scaler: bool | None = None
    lr_steps: int = DEFAULT_LR_STEPS
    fail_on: str = "error"


def plan_from_training_args(args: Mapping[str, Any], *, strict: bool = False) -> dict[str, Any]:
    """Planned values from a ``TrainingArguments``-like mapping (``args.to_dict()``, a JSON config file).

    Only the fields the resume arithmetic reads are taken; ``warmup_ratio`` (transformers 4) becomes a
    ``warmup_steps`` ratio when ``warmup_steps`` is 0. ``fp16`` false with ``bf16`` true is ``grad_scaler=False``:
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
        value = _num(args.get(key))
        if value is not None:
            out[key] = value
    if _int(args.get("max_steps")) is not None:
        out["max_steps"] = int(args["max_steps"])
    if isinstance(args.get("lr_scheduler_type"), str):
        out["lr_scheduler_type"] = args["lr_scheduler_type"]
    kwargs = _kwargs(args.get("lr_scheduler_kwargs"))
    if kwargs is not None:
        out["lr_scheduler_kwargs"] = kwargs
    if isinstance(args.get("ignore_data_skip"), bool):
        out["ignore_data_skip"] = args["ignore_data_skip"]
    ratio = _num(args.get("warmup_ratio"))
    if ratio and not out.get("warmup_steps") and 0 < ratio < 1:
        out["warmup_steps"] = ratio
    if args.get("fp16") is False and args.get("bf16") is True:
        out["grad_scaler"] = False
    return out


def _check_training_args(args: Mapping[str, Any]) -> None:
    """``GateInputError`` for a planned ``TrainingArguments`` value that ``plan_from_training_args`` would skip."""
    brief = schedules.brief
    for key in ("num_train_epochs", "learning_rate", "warmup_steps", "warmup_ratio"):
        v = args.get(key)
        number = _num(v)
        if v is not None and (number is None or not math.isfinite(number)):
            raise GateInputError(f"training_args {key} must be a finite number, not {brief(v)}")
    v = args.get("max_steps")
    if v is not None and _int(v) is None:
        raise GateInputError(f"training_args max_steps must be an integer, not {brief(v)}")
    v = args.get("lr_scheduler_type")
    if v is not None and not isinstance(v, str):
        raise GateInputError(f"training_args lr_scheduler_type must be a string, not {brief(v)}")
    for key in ("ignore_data_skip", "fp16", "bf16"):
        v = args.get(key)
        if v is not None and not isinstance(v, bool):
            raise GateInputError(f"training_args {key} must be true or false, not {brief(v)}")
    v = args.get("lr_scheduler_kwargs")
    if v is not None and _kwargs(v) is None and not (isinstance(v, str) and not v.strip()):
        raise GateInputError(f"training_args lr_scheduler_kwargs must be a mapping or a JSON object, not {brief(v)}")


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
class GateResult:
    """The predicted resume and the findings about it. ``lr`` holds the LRs of the first optimizer steps."""

    run: str
    checkpoint: str | None
    weights_branch: str
    start_step: int | None  # None: no checkpoint, or its trainer_state.json cannot be read
    max_steps: int | None  # None (as steps_to_train, and the loop fields below): not predicted, train() raises
    steps_to_train: int | None
    lr: tuple[float, ...]
    findings: tuple[Finding, ...]
    settings: Settings | None = None
    restores_optimizer: bool = False
    epochs_trained: int | None = None
    num_train_epochs: int | None = None
    warmup_steps: int | None = None
    base_lr: float | None = None
    fail_on: str = "error"
    fail_on_from_settings: bool = False  # fail_on is RUN_DIR's settings file's, not the caller's

    @property
    def failed(self) -> bool:
        """True when a finding reaches ``fail_on``, or, under a settings file's ``fail-on = "never"``, when a
        security rule (CKD6xx) reports an error: as ``ckptdoctor scan``, a file that came with the checkpoint
        cannot wave its own malicious pickle through."""
        if Report((), self.findings, 0.0).failed(self.fail_on):
            return True
        return self.fail_on_from_settings and any(
            f.rule in security_codes() and f.severity is Severity.ERROR for f in self.findings
        )

    @property
    def verdict(self) -> str:
        return "fail" if self.failed else "pass"

    @property
    def exit_code(self) -> int:
        return 1 if self.failed else 0

    def to_json(self) -> dict[str, Any]:
        """The documented ``ckptdoctor.gate/1`` document (plus ``resolved``: the arguments the prediction used)."""
        from ckptdoctor.render.report import finding_json

        s = self.settings
        resolved: dict[str, Any] | None = None
        if s is not None:
            resolved = {
                "num_train_epochs": s.num_train_epochs,
                "max_steps_argument": s.max_steps,
                "learning_rate": s.learning_rate,
                "lr_scheduler_type": s.lr_scheduler_type,
                "warmup_steps_argument": s.warmup_steps,
                "warmup_steps": self.warmup_steps,
                "lr_scheduler_kwargs": dict(s.lr_scheduler_kwargs),
                "steps_per_epoch": s.steps_per_epoch,
                "epochs_trained": self.epochs_trained,
                "loop_epochs": self.num_train_epochs,
                "restores_optimizer_and_scheduler": self.restores_optimizer,
                "base_lr": self.base_lr,
                "sources": dict(s.sources),
            }
        doc: dict[str, Any] = _finite({
            "schema": SCHEMA,
            "run": self.run,
            "checkpoint": self.checkpoint,
            "weights_branch": self.weights_branch,
            "start_step": self.start_step,
            "max_steps": self.max_steps,
            "steps_to_train": self.steps_to_train,
            "lr": list(self.lr),
            "verdict": self.verdict,
            "findings": [finding_json(f) for f in self.findings],
            "resolved": resolved,
        })
        return doc


def _finite(value: Any, depth: int = 0) -> Any:
    """``value`` as strict JSON can carry it: a NaN or infinite float (read from a checkpoint, say) and an integer
    too long to print become None; anything else a pickle holds, or nesting deeper than ``_JSON_DEPTH``, its
    ``schedules.brief`` text."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, int):
        return value if value.bit_length() <= _PRINTABLE_BITS else None
    if depth < _JSON_DEPTH and isinstance(value, dict):
        return {k if isinstance(k, str) else schedules.brief(k): _finite(v, depth + 1) for k, v in value.items()}
    if depth < _JSON_DEPTH and isinstance(value, (list, tuple)):
        return [_finite(v, depth + 1) for v in value]
    return schedules.brief(value)


_JSON_DEPTH = 32  # lr_scheduler_kwargs nest a level or two; json.dumps(indent=2) recurses in Python per level
_PRINTABLE_BITS = 4000  # about 1,200 digits: well under Python's 4,300-digit int-to-str limit
# Integers beyond this cannot become a float: transformers' step and warm-up arithmetic overflows on them, and a
# prediction built on one says nothing. A max_steps this large is that crash (CKD413); a global_step, or a planned
# integer, is unusable input.
_INT_LIMIT = 2**1023


# ---------------------------------------------------------------------------------------------------------------
# Small readers of plain values


def _num(v: Any) -> float | None:
    """``v`` as a float when it is a number (an integer beyond any float is +-inf), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        return float(v)
    except OverflowError:  # a 400-digit integer: as unusable as inf, and reported as such
        return math.inf if v > 0 else -math.inf


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _kwargs(v: Any) -> dict[str, Any] | None:
    """``lr_scheduler_kwargs`` as TrainingArguments accepts it: a dict, a JSON object string, or None/empty."""
    if isinstance(v, str) and v.strip():
        try:
            v = json.loads(v)
        except (ValueError, RecursionError):  # not JSON, a 5,000-digit number, or arrays nested 10^5 deep
            return None
    if isinstance(v, dict):
        return {k if isinstance(k, str) else schedules.brief(k): x for k, x in v.items()}
    return None


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=LR_RTOL, abs_tol=0.0)


def _superseded(code: str) -> bool:
    """A scan rule whose message the gate's exact prediction replaces (``@rule(..., superseded_by_gate=True)``)."""
    r = get_rule(code)
    return r is not None and r.superseded_by_gate


def _in(path: str, folder: str) -> bool:
    return folder in ("", ".") or path == folder or path.startswith(folder + "/")


# ---------------------------------------------------------------------------------------------------------------
# Resolving the planned arguments


def resolve(plan: Plan, ck: Checkpoint, ts: trainer_view.TrainerStateView | None) -> Settings:
    """The arguments the resume will run with: planned values first, then the checkpoint's ``training_args.bin``,
    then ``trainer_state.json`` / ``scheduler.pt``, then transformers' defaults."""
    args = trainer_view.training_args(ck) or {}
    sources: dict[str, str] = {}

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
    max_steps = pick("max_steps", planned_max, _int(args.get("max_steps")),
                     (ts.max_steps if ts else None, "trainer_state.json"))
    epochs = pick("num_train_epochs", plan.num_train_epochs, _num(args.get("num_train_epochs")),
                  (ts.num_train_epochs if ts else None, "trainer_state.json"))
    lr = pick("learning_rate", plan.learning_rate, _num(args.get("learning_rate")),
              (sched.base_lrs[0] if sched and sched.base_lrs else None, "scheduler.pt"))
    stype = args.get("lr_scheduler_type")
    stype = pick("lr_scheduler_type", plan.lr_scheduler_type, stype if isinstance(stype, str) else None)
    own_warmup = plan_from_training_args(args).get("warmup_steps") if args else None
    warmup = pick("warmup_steps", plan.warmup_steps, own_warmup)
    kw = pick("lr_scheduler_kwargs", plan.lr_scheduler_kwargs, _kwargs(args.get("lr_scheduler_kwargs")))
    skip_flag = args.get("ignore_data_skip")
    ignore = pick("ignore_data_skip", plan.ignore_data_skip, skip_flag if isinstance(skip_flag, bool) else None)
    upe = plan.steps_per_epoch
    sources["steps_per_epoch"] = "planned"
    if upe is None:
        upe = steps_per_epoch_of(ts) if ts else None
        sources["steps_per_epoch"] = "trainer_state.json" if upe is not None else "unknown"
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
    )


# ---------------------------------------------------------------------------------------------------------------
# The prediction


class _Findings:
    """Collects gate findings with the registered rule's name and default severity, under ``selection``: a rule it
    leaves out is dropped, and its severity override wins over the finding's own, as ``run_rules`` does."""

    def __init__(self, root: str, scanned: Sequence[Finding] = (), selection: Selection | None = None) -> None:
        self.root = root
        self.items: list[Finding] = list(scanned)
        self.selection = selection or Selection()

    def add(self, code: str, path: str, message: str, severity: Severity | None = None) -> None:
        r = get_rule(code)
        assert r is not None, code
        # Selection.enabled leaves every gate-only rule out of a scan; here the gate is what runs them. A select list
        # narrows the scan findings only: one written for `scan` (select = ["CKD1", "CKD2"]) must not silently turn
        # the gate's own judgement off. Ignoring a gate rule by code or prefix does.
        if not replace(self.selection, select=()).enabled(replace(r, gate_only=False)):
            return
        sev = self.selection.severity.get(r.code, severity or r.severity)
        self.items.append(Finding(r.code, r.name, sev, path, message, root=self.root))

    def sorted(self) -> tuple[Finding, ...]:
        return tuple(sorted(self.items, key=Finding.sort_key))


def _in_folder(ck: Checkpoint, name: str) -> str:
    return name if ck.path in ("", ".") else f"{ck.path}/{name}"


# What the real loaders raise on a file the scan could not read (transformers 5.23, torch 2.13, safetensors 0.8):
# tests/test_gate_damage.py resumes a real Trainer on each kind of damage. torch's zip reader (miniz) looks for the
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
    if f.kind is FileKind.JSON or name.endswith(".json"):
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
    """The CKD413 message when the file ``name`` that ``loader`` loads is unreadable (None when it loads)."""
    f = ck.file(name)
    bad = _load_error(f) if f is not None else None
    if bad is None:
        return None
    return f"`{name}` {bad[0]}: train() raises {bad[1]} in {loader}"


def _shard_names(ck: Checkpoint) -> list[str] | None:
    """The shards ``load_sharded_checkpoint`` opens (the safetensors index first), or None when its index is
    unusable (its own crash). Names that are not plain paths inside the folder are left to the scan rules."""
    wm = trainer_view.weight_map(ck.file(trainer_view.SAFE_INDEX) or ck.file(trainer_view.BIN_INDEX))
    if wm is None:
        return None
    return sorted(n for n in set(wm.values()) if n and not n.startswith("/") and ".." not in n.split("/"))


def _weights_crash(ck: Checkpoint, branch: str) -> str | None:
    """What ``_load_from_checkpoint`` raises on a damaged file it reads: config.json, then the weights branch's."""
    if branch == "deepspeed":
        return None  # deepspeed_load_checkpoint reads its own global_step*/ files (not modelled here)
    crash = _damaged(ck, "config.json", "_load_from_checkpoint (PreTrainedConfig.from_json_file)")
    if crash is not None or branch not in ("full", "sharded"):
        return crash  # adapter and FSDP weights are read by peft and accelerate: not modelled here
    if branch == "full":
        if ck.file(trainer_view.SAFE_WEIGHTS) is not None:
            return _damaged(ck, trainer_view.SAFE_WEIGHTS, "_load_from_checkpoint (safetensors.torch.load_file)")
        return _damaged(ck, trainer_view.BIN_WEIGHTS, "_load_from_checkpoint (torch.load)")
    index = trainer_view.SAFE_INDEX if ck.file(trainer_view.SAFE_INDEX) is not None else trainer_view.BIN_INDEX
    crash = _damaged(ck, index, "load_sharded_checkpoint (json.load)")
    loader = "safetensors.torch.load_file" if index == trainer_view.SAFE_INDEX else "torch.load"
    for shard in _shard_names(ck) or ():
        if ck.file(shard) is None:
            return (f"`{shard}` (listed in `{index}`) is missing: train() raises FileNotFoundError in "
                    f"load_sharded_checkpoint ({loader})")
        crash = crash or _damaged(ck, shard, f"load_sharded_checkpoint ({loader})")
    return crash


def _crash(ck: Checkpoint, ts: trainer_view.TrainerStateView | None, branch: str) -> str | None:
    """What makes ``train()`` raise before the first step, in the order it would happen (None: nothing): the
    weights and ``trainer_state.json`` that ``train()`` loads first (``_state_crash`` has the rest)."""
    if branch == "none":
        return "no weights file to load: train() raises ValueError(\"Can't find a valid checkpoint at ...\")"
    crash = _weights_crash(ck, branch)
    if crash is not None:
        return crash
    state = ck.file(trainer_view.TRAINER_STATE)
    if state is None:
        return "no `trainer_state.json`: train() raises FileNotFoundError in TrainerState.load_from_json"
    if ts is None:
        bad = _load_error(state)
        if bad is not None:
            return f"`trainer_state.json` {bad[0]}: train() raises {bad[1]} in TrainerState.load_from_json"
        return "`trainer_state.json` is not a valid JSON object: train() raises in TrainerState.load_from_json"
    if "train_batch_size" in ts.raw and ts.raw["train_batch_size"] is None:
        return "`train_batch_size` is null: train() raises TypeError in compare_trainer_and_checkpoint_args"
    if trainer_view.is_deepspeed(ck) and ck.file(trainer_view.SCHEDULER) is None:
        return "DeepSpeed checkpoint without `scheduler.pt`: _load_optimizer_and_scheduler raises FileNotFoundError"
    return None


def _state_crash(
    ck: Checkpoint, branch: str, steps_to_train: int, world_size: int | None, grad_scaler: bool | None = None
) -> str | None:
    """What raises after the step arithmetic and before the first optimizer step: a damaged ``optimizer.pt`` or
    ``scheduler.pt`` that ``_load_optimizer_and_scheduler`` loads (both exist), ``scaler.pt`` (``_load_scaler``:
    any one when the resume has no GradScaler, ``grad_scaler`` False; a damaged one otherwise), and the RNG file
    ``_load_rng_state`` loads when the first epoch runs (each rank its ``rng_state_R.pth`` when more than one
    process runs; a missing one only logs)."""
    loader = "_load_optimizer_and_scheduler (torch.load)"
    if branch == "deepspeed":
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
        m = _RNG_RE.match(ck.relname(f))
        rank = None if m is None else (-1 if m.group(1) is None else int(m.group(1)))
        if rank is not None and (rank == -1 if ranks == 1 else 0 <= rank < ranks):
            crash = crash or _damaged(ck, ck.relname(f), "_load_rng_state (torch.load)")
    return crash


def _first_lr(ck: Checkpoint) -> float | None:
    """The LR the first resumed step uses: ``optimizer.pt``'s group 0, else what the checkpoint otherwise holds."""
    opt = trainer_view.optimizer_state(ck)
    if opt is not None and opt.groups and opt.groups[0].lr is not None:
        return opt.groups[0].lr
    return trainer_view.checkpoint_lr(ck)


def _base_lr(ck: Checkpoint) -> float | None:
    """``base_lrs[0]`` that ``LambdaLR.load_state_dict`` restores, else the optimizer's ``initial_lr``."""
    sched = trainer_view.scheduler_state(ck)
    if sched is not None and sched.base_lrs:
        return sched.base_lrs[0]
    opt = trainer_view.optimizer_state(ck)
    if opt is not None and opt.groups:
        return opt.groups[0].initial_lr
    return None


def _last_used_lr(ts: trainer_view.TrainerStateView, step: int) -> tuple[int, float] | None:
    """The last ``(step, learning_rate)`` logged at or before ``step``: the LR the run last trained with."""
    logged = [(s, lr) for s, lr in ts.learning_rates() if s <= step]
    return logged[-1] if logged else None


def _rng_ranks(ck: Checkpoint) -> int | None:
    """Ranks that saved RNG state: 1 for ``rng_state.pth``, else the highest ``rng_state_R.pth`` + 1."""
    ranks: set[int] = set()
    for f in ck.files:
        rel = ck.relname(f)
        m = _RNG_RE.match(rel)
        if m:
            ranks.add(int(m.group(1)) if m.group(1) is not None else -1)
    if not ranks:
        return None
    return 1 if ranks == {-1} else max(ranks) + 1


def _world_size(out: _Findings, ck: Checkpoint, planned: int) -> None:
    saved = saved_world_size(ck)
    kind = "FSDP/DeepSpeed shards"
    sev = Severity.ERROR
    if saved is None:
        saved, kind, sev = _rng_ranks(ck), "RNG state files", Severity.WARNING
    if saved is None or saved == planned:
        return
    if sev == Severity.ERROR:
        tail = "the resume fails or must reshard"
    else:
        tail = "ranks without their own file continue with fresh random state"
    out.add("CKD504", ck.path, f"saved by {saved} ranks ({kind}) but planned world size is {planned}: {tail}", sev)


def _fmt_lrs(lrs: Sequence[float]) -> str:
    return ", ".join(f"{x:.4g}" for x in lrs)


def predict(
    tree: Tree,
    plan: Plan,
    *,
    run: str | None = None,
    scanned: Sequence[Finding] = (),
    selection: Selection | None = None,
) -> GateResult:
    """Predict the resume of the run in ``tree`` (or of the checkpoint ``tree`` holds) under ``plan``.

    ``scanned`` are the scan's findings for ``tree``; those about the checkpoint the resume loads are kept.
    ``selection`` (``--select``/``--ignore`` and a settings file's) decides which gate rules report, and at what
    severity; the scan findings were made under it already. Raises ``GateInputError`` when steps per epoch can
    neither be read from the checkpoint nor were planned, or when the checkpoint's global_step is beyond any float
    (other numbers past float range read as infinities, ``trainer_view.number``).
    """
    run_label = run if run is not None else tree.root
    root_run = next((r for r in tree.runs if r.path in ("", ".")), None)
    ck: Checkpoint | None = None
    if root_run is not None:
        if root_run.resume_pick is not None:
            ck = next((c for c in root_run.checkpoints if c.path == root_run.resume_pick), None)
        elif root_run.standalone and root_run.checkpoints:
            ck = next((c for c in root_run.checkpoints if c.path in ("", ".")), root_run.checkpoints[0])
    if ck is None:
        out = _Findings(tree.root, selection=selection)
        pick = root_run.resume_pick if root_run is not None else None
        if pick is not None and plan.checkpoint is None:
            # A `checkpoint-N` link out of the root: get_last_checkpoint picks it, the scan never reads it (CKD604,
            # an error there). The resume may well work; nothing here can say what it loads.
            out.items.extend(f for f in scanned if _in(f.path, pick))
            from ckptdoctor.render.report import display_path

            return GateResult(run_label, display_path(tree.root, pick), "none", None, None, None, (), out.sorted(),
                              fail_on=plan.fail_on)  # fmt: skip
        if plan.checkpoint is not None:
            # the scan could not open the root: transformers' os.path.isfile checks then find no weights file either
            missing = any(p.path in ("", ".") and p.problem.kind is ProblemKind.UNREADABLE for p in tree.path_problems)
            what = "no folder (the path is taken as given, from the working directory)" if missing else (
                "a folder with no weights file")
            out.add("CKD413", ".", f"resume_from_checkpoint={plan.checkpoint!r} names {what}: "
                    "train() raises ValueError(\"Can't find a valid checkpoint at ...\")")
        else:
            out.add("CKD413", ".", "resume_from_checkpoint=True finds no `checkpoint-N` folder: train() raises "
                    "ValueError(\"No valid checkpoint found in output directory\")")
        return GateResult(run_label, None, "none", None, None, None, (), out.sorted(), fail_on=plan.fail_on)

    from ckptdoctor.render.report import display_path

    kept = [f for f in scanned if _in(f.path, ck.path) and not _superseded(f.rule)]
    out = _Findings(tree.root, kept, selection)
    label = display_path(tree.root, ck.path)
    ts = trainer_view.trainer_state(ck)
    branch = trainer_view.weights_branch(ck)
    # TrainerState.global_step defaults to 0; with no readable state the resume never gets a start step
    start = (ts.global_step or 0) if ts is not None else None
    crash = _crash(ck, ts, branch)
    settings = resolve(plan, ck, ts)
    if start is not None and abs(start) >= _INT_LIMIT:
        raise GateInputError(f"`{label}`: global_step ({_int_text(start)}) is beyond any float: nothing can be "
                             "predicted from it")
    if plan.world_size is not None:
        _world_size(out, ck, plan.world_size)
    if crash is not None or start is None:
        out.add("CKD413", ck.path, crash or "`trainer_state.json` cannot be read: train() raises")
        return GateResult(run_label, label, branch, start, None, None, (), out.sorted(), settings,
                          fail_on=plan.fail_on)
    if settings.steps_per_epoch is None:
        raise GateInputError(
            f"cannot derive steps per epoch from `{label}`'s trainer_state.json; pass --steps-per-epoch"
        )
    try:
        if abs(settings.max_steps) >= _INT_LIMIT:
            # What transformers' first float of it raises (the warm-up steps, or the schedule's lambda); checked here
            # so that no prediction carries a step count too long to print or too costly to compute with.
            raise OverflowError("int too large to convert to float")
        steps = resume_steps(start, settings.steps_per_epoch, settings.max_steps, settings.num_train_epochs,
                             settings.ignore_data_skip)
        warmup = schedules.warmup_steps_for(settings.warmup_steps, steps.max_steps)
    except (ArithmeticError, ValueError) as exc:
        # transformers does the same arithmetic (math.ceil of epochs x steps, of max_steps x a warm-up ratio) and
        # raises the same error on an infinite, NaN or float-overflowing value read from the checkpoint.
        src = settings.sources
        out.add("CKD413", ck.path, f"num_train_epochs {settings.num_train_epochs:g} "
                f"({src.get('num_train_epochs', 'default')}), max_steps {_int_text(settings.max_steps)} "
                f"({src.get('max_steps', 'default')}), warmup_steps {settings.warmup_steps:g} "
                f"({src.get('warmup_steps', 'default')}): train() raises {type(exc).__name__} computing max_steps and "
                f"the warm-up steps ({exc})")
        return GateResult(run_label, label, branch, start, None, None, (), out.sorted(), settings,
                          fail_on=plan.fail_on)
    crash = _state_crash(ck, branch, steps.steps_to_train, plan.world_size, plan.grad_scaler)
    if crash is not None:  # a file the resume loads before its first step cannot be loaded: nothing is restored
        out.add("CKD413", ck.path, crash)
        return GateResult(run_label, label, branch, start, None, None, (), out.sorted(), settings,
                          fail_on=plan.fail_on)
    restores = trainer_view.is_deepspeed(ck) or (
        trainer_view.has_optimizer_state(ck) and ck.file(trainer_view.SCHEDULER) is not None
    )
    base = _base_lr(ck) if restores else settings.learning_rate
    result = GateResult(
        run_label, label, branch, start, steps.max_steps, steps.steps_to_train, (), (), settings, restores,
        steps.epochs_trained, steps.num_train_epochs, warmup, base, plan.fail_on,
    )
    if steps.steps_to_train == 0:
        span = (
            f"max_steps {steps.max_steps}" if settings.max_steps > 0
            else f"{settings.num_train_epochs:g} epochs x {settings.steps_per_epoch} steps = max_steps "
            f"{steps.max_steps}"
        )
        past = " (the checkpoint is past the planned end)" if start > steps.max_steps else ""
        out.add("CKD407", ck.path, f"resume starts at global_step {start} with {span}{past}: train() returns "
                "after 0 steps, reporting success")
    lrs = _predict_lrs(out, ck, ts, settings, steps, warmup, restores, base, plan.lr_steps)
    return replace(result, lr=lrs, findings=out.sorted())


def _predict_lrs(
    out: _Findings,
    ck: Checkpoint,
    ts: trainer_view.TrainerStateView | None,
    s: Settings,
    steps: StepPlan,
    warmup: int,
    restores: bool,
    base: float | None,
    lr_steps: int,
) -> tuple[float, ...]:
    """The LRs of the first ``lr_steps`` resumed optimizer steps, with the LR findings (CKD408-CKD413)."""
    start = ts.global_step or 0 if ts is not None else 0
    try:
        sched = schedules.build(s.lr_scheduler_type, num_warmup_steps=warmup, num_training_steps=steps.max_steps,
                                lr_init=s.learning_rate, kwargs=s.lr_scheduler_kwargs)
        lr0 = sched.lr(s.learning_rate, 0)  # LambdaLR.__init__ evaluates the lambda at step 0: create_scheduler raises
    except schedules.ScheduleError as exc:
        if s.lr_scheduler_type in schedules.METRIC_DRIVEN:
            out.add("CKD412", ck.path, f"`{s.lr_scheduler_type}`: {exc}")
        else:
            out.add("CKD413", ck.path, f"create_scheduler raises: {exc}")
        return ()
    except (ArithmeticError, TypeError, ValueError) as exc:  # kwargs of the wrong type or size, as get_scheduler
        out.add("CKD413", ck.path, f"create_scheduler raises {type(exc).__name__} on lr_scheduler_kwargs "
                f"{schedules.brief(dict(s.lr_scheduler_kwargs))}: {exc}")
        return ()
    n = max(0, min(lr_steps, steps.steps_to_train))
    sched_state = trainer_view.scheduler_state(ck)
    if not restores:
        has_sched = ck.file(trainer_view.SCHEDULER) is not None
        have = "optimizer state" if trainer_view.has_optimizer_state(ck) else ("`scheduler.pt`" if has_sched else "")
        missing = "no `scheduler.pt`" if have == "optimizer state" else (
            "no optimizer state" if have else "no optimizer state and no `scheduler.pt`")
        lead = f"has {have} but {missing}" if have else f"has {missing}"
        out.add("CKD408", ck.path, f"{lead}: the resume restores neither; AdamW restarts from zero moments and the "
                f"`{s.lr_scheduler_type}` schedule restarts at its step 0 (LR {lr0:.4g}) while global_step continues "
                f"at {start}")
    if n == 0:
        return ()
    first = _first_lr(ck) if restores else None
    if restores and (first is None or base is None):
        out.add("CKD412", ck.path, "cannot read the LR stored in `optimizer.pt` / `scheduler.pt`; LRs not predicted")
        return ()
    last_epoch = start
    if sched_state is not None and sched_state.last_epoch is not None:
        last_epoch = sched_state.last_epoch
    try:
        if restores:
            assert first is not None and base is not None
            lrs = [first] + [sched.lr(base, last_epoch + i) for i in range(1, n)]
        else:
            lrs = [sched.lr(s.learning_rate, i) for i in range(n)]
    except (ArithmeticError, TypeError, ValueError) as exc:  # e.g. num_cycles "x": LambdaLR's float() raises too
        out.add("CKD413", ck.path, f"the `{s.lr_scheduler_type}` schedule raises {type(exc).__name__} within the first "
                f"{n} resumed steps")
        return ()
    if restores and base is not None and not _close(s.learning_rate, base):
        src = s.sources.get("learning_rate", "planned")
        out.add("CKD409", _in_folder(ck, trainer_view.SCHEDULER),
                f"learning_rate {s.learning_rate:g} ({src}) is ignored: "
                f"the resume restores base LR {base:g} from the checkpoint"
                + (f"; the first steps run at {_fmt_lrs(lrs)}" if lrs else ""))
    if lrs and lrs[0] == 0.0:
        why = "the LR stored in `optimizer.pt`" if restores else "the restarted schedule's warm-up"
        out.add("CKD410", ck.path, f"the first resumed optimizer step (step {start + 1}) runs at LR 0 ({why})")
    if ts is not None and lrs:
        _jump(out, ck, ts, lrs, start, steps.max_steps)
    return tuple(lrs)


def _jump(
    out: _Findings, ck: Checkpoint, ts: trainer_view.TrainerStateView, lrs: list[float], start: int, new_max: int
) -> None:
    last = _last_used_lr(ts, start)
    if last is None or last[1] <= 0:
        return
    own_warmup = plan_from_training_args(trainer_view.training_args(ck) or {}).get("warmup_steps", 0.0)
    try:
        if ts.max_steps and start < schedules.warmup_steps_for(own_warmup, ts.max_steps):
            return  # the run was still warming up: a rising LR is its own schedule
    except (ArithmeticError, ValueError):
        pass  # its warm-up cannot be computed (NaN, inf, a ratio of an overflowing max_steps): judge the rise anyway
    peak = max(range(len(lrs)), key=lambda i: lrs[i])
    if lrs[peak] > last[1] * JUMP_FACTOR:
        was = f" (the run's max_steps was {ts.max_steps}, the resume's is {new_max})" if ts.max_steps != new_max else ""
        out.add("CKD411", ck.path, f"LR rises from {last[1]:.4g} (logged at step {last[0]}) to {lrs[peak]:.4g} at "
                f"step {start + 1 + peak}: the resume does not continue the run's schedule{was}")


# ---------------------------------------------------------------------------------------------------------------
# Python entry point


_PLAN_FIELDS = frozenset(
    ("num_train_epochs", "max_steps", "learning_rate", "lr_scheduler_type", "warmup_steps", "lr_scheduler_kwargs",
     "steps_per_epoch", "world_size", "ignore_data_skip", "grad_scaler")
)


def gate(
    run_dir: str | os.PathLike[str],
    *,
    checkpoint: str | os.PathLike[str] | None = None,
    checkpoint_in_run: bool = True,
    training_args: Mapping[str, Any] | None = None,
    lr_steps: int = DEFAULT_LR_STEPS,
    fail_on: str | None = None,
    select: Sequence[str] = (),
    ignore: Sequence[str] = (),
    config: bool = True,
    **planned: Any,
) -> GateResult:
    """Predict ``trainer.train(resume_from_checkpoint=checkpoint or True)`` for ``run_dir`` (the output_dir).

    ``planned`` takes the ``Plan`` fields (``num_train_epochs``, ``max_steps``, ``learning_rate``,
    ``lr_scheduler_type``, ``warmup_steps``, ``lr_scheduler_kwargs``, ``steps_per_epoch``, ``world_size``,
    ``ignore_data_skip``, ``grad_scaler``: whether the resuming Trainer has a GradScaler,
    ``trainer.accelerator.scaler is not None``, None unknown; False with a ``scaler.pt`` in the checkpoint is
    CKD413); ``training_args`` is a ``TrainingArguments``-like mapping read first, which explicit keywords override
    (a value of the wrong type or not finite in either raises ``GateInputError`` naming it). Anything not planned
    is the run's own. ``checkpoint`` may be a path, or (``checkpoint_in_run``, as ``gate
    --checkpoint``) a folder name inside ``run_dir``; with ``checkpoint_in_run=False`` it is a path only, taken
    from the working directory exactly as ``train()`` takes it (a folder that is not there is CKD413). Reads only;
    never imports torch.

    Rules are chosen as ``ckptdoctor scan`` chooses them: ``select`` and ``ignore`` are rule codes or prefixes
    (``--select``/``--ignore``), combined with the settings file at ``run_dir`` (``.ckptdoctor.toml`` or
    ``[tool.ckptdoctor]`` in ``pyproject.toml``) unless ``config`` is False. The file's ignore and severity apply
    to the scan findings and to the gate's own rules (CKD407-413, CKD504); its select, like ``select``, narrows
    the scan findings only (the gate rules run unless ignored). It cannot turn off or lower the security rules
    (CKD6xx): when it tries, a ``UserWarning`` says which stay on (``ignore=`` can turn them off). ``fail_on``
    defaults to the file's ``fail-on``, else ``"error"``; a file's ``"never"`` still fails on a security error. An
    unknown code, a deep-only selection or a bad settings file raises ``GateInputError``.
    """
    return _gate(run_dir, checkpoint, checkpoint_in_run, training_args, lr_steps, fail_on, select, ignore, config,
                 planned, on_kept=_warn_kept)


def _gate(
    run_dir: str | os.PathLike[str],
    checkpoint: str | os.PathLike[str] | None,
    checkpoint_in_run: bool,
    training_args: Mapping[str, Any] | None,
    lr_steps: int,
    fail_on: str | None,
    select: Sequence[str],
    ignore: Sequence[str],
    config: bool,
    planned: Mapping[str, Any],
    on_kept: Callable[[str, Sequence[str]], None] | None,
) -> GateResult:
    """``gate``, telling ``on_kept`` of security rules a settings file may not turn off (None: the CLI's note)."""
    unknown = sorted(set(planned) - _PLAN_FIELDS)
    if unknown:
        raise TypeError(f"gate() got unexpected planned arguments: {', '.join(unknown)}")
    if fail_on is not None and fail_on not in FAIL_ON:
        raise GateInputError(f"fail_on must be one of {', '.join(FAIL_ON)}")
    if not _is_int(lr_steps) or not 0 <= lr_steps <= MAX_LR_STEPS:
        raise GateInputError(f"lr_steps must be an integer between 0 and {MAX_LR_STEPS:,}, not {lr_steps!r}")
    values = plan_from_training_args(training_args, strict=True) if training_args else {}
    values.update({k: v for k, v in planned.items() if v is not None})
    _check_plan(values)
    if planned.get("num_train_epochs") is not None and planned.get("max_steps") is None:
        values.pop("max_steps", None)  # epochs planned explicitly: an epoch-based run, whatever the file says
    target = os.fspath(run_dir)
    ck_arg: str | None = None
    if checkpoint is not None:
        ck_arg = os.fspath(checkpoint)
        inside = os.path.join(target, ck_arg)
        in_run = checkpoint_in_run and not os.path.isdir(ck_arg) and os.path.isdir(inside)
        target = inside if in_run else ck_arg
    selection, cfg_fail_on = rule_selection(os.fspath(run_dir), select, ignore, config, on_kept=on_kept)
    plan = Plan(checkpoint=ck_arg, lr_steps=lr_steps, fail_on=fail_on or cfg_fail_on or "error", **values)
    scanned: Sequence[Finding] = ()
    if ck_arg is not None and not os.path.isdir(target):
        # No folder there (or a file): train() finds no weights file in it and raises; nothing to scan.
        tree = Tree(target, (), path_problems=(PathProblem(".", ReadProblem(ProblemKind.UNREADABLE, "not a folder")),))
    else:
        from ckptdoctor.scanner import scan

        report = scan(target, selection=selection)
        tree, scanned = report.trees[0], report.findings
    result = predict(tree, plan, run=os.fspath(run_dir), scanned=scanned, selection=selection)
    return replace(result, fail_on_from_settings=fail_on is None and cfg_fail_on is not None)


def _warn_kept(source: str, codes: Sequence[str]) -> None:
    """The Python API's word for a settings file that tries to turn off security rules: a ``UserWarning`` at the
    first caller outside ckptdoctor (a script calling ``gate()`` or ``check_resume``), not a CLI hint on stderr."""
    level, frame = 2, sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("ckptdoctor."):
        frame, level = frame.f_back, level + 1
    warnings.warn(
        f"ckptdoctor: {source} may not turn off or lower security rules ({', '.join(codes)}): they stay on (a "
        "settings file in a scanned folder can come from whoever made the checkpoint); pass ignore=[...] to turn "
        "one off.",
        UserWarning,
        stacklevel=level,
    )


def rule_selection(
    run_dir: str,
    select: Sequence[str] | str,
    ignore: Sequence[str] | str,
    config: bool,
    *,
    on_kept: Callable[[str, Sequence[str]], None] | None = None,
) -> tuple[Selection, str | None]:
    """The rule selection of ``select``/``ignore`` plus the settings file at ``run_dir`` (when ``config``), and that
    file's fail-on: ``ckptdoctor scan``'s own resolution (``cli.resolve_selection``), with the gate's usage check.

    ``on_kept`` hears of security rules the settings file may not turn off (None: the CLI's note on stderr). Raises
    ``GateInputError`` for an unknown code, a selection of --deep rules only (the gate never reads tensor data), or
    a settings file that cannot be used.
    """
    from ckptdoctor.cli import UsageProblem, resolve_selection, split_codes

    select = (select,) if isinstance(select, str) else tuple(select)
    ignore = (ignore,) if isinstance(ignore, str) else tuple(ignore)
    for code in split_codes(select):
        matched = [r for r in all_rules() if r.code.startswith(code)]
        if matched and all(r.deep_only for r in matched):
            raise GateInputError(f"--select {code}: {code} reads tensor data: `ckptdoctor scan --deep` runs it, the "
                                 "gate never does")
    try:
        return resolve_selection([run_dir], select, ignore, not config, on_kept=on_kept)
    except UsageProblem as exc:
        raise GateInputError(exc.message) from None


def _int_text(n: int) -> str:
    """``n`` for a message; one too long for Python to print (over 4,300 digits, from a pickle) by its size."""
    return str(n) if n.bit_length() <= _PRINTABLE_BITS else f"<an integer of {n.bit_length():,} bits>"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_plan(values: dict[str, Any]) -> None:
    """Planned values of the wrong type or range are the caller's mistake: ``GateInputError``, never a traceback
    from deep in the arithmetic. ``lr_scheduler_kwargs`` given as a JSON object string becomes a dict."""
    brief = schedules.brief
    for key in ("num_train_epochs", "learning_rate", "warmup_steps"):
        v = values.get(key)
        number = _num(v)
        if v is not None and (number is None or not math.isfinite(number)):
            raise GateInputError(f"{key} must be a finite number, not {brief(v)}")
    for key, low in (("max_steps", None), ("steps_per_epoch", 1), ("world_size", 1)):
        v = values.get(key)
        if v is not None and (not _is_int(v) or (low is not None and v < low) or abs(v) >= _INT_LIMIT):
            raise GateInputError(f"{key} must be an integer{f' >= {low}' if low else ''} below 2**1023, not {brief(v)}")
    if values.get("lr_scheduler_type") is not None and not isinstance(values["lr_scheduler_type"], str):
        raise GateInputError(f"lr_scheduler_type must be a string, not {brief(values['lr_scheduler_type'])}")
    for key in ("ignore_data_skip", "grad_scaler"):
        if values.get(key) is not None and not isinstance(values[key], bool):
            raise GateInputError(f"{key} must be True or False, not {brief(values[key])}")
    raw = values.get("lr_scheduler_kwargs")
    if isinstance(raw, str) and not raw.strip():
        values.pop("lr_scheduler_kwargs")  # TrainingArguments reads an empty string as no kwargs
    elif raw is not None:
        kwargs = _kwargs(dict(raw) if isinstance(raw, Mapping) else raw)
        if kwargs is None:
            raise GateInputError(f"lr_scheduler_kwargs must be a mapping, not {brief(raw)}")
        values["lr_scheduler_kwargs"] = kwargs


# ---------------------------------------------------------------------------------------------------------------
# Text output


def render_text(result: GateResult) -> str:
    """The prediction as a short block for people, then the findings as `scan` prints them, then the verdict."""
    from ckptdoctor.render.report import plural, printable

    lines: list[str] = [f"ckptdoctor gate {printable(result.run)}"]
    if result.checkpoint is None:
        lines.append("  checkpoint       none found")
    else:
        lines.append(f"  checkpoint       {printable(result.checkpoint)}  (weights: {result.weights_branch})")
        s = result.settings
        start, total, todo = result.start_step, result.max_steps, result.steps_to_train
        if total is None or todo is None:
            at = "unknown" if start is None else f"global_step {start}"
            why = ("the resume raises before its first step" if any(f.rule == "CKD413" for f in result.findings)
                   else "the checkpoint was not read (CKD604)")
            lines.append(f"  steps            {at}: not predicted, {why}")
        elif s is not None and start is not None and total:
            end = start + todo
            lines.append(
                f"  steps            global_step {start} -> {end} of max_steps {total}: "
                f"trains {todo} ({s.steps_per_epoch} steps per epoch, {result.epochs_trained} of "
                f"{result.num_train_epochs} epochs done)"
            )
            state = "restored from the checkpoint" if result.restores_optimizer else "NOT restored (fresh)"
            base = "?" if result.base_lr is None else f"{result.base_lr:.4g}"
            lines.append(f"  optimizer        {state}")
            sched = printable(s.lr_scheduler_type)
            lines.append(f"  schedule         {sched}, {result.warmup_steps} warm-up steps, base LR {base}")
        if result.lr:
            lines.append(f"  first {len(result.lr)} LRs      " + _fmt_lrs(result.lr))
    if result.findings:
        lines.append("")
        lines.extend(finding_line(f) for f in result.findings)
    counts = {sev: sum(1 for f in result.findings if f.severity == sev) for sev in Severity}
    tally = ", ".join(plural(counts[s], s.value) for s in (Severity.ERROR, Severity.WARNING, Severity.INFO))
    lines.append("")
    threshold = f"fail-on {result.fail_on} from the settings file" if result.fail_on_from_settings else (
        f"--fail-on {result.fail_on}")
    lines.append(f"Verdict: {result.verdict} ({tally}; {threshold})")
    return "\n".join(lines)


def finding_line(f: Finding) -> str:
    """One finding as ``scan``'s text output prints it: ``path: CODE [severity] message`` (without its fix line)."""
    from ckptdoctor.render.report import finding_text

    return finding_text(f)[0]


def summary(result: GateResult) -> str:
    """One line for CI logs: what the resume will do."""
    if result.checkpoint is None:
        return "resume finds no checkpoint"
    lrs = f"; first LRs {_fmt_lrs(result.lr)}" if result.lr else ""
    if result.max_steps is None or result.steps_to_train is None:
        return (f"resume loads {result.checkpoint} ({result.weights_branch}) and raises before its first step; "
                f"verdict {result.verdict}")
    return (
        f"resume loads {result.checkpoint} ({result.weights_branch}) at step {result.start_step} and trains "
        f"{result.steps_to_train} of max_steps {result.max_steps}{lrs}; verdict {result.verdict}"
    )


# ---------------------------------------------------------------------------------------------------------------
# Command line

_EPILOG = """\b
Examples:
  ckptdoctor gate runs/my-run                          # resume with the run's own arguments
  ckptdoctor gate runs/my-run --num-train-epochs 5     # what will 2 more epochs do?
  ckptdoctor gate fixtures/lr-finished --max-steps 16  # resume a finished run: LR 0, then a new schedule
  ckptdoctor gate runs/my-run --checkpoint checkpoint-800 --learning-rate 1e-4 --format json
  ckptdoctor gate runs/my-run --training-args args.json --world-size 8 --format github   # in CI, before launch
  ckptdoctor gate runs/my-run --ignore CKD411 --fail-on warning   # rules chosen as for `ckptdoctor scan`

\b
Options left out are the run's own: read from the checkpoint's training_args.bin and trainer_state.json (or
--training-args), else transformers' defaults; --format json lists each value used and where it came from.

\b
Settings: RUN_DIR's .ckptdoctor.toml or [tool.ckptdoctor] in its pyproject.toml applies as it does for
`ckptdoctor scan RUN_DIR`: its ignore and severity to the scan findings and to the gate rules, its select to the
scan findings only (the gate rules CKD407-413 and CKD504 run unless ignored), its fail-on when --fail-on is not
given. It cannot turn off or lower the security rules (CKD6xx), nor let their errors pass
with fail-on = "never"; --ignore and --fail-on here can. --no-config ignores it.

\b
Exit codes: 0 pass, 1 a finding at or above --fail-on, 2 usage error (conflicting options, a number that is not
finite, an unreadable --training-args, no such --checkpoint, an unknown rule code, a bad settings file) or a
checkpoint whose global_step is beyond any float (nothing can be predicted from it).
"""


@click.command("gate", epilog=_EPILOG, short_help="Predict what a resume will load, train and at which LRs.")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--checkpoint", metavar="PATH", help="Resume from this checkpoint (a path, or a folder in RUN_DIR), as "
              "resume_from_checkpoint=PATH does.  [default: the highest-numbered checkpoint-N in RUN_DIR, as "
              "resume_from_checkpoint=True picks]")
@click.option("--num-train-epochs", type=float, help="Planned num_train_epochs: an epoch-based run (not with "
              "--max-steps).  [default: the run's own]")
@click.option("--max-steps", type=click.IntRange(min=1), help="Planned max_steps: a step-based run, which ignores "
              "epochs (not with --num-train-epochs).  [default: the run's own]")
@click.option("--learning-rate", type=float, help="Planned learning_rate. A restored scheduler keeps the "
              "checkpoint's base LR, so a different value is ignored (CKD409).  [default: the run's own]")
@click.option("--lr-scheduler-type", type=click.Choice([*schedules.SUPPORTED, *schedules.METRIC_DRIVEN]),
              help="Planned lr_scheduler_type (the last two are metric-driven: reported as unpredictable).  "
              "[default: the run's own]")
@click.option("--lr-scheduler-kwargs", metavar="JSON", help='Planned lr_scheduler_kwargs, a JSON object, e.g. '
              '\'{"num_cycles": 2}\'.  [default: the run\'s own]')
@click.option("--warmup-steps", type=click.FloatRange(min=0), help="Planned warmup_steps; below 1 it is a ratio of "
              "max_steps, as in transformers 5.x (not with --warmup-ratio).  [default: the run's own]")
@click.option("--warmup-ratio", type=click.FloatRange(min=0, max=1, max_open=True), help="Planned warm-up as a "
              "ratio of max_steps (4.x's warmup_ratio; not with --warmup-steps).  [default: the run's own]")
@click.option("--steps-per-epoch", type=click.IntRange(min=1),
              help="Optimizer steps per epoch of the resumed run; give it when the dataset, batch size, gradient "
              "accumulation or world size changes.  [default: the checkpoint's, from trainer_state.json]")
@click.option("--world-size", type=click.IntRange(min=1), help="Processes the resume will run on, compared with "
              "the ranks that saved the checkpoint (CKD504).  [default: not checked]")
@click.option("--training-args", "training_args_file", type=click.Path(exists=True, dir_okay=False),
              metavar="FILE.json", help="The planned TrainingArguments as JSON (args.to_json_string()); the options "
              "above override it.  [default: none: the run's own arguments]")
@click.option("--lr-steps", type=click.IntRange(min=0, max=MAX_LR_STEPS), default=DEFAULT_LR_STEPS, show_default=True,
              help="How many resumed optimizer steps' LRs to predict (fewer when the resume trains fewer steps).")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "sarif", "github"]), default="text",
              show_default=True, help="text: the prediction, findings and verdict for people; json: one "
              "ckptdoctor.gate/1 document for scripts; sarif: SARIF 2.1.0 for code scanning; github: workflow "
              "annotation lines.")
@rule_options(never_runs="Narrows the scan findings the gate keeps; the gate rules (CKD407-413, CKD504) run "
              "unless ignored. Selecting only --deep rules is a usage error (the gate never reads tensor data).",
              every_rule="every rule the gate runs", root="RUN_DIR", each_root="RUN_DIR")
def gate_command(
    run_dir: str,
    checkpoint: str | None,
    num_train_epochs: float | None,
    max_steps: int | None,
    learning_rate: float | None,
    lr_scheduler_type: str | None,
    lr_scheduler_kwargs: str | None,
    warmup_steps: float | None,
    warmup_ratio: float | None,
    steps_per_epoch: int | None,
    world_size: int | None,
    training_args_file: str | None,
    lr_steps: int,
    fmt: str,
    fail_on: str | None,
    select: tuple[str, ...],
    ignore: tuple[str, ...],
    no_config: bool,
) -> None:
    """Predict what trainer.train(resume_from_checkpoint=...) will do for RUN_DIR, and fail when it is wrong.

    It names the checkpoint the resume loads and through which loader, how many steps it trains and at which
    learning rates, following transformers 5.x's resume path, then judges the plan: the gate rules (CKD407-413,
    CKD504) plus every scan finding about that checkpoint, under RUN_DIR's settings file as `ckptdoctor scan`
    reads it. RUN_DIR is the output_dir, or a checkpoint folder. Arguments you do not plan are the run's own (read
    from the checkpoint's training_args.bin and trainer_state.json). Nothing is loaded or executed.
    """
    from ckptdoctor.cli import UsageProblem  # here: cli imports this module when it registers the command

    if num_train_epochs is not None and max_steps is not None:
        raise UsageProblem("give --num-train-epochs or --max-steps, not both")
    if warmup_steps is not None and warmup_ratio is not None:
        raise UsageProblem("give --warmup-steps or --warmup-ratio, not both")
    kwargs = None
    if lr_scheduler_kwargs is not None:
        kwargs = _kwargs(lr_scheduler_kwargs)
        if kwargs is None and lr_scheduler_kwargs.strip():
            raise UsageProblem("--lr-scheduler-kwargs must be a JSON object")
    file_args: dict[str, Any] | None = None
    if training_args_file is not None:
        try:
            with open(training_args_file, encoding="utf-8") as fh:
                loaded = json.load(fh)
        except (OSError, ValueError, RecursionError) as exc:  # RecursionError: arrays nested 10^5 deep
            raise UsageProblem(f"--training-args {training_args_file}: {exc or type(exc).__name__}") from None
        if not isinstance(loaded, dict):
            raise UsageProblem(f"--training-args {training_args_file}: not a JSON object")
        file_args = loaded
        try:
            plan_from_training_args(file_args, strict=True)
        except GateInputError as exc:
            raise UsageProblem(f"--training-args {training_args_file}: {exc}") from None
    if checkpoint is not None and not (os.path.isdir(checkpoint) or os.path.isdir(os.path.join(run_dir, checkpoint))):
        raise UsageProblem(f"--checkpoint {checkpoint}: no such folder (nor in {run_dir})")
    try:
        planned = {
            "num_train_epochs": num_train_epochs, "max_steps": max_steps, "learning_rate": learning_rate,
            "lr_scheduler_type": lr_scheduler_type, "lr_scheduler_kwargs": kwargs,
            "warmup_steps": warmup_steps if warmup_steps is not None else warmup_ratio,
            "steps_per_epoch": steps_per_epoch, "world_size": world_size,
        }
        # _gate, not gate: a settings file's note on security rules is the CLI's stderr line, not a Python warning
        result = _gate(run_dir, checkpoint, True, file_args, lr_steps, fail_on, select, ignore, not no_config,
                       planned, on_kept=None)
    except GateInputError as exc:
        raise UsageProblem(str(exc)) from None
    if fmt == "json":
        click.echo(json.dumps(result.to_json(), indent=2, allow_nan=False))
    elif fmt in ("sarif", "github"):
        from ckptdoctor.render import sarif

        if fmt == "sarif":
            click.echo(sarif.render_sarif(result.findings))
        else:
            click.echo(sarif.render_github(result.findings, notice=summary(result)))
    else:
        click.echo(render_text(result))
    from ckptdoctor.cli import _exit_code, _read_only_done

    # scan's exit code and its note on stderr when a settings file's fail-on = "never" meets a security error
    cfg_fail_on = result.fail_on if result.fail_on_from_settings else None
    code = _exit_code(Report((), result.findings, 0.0), fail_on, cfg_fail_on)
    _read_only_done()  # the gate wrote nothing: the process may end without tearing the scan down
    sys.exit(code)
