"""Facts about checkpoints that several rule families and the gate read, in one home: derived from the model (no
I/O), so no rule family borrows another's helpers.

What the Trainer picks and loads is ``trainer_view``'s; here is what the files say about how the checkpoint was
saved (how many ranks wrote it, what its shards hold, which tensors are LoRA B matrices), whether a tree holds
checkpoint state at all, whether two trainer states tell one run's story (``same_history``,
``history_divergence``), the words findings share (``plural``, ``versus``) and the one parser of the versions they
compare (``version_tuple``).
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import posixpath
import re
from collections import Counter
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast, overload

from ckptdoctor import trainer_view
from ckptdoctor.model import (
    Checkpoint,
    FileFacts,
    FileKind,
    FolderRole,
    ProblemKind,
    Run,
    RunHistory,
    TensorInfo,
    Tree,
)
from ckptdoctor.patterns import lazy

# The path problems CKD001 reports; the corrupt-file rules (CKD202, CKD203, CKD211) leave them to it.
PATH_KINDS = (
    ProblemKind.UNREADABLE,
    ProblemKind.SYMLINK_LOOP,
    ProblemKind.BAD_NAME,
    ProblemKind.SPECIAL_FILE,
    ProblemKind.LIMIT,
    ProblemKind.NOT_CHECKED,
)


# Files of other stacks ckptdoctor does not read, by name: a checkpoint it cannot judge is said (CKD216), never
# passed over, and a root holding one is not empty (CKD002).
UNSUPPORTED_FORMATS = (
    (".gguf", "GGUF (llama.cpp)"),
    (".msgpack", "Flax msgpack"),
    (".keras", "Keras 3 `.keras` archive"),
    (".onnx", "ONNX"),
    (".tflite", "TensorFlow Lite"),
    (".pdparams", "PaddlePaddle parameters"),
    (".pdopt", "PaddlePaddle optimizer state"),
    ("saved_model.pb", "TensorFlow SavedModel"),
    ("saved_model.pbtxt", "TensorFlow SavedModel"),
    (".meta", "TensorFlow 1.x MetaGraph"),
)


# What is not checkpoint state by itself: a root holding only these (logs, notes, JSON, tokenizer files) is empty.
_NOT_STATE = (FileKind.JSON, FileKind.TEXT, FileKind.EMPTY, FileKind.OTHER, FileKind.SPECIAL)


def _holds_state(f: FileFacts) -> bool:
    """Whether ``f`` is checkpoint state: a format a loader reads (weights, optimizer, pickles, bundles), or one of
    another stack that CKD216 names."""
    if f.kind not in _NOT_STATE:
        return True
    name = f.name.lower()
    return any(name.endswith(suffix) for suffix, _ in UNSUPPORTED_FORMATS)


def holds_checkpoint(tree: Tree) -> bool:
    """Whether ``tree`` holds any checkpoint: a checkpoint or model folder, or a loose file of checkpoint state.
    CKD002 reports a root without one; ``gate --allow-empty`` accepts it as a run not saved yet."""
    return any(run.checkpoints for run in tree.runs) or any(_holds_state(f) for f in tree.loose_files)


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 tensor``, ``2 tensors``, ``1,297 bytes`` (``many`` for irregular plurals). Shared by the findings' words."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"


_VERSION_RE = lazy(r"\s*(\d{1,4})(?:\.(\d{1,4}))?(?![\d])")


def version_tuple(version: object) -> tuple[int, int] | None:
    """``(major, minor)`` of a version string ("4.57.6" -> (4, 57), "5.23.0.dev0", "4.57", "2" -> (2, 0)): the one
    parser of the versions the rules and the gate compare (transformers, torch, numpy); None when it is not one."""
    m = _VERSION_RE.match(version) if isinstance(version, str) else None
    return None if m is None else (int(m.group(1)), int(m.group(2) or 0))


# A shard of a sharded transformers checkpoint, as `save_pretrained` names it (one pattern, the Trainer view's).
SHARD_RE = trainer_view.SHARD_RE


def shard_contents(
    ck: Checkpoint, idx: FileFacts, wm: dict[str, str]
) -> tuple[dict[str, tuple[TensorInfo, ...]], bool]:
    """The tensors of every shard the index names or that sits beside it in the index's format (their own headers),
    and whether every one of them was readable (callers never change them)."""
    return _shard_contents((ck, idx, wm))


@trainer_view.per_parts
def _shard_contents(parts: tuple[Any, ...]) -> tuple[dict[str, tuple[TensorInfo, ...]], bool]:
    # once per checkpoint and index: CKD205 and the optimizer's comparison (CKD405) both ask
    ck, idx, wm = parts
    suffix = ".safetensors" if idx.name == trainer_view.SAFE_INDEX else ".bin"
    on_disk = {name for name, _ in ck.top_files() if SHARD_RE.match(name) and name.endswith(suffix)}
    content: dict[str, tuple[TensorInfo, ...]] = {}
    complete = True
    for shard in sorted(trainer_view.shard_counts(wm).keys() | on_disk):
        ts = trainer_view.tensors_of(ck.file(shard))
        if ts is None:
            complete = False
            continue
        content[shard] = ts  # the header's own tuple: alike checkpoints share it (``trainer_view.per_parts``)
    return content, complete


def saved_shard_tensors(ck: Checkpoint) -> tuple[TensorInfo, ...] | None:
    """Every tensor the shards of a sharded checkpoint hold by their own headers, not by its index: what the model
    saved, and what a rebuilt index maps (the shards the index a resume reads names, plus any other shard of its
    format beside it). None when that index is not valid, a shard it names is missing, a shard is unreadable, or a
    tensor sits in two shards: nothing whole to compare with."""
    idx = ck.file(trainer_view.SAFE_INDEX) or ck.file(trainer_view.BIN_INDEX)
    wm = trainer_view.weight_map(idx) if idx is not None else None
    if idx is None or wm is None or any(ck.file(s) is None for s in trainer_view.shard_counts(wm)):
        return None
    content, complete = shard_contents(ck, idx, wm)
    return _disjoint_union(tuple(content.values())) if complete else None


@trainer_view.per_parts
def _disjoint_union(shards: tuple[tuple[TensorInfo, ...], ...]) -> tuple[TensorInfo, ...] | None:
    """The tensors of ``shards`` in order, or None when a name is in two of them (one tuple for a run's alike
    checkpoints)."""
    out = tuple(t for ts in shards for t in ts)
    return out if len({t.name for t in out}) == len(out) else None


def is_lora_b(name: str) -> bool:
    """Whether a tensor is a LoRA B matrix (``...lora_B.weight``, ``...lora_embedding_B``): PEFT zero-inits them."""
    parts = name.split(".")
    return "lora_B" in parts or "lora_embedding_B" in parts


_DCP_RANK_RE = re.compile(r"^__(\d+)_\d+\.distcp$")

_DS_RANK_RE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def saved_world_size(ck: Checkpoint) -> int | None:
    """How many ranks wrote the checkpoint, from FSDP `.distcp` files or DeepSpeed optimizer partitions."""
    ranks: set[int] = set()
    for f in ck.files:
        if ".distcp" not in f.path and "optim_states.pt" not in f.path:
            continue  # neither pattern can match its name: most files of a checkpoint, passed over at C speed
        m = _DCP_RANK_RE.match(f.name) or _DS_RANK_RE.search(f.name)
        if m:
            ranks.add(int(m.group(1)))
    return max(ranks) + 1 if ranks else None


# ---------------------------------------------------------------------------------------------------------------
# Whether two trainer states tell one run's story: the stale-run rules (1xx) and the sibling-run rule (4xx) ask.


def versus(a: float, b: float) -> str:
    """``a vs b`` in one format: both sides with the same significant digits, as many as the longer of their
    6-digit forms needs (``4.16240 vs 4.15653``, ``0.02 vs 0.05``), more when 6 would print them equal. Integers
    (not bools) print whole."""
    if type(a) is int and type(b) is int:
        return f"{a} vs {b}"
    fa, fb = trainer_view.number(a), trainer_view.number(b)  # an integer past float range prints as an infinity
    if fa is None or fb is None:
        return f"{a!r} vs {b!r}"
    a, b = fa, fb
    short = f"{a:.6g}", f"{b:.6g}"
    digits = max(map(_digits, short))
    exponent = any("e" in t for t in short)  # then both sides, so 5e-05 and 1e-04 line up
    while True:
        left, right = _fixed_digits(a, digits, exponent), _fixed_digits(b, digits, exponent)
        if left != right or digits >= 17:  # 17 significant digits tell any two distinct doubles apart
            return f"{left} vs {right}"
        digits += 1


def _digits(text: str) -> int:
    """Significant digits of a number as ``:g`` prints it (1 for zero, NaN or infinity)."""
    mantissa = text.split("e")[0].replace("-", "").replace(".", "").lstrip("0")
    return max(sum(c.isdigit() for c in mantissa), 1)


def _fixed_digits(x: float, digits: int, exponent: bool) -> str:
    """``x`` with exactly ``digits`` significant digits, trailing zeros kept (but no bare trailing point), in
    exponent notation when ``exponent`` is set."""
    text = f"{x:#.{digits - 1}e}" if exponent else f"{x:#.{digits}g}"
    return text.replace(".e", "e").removesuffix(".")


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


def history_divergence(older: trainer_view.TrainerStateView, newer: trainer_view.TrainerStateView) -> str | None:
    """Where two trainer states stop telling the same story, or None when ``older``'s history is a prefix of
    ``newer``'s (as for two checkpoints of one run). Compares loss and learning_rate at the steps both logged."""
    by_step = newer.by_step
    hist = older.log_history
    if _starts(newer, hist):
        # Entry for entry, ``older``'s log is the start of ``newer``'s (two checkpoints of one run, the usual case):
        # an equal entry diverges only where ``newer``'s own entry at that position could.
        for i in _suspects(newer):
            if i >= len(hist):
                break
            why = _entry_divergence(hist[i], by_step)
            if why is not None:
                return why
        return None
    for e in hist:
        why = _entry_divergence(e, by_step)
        if why is not None:
            return why
    return None


def _entry_divergence(e: dict[str, Any], by_step: Mapping[int, dict[str, Any]]) -> str | None:
    """Where one log entry disagrees with the merged entry of its step, or None."""
    step = e.get("step")
    if not isinstance(step, int) or step not in by_step:
        return None
    other = by_step[step]
    for key in ("loss", "learning_rate"):
        a, b = e.get(key), other.get(key)
        x, y = trainer_view.number(a), trainer_view.number(b)
        if x is not None and y is not None and a != b and not _close(x, y):
            return f"log_history diverges at step {step} ({key} {versus(cast(float, a), cast(float, b))})"
    return None


def _starts(ts: trainer_view.TrainerStateView, prefix: tuple[dict[str, Any], ...]) -> bool:
    """Whether ``ts``'s log_history starts with entries whose step, loss and learning_rate equal ``prefix``'s."""
    n = len(prefix)
    if n > len(ts.log_history):
        return False
    try:
        if ts.log_history[:n] == prefix:  # whole entries equal: what the Trainer writes, a single C-speed pass
            return True
        ours, theirs = trainer_view.log_columns(ts.log_history), trainer_view.log_columns(prefix)
        if ours is None or theirs is None:
            return False
        return all(a[:n] == b for a, b in zip(ours, theirs, strict=True))
    except RecursionError:  # values nested deeper than the comparison may recurse: take the entry-by-entry path
        return False


# Steps of these types give equal values the same treatment in ``_entry_divergence`` (an int step is compared,
# a string or null one is not); a float step equal to an int one is not compared while the int one is.
_PLAIN_STEPS = frozenset({int, bool, str, type(None)})


@trainer_view.per_object
def _suspects(ts: trainer_view.TrainerStateView) -> tuple[int, ...]:
    """Positions in ``ts``'s log_history where an equal entry of another history could diverge from ``ts``: where
    ts's own entry does (or cannot be compared without an error), or where equal steps may be treated apart."""
    quick = _suspects_quickly(ts)
    if quick is not None:
        return quick
    by_step = ts.by_step
    unlike = _unlike_their_step(ts)
    candidates: Iterable[int] = range(len(ts.log_history)) if unlike is None else unlike
    out: list[int] = []
    for i in candidates:
        e = ts.log_history[i]
        if type(e.get("step")) not in _PLAIN_STEPS:
            out.append(i)
            continue
        try:
            why = _entry_divergence(e, by_step)
        except Exception:  # the other history's entry is then compared (and fails) as it always was
            why = "error"
        if why is not None:
            out.append(i)
    return tuple(out)


def _suspects_quickly(ts: trainer_view.TrainerStateView) -> tuple[int, ...] | None:
    """``_suspects`` of a log of plain dicts with plain integer steps (what the Trainer writes), without merging the
    whole log per step; None for any other log. Each step's merged entry (``by_step``) is then the entry itself for
    a step logged once: its loss and rate are that entry's own, unequal (``!=``) only when unequal to themselves
    (NaN), so only those entries and the entries of steps logged more than once (a train and an eval log) can
    diverge, and only they are compared, each with its step's entries merged in order, as ``by_step`` merges them.
    A long run's newest log holds 10^4 entries and a hundred such: merging the whole log was most of CKD101's cost."""
    columns = trainer_view.log_columns(ts.log_history)
    if columns is None or not trainer_view.integer_steps(ts.log_history):
        return None
    steps, losses, rates = columns
    n = range(len(steps))
    look = {*itertools.compress(n, map(operator.ne, losses, losses)),
            *itertools.compress(n, map(operator.ne, rates, rates))}  # fmt: skip
    merged: dict[int, dict[str, Any]] = {}
    repeats = len(steps) - len(set(steps))
    if repeats:
        # a step's entries side by side (the Trainer logs a step's train and eval entries one after the other):
        # each repeat is an entry whose step equals the one before
        same_as_before = map(operator.eq, steps, itertools.islice(steps, 1, None))
        after = list(itertools.compress(range(1, len(steps)), same_as_before))
        if len(after) == repeats:
            logged_again = sorted({*after, *(i - 1 for i in after)})
        else:
            again = {step for step, count in Counter(steps).items() if count > 1}
            logged_again = list(itertools.compress(n, map(again.__contains__, steps)))
        for i in logged_again:
            merged.setdefault(steps[i], {}).update(ts.log_history[i])
        look.update(logged_again)
    out: list[int] = []
    for i in sorted(look):
        e = ts.log_history[i]
        try:
            why = _entry_divergence(e, {steps[i]: merged.get(steps[i], e)})
        except Exception:  # as ``_suspects`` takes it
            why = "error"
        if why is not None:
            out.append(i)
    return tuple(out)


_NO_ENTRY: dict[str, Any] = {}


def _unlike_their_step(ts: trainer_view.TrainerStateView) -> list[int] | None:
    """The positions in ``ts``'s log_history whose loss or learning_rate is not equal (``==``) to its step's merged
    entry's, found at C speed: only those can diverge in ``_entry_divergence`` (which compares values that are not
    equal). None when the quick look does not apply (entries that are not plain dicts, steps that are neither
    integers, text nor null): then every entry is looked at."""
    columns = trainer_view.log_columns(ts.log_history)
    if columns is None:
        return None
    steps, losses, rates = columns
    if not _PLAIN_STEPS.issuperset(map(type, steps)):
        return None
    # a step no entry is merged under (text, null, an integer never logged) is never compared (a bool step finds
    # its integer's entry, as ``in`` does in ``_entry_divergence``)
    others = list(map(trainer_view.merged_steps(ts).get, steps, itertools.repeat(_NO_ENTRY)))
    try:
        same = map(
            operator.and_,
            map(operator.eq, losses, map(dict.get, others, itertools.repeat("loss"))),
            map(operator.eq, rates, map(dict.get, others, itertools.repeat("learning_rate"))),
        )
        differ = list(itertools.compress(range(len(steps)), map(operator.not_, same)))
    except RecursionError:  # values nested deeper than ``==`` may recurse: every entry is looked at
        return None
    return [i for i in differ if others[i] is not _NO_ENTRY]


def run_identity_difference(a: trainer_view.TrainerStateView, b: trainer_view.TrainerStateView) -> str | None:
    """A difference in the run-level settings two checkpoints of one run share (max_steps, epochs, batch size)."""
    for label, x, y in (
        ("max_steps", a.max_steps, b.max_steps),
        ("num_train_epochs", a.num_train_epochs, b.num_train_epochs),
        ("train_batch_size", a.train_batch_size, b.train_batch_size),
    ):
        if x is not None and y is not None and x != y:
            return f"{label} {versus(x, y)}"
    return None


def common_steps(a: trainer_view.TrainerStateView, b: trainer_view.TrainerStateView) -> bool:
    steps = {e.get("step") for e in a.log_history if "loss" in e or "learning_rate" in e}
    return any(e.get("step") in steps for e in b.log_history if "loss" in e or "learning_rate" in e)


def same_history(older: trainer_view.TrainerStateView, newer: trainer_view.TrainerStateView) -> bool:
    """True when two trainer states logged steps in common and agree on them: two checkpoints of one run."""
    return common_steps(older, newer) and history_divergence(older, newer) is None


# Where a run started (CKD422): what its newest checkpoint shows, kept when a scan judging run by run releases it.

_CHECKPOINT_NAME = lazy(r"^checkpoint-\d+$")


def _loss_at(entry: object) -> tuple[int, float] | None:
    if not isinstance(entry, dict):
        return None
    step, loss = trainer_view.integer(entry.get("step")), trainer_view._num(entry.get("loss"))
    return (step, loss) if step is not None and loss is not None and math.isfinite(loss) else None


def _losses(ts: trainer_view.TrainerStateView) -> tuple[tuple[int, float], ...]:
    """The first and the last ``(step, loss)`` training logs of ``log_history`` (one when there is one, none when
    there is none): all CKD422 compares, found without walking a long history whole."""
    log = ts.log_history
    first = next(((i, x) for i, e in enumerate(log) if (x := _loss_at(e)) is not None), None)
    if first is None:
        return ()
    n = len(log)
    last = next(((n - 1 - i, x) for i, e in enumerate(reversed(log)) if (x := _loss_at(e)) is not None), first)
    return (first[1],) if last[0] == first[0] else (first[1], last[1])


def _newest(run: Run) -> Checkpoint | None:
    cks = [c for c in run.checkpoints if c.role == FolderRole.CHECKPOINT and c.step is not None]
    return max(cks, key=lambda c: c.step or 0) if cks else None


# One object per distinct weights layout among the ``RunHistory`` a scan keeps: a fleet's runs are mostly of a few
# models, and each run's own copy (a 7B model's 291 names and shapes, about 60 KB) outlived the run's facts, so a
# scan judged run by run grew with the number of runs (bench/RESULTS.md, issue 27). Bounded: cleared when full.
_LAYOUTS: dict[frozenset[tuple[str, tuple[int, ...]]], frozenset[tuple[str, tuple[int, ...]]]] = {}
_LAYOUTS_ENTRIES = 256


def _layout(ck: Checkpoint) -> frozenset[tuple[str, tuple[int, ...]]] | None:
    tensors = trainer_view.tensors_of(trainer_view.loaded_weight_file(ck))
    if not tensors:
        return None
    layout = frozenset((t.name, tuple(t.shape)) for t in tensors)
    known = _LAYOUTS.get(layout)
    if known is not None:
        return known
    if len(_LAYOUTS) >= _LAYOUTS_ENTRIES:
        _LAYOUTS.clear()
    _LAYOUTS[layout] = layout
    return layout


def _source_named(ck: Checkpoint, run: Run, root: str) -> str | None:
    """The checkpoint folder ``config.json``'s ``_name_or_path`` names, when it is not one of ``run``'s own."""
    config = trainer_view.json_value(ck.file("config.json"))
    name = config.get("_name_or_path") if isinstance(config, dict) else None
    if not isinstance(name, str) or not _CHECKPOINT_NAME.match(posixpath.basename(name.rstrip("/\\"))):
        return None
    parent = posixpath.normpath(posixpath.dirname(name.rstrip("/\\").replace("\\", "/")))
    own = posixpath.normpath(posixpath.join(root.replace("\\", "/"), run.path))
    return None if parent in (own, posixpath.normpath(run.path)) else name


def run_history(run: Run, root: str) -> RunHistory | None:
    """``run``'s ``RunHistory`` (``root``: the tree's root as given), or None when it holds no numbered
    checkpoint."""
    ck = _newest(run)
    if ck is None:
        return None
    ts = trainer_view.trainer_state(ck)
    return RunHistory(
        path=run.path,
        where=ck.path + "/config.json" if ck.path not in ("", ".") else "config.json",
        newest_mtime=ck.folder_mtime,
        oldest_mtime=min((c.folder_mtime for c in run.checkpoints), default=0.0),
        layout=_layout(ck),
        has_config=ck.file("config.json") is not None,
        named=_source_named(ck, run, root),
        losses=_losses(ts) if ts is not None else (),
    )


# ---------------------------------------------------------------------------------------------------------------
# Sibling runs (CKD422): which run's losses show it was started from another's weights, found without comparing
# every pair of a fleet's runs

LEARNED = 0.02  # a run whose logged loss fell by less than this fraction gives no evidence of where another started


def _taught(h: RunHistory) -> float | None:
    """The loss halfway down ``h``'s logged fall when ``h`` learned (it may have been another run's source), else
    None: a run whose first logged loss is below it started nearer to where ``h`` ended than to where it began."""
    if len(h.losses) < 2 or h.layout is None:
        return None
    start, late = h.losses[0][1], h.losses[-1][1]
    if start - late < LEARNED * abs(start):
        return None
    return start - (start - late) / 2


def _may_have_started(h: RunHistory) -> bool:
    """Whether ``h`` is a run CKD422 infers the start of from the losses (none named its source in a file)."""
    return h.named is None and bool(h.losses) and h.has_config and h.layout is not None


def started_from(mine: RunHistory, other: RunHistory) -> bool:
    """Whether the losses show ``mine`` likely started from ``other``'s weights as a new run: ``other`` has the
    same weights layout, its checkpoints are all older than ``mine``'s, it learned, and ``mine``'s first logged
    loss (at the first step ``other`` logged) starts below the middle of ``other``'s fall."""
    if not _may_have_started(mine) or other.newest_mtime > mine.oldest_mtime or other.layout != mine.layout:
        return False
    middle = _taught(other)
    first_step, first = mine.losses[0]
    return middle is not None and other.losses[0][0] == first_step and first < middle


_Key = tuple[frozenset[tuple[str, tuple[int, ...]]], int]


class _Front:
    """Points (x, y) kept so that "is there one with x <= X and y > Y" is answered in O(log n): only the points no
    other dominates (none has both a smaller or equal x and a larger or equal y), sorted by x, their y rising."""

    __slots__ = ("xs", "ys")

    def __init__(self) -> None:
        self.xs: list[float] = []
        self.ys: list[float] = []

    def add(self, x: float, y: float) -> None:
        xs, ys = self.xs, self.ys
        below = bisect.bisect_right(xs, x)
        if below and ys[below - 1] >= y:
            return  # one already kept answers every question this one would
        at = end = bisect.bisect_left(xs, x)
        while end < len(xs) and ys[end] <= y:  # those it dominates
            end += 1
        xs[at:end] = [x]
        ys[at:end] = [y]

    def any(self, x: float, y: float) -> bool:
        below = bisect.bisect_right(self.xs, x)
        return below > 0 and self.ys[below - 1] > y


class _Group:
    """The runs of one weights layout and first logged step: those that may have been a source (``taught``, with
    the front of (newest folder time, middle of the fall)) and those that may have started from one (``started``,
    with the front of (-oldest folder time, -first loss)), by their place in the order the runs were judged."""

    __slots__ = ("started", "started_front", "taught", "taught_front")

    def __init__(self) -> None:
        self.taught: list[int] = []
        self.taught_front = _Front()
        self.started: list[int] = []
        self.started_front = _Front()


class _Log:
    __slots__ = ("groups", "histories")

    def __init__(self) -> None:
        self.histories: list[RunHistory] = []
        self.groups: dict[_Key, _Group] = {}

    def add(self, h: RunHistory) -> None:
        at = len(self.histories)
        self.histories.append(h)
        if h.layout is None or not h.losses:
            return
        group = self.groups.setdefault((h.layout, h.losses[0][0]), _Group())
        middle = _taught(h)
        if middle is not None:
            group.taught.append(at)
            group.taught_front.add(h.newest_mtime, middle)
        if _may_have_started(h):
            group.started.append(at)
            group.started_front.add(-h.oldest_mtime, -h.losses[0][1])


class SiblingRuns(Sequence[RunHistory]):
    """The ``RunHistory`` of the runs of one root judged before a tree (``Tree.siblings``), in the order they were
    judged, indexed by weights layout and first logged step so that CKD422 finds which run started from which in
    about O(log n) a run, where comparing every pair of a fleet's runs grew with its square (a scan judges each run
    against all before it: the cube). ``extended`` returns the runs with more after them; the runs already handed
    out are never changed (the index is shared, each value sees its first ``len`` runs)."""

    __slots__ = ("_count", "_log")

    def __init__(self, histories: Iterable[RunHistory] = ()) -> None:
        self._log = _Log()
        for h in histories:
            self._log.add(h)
        self._count = len(self._log.histories)

    def extended(self, histories: Iterable[RunHistory]) -> SiblingRuns:
        """These runs and then ``histories``."""
        # not the newest value: the index holds runs this one does not, so these are indexed again first
        base = SiblingRuns(self) if self._count != len(self._log.histories) else self
        for h in histories:
            base._log.add(h)
        out = SiblingRuns.__new__(SiblingRuns)
        out._log, out._count = base._log, len(base._log.histories)
        return out

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> RunHistory: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[RunHistory]: ...
    def __getitem__(self, i: int | slice) -> RunHistory | Sequence[RunHistory]:
        return self._log.histories[: self._count][i]

    def __iter__(self) -> Iterator[RunHistory]:
        return itertools.islice(self._log.histories, self._count)

    def __repr__(self) -> str:  # a Tree's repr shows its siblings' histories, as the tuple it held did
        return repr(tuple(self))

    def source_of(self, mine: RunHistory, skip: Container[str] = ()) -> RunHistory | None:
        """The first of these runs (not one whose path is in ``skip``) that ``mine`` ``started_from``, or None."""
        if not _may_have_started(mine) or mine.layout is None:
            return None
        group = self._log.groups.get((mine.layout, mine.losses[0][0]))
        if group is None or not group.taught_front.any(mine.oldest_mtime, mine.losses[0][1]):
            return None
        histories = self._log.histories
        for at in itertools.takewhile(lambda at: at < self._count, group.taught):
            other = histories[at]
            if other.path not in skip and started_from(mine, other):
                return other
        return None

    def started_from(self, other: RunHistory, skip: Container[str] = ()) -> list[tuple[int, RunHistory]]:
        """Each of these runs (with its place among them; not one whose path is in ``skip``) that ``started_from``
        ``other``."""
        middle = _taught(other)
        if middle is None or other.layout is None:
            return []
        group = self._log.groups.get((other.layout, other.losses[0][0]))
        if group is None or not group.started_front.any(-other.newest_mtime, -middle):
            return []
        histories = self._log.histories
        return [
            (at, histories[at])
            for at in itertools.takewhile(lambda at: at < self._count, group.started)
            if histories[at].path not in skip and started_from(histories[at], other)
        ]
