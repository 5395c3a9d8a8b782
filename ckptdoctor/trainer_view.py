"""The Trainer's view of a checkpoint: which files it picks and loads, in which order, and what it reads from them.

Typed views of the trainer state, scheduler, optimizer, adapter config, shard index and weights. Pure functions
over the model (no I/O): they interpret the plain values the readers rebuilt, the way transformers and torch would,
so rules, reports and the gate share one reading of each file.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar, cast

from ckptdoctor.discover import is_deepspeed_state
from ckptdoctor.model import (
    HISTORY_KEYS,
    Checkpoint,
    FileFacts,
    FileKind,
    Framework,
    JsonFacts,
    MindSporeFacts,
    Opaque,
    SafetensorsFacts,
    TensorInfo,
    TextFacts,
    TorchFacts,
    frozen,
)

# transformers' Trainer._load_from_checkpoint candidates (src/transformers/trainer.py)
SAFE_WEIGHTS = "model.safetensors"
BIN_WEIGHTS = "pytorch_model.bin"
SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
ADAPTER_SAFE = "adapter_model.safetensors"
ADAPTER_BIN = "adapter_model.bin"
ADAPTER_CONFIG = "adapter_config.json"
TRAINER_STATE = "trainer_state.json"
OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")
SCHEDULER = "scheduler.pt"
# Each rank's RNG state (`Trainer._save_rng_state`): `rng_state.pth` for one process, `rng_state_R.pth` for rank R.
RNG_RE = re.compile(r"^rng_state(?:_(\d+))?\.pth$")
FULL_WEIGHT_FILES = (SAFE_WEIGHTS, BIN_WEIGHTS)
WEIGHT_CANDIDATES = (ADAPTER_BIN, ADAPTER_SAFE, BIN_WEIGHTS, BIN_INDEX, SAFE_WEIGHTS, SAFE_INDEX)

# The MindNLP 0.4 Trainer's names (mindnlp/engine/trainer/base.py OPTIMIZER_NAME, SCHEDULER_NAME; mindnlp/configs.py
# WEIGHTS_NAME). Both state files are torch-style zip archives holding one pickle, `scheduler.json` included.
MS_WEIGHTS = "mindspore_model.ckpt"
MS_OPTIMIZER = "optimizer.ckpt"
MS_SCHEDULER = "scheduler.json"


def is_mindnlp(ck: Checkpoint) -> bool:
    """A checkpoint the MindNLP Trainer wrote (discovery decides from its files)."""
    return ck.framework is Framework.MINDNLP


def scheduler_file(ck: Checkpoint) -> FileFacts | None:
    """The scheduler state the resume restores: `scheduler.json` for MindNLP, else `scheduler.pt`."""
    return ck.file(MS_SCHEDULER if is_mindnlp(ck) else SCHEDULER)


_T = TypeVar("_T")
_K = TypeVar("_K")
_CACHE_SIZE = 4096
_CACHES: list[dict[Any, Any]] = []  # every ``per_object`` and ``per_parts`` cache, for ``forget``


def per_object(fn: Callable[[_K], _T]) -> Callable[[_K], _T]:
    """Memoise ``fn`` by its argument's identity, for pure functions of frozen values that are asked the same
    question by several rules. The cache is bounded and holds each argument, so its id stays unique."""
    cache: dict[int, tuple[_K, _T]] = {}
    _CACHES.append(cache)

    def memo(x: _K) -> _T:
        hit = cache.get(id(x))
        if hit is not None and hit[0] is x:
            return hit[1]
        if len(cache) >= _CACHE_SIZE:
            cache.clear()
        result = fn(x)
        cache[id(x)] = (x, result)
        return result

    return memo


def per_parts(fn: Callable[[tuple[Any, ...]], _T]) -> Callable[[tuple[Any, ...]], _T]:
    """Memoise ``fn`` of a tuple by the identities of its items: a run's checkpoints hand the same objects (a
    shard's tensors, an index's weight map) to a view built anew for each checkpoint when their files are alike
    (the readers share equal headers, and the verdict cache decodes equal values as one object). The cache is
    bounded and holds each tuple, so the ids of its items stay unique."""
    cache: dict[tuple[int, ...], tuple[tuple[Any, ...], _T]] = {}
    _CACHES.append(cache)

    def memo(parts: tuple[Any, ...]) -> _T:
        key = tuple(map(id, parts))
        hit = cache.get(key)
        if hit is not None:
            return hit[1]
        if len(cache) >= _CACHE_SIZE:
            cache.clear()
        result = fn(parts)
        cache[key] = (parts, result)
        return result

    return memo


def forget() -> None:
    """Empty every ``per_object`` cache: a scan that judges one run at a time calls it once a run is judged and
    rendered, since each cache holds its arguments (a run's facts, its parsed log histories) until it fills."""
    for cache in _CACHES:
        cache.clear()
    _PLAIN_LOG[0] = []


def per_file(fn: Callable[[FileFacts], _T]) -> Callable[[FileFacts | None], _T | None]:
    """Memoise a view of one file by the file's identity: every rule asks for the same trainer state or optimizer
    view, and building it walks a log_history or a state dict that can hold 10^5 entries. Facts are frozen, so an
    identical object always gives the same answer (see ``per_object``)."""
    memo = per_object(fn)

    def view(f: FileFacts | None) -> _T | None:
        return None if f is None else memo(f)

    return view


def json_value(f: FileFacts | None) -> Any:
    """The parsed value of a JSON file's facts, or None when ``f`` is missing or not JSON."""
    if f is not None and isinstance(f.content, JsonFacts):
        return f.content.value
    return None


def _torch_value(f: FileFacts | None) -> Any:
    if f is not None and isinstance(f.content, TorchFacts) and f.content.pickle is not None:
        return f.content.pickle.value
    return None


def _num(v: Any) -> float | None:
    """``v`` as a float when it is a JSON number (not a bool); an integer past float range is an infinity."""
    if isinstance(v, bool):
        return None
    if isinstance(v, float):
        return v
    if isinstance(v, int):
        try:
            return float(v)
        except OverflowError:  # JSON allows any integer; one past float range compares as an infinity would
            return math.inf if v > 0 else -math.inf
    return None


number = _num  # the same conversion for rules that compare values read from files


def integer(v: Any) -> int | None:
    """``v`` when it is a JSON integer (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, int):
        return None
    return v


# ---------------------------------------------------------------------------------------------------------------
# trainer_state.json


@frozen
class TrainerStateView:
    """The fields of ``trainer_state.json`` that resume and ckptdoctor's rules depend on."""

    global_step: int | None
    max_steps: int | None
    num_train_epochs: float | None
    epoch: float | None
    log_history: tuple[dict[str, Any], ...]
    best_model_checkpoint: str | None
    best_metric: float | None
    train_batch_size: int | None
    save_steps: int | None
    logging_steps: int | None
    raw: dict[str, Any]
    by_step: Mapping[int, dict[str, Any]]  # log_history entries merged per step (train and eval logs share a step)
    # False for a large file read in pieces: its log_history entries hold only model.HISTORY_KEYS, so ``raw`` is
    # not the whole file and must not be written back
    complete: bool = True

    def learning_rates(self) -> list[tuple[int, float]]:
        """``(step, learning_rate)`` pairs from log_history, in file order."""
        log = self.log_history
        columns = log_columns(log)  # the log's steps and rates, when its entries are plain dicts (shared)
        if columns is not None:
            # at C speed for what JSON gives (plain dicts of plain values): the entries whose step is an integer and
            # whose learning_rate is a number (no bool), as ``integer`` and ``_num`` take them one by one below
            steps, _, rates = columns
            rate_types = list(map(type, rates))
            kept = _kept_rates(log, steps, rate_types) if _JSON_SCALARS.issuperset(rate_types) else None
            if kept is not None:
                pairs = zip(itertools.compress(steps, kept), itertools.compress(rates, kept), strict=True)
                if _FLOAT_ONLY.issuperset(itertools.compress(rate_types, kept)):
                    return list(pairs)  # the rates as they are: what the loop below makes of floats
                return [(step, lr if lr.__class__ is float else cast(float, _num(lr))) for step, lr in pairs]
        out: list[tuple[int, float]] = []
        for entry in log:
            step, lr = integer(entry.get("step")), _num(entry.get("learning_rate"))
            if step is not None and lr is not None:
                out.append((step, lr))
        return out


def _kept_rates(log: tuple[dict[str, Any], ...], steps: list[Any], rate_types: list[type]) -> list[bool] | None:
    """For ``learning_rates``: which entries have an integer step and a number for a rate, or None when a step is
    not a JSON scalar (then each entry is looked at)."""
    if integer_steps(log):  # what the Trainer writes: an entry is kept where its rate is a number
        return list(map(_NUMBERS.__contains__, rate_types))
    step_types = list(map(type, steps))
    if not _JSON_SCALARS.issuperset(step_types):
        return None
    return list(map(
        operator.and_, map(operator.is_, step_types, itertools.repeat(int)), map(_NUMBERS.__contains__, rate_types)
    ))  # fmt: skip


def trainer_state(ck: Checkpoint) -> TrainerStateView | None:
    """The checkpoint's trainer state, or None when the file is absent or not a JSON object."""
    return _trainer_state(ck.file(TRAINER_STATE))


@per_file
def _trainer_state(f: FileFacts) -> TrainerStateView | None:
    value = json_value(f)
    if not isinstance(value, dict):
        return None
    hist = value.get("log_history")
    history: tuple[dict[str, Any], ...] = ()
    if isinstance(hist, list):
        # A long run logs 10^4-10^5 entries per checkpoint: check their types at C speed when all are plain dicts.
        history = tuple(hist) if _plain_log(hist) else tuple(e for e in hist if isinstance(e, dict))
    best = value.get("best_model_checkpoint")
    return TrainerStateView(
        global_step=integer(value.get("global_step")),
        max_steps=integer(value.get("max_steps")),
        num_train_epochs=_num(value.get("num_train_epochs")),
        epoch=_num(value.get("epoch")),
        log_history=history,
        best_model_checkpoint=best if isinstance(best, str) else None,
        best_metric=_num(value.get("best_metric")),
        train_batch_size=integer(value.get("train_batch_size")),
        save_steps=integer(value.get("save_steps")),
        logging_steps=integer(value.get("logging_steps")),
        raw=value,
        by_step=_MergedSteps(history),
        complete=not (isinstance(f.content, JsonFacts) and f.content.partial),
    )


def _merged_quickly(entries: tuple[dict[str, Any], ...]) -> dict[int, dict[str, Any]] | None:
    """``_MergedSteps``' dict built at C speed when every entry is a plain dict with a plain integer step (what the
    Trainer writes): each entry itself under its step (no copy: nobody changes them), and the entries of a step
    logged more than once (a train and an eval log) merged in order into a new dict; None otherwise (then the
    entries are merged one by one)."""
    if not plain_dicts(entries):
        return None
    found: list[Any] = list(map(dict.get, entries, itertools.repeat("step")))
    if not _INT_ONLY.issuperset(map(type, found)):
        return None
    steps: list[int] = found
    merged = dict(zip(steps, entries, strict=True))  # each step where first logged, as ``setdefault`` does
    if len(merged) < len(steps):
        again = {step for step, n in Counter(steps).items() if n > 1}
        for step in again:
            merged[step] = {}
        for i in itertools.compress(range(len(steps)), map(again.__contains__, steps)):
            merged[steps[i]].update(entries[i])
    return merged


_DICT_ONLY = frozenset({dict})
_INT_ONLY = frozenset({int})
_JSON_SCALARS = frozenset({int, float, bool, str, type(None)})
_NUMBERS = frozenset({int, float})
_FLOAT_ONLY = frozenset({float})


def plain_dicts(items: Iterable[Any]) -> bool:
    """Whether every item is a ``dict`` itself (no subclass), checked at C speed (a log_history of 10^4 entries)."""
    return _DICT_ONLY.issuperset(map(type, items))


@per_object
def log_columns(log: tuple[dict[str, Any], ...]) -> tuple[list[Any], list[Any], list[Any]] | None:
    """The step, loss and learning_rate of every entry of a log_history (``HISTORY_KEYS``), one list per key
    (built at C speed; None as the entry lacks it), or None when an entry is not a plain dict. Asked of the newest
    checkpoint's log by the history comparisons (CKD101) and the learning-rate checks (CKD406): built once, never
    changed."""
    if not plain_dicts(log):
        return None
    step, loss, rate = (list(map(dict.get, log, itertools.repeat(key))) for key in HISTORY_KEYS)
    return step, loss, rate


@per_object
def integer_steps(log: tuple[dict[str, Any], ...]) -> bool:
    """Whether every entry of a log_history is a plain dict whose step is an integer (``int`` itself, no bool):
    what the Trainer writes, which the history comparisons (CKD101) and the learning rates (CKD406) take quickly."""
    columns = log_columns(log)
    return columns is not None and _INT_ONLY.issuperset(map(type, columns[0]))


def merged_steps(ts: TrainerStateView) -> dict[int, dict[str, Any]]:
    """``ts.by_step`` as a plain dict (looked up at C speed by rules that compare whole histories)."""
    by_step = ts.by_step
    return by_step.merged() if isinstance(by_step, _MergedSteps) else dict(by_step)


# The longest log_history found to hold plain dicts only, since the last ``forget``: a run's checkpoints log the
# same entries (the very objects, when the readers or the verdict cache share them), each history a prefix of the
# next, so a history that is a prefix of it, or starts with it, has its types checked by identity, not one by one.
_PLAIN_LOG: list[list[Any]] = [[]]


def _plain_log(hist: list[Any]) -> bool:
    """Whether every entry of ``hist`` is a plain dict (``plain_dicts``), looked up in ``_PLAIN_LOG`` first."""
    known = _PLAIN_LOG[0]
    n = len(known)
    if len(hist) <= n:
        if known[: len(hist)] == hist:  # identical entries compare at C speed; a JSON non-dict never equals a dict
            return True
        return plain_dicts(hist)
    if not (hist[:n] == known and plain_dicts(itertools.islice(hist, n, None))) and not plain_dicts(hist):
        return False
    _PLAIN_LOG[0] = hist
    return True


class _MergedSteps(Mapping[int, dict[str, Any]]):
    """log_history entries merged per integer step, built on first use: most trainer states are never asked
    (only the checkpoint another is compared with), and merging 10^5 entries is the costliest part of a view."""

    __slots__ = ("_entries", "_merged")

    def __init__(self, entries: tuple[dict[str, Any], ...]) -> None:
        self._entries = entries
        self._merged: dict[int, dict[str, Any]] | None = None

    def merged(self) -> dict[int, dict[str, Any]]:
        """The entries merged per step, as a dict (not to be changed)."""
        return self._get()

    def _get(self) -> dict[int, dict[str, Any]]:
        if self._merged is None:
            merged = _merged_quickly(self._entries)
            if merged is None:
                merged = {}
                for e in self._entries:
                    step = e.get("step")
                    if isinstance(step, int) and not isinstance(step, bool):
                        merged.setdefault(step, {}).update(e)
            self._merged = merged
        return self._merged

    def __getitem__(self, step: int) -> dict[str, Any]:
        return self._get()[step]

    def __contains__(self, step: object) -> bool:
        return step in self._get()

    def __iter__(self) -> Iterator[int]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __repr__(self) -> str:
        return repr(self._get())


def logged_warmup_steps(ts: TrainerStateView, base_lr: float) -> int | None:
    """The linear warm-up length a run's logged LRs show: the first logged step ``k`` whose LR is below ``base_lr``
    gives ``k * base_lr / lr`` (the warm-up lambda is ``step / warmup_steps``, logged after the scheduler stepped),
    when that is a whole number and every earlier logged LR rose; 0 when the first logged LR is already ``base_lr``;
    None when the history shows neither (no LRs, or not a linear warm-up)."""
    lrs = ts.learning_rates()
    if not lrs or not finite(base_lr) or base_lr <= 0:
        return None
    step, lr = lrs[0]
    if math.isclose(lr, base_lr, rel_tol=1e-6):
        return 0 if step == 1 else None
    if not 0 < lr < base_lr or step < 1:
        return None
    w = step * base_lr / lr
    if not math.isclose(w, round(w), rel_tol=0, abs_tol=1e-6):
        return None
    warmup = round(w)
    for k, v in lrs[1:]:
        if k >= warmup:
            break
        if not math.isclose(v, base_lr * k / warmup, rel_tol=1e-6):
            return None
    return warmup


# ---------------------------------------------------------------------------------------------------------------
# scheduler.pt / optimizer.pt


@frozen
class SchedulerView:
    """``LambdaLR.state_dict()`` as saved in ``scheduler.pt`` (``torch/optim/lr_scheduler.py``)."""

    last_epoch: int | None
    base_lrs: tuple[float, ...]
    last_lr: tuple[float, ...]
    step_count: int | None


def _floats(v: Any) -> tuple[float, ...]:
    if isinstance(v, (list, tuple)):
        out = [_num(x) for x in v]
        return tuple(x for x in out if x is not None)
    return ()


def _state_dict(v: Any) -> dict[Any, Any] | None:
    if isinstance(v, dict):
        return v
    if isinstance(v, Opaque) and isinstance(v.state, dict):
        return v.state
    return None


def scheduler_state(ck: Checkpoint) -> SchedulerView | None:
    """The scheduler state, or None when the scheduler file is absent or holds no state dict."""
    return _scheduler_state(scheduler_file(ck))


@per_file
def _scheduler_state(f: FileFacts) -> SchedulerView | None:
    d = _state_dict(_torch_value(f))
    if d is None:
        return None
    return SchedulerView(
        last_epoch=integer(d.get("last_epoch")),
        base_lrs=_floats(d.get("base_lrs")),
        last_lr=_floats(d.get("_last_lr")),
        step_count=integer(d.get("_step_count")),
    )


@frozen
class ParamGroupView:
    """One optimizer param group: its LRs and the parameter indices it owns."""

    lr: float | None
    initial_lr: float | None
    params: tuple[int, ...]


@frozen
class OptimizerView:
    """``Optimizer.state_dict()`` as saved in ``optimizer.pt``: groups and per-parameter state tensor shapes."""

    groups: tuple[ParamGroupView, ...]
    state_shapes: dict[int, dict[str, tuple[int, ...]]]
    steps: dict[int, float]

    @property
    def param_count(self) -> int:
        return sum(len(g.params) for g in self.groups)


def optimizer_file(ck: Checkpoint) -> FileFacts | None:
    """``optimizer.pt`` or ``optimizer.bin``, whichever exists (the Trainer accepts both); MindNLP's
    ``optimizer.ckpt``."""
    if is_mindnlp(ck):
        return ck.file(MS_OPTIMIZER)
    for name in OPTIMIZER_FILES:
        f = ck.file(name)
        if f is not None:
            return f
    return None


def optimizer_state(ck: Checkpoint) -> OptimizerView | None:
    """The optimizer state, or None when the file is absent or unreadable."""
    return _optimizer_state(optimizer_file(ck))


@per_file
def _optimizer_state(f: FileFacts) -> OptimizerView | None:
    d = _state_dict(_torch_value(f))
    if d is None:
        return None
    groups: list[ParamGroupView] = []
    raw_groups = d.get("param_groups")
    if isinstance(raw_groups, list):
        for g in raw_groups:
            if isinstance(g, dict):
                params = g.get("params")
                idx = _param_ids(params) if isinstance(params, list) else ()
                groups.append(ParamGroupView(_num(g.get("lr")), _num(g.get("initial_lr")), idx))
    raw_state = d.get("state")
    shapes, steps = _state_shapes(raw_state) if isinstance(raw_state, dict) else ({}, {})
    return OptimizerView(tuple(groups), shapes, steps)


@per_object
def _param_ids(params: list[Any]) -> tuple[int, ...]:
    # by the list's identity: a run's checkpoints share one list of parameter ids (see ``_state_shapes``); what
    # torch saves (plain integers) is taken whole, at C speed
    if _INT_ONLY.issuperset(map(type, params)):
        return tuple(params)
    return tuple(p for p in params if isinstance(p, int))


@per_object
def _state_shapes(raw_state: dict[Any, Any]) -> tuple[dict[int, dict[str, tuple[int, ...]]], dict[int, float]]:
    """Each parameter's state shapes and step: a run's checkpoints share one state dict object when their states are
    alike (the readers hand out equal values as one object, and so does the verdict cache), so it is read once."""
    shapes: dict[int, dict[str, tuple[int, ...]]] = {}
    steps: dict[int, float] = {}
    for k, v in raw_state.items():
        if not isinstance(k, int) or not isinstance(v, dict):
            continue
        per: dict[str, tuple[int, ...]] = {}
        for name, t in v.items():
            shape = getattr(t, "shape", None)
            if shape is None and isinstance(t, Opaque):
                shape = mindspore_tensor_shape(t)
            if isinstance(name, str) and isinstance(shape, tuple):
                per[name] = shape
            if name == "step":
                s = _num(t)
                if s is not None:
                    steps[k] = s
        shapes[k] = per
    return shapes, steps


def mindspore_tensor_shape(v: Opaque) -> tuple[int, ...] | None:
    """The shape of a MindSpore tensor pickled inline (MindNLP's ``optimizer.ckpt``): a
    ``mindspore.common.tensor.Tensor`` whose state wraps a numpy array rebuilt by ``_reconstruct`` and given its
    shape by the array's BUILD state ``(version, shape, dtype, is_fortran, bytes)``; None for anything else."""
    if v.func is None or v.func.dotted != "mindspore.common.tensor.Tensor":
        return None
    inner = v.state.get("value") if isinstance(v.state, dict) else v.args
    arrays = inner if isinstance(inner, (list, tuple)) else (inner,)
    for a in arrays[:1]:
        if isinstance(a, Opaque) and isinstance(a.state, tuple) and len(a.state) >= 2:
            shape = a.state[1]
            if isinstance(shape, tuple) and all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
                return shape
    return None


def has_optimizer_state(ck: Checkpoint) -> bool:
    """transformers' test: `optimizer.pt`/`optimizer.bin`, or any sub-folder whose name contains `optimizer`
    (MindNLP: `optimizer.ckpt`)."""
    if optimizer_file(ck) is not None:
        return True
    if is_mindnlp(ck):
        return False
    return any("/" in ck.relname(f) and "optimizer" in ck.relname(f).split("/", 1)[0] for f in ck.files)


def checkpoint_lr(ck: Checkpoint) -> float | None:
    """The LR the checkpoint holds: scheduler ``_last_lr[0]``, else optimizer group 0 ``lr``, else the last logged LR.

    This is the LR the first resumed optimizer step would use (it is restored into the optimizer).
    """
    sched = scheduler_state(ck)
    if sched is not None and sched.last_lr:
        return sched.last_lr[0]
    opt = optimizer_state(ck)
    if opt is not None and opt.groups and opt.groups[0].lr is not None:
        return opt.groups[0].lr
    ts = trainer_state(ck)
    if ts is not None:
        lrs = ts.learning_rates()
        if lrs:
            return lrs[-1][1]
    return None


TRAINING_ARGS = "training_args.bin"


def training_args(ck: Checkpoint) -> dict[str, Any] | None:
    """The fields of ``training_args.bin`` (a pickled ``TrainingArguments``, walked statically), or None.

    Enum members (``SchedulerType('linear')``, ``IntervalStrategy('steps')``) are given as their plain values.
    """
    return training_args_value(ck.file(TRAINING_ARGS))


@per_file
def training_args_value(f: FileFacts) -> dict[str, Any] | None:
    """The string-keyed fields of a ``training_args.bin``'s pickled state, or None when it has none."""
    d = _state_dict(_torch_value(f))
    if d is None:
        return None
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(k, str):
            enum_value = isinstance(v, Opaque) and isinstance(v.args, tuple) and len(v.args) == 1
            out[k] = v.args[0] if enum_value else v
    return out


# ---------------------------------------------------------------------------------------------------------------
# Weights


def tensors_of(f: FileFacts | None) -> tuple[TensorInfo, ...] | None:
    """Tensors a weights file holds (safetensors header or torch state dict), or None when unreadable."""
    return _tensors_of(f)


@per_file
def _tensors_of(f: FileFacts) -> tuple[TensorInfo, ...] | None:
    c = f.content
    if isinstance(c, (SafetensorsFacts, MindSporeFacts)):
        return c.tensors
    if f.kind is FileKind.EMPTY and f.name.lower() == MS_WEIGHTS:
        return ()  # protobuf writes a `Checkpoint` with no values as zero bytes
    if isinstance(c, TorchFacts):
        return tuple(TensorInfo(name, t.dtype, t.shape, t.numel * _itemsize(t.dtype)) for name, t in c.tensors)
    return None


_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "C64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2}


def _itemsize(dtype: str) -> int:
    return _ITEMSIZE.get(dtype, 1)


@per_file
def weight_map(f: FileFacts) -> dict[str, str] | None:
    """A shard index's ``weight_map`` (tensor name -> shard file), or None when it is not a valid one. Shared by
    several rules; callers never change it."""
    if not isinstance(f.content, JsonFacts) or not isinstance(f.content.value, dict):
        return None
    wm = f.content.value.get("weight_map")
    return _weight_map(wm) if isinstance(wm, dict) else None


@per_object
def _weight_map(wm: dict[Any, Any]) -> dict[str, str] | None:
    # by the map's identity: a run's indexes are often one value (the readers and the verdict cache share them)
    if not all(isinstance(v, str) for v in wm.values()):
        return None
    return {str(k): v for k, v in wm.items()}


@per_object
def shard_counts(wm: dict[str, str]) -> Counter[str]:
    """How many tensors a shard index's ``weight_map`` (``weight_map``'s) maps to each shard, in the order the
    shards first appear: its keys are the shards the index names. Asked of every index by several rules, once per
    map (a run's checkpoints share one); callers never change it."""
    return Counter(wm.values())


# The top-level files some resume of a Trainer checkpoint opens, transformers 4.x and 5.x, any backend:
# `Trainer._load_from_checkpoint` (config.json, the full weights, the shard indexes, the adapter files),
# `TrainerState.load_from_json`, `_load_optimizer_and_scheduler` (optimizer.pt, or optimizer.bin under FSDP),
# `_load_scaler`, `_load_rng_state`, accelerate's `load_fsdp_model` (pytorch_model_fsdp.bin) and DeepSpeed's
# `load_checkpoint` (`latest`), src/transformers/trainer.py; MindNLP's three files (mindnlp/engine/trainer/base.py).
_RESUME_FILES = frozenset({
    "config.json", SAFE_WEIGHTS, BIN_WEIGHTS, SAFE_INDEX, BIN_INDEX, ADAPTER_SAFE, ADAPTER_BIN, ADAPTER_CONFIG,
    TRAINER_STATE, *OPTIMIZER_FILES, SCHEDULER, "scaler.pt", "pytorch_model_fsdp.bin", "latest",
    MS_WEIGHTS, MS_OPTIMIZER, MS_SCHEDULER, ".metadata",
})
# `save_pretrained`'s shard names (transformers' `SAFE_WEIGHTS_NAME`/`WEIGHTS_NAME` with `-00001-of-00002`): the
# sharded load opens them through the index, which may itself be the file a torn save lost
SHARD_RE = re.compile(r"^(?:model|pytorch_model)-\d+-of-\d+\.(?:safetensors|bin)$")


def resume_reads(ck: Checkpoint, rel: str) -> bool:
    """Whether some resume of ``ck`` (transformers 4.x or 5.x, any ``save_safetensors``, any backend) opens ``rel``
    (relative to the folder; ``""`` is the folder itself): the one answer to "does the resume read this file" that
    the scan rules share. A side file a Trainer never loads (`ema_backup.safetensors`, `training_args.bin`,
    `generation_config.json`) is not read; anything in a sub-folder is (named adapters, FSDP and DeepSpeed state
    folders and DCP folders are loaded whole), and so is every file of a checkpoint another stack wrote, since
    which of them its loader opens is not modelled."""
    if rel == "" or "/" in rel or ck.framework not in (Framework.PYTORCH, Framework.MINDNLP):
        return True
    if rel in _RESUME_FILES or RNG_RE.match(rel) or SHARD_RE.match(rel) or rel.endswith(".distcp"):
        return True
    return rel in _indexed_shards(ck)


@per_object
def _indexed_shards(ck: Checkpoint) -> frozenset[str]:
    """The shard names the folder's indexes list (once per folder: ``ck.file`` walks every file)."""
    out: set[str] = set()
    for index in (SAFE_INDEX, BIN_INDEX):
        wm = weight_map(ck.file(index))
        if wm is not None:
            out.update(shard_counts(wm))
    return frozenset(out)


@per_object  # asked by several rules of every checkpoint; walks all its files
def is_fsdp(ck: Checkpoint) -> bool:
    """transformers' ``is_fsdp_ckpt``: a sub-folder whose name contains ``pytorch_model_fsdp``, or that file."""
    for rel, _ in ck.entries():
        if "pytorch_model_fsdp" not in rel:
            continue  # neither test below can pass: most files, passed over at C speed
        head = rel.split("/", 1)[0]
        if "/" in rel and "pytorch_model_fsdp" in head:
            return True
        if rel == "pytorch_model_fsdp.bin":
            return True
    return False


@per_object  # asked by several rules of every checkpoint; walks all its files
def is_deepspeed(ck: Checkpoint) -> bool:
    """A DeepSpeed checkpoint: a ``global_step*/`` folder, or a tag folder of any name holding DeepSpeed's model or
    optimizer states (``discover.is_deepspeed_tag``)."""
    for rel, f in ck.entries():
        if "/" in rel and (rel.startswith("global_step") or (rel.count("/") == 1 and is_deepspeed_state(f.name))):
            return True
    return False


@per_object  # asked by several rules of every checkpoint; walks all its files
def adapter_subdirs(ck: Checkpoint) -> tuple[str, ...]:
    """Sub-folders holding adapter weights (extra named adapters), as transformers detects them."""
    out = set()
    for rel, _ in ck.entries():
        if "/" not in rel:
            continue  # a file directly in the folder: most of them
        parts = rel.split("/")
        if len(parts) == 2 and parts[1] in (ADAPTER_SAFE, ADAPTER_BIN):
            out.add(parts[0])
    return tuple(sorted(out))


@per_object  # asked by several rules of every checkpoint, some of them a few times
def has_adapter(ck: Checkpoint) -> bool:
    """Adapter weights in the folder or in a sub-folder of it (a named adapter)."""
    return ck.file(ADAPTER_SAFE) is not None or ck.file(ADAPTER_BIN) is not None or bool(adapter_subdirs(ck))


@per_object  # asked by several rules of every checkpoint, some of them a few times
def weights_branch(ck: Checkpoint) -> str:
    """Which loader a resume would use, in ``Trainer._load_from_checkpoint`` order (transformers 5.x).

    ``fsdp`` and ``deepspeed`` assume the resume runs under that backend; ``adapter`` assumes a PeftModel (adapter
    files on disk are our evidence of that); ``none`` is "Can't find a valid checkpoint". MindNLP's
    ``_load_from_checkpoint`` loads ``model.safetensors`` or ``mindspore_model.ckpt``, else a sharded checkpoint
    (its adapter branch is commented out), and accepts the folder when any weights, index or adapter file exists.
    """
    if is_mindnlp(ck):
        if ck.file(SAFE_WEIGHTS) is not None or ck.file(MS_WEIGHTS) is not None:
            return "full"
        if any(ck.file(n) is not None for n in (SAFE_INDEX, BIN_INDEX, ADAPTER_SAFE, ADAPTER_BIN)):
            return "sharded"
        return "none"
    if is_deepspeed(ck):
        return "deepspeed"
    if is_fsdp(ck):
        return "fsdp"
    if ck.file(SAFE_WEIGHTS) is not None or ck.file(BIN_WEIGHTS) is not None:
        return "full"
    if has_adapter(ck):
        return "adapter"
    if ck.file(SAFE_INDEX) is not None or ck.file(BIN_INDEX) is not None:
        return "sharded"
    return "none"


def loaded_weight_file(ck: Checkpoint, prefer_safe: bool = True) -> FileFacts | None:
    """The single full-weights file ``Trainer._load_from_checkpoint`` reads: ``model.safetensors`` first, else
    ``pytorch_model.bin`` (MindNLP: else ``mindspore_model.ckpt``). ``prefer_safe`` is the resuming
    ``save_safetensors`` under transformers 4.x, which reads ``model.safetensors`` only when it is True (4.57's
    ``_load_from_checkpoint``: ``if os.path.isfile(safe_weights_file) and args.save_safetensors``); 5.x always
    prefers it. None when the file it reads is not there (4.x then raises FileNotFoundError in ``torch.load``).
    The one place that says which file the load reads: the gate, ``check_resume`` and CKD201 all ask it."""
    if prefer_safe or is_mindnlp(ck):
        return ck.file(SAFE_WEIGHTS) or ck.file(MS_WEIGHTS if is_mindnlp(ck) else BIN_WEIGHTS)
    return ck.file(BIN_WEIGHTS)


def competing_weight_forms(ck: Checkpoint) -> tuple[tuple[str, tuple[FileFacts, ...] | None], ...]:
    """The full-weight forms of a folder that holds more than one (empty otherwise), in the order
    ``Trainer._load_from_checkpoint`` prefers them: ``model.safetensors``, ``pytorch_model.bin``, then the shard
    indexes (``load_sharded_checkpoint``). Each is its name and the files holding its tensors: the single file, or
    the index's shards that exist (None when the index is not a valid one). Only the first is loaded."""
    singles = [f for f in (ck.file(SAFE_WEIGHTS), ck.file(BIN_WEIGHTS)) if f is not None]
    indexes = [f for f in (ck.file(SAFE_INDEX), ck.file(BIN_INDEX)) if f is not None]
    if len(singles) + len(indexes) < 2:
        return ()  # one form: nothing competes (and an index's shards are never looked up)
    forms: list[tuple[str, tuple[FileFacts, ...] | None]] = [(ck.relname(f), (f,)) for f in singles]
    for idx in indexes:
        wm = weight_map(idx)
        shards = None if wm is None else tuple(f for f in map(ck.file, sorted(shard_counts(wm))) if f is not None)
        forms.append((idx.name, shards))
    return tuple(forms)


def value_compared_files(checkpoints: Iterable[Checkpoint]) -> frozenset[str]:
    """The files whose tensor values ``--deep`` digests: every form of a folder with competing full-weight forms
    (``competing_weight_forms``), so that forms alike in names and shapes can be told apart by value."""
    return frozenset(
        f.path for ck in checkpoints for _, files in competing_weight_forms(ck) for f in files or ()
    )


def kinds(ck: Checkpoint) -> list[str]:
    """Short labels of what the checkpoint holds, for tables and JSON (weights forms first, then state files)."""
    out: list[str] = []
    if is_fsdp(ck):
        out.append("fsdp")
    if is_deepspeed(ck):
        out.append("deepspeed")
    if (
        ck.file(SAFE_WEIGHTS) is not None
        or ck.file(BIN_WEIGHTS) is not None
        or (is_mindnlp(ck) and ck.file(MS_WEIGHTS) is not None)
    ):
        out.append("full")
    if ck.file(SAFE_INDEX) is not None or ck.file(BIN_INDEX) is not None:
        out.append("sharded")
    if has_adapter(ck):
        out.append("adapter")
    if any(f.kind is FileKind.TF_INDEX for f in ck.files):
        out.append("tf-bundle")
    if any(f.kind is FileKind.HDF5 for f in ck.files):
        out.append("hdf5")
    if has_optimizer_state(ck):  # the test the resume makes (FSDP keeps it in an `optimizer_0/` folder)
        out.append("optimizer")
    if scheduler_file(ck) is not None:
        out.append("scheduler")
    if ck.file(TRAINER_STATE) is not None:
        out.append("trainer-state")
    return out


def tensor_count(ck: Checkpoint) -> int | None:
    """Tensors in the weights a resume would load (all weight and adapter files), None when none are readable."""
    total: int | None = None
    for f in ck.files:
        rel = ck.relname(f)
        base = rel.rsplit("/", 1)[-1]
        is_weights = base in FULL_WEIGHT_FILES or base in (ADAPTER_SAFE, ADAPTER_BIN) or base == MS_WEIGHTS
        is_shard = (base.startswith("model-") and base.endswith(".safetensors")) or (
            base.startswith("pytorch_model-") and base.endswith(".bin")
        )
        if not (is_weights or is_shard):
            continue
        ts = tensors_of(f)
        if ts is not None:
            total = (total or 0) + len(ts)
    return total


def finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


# ---------------------------------------------------------------------------------------------------------------
# What a full-weights file restores of an adapter

# peft's `PEFT_TYPE_TO_PREFIX_MAPPING` (src/peft/mapping.py, filled by each tuner's `register_peft_method`): the
# substring that marks a tuner's own parameters. Most tuners use their lower-cased type and "_"; these differ.
_PEFT_PREFIX = {"ADALORA": "lora_", "LOHA": "hada_", "VERA": "vera_lambda_", "PVERA": "pvera_lambda_"}
DEFAULT_ADAPTER = "default"  # the adapter name `get_peft_model` gives, and the Trainer's resume loads the root's as


@frozen
class AdapterRestore:
    """What ``load_state_dict(state_dict, strict=False)`` of the full-weights file restores of the PeftModel's
    adapter parameters (the adapter branch of the resume never runs when that file exists)."""

    file: FileFacts  # the full-weights file the resume loads (``loaded_weight_file``)
    tensors: int  # tensors that file holds
    restored: int  # adapter parameters whose exact name the file holds
    total: int  # adapter parameters of the PeftModel, from the adapter files on disk
    foreign: tuple[str, ...]  # the file's tensors named like adapter parameters that match no PeftModel name

    @property
    def complete(self) -> bool:
        """Every adapter parameter is restored."""
        return self.restored == self.total


def adapter_restore(ck: Checkpoint, prefer_safe: bool = True) -> AdapterRestore | None:
    """What the resume of ``ck`` restores of its adapter when a full-weights file is loaded instead of it.

    The Trainer holds a PeftModel; ``Trainer._load_from_checkpoint`` (transformers 5.x, and 4.x) loads
    ``model.safetensors`` (else ``pytorch_model.bin``) into it with ``model.load_state_dict(state_dict, False)``,
    which restores a parameter only when the file holds its exact name. The PeftModel's adapter parameter names are
    the adapter files' keys with the adapter name put back, as peft's ``set_peft_model_state_dict`` does on load
    (``src/peft/utils/save_and_load.py``: the tuner's ``_remap_adapter_state_dict_for_load`` inverts
    ``get_peft_model_state_dict``'s removal; ``ModulesToSaveWrapper.adapter_state_dict_load_map`` for
    ``modules_to_save``): ``base_model.model.x.q_proj.lora_A.weight`` is the parameter
    ``base_model.model.x.q_proj.lora_A.default.weight``. The root adapter is ``default``, one in a sub-folder is
    named after it, as the Trainer's adapter branch loads them. None when the resume loads no full-weights file
    beside an adapter, or when the loaded file or every adapter file is unreadable. ``prefer_safe`` is
    ``loaded_weight_file``'s (transformers 4.x with ``save_safetensors=False`` reads ``pytorch_model.bin``).
    """
    return _adapter_restore(ck) if prefer_safe else _adapter_restore_bin(ck)


def _restore_of(ck: Checkpoint, prefer_safe: bool) -> AdapterRestore | None:
    if not has_adapter(ck) or weights_branch(ck) != "full":
        return None
    loaded = loaded_weight_file(ck, prefer_safe)
    tensors = tensors_of(loaded)
    if loaded is None or tensors is None:
        return None
    wanted: set[str] = set()
    prefixes: set[str] = set()
    for folder, name in (("", DEFAULT_ADAPTER), *((d + "/", d) for d in adapter_subdirs(ck))):
        f = ck.file(folder + ADAPTER_SAFE) or ck.file(folder + ADAPTER_BIN)  # peft's load_peft_weights order
        saved = tensors_of(f)
        if not saved:
            continue
        cfg = json_value(ck.file(folder + ADAPTER_CONFIG))
        cfg = cfg if isinstance(cfg, dict) else {}
        prefix = _peft_prefix(cfg.get("peft_type"))
        prefixes.add(prefix)
        to_save = cfg.get("modules_to_save")
        modules = tuple(m for m in to_save if isinstance(m, str)) if isinstance(to_save, list) else ()
        wanted.update(model_key(t.name, name, prefix, modules) for t in saved)
    if not wanted:
        return None
    held = {t.name for t in tensors}
    foreign = tuple(sorted(n for n in held - wanted if any(p in n for p in prefixes)))
    return AdapterRestore(loaded, len(tensors), len(wanted & held), len(wanted), foreign)


_adapter_restore = per_object(functools.partial(_restore_of, prefer_safe=True))
_adapter_restore_bin = per_object(functools.partial(_restore_of, prefer_safe=False))


def _peft_prefix(peft_type: Any) -> str:
    """The parameter prefix of a peft type (``lora_`` when the config does not say: the Trainer's usual adapter)."""
    if not isinstance(peft_type, str) or not peft_type:
        return "lora_"
    return _PEFT_PREFIX.get(peft_type, peft_type.lower() + "_")


def model_key(saved: str, adapter: str, prefix: str, modules_to_save: tuple[str, ...] = ()) -> str:
    """The PeftModel parameter an adapter file's key ``saved`` is loaded into (peft's
    ``_insert_adapter_name_into_state_dict``): the adapter name goes after the first part past the tuner's prefix
    (``...lora_A.weight`` -> ``...lora_A.default.weight``), or at the end when nothing follows it
    (``...lora_embedding_A`` -> ``...lora_embedding_A.default``); a key of a ``modules_to_save`` module goes under
    that module's ``modules_to_save.<adapter>`` (a module whose name ends with an entry, as peft's ``_set_trainable``
    matches them); any other key is kept."""
    if prefix in saved:
        suffix = saved.rpartition(prefix)[2]
        if "." not in suffix:
            return f"{saved}.{adapter}"
        rest = suffix.split(".", 1)[1]
        return f"{saved[: len(saved) - len(rest)]}{adapter}.{rest}"
    module, _, param = saved.rpartition(".")
    if module and any(module.endswith(m) for m in modules_to_save):
        return f"{module}.modules_to_save.{adapter}.{param}"
    return saved


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed's own state: what `engine.load_checkpoint` restores of the LR schedule (deepspeed/runtime/engine.py)

LATEST = "latest"
_DS_MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
_DS_OPTIM_STATES = ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")


@frozen
class DeepSpeedView:
    """What a DeepSpeed checkpoint's own files say about the schedule its resume restores.

    Read from the tag folder ``latest`` names (the one ``engine.load_checkpoint(dir)`` loads): the model states of
    data-parallel rank 0 (``lr_scheduler``, ``ds_config``) and its ZeRO optimizer partition
    (``optimizer_state_dict``). None in a field: not said by the files (absent, unreadable, another layout).
    """

    tag: str | None  # the tag folder `latest` names
    config: dict[str, Any] | None  # the engine's config as it ran (the model states' `ds_config`, "auto" resolved)
    # the config names an "optimizer" or a "scheduler": the Trainer's scheduler is then accelerate's
    # DeepSpeedSchedulerWrapper, stepped and saved by the engine (no scheduler.pt); else the Trainer's own LambdaLR
    engine_scheduler: bool | None
    ds_scheduler: str | None  # the type of DeepSpeed's own scheduler ("WarmupDecayLR"), when the config has one
    scheduler: SchedulerView | None  # the engine's saved `lr_scheduler` when it is a LambdaLR's state
    scheduler_saved: bool | None  # the model states hold an `lr_scheduler` state (not None)
    # the partition holds the base optimizer's whole state_dict (param groups with their LR): a rigid ZeRO checkpoint.
    # False: an elastic one (ZeRO 1/2 `elastic_checkpoint`), per-group tensors only, whose param groups (LR) are
    # never restored
    rigid: bool | None
    elastic_step: bool | None  # an elastic partition holds `base_optimizer_state_step`, which its load asserts
    lr: float | None  # param group 0's `lr` in a rigid partition: the LR the first resumed step uses
    zero_stage: int | None


def deepspeed_view(ck: Checkpoint) -> DeepSpeedView | None:
    """What ``ck``'s DeepSpeed files say (``DeepSpeedView``); None for a checkpoint that is not DeepSpeed's."""
    return _deepspeed_view(ck) if is_deepspeed(ck) else None


@per_object
def _deepspeed_view(ck: Checkpoint) -> DeepSpeedView:
    latest = ck.file(LATEST)
    tag = latest.content.text if latest is not None and isinstance(latest.content, TextFacts) else None
    model = optim = None
    if tag:
        model = next((_state_dict(_torch_value(ck.file(f"{tag}/{n}"))) for n in _DS_MODEL_STATES
                      if ck.file(f"{tag}/{n}") is not None), None)
        optim = next((_state_dict(_torch_value(ck.file(f"{tag}/{n}"))) for n in _DS_OPTIM_STATES
                      if ck.file(f"{tag}/{n}") is not None), None)
    config = model.get("ds_config") if model is not None else None
    if not isinstance(config, dict):
        config = None
    sched = config.get("scheduler") if config is not None else None
    has_sched = model is not None and "lr_scheduler" in model
    lr_sched = _state_dict(model.get("lr_scheduler")) if model is not None else None
    osd = optim.get("optimizer_state_dict") if optim is not None else None
    osd = osd if isinstance(osd, dict) else None
    base = osd.get("base_optimizer_state") if osd is not None else None
    rigid = True if isinstance(base, dict) else False if isinstance(base, list) else None
    lr = None
    if isinstance(base, dict) and isinstance(base.get("param_groups"), list) and base["param_groups"]:
        group = base["param_groups"][0]
        lr = _num(group.get("lr")) if isinstance(group, dict) else None
    stage = osd.get("zero_stage") if osd is not None else None
    if isinstance(stage, Opaque):  # ZeroStageEnum(2): an enum rebuilt by value
        stage = stage.args[0] if len(stage.args) == 1 else None
    zero = config.get("zero_optimization") if config is not None else None
    if stage is None and isinstance(zero, dict):
        stage = zero.get("stage")
    return DeepSpeedView(
        tag=tag or None,
        config=config,
        engine_scheduler=None if config is None else ("optimizer" in config or "scheduler" in config),
        ds_scheduler=str(sched.get("type")) if isinstance(sched, dict) and sched.get("type") is not None else None,
        scheduler=SchedulerView(
            last_epoch=integer(lr_sched.get("last_epoch")), base_lrs=_floats(lr_sched.get("base_lrs")),
            last_lr=_floats(lr_sched.get("_last_lr")), step_count=integer(lr_sched.get("_step_count")),
        ) if lr_sched is not None and "base_lrs" in lr_sched else None,
        scheduler_saved=(model.get("lr_scheduler") is not None) if model is not None and has_sched else None,
        rigid=rigid,
        elastic_step=None if rigid is not False or osd is None else "base_optimizer_state_step" in osd,
        lr=lr,
        zero_stage=integer(stage),
    )
