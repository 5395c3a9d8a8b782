"""Walk a scan root once, read every file's header facts, and group them into runs and checkpoints."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import field
from typing import TYPE_CHECKING, Any, Generic, Protocol, cast

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import (
    Checkpoint,
    DcpItem,
    DcpMetadataFacts,
    DeepSpeedTag,
    FileFacts,
    FileKind,
    FolderRole,
    Framework,
    PathProblem,
    ProblemKind,
    ReadProblem,
    Run,
    ShardProblem,
    Stack,
    TfIndexFacts,
    Tree,
    mutable,
)
from ckptdoctor.patterns import lazy
from ckptdoctor.progress import when_done
from ckptdoctor.readers import VANISHED
from ckptdoctor.sources import is_remote, source_for
from ckptdoctor.sources.interface import OWN_DIR, Entry, L, M, Source, display
from ckptdoctor.sources.local import on_local_disk
from ckptdoctor.stacks import accelerate as accelerate_stack
from ckptdoctor.stacks import lightning as lightning_stack
from ckptdoctor.stacks import settle
from ckptdoctor.stacks import torchtitan as titan_stack

if TYPE_CHECKING:  # the pool is made only for more than one read at once (not a local disk's default)
    from concurrent.futures import Future, ThreadPoolExecutor

# How `_read_dcp_items` completes a `.distcp` file's facts: (where to open it, facts, items or None).
DcpItemReader = Callable[[str, FileFacts, "list[DcpItem] | None"], FileFacts]
# What `discover` hands each run folder it finishes when asked to (``on_part``): the folder's own Tree (its runs,
# loose files and path problems, as the whole root's Tree would hold them) and the paths of the files listed in the
# folders above it inside the root (where settings files that govern it live).
PartCallback = Callable[[Tree, "tuple[str, ...]"], None]

# transformers trainer_utils `_re_checkpoint`, used by get_last_checkpoint (and so by resume_from_checkpoint=True).
# Kept exactly, Unicode `\d` and `$` before a trailing newline included, so resume_pick agrees with it.
_RESUME_RE = re.compile(r"^checkpoint\-(\d+)$")
# Rotation (`sort_checkpoints`) sees any folder whose name holds `checkpoint-<digits>`; so do we when deciding
# what is a run and which of its folders are checkpoints of some sort.
_ROTATION_RE = re.compile(r"checkpoint-\d+")
_TEMP_PREFIX = "tmp-checkpoint-"
# DeepSpeed's tag folders inside a checkpoint (or a run's top level when save_checkpoint targeted it). The Trainer
# names them `global_stepN`; any other caller of `engine.save_checkpoint(dir, tag)` picks its own name (accelerate's
# `save_state` uses `pytorch_model`), so a folder holding DeepSpeed's state files is a tag folder whatever its name.
_DS_TAG_RE = lazy(r"^global_step\d+$")
DS_OPTIM_RE = lazy(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
DS_MODEL_RE = lazy(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")


def is_deepspeed_state(name: str) -> bool:
    """Whether a file name is one DeepSpeed's ``engine.save_checkpoint`` writes into a tag folder (model states or
    a ZeRO optimizer partition)."""
    return bool(DS_MODEL_RE.match(name) or DS_OPTIM_RE.match(name))


def is_deepspeed_tag(name: str, files: Iterable[str]) -> bool:
    """Whether a sub-folder (its name, its file names) is a DeepSpeed tag folder: `global_stepN`, or any name when
    it holds DeepSpeed's state files."""
    return bool(_DS_TAG_RE.match(name)) or any(is_deepspeed_state(n) for n in files)


# Files that make a folder a checkpoint or model folder: weights, adapters, training state, DeepSpeed/DCP pieces.
# config.json alone is not enough (configs live in many folders that hold no model).
_CKPT_NAMES = frozenset(
    {"trainer_state.json", "adapter_config.json", "latest", "checkpoint-is-incomplete.txt", ".metadata"}
)
_CKPT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".index.json", ".distcp")

# Other stacks' checkpoints. MindNLP 0.4's Trainer writes `optimizer.ckpt`, `scheduler.json` and (with
# save_safetensors=False) `mindspore_model.ckpt` into checkpoint-N folders (mindnlp/engine/trainer/base.py
# OPTIMIZER_NAME, SCHEDULER_NAME; mindnlp/configs.py WEIGHTS_NAME). A tf.train.CheckpointManager folder holds the
# text `checkpoint` file and `ckpt-N.index` / `ckpt-N.data-K-of-M` bundles; Keras and TFTrainer's save_model write
# `.h5` weights. Such folders are checkpoints even outside a run of checkpoint-N folders.
_MINDNLP_NAMES = frozenset({"optimizer.ckpt", "scheduler.json", "mindspore_model.ckpt"})
_TF_BUNDLE_KINDS = frozenset({FileKind.TF_INDEX, FileKind.TF_CHECKPOINT_STATE})
_TF_KINDS = _TF_BUNDLE_KINDS | {FileKind.TF_DATA, FileKind.HDF5}
_TORCH_KINDS = frozenset({FileKind.SAFETENSORS, FileKind.TORCH_ZIP, FileKind.TORCH_LEGACY, FileKind.DCP_DATA})


@mutable
class _Dir:
    """One walked directory: its files (already read), walked subfolders and the names listing showed as dirs."""

    rel: str
    name: str  # the raw name (may hold surrogate escapes), as os.listdir would give it
    mtime: float
    files: list[FileFacts] = field(default_factory=list)
    # Reads handed to the thread pool, in walk order; turned into ``files`` once the walk is over.
    pending: list[Future[FileFacts]] = field(default_factory=list)
    dirs: list[_Dir] = field(default_factory=list)
    # Every child os.path.isdir would accept (links included, even those not followed): get_last_checkpoint's view.
    dir_names: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # every name listed, ckptdoctor's own folder too (os.listdir's)
    has_run: bool = False  # this folder or one below it is a run
    # Handed to ``on_part`` as its own Tree and released: only its name, file names and ``has_run`` stay, which is
    # all its parent's grouping asks of it (``_is_model_subfolder``, ``_is_run``); the Grouper skips it.
    emitted: bool = False
    # Paths of the files listed here, kept while the walk is below this folder (``PartCallback``'s second value).
    listed: list[str] = field(default_factory=list)
    # `.distcp` files (relative path -> path to open): read after the walk, at the items `.metadata` locates.
    distcp: dict[str, str] = field(default_factory=dict)
    file_names: list[str] = field(default_factory=list)  # its files' names as listed (known before pooled reads end)
    read_names: list[str] = field(default_factory=list)  # an emitted folder's files' names once read (files released)


def default_jobs(root: str | None = None) -> int:
    """How many files are read at once by default for ``root``.

    On a local disk a header read takes microseconds and parsing it holds the GIL, so threads only contend (a
    100-checkpoint 7B run: 2.0 s with one, 2.4 s with four; bench/RESULTS.md): one. On a network file system, on
    object storage, on a file system we do not know, or with no root given (``--deep``: numpy and hashing release
    the GIL), reads wait on the network or the disk: a few more threads than cores, bounded so a big machine does
    not open dozens of files at once.
    """
    if root is not None and not is_remote(root) and on_local_disk(root):
        return 1
    return max(1, min(8, (os.cpu_count() or 1) * 2))


class Cache(Protocol):
    """What discovery asks of a verdict cache (``ckptdoctor.cache.FactsCache``): the root's source with its reads
    answered from the cache, and word that the walk of a folder, and the judging of the part it was, is over."""

    def source(self, inner: Source[L, M]) -> Source[L, M]:
        """``inner`` reading through the cache."""
        ...

    def left(self, rel: str) -> None:
        """The folder ``rel``, handed to ``on_part`` as a part, is done with (its walk and its judging)."""
        ...


def discover(
    root: str,
    limits: Limits = DEFAULT_LIMITS,
    jobs: int = 1,
    progress: Callable[[], None] | None = None,
    on_part: PartCallback | None = None,
    cache: Cache | None = None,
) -> Tree:
    """Walk ``root`` (a folder or a single file) and return the ``Tree`` of runs, checkpoints and loose files.

    Never writes, never follows a link out of the root (``LINK_ESCAPES_ROOT`` records it; a linked folder still
    counts as a checkpoint folder, as get_last_checkpoint counts it) or around a loop, never opens FIFOs or devices;
    every path it could not take is a ``PathProblem`` and the walk goes on. Everything is sorted by path.
    ``jobs`` > 1 reads up to that many files at once (a bounded thread pool); the walk itself stays on this
    thread and every result lands where the sequential walk would put it, so the Tree is the same for any value.
    A URL root (``s3://bucket/run/``, ``gs://``, ``hf://``...) is listed and read through fsspec instead
    (``ckptdoctor.sources.fsspec``), into the same Tree. ``progress`` is called once per file read (from any
    thread).

    ``on_part`` (a scan that keeps one run in memory at a time) is handed each folder below the root that is grouped
    on its own whatever is above it (a run, or a folder of runs, not inside a folder its run may take as a
    checkpoint) as soon as its walk is over, as a Tree of its runs, loose files and path problems; its facts are
    then released and the returned Tree holds the rest. The parts and the rest hold exactly what the Tree without
    ``on_part`` holds.

    ``cache`` (``ckptdoctor.cache.FactsCache``) answers reads of files it proves unchanged since a scan stored them,
    and is told when each folder's walk (and the part it was handed as) is over; the Tree is the same with it.
    """
    opened = open_root(root, limits)
    # A source that indexes its listing as the walk goes (an S3 root) is told when the walk leaves each folder; the
    # cache's wrapper does not pass that on, so it is taken from the source itself.
    walked = cast("Callable[[str], None] | None", getattr(opened.source, "walked", None))
    if cache is None:
        return discover_opened(opened, jobs, progress, on_part, walked=walked)
    opened.source = cache.source(opened.source)
    return discover_opened(opened, jobs, progress, on_part, left=cache.left, walked=walked)


@mutable
class Opened(Generic[L, M]):
    """A root as its storage first answered (``open_root``): the source that reads it, the root itself (or why it
    cannot be scanned) and the problems met so far. A fan-out (``ckptdoctor.fanout``) plans from it
    (``plan_folders``) and walks it (``discover_opened``) without asking the storage twice."""

    root: str  # the root as the user gave it (``Tree.root``)
    source: Source[L, M]
    found: Entry[M] | PathProblem
    problems: list[PathProblem]


def open_root(root: str, limits: Limits = DEFAULT_LIMITS, where: str | None = None) -> Opened[Any, Any]:
    """``root`` opened through its source (``sources.source_for``): a local root stat'ed, a URL root listed (one
    request). ``where``: the path to open when it differs from the name the report gives (an absolute path, for a
    process whose working directory is not the caller's)."""
    problems: list[PathProblem] = []
    source = source_for(where or root, limits)
    return Opened(root, source, source.root(problems), problems)


def discover_opened(
    opened: Opened[L, M],
    jobs: int = 1,
    progress: Callable[[], None] | None = None,
    on_part: PartCallback | None = None,
    handed: Handed | None = None,
    left: Callable[[str], None] | None = None,
    walked: Callable[[str], None] | None = None,
) -> Tree:
    """``discover`` of a root already opened (``open_root``). ``handed`` (with ``on_part``: a fan-out) is asked
    about each folder the walk reaches that could be handed on as a part of its own: what walking it elsewhere gave
    (``walk_folder``), put in place of walking it here, or None to walk it here. ``left`` (``Cache.left``) is told
    each folder handed on as a part once that part is done with. ``walked`` (``FsspecSource.walked``) is told the
    path of each folder whose walk is over, before it is judged."""
    root, source, found, problems = opened.root, opened.source, opened.found, opened.problems
    if isinstance(found, PathProblem):
        return Tree(root=root, runs=(), path_problems=(found,))
    if not found.is_dir:
        name = display(found.name)
        facts = source.read(found, name, False)
        bad = () if name == found.name else (_bad_name(name, found.name),)
        return Tree(
            root=root, runs=(), loose_files=(facts,), path_problems=bad, files_seen=1, abs_root=source.abs_root,
            tf_shard_problems=tf_shard_problems((facts,)),
        )

    emit = None if on_part is None else _Emitter(root, source, problems, on_part)
    if jobs <= 1:
        walker = _Walker(source, problems, None, progress, emit, handed, left, walked)
        top = walker.walk(found, ".", 0, frozenset())
    else:
        with _pool(jobs) as pool:
            walker = _Walker(source, problems, pool, progress, emit, handed, left, walked)
            top = walker.walk(found, ".", 0, frozenset())
            _collect(top)
    _drop_vanished(top, problems)
    _read_dcp_items(top, source.read_dcp_items)
    return build_tree(root, top, found.name, problems, walker.files_seen, source.abs_root)


def build_tree(
    root: str, top: _Dir, root_name: str, problems: list[PathProblem], files_seen: int, abs_root: str = ""
) -> Tree:
    """Group a walked (and read) folder tree into the sorted ``Tree``."""
    _mark_lightning(top)
    grouper = _Grouper()
    grouper.visit_root(top, root_name)
    return _grouped(root, grouper, problems, files_seen, abs_root)


def _grouped(root: str, grouper: _Grouper, problems: list[PathProblem], files_seen: int, abs_root: str) -> Tree:
    """The sorted ``Tree`` of what ``grouper`` found."""
    runs = tuple(sorted(grouper.runs, key=lambda r: r.path))
    loose = tuple(sorted(grouper.loose, key=lambda f: f.path))
    return Tree(
        root=root,
        runs=runs,
        loose_files=loose,
        path_problems=tuple(sorted(problems, key=lambda p: (p.path, p.problem.kind.value))),
        files_seen=files_seen,
        abs_root=abs_root,
        tf_shard_problems=tf_shard_problems([*(f for run in runs for ck in run.checkpoints for f in ck.files), *loose]),
    )


def tf_shard_problems(files: Sequence[FileFacts]) -> tuple[ShardProblem, ...]:
    """Every TensorFlow bundle index among ``files`` (a tree's, in ``Tree.all_files`` order) with its data shards
    checked against it (``tfbundle.shard_problems``: the shards beside the index, by name and size)."""
    indexes = [f for f in files if f.kind is FileKind.TF_INDEX and isinstance(f.content, TfIndexFacts)]
    if not indexes:
        return ()
    from ckptdoctor.readers.tfbundle import shard_problems  # only a tree with a TF bundle pays for it

    by_folder: dict[str, dict[str, int]] = {}
    for f in files:
        folder = f.path.rsplit("/", 1)[0] if "/" in f.path else ""
        by_folder.setdefault(folder, {})[f.name] = f.size
    out: list[ShardProblem] = []
    for idx in indexes:
        assert isinstance(idx.content, TfIndexFacts)
        folder = idx.path.rsplit("/", 1)[0] if "/" in idx.path else ""
        prefix = idx.name[: -len(".index")]
        for name, problem in shard_problems(prefix, idx.content, by_folder.get(folder, {})):
            out.append(ShardProblem(idx.path, f"{folder}/{name}" if folder else name, problem))
    return tuple(out)


# ---------------------------------------------------------------------------------------------------------------
# The walk


class _Walker(Generic[L, M]):
    """Depth-first walk through ``source``, one stat per entry, reading each file as it is met (or handing it to
    ``pool``)."""

    def __init__(
        self,
        source: Source[L, M],
        problems: list[PathProblem],
        pool: ThreadPoolExecutor | None,
        progress: Callable[[], None] | None = None,
        emit: _Emitter | None = None,
        handed: Handed | None = None,
        left: Callable[[str], None] | None = None,
        walked: Callable[[str], None] | None = None,
    ) -> None:
        self.source = source
        self.handed = handed
        self.left = left  # told each folder handed to ``emit`` once that is over
        self.walked = walked  # told each folder's path once its walk is over
        self.limits = source.limits
        self.pool = pool
        self.progress = progress
        self.problems = problems
        self.files_seen = 0
        self.emit = emit
        self.above: list[_Dir] = []  # the folders being walked, the root first (their ``listed`` files)

    def walk(
        self, folder: Entry[M], rel: str, depth: int, ancestors: frozenset[Hashable], absorbed: bool = False
    ) -> _Dir:
        """Walk one directory (already known to be one) and everything below it. ``absorbed``: it is, or is inside,
        a folder its run may take whole as a checkpoint (nothing below it is emitted on its own)."""
        node = _Dir(rel=rel, name=folder.name, mtime=folder.mtime)
        source = self.source
        if source.stopped:
            return node
        if depth > self.limits.dir_depth:
            msg = f"deeper than the {self.limits.dir_depth}-level limit; not walked"
            self.problems.append(PathProblem(rel, ReadProblem(ProblemKind.LIMIT, msg)))
            return node
        ancestors = ancestors | {folder.key}
        listing = _listing(source, folder, node, self.problems)
        if listing is None:
            return node
        files, subdirs = listing

        in_dcp = in_dcp_folder(crel for _, crel in files)
        if self.emit is not None:
            node.listed = [crel for _, crel in files]
        for entry, crel in files:
            if in_dcp and crel.endswith(".distcp"):
                node.distcp[crel] = entry.path
            if self.pool is None:
                node.files.append(source.read(entry, crel, in_dcp))
                if self.progress is not None:
                    self.progress()
            else:
                fut = self.pool.submit(source.read, entry, crel, in_dcp)
                if self.progress is not None:
                    fut.add_done_callback(when_done(self.progress))
                node.pending.append(fut)
            self.files_seen += 1
        for entry, crel in subdirs:
            if entry.key in ancestors:
                target = source.shown_target(entry.path)
                self.problems.append(
                    PathProblem(crel, ReadProblem(ProblemKind.SYMLINK_LOOP, "leads back to a folder above it"), target)
                )
                continue
            if self.emit is None:
                node.dirs.append(self.walk(entry, crel, depth + 1, ancestors))
                continue
            inner = absorbed or absorbable(entry.name)
            done = None if inner or self.handed is None else self.handed(crel)
            if done is not None:
                node.dirs.append(self._take(done, crel))
                continue
            before = self.files_seen
            self.above.append(node)
            try:
                child = self.walk(entry, crel, depth + 1, ancestors, inner)
                if child.has_run and not inner:
                    # its files (those of parts emitted below it are counted there already) go with it
                    child = self.emit(child, self.files_seen - before, self.above)
                    self.files_seen = before
            finally:
                self.above.pop()
            node.dirs.append(child)
            if child.emitted and self.left is not None:
                self.left(crel)
        # The folder's own reads are over before it is judged a run: a TensorFlow folder or a Lightning `.ckpt` is
        # known by what its files hold (a pooled read still pending would leave it loose).
        if node.pending:
            node.files.extend(f.result() for f in node.pending)
            node.pending.clear()
        if self.walked is not None:
            self.walked(folder.path)
        node.has_run = (
            _is_run(node)
            or _is_framework_folder(node)
            or _is_lightning_folder(node)
            or any(d.has_run for d in node.dirs)
        )
        return node

    def _take(self, done: FolderWalk, rel: str) -> _Dir:
        """The folder at ``rel``, walked elsewhere (``walk_folder``), put where walking it here would put it: its own
        entry's problems (met listing its parent) went with its task, its parts are handed on in walk order, and
        what it did not hand on joins this walk."""
        prefix = rel + "/"
        self.problems[:] = [p for p in self.problems if p.path != rel and not p.path.startswith(prefix)]
        self.problems.extend(done.problems)
        self.files_seen += done.files_seen
        if self.progress is not None:
            for _ in range(done.files_seen + sum(tree.files_seen for tree, _ in done.parts)):
                self.progress()
        assert self.emit is not None  # folders are handed on only by a walk that hands parts on
        for tree, above in done.parts:
            self.emit.on_part(tree, above)
        return done.node


def _listing(
    source: Source[L, M], folder: Entry[M], node: _Dir, problems: list[PathProblem]
) -> tuple[list[tuple[Entry[M], str]], list[tuple[Entry[M], str]]] | None:
    """``folder``'s entries stat'ed, in name order: its files and the folders to walk, each with its path relative
    to the root (None when it cannot be listed). Fills ``node``'s names as listed; what could not be taken is in
    ``problems``. The walk and the fan-out's plan (``plan_folders``) list through it alike."""
    rel = node.rel
    listed = source.listdir(folder, rel, problems)
    if listed is None:
        return None
    listed.sort(key=lambda e: e.name)
    files: list[tuple[Entry[M], str]] = []  # (file, rel)
    subdirs: list[tuple[Entry[M], str]] = []  # (folder, rel)
    for item in listed:
        raw = item.name
        node.names.append(raw)
        if raw == OWN_DIR:
            continue
        shown = display(raw)
        crel = shown if rel == "." else f"{rel}/{shown}"
        if shown != raw:
            problems.append(_bad_name(crel, raw))
        entry = source.entry(item, crel, problems)
        if entry is None:
            continue
        if entry.is_dir:
            node.dir_names.append(raw)
            if entry.followed:
                subdirs.append((entry, crel))
        elif entry.followed:
            files.append((entry, crel))
    node.file_names = [entry.name for entry, _ in files]
    return files, subdirs


def absorbable(name: str) -> bool:
    """Whether a folder of this name may be taken whole as a checkpoint by the run above it (``_Grouper.visit``),
    subfolders and all: nothing inside it is grouped on its own."""
    return bool(
        _ROTATION_RE.search(name) or accelerate_stack.AUTOMATIC_RE.match(name) or titan_stack.step_of(name) is not None
    )


class _Emitter:
    """Hands each finished run folder to ``on_part`` as its own Tree (grouped exactly as the whole root's grouping
    would group it: a folder with a run in it, named so no run above takes it as a checkpoint, is visited on its
    own) and leaves a stub in its place."""

    def __init__(self, root: str, source: Source[L, M], problems: list[PathProblem], on_part: PartCallback) -> None:
        self.root = root
        self.read_dcp_items = source.read_dcp_items
        self.abs_root = source.abs_root
        self.problems = problems
        self.on_part = on_part

    def __call__(self, node: _Dir, files_seen: int, above: Sequence[_Dir]) -> _Dir:
        """Emit ``node`` (``files_seen``: the files its walk read, those of parts emitted below it left out) and
        return its stub. ``above``: the folders it is in, the root first."""
        mine: list[PathProblem] = []
        kept: list[PathProblem] = []
        prefix = node.rel + "/"
        for p in self.problems:  # its own entry's problems (a bad name, a link) and everything below it
            (mine if p.path == node.rel or p.path.startswith(prefix) else kept).append(p)
        self.problems[:] = kept
        _drop_vanished(node, mine)
        _read_dcp_items(node, self.read_dcp_items)
        _mark_lightning(node)
        grouper = _Grouper()
        grouper.visit(node)
        tree = _grouped(self.root, grouper, mine, files_seen, self.abs_root)
        self.on_part(tree, tuple(rel for d in above for rel in d.listed))
        return _Dir(
            rel=node.rel, name=node.name, mtime=node.mtime, has_run=True, emitted=True,
            file_names=node.file_names, read_names=[f.name for f in node.files],
        )


def _drop_vanished(top: _Dir, problems: list[PathProblem]) -> None:
    """Move files that vanished between the listing and the read out of the tree into ``problems``: a file gone
    during the scan (a save or a rotation at work) is not a corrupt file, and no rule must judge it as one."""
    stack = [top]
    while stack:
        d = stack.pop()
        stack.extend(d.dirs)
        kept: list[FileFacts] = []
        for f in d.files:
            gone = next((p for p in f.problems if p.kind is ProblemKind.UNREADABLE and p.message == VANISHED), None)
            if gone is None:
                kept.append(f)
            else:
                problems.append(PathProblem(f.path, gone))
                d.distcp.pop(f.path, None)
        d.files = kept


def in_dcp_folder(rels: Iterable[str]) -> bool:
    """Whether a folder holding files at ``rels`` is a torch.distributed.checkpoint folder, where `.metadata` is
    sniffed as DCP metadata."""
    return any(r.endswith(("/.metadata", ".distcp")) or r == ".metadata" for r in rels)


def _read_dcp_items(top: _Dir, read_items: DcpItemReader) -> None:
    """Complete each `.distcp` file's facts with the pickles of its BYTE_IO items, located by the folder's
    `.metadata` (torch unpickles those with weights_only=False), and of its `_extra_state` tensors (pickles
    TransformerEngine's set_extra_state loads), so the cost is those items, not the file. Without
    readable metadata (a torn or doctored folder, rare) each file is searched for blobs, bounded by the limits."""
    stack = [top]
    while stack:
        d = stack.pop()
        stack.extend(d.dirs)
        if not d.distcp:
            continue
        from ckptdoctor.readers.extra_state import EXTRA_STATE_SUFFIX

        items: dict[str, list[DcpItem]] = {}
        has_metadata = any(isinstance(f.content, DcpMetadataFacts) for f in d.files)
        for f in d.files:
            if isinstance(f.content, DcpMetadataFacts):
                folder = f.path.rsplit("/", 1)[0] if "/" in f.path else ""
                for ref in f.content.storage:
                    extra = not ref.is_bytes and ref.fqn.endswith(EXTRA_STATE_SUFFIX)
                    if ref.is_bytes or extra:
                        rel = f"{folder}/{ref.relative_path}" if folder else ref.relative_path
                        items.setdefault(rel, []).append(DcpItem(ref.offset, ref.length, ref.fqn if extra else ""))
        d.files = [
            f
            if f.path not in d.distcp or (has_metadata and f.path not in items)
            else read_items(d.distcp[f.path], f, items.get(f.path) if has_metadata else None)
            for f in d.files
        ]


def _collect(node: _Dir) -> None:
    """Wait for the pooled reads of ``node`` and below, keeping walk order (so any ``jobs`` gives the same Tree)."""
    stack = [node]
    while stack:
        d = stack.pop()
        d.files.extend(f.result() for f in d.pending)
        d.pending.clear()
        stack.extend(d.dirs)


def _bad_name(rel: str, raw: str) -> PathProblem:
    return PathProblem(rel, ReadProblem(ProblemKind.BAD_NAME, f"name is not valid UTF-8: {os.fsencode(raw)!r}"))


# ---------------------------------------------------------------------------------------------------------------
# Folders walked elsewhere (a fan-out: ``ckptdoctor.fanout``)


@mutable
class FolderTask:
    """A folder of a root that a fan-out walks on its own (``walk_folder``): what the walk of its root knows of it
    when it reaches it."""

    rel: str  # its path relative to the root
    entry: Entry[Any]  # as its parent's listing stat'ed it
    depth: int
    ancestors: tuple[str, ...]  # where the folders above it are (``Entry.path``): a link back to one is a loop
    above: tuple[str, ...]  # the files listed in the folders above it (``PartCallback``'s second value)
    problems: tuple[PathProblem, ...]  # its own entry's (a bad name), met listing its parent


@mutable
class FolderWalk:
    """What walking one folder gave (``walk_folder``), put in its place by the walk of its root (``Handed``)."""

    node: _Dir  # its stub when it was handed on as a part of its own, else the folder as walked
    parts: list[tuple[Tree, tuple[str, ...]]]  # the parts handed on, in walk order (``PartCallback``'s values)
    problems: list[PathProblem]  # those no part took
    files_seen: int  # the files read that no part took (they join the rest of the root)


# What a walk that hands parts on asks at each folder it could hand on (its path): the folder as walked elsewhere
# (``walk_folder``), or None to walk it here.
Handed = Callable[[str], "FolderWalk | None"]

# Names that make a folder worth a task of its own even when its listing shows no run: checkpoint files, and the
# TensorFlow and Keras files (known by content, so by their usual names here).
_TASK_NAMES = frozenset({"checkpoint"})
_TASK_SUFFIXES = (".index", ".h5", ".hdf5")


def plan_folders(opened: Opened[L, M]) -> list[FolderTask] | None:
    """The folders of ``opened``'s root a fan-out walks as tasks of their own, in walk order, found by listing alone
    (nothing is read): each folder below the root that the walk reaches outside any folder its run may take whole
    as a checkpoint (``absorbable``) and whose listing shows a run (``_is_run``: `checkpoint-N` folders,
    accelerate's automatic naming), a torchtitan `step-N` folder or checkpoint files; the folders above them are
    listed further. None when the root is one task: a file, a run itself, a root that cannot be opened, or one with
    no such folder in it (a checkpoint folder).

    Which folders are handed on decides how the work is split, never what is found: a folder handed on that is no
    part of its own (nothing in it is a run) comes back whole, and the walk of the root groups it as it would have.
    """
    found = opened.found
    if isinstance(found, PathProblem) or not found.is_dir:
        return None
    source = opened.source.part(found.path)  # a listing of its own: the walk's entry count starts afresh
    tasks: list[FolderTask] = []

    def visit(
        folder: Entry[M], rel: str, depth: int, ancestors: tuple[Entry[M], ...], above: tuple[str, ...],
        own: tuple[PathProblem, ...],
    ) -> bool:
        """List ``folder``: True when it is worth a task of its own (appended, unless it is the root), else its
        folders are visited in turn."""
        if source.stopped or depth > source.limits.dir_depth:
            return False  # the walk stops there and says so
        node = _Dir(rel=rel, name=folder.name, mtime=folder.mtime)
        problems: list[PathProblem] = []
        listing = _listing(source, folder, node, problems)
        if listing is None:
            return False
        files, subdirs = listing
        if rel == ".":  # a root that is a run is one task; one with checkpoint files beside its runs is split
            if _is_run(node):
                return True
        elif _is_run(node) or any(_worth_a_task(n) for n in node.file_names) or any(
            titan_stack.step_of(n) is not None for n in node.dir_names
        ):
            tasks.append(FolderTask(rel, folder, depth, tuple(a.path for a in ancestors), above, own))
            return True
        inside = (*ancestors, folder)
        keys = {a.key for a in inside}
        listed = above + tuple(crel for _, crel in files)
        for sub, crel in subdirs:
            if sub.key not in keys and not absorbable(sub.name):
                visit(sub, crel, depth + 1, inside, listed, tuple(p for p in problems if p.path == crel))
        return False

    if visit(found, ".", 0, (), (), ()):
        return None
    return tasks or None


def _worth_a_task(name: str) -> bool:
    lower = name.lower()
    return _is_ckpt_file(lower) or lower in _TASK_NAMES or lower.endswith(_TASK_SUFFIXES)


def _pool(jobs: int) -> ThreadPoolExecutor:
    """A pool of ``jobs`` reading threads (``concurrent.futures`` is loaded only for more than one read at once)."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="ckptdoctor-read")


def walk_folder(root: str, source: Source[L, M], task: FolderTask, jobs: int = 1) -> FolderWalk:
    """Walk the folder of ``task`` (in any process: ``source`` is the root's source for it, ``Source.part``) as the
    walk of ``root`` would reach it: the parts below it, and the folder itself when a run is in it, are handed on
    (``discover``'s ``on_part``) and returned in walk order with what is left. ``jobs`` as ``discover``'s."""
    parts: list[tuple[Tree, tuple[str, ...]]] = []
    problems = list(task.problems)
    emit = _Emitter(root, source, problems, lambda tree, above: parts.append((tree, above)))
    pool = _pool(jobs) if jobs > 1 else None
    # Folders are keyed as this process sees them (another machine numbers a shared file system's devices its own
    # way), so a link back above the folder is the loop here that it is in the walk of the root.
    entry = dataclasses.replace(task.entry, key=source.key(task.entry.path))
    ancestors = frozenset(source.key(path) for path in task.ancestors)
    try:
        walker = _Walker(source, problems, pool, None, emit)
        walker.above.append(_Dir(rel="", name="", mtime=0.0, listed=list(task.above)))
        node = walker.walk(entry, task.rel, task.depth, ancestors)
    finally:
        if pool is not None:
            pool.shutdown()
    seen = walker.files_seen
    if node.has_run:  # as the walk of the root hands on a folder with a run in it
        node = emit(node, seen, walker.above)
        seen = 0
    return FolderWalk(node, parts, problems, seen)


def lost_folder(root: str, task: FolderTask, why: str) -> FolderWalk:
    """``task``'s folder when walking it failed for good (its worker lost, again and again): one part that says it
    was not checked (``ProblemKind.NOT_CHECKED``, with ``why``), never a folder silently missing."""
    problem = PathProblem(task.rel, ReadProblem(ProblemKind.NOT_CHECKED, why))
    problems = sorted([*task.problems, problem], key=lambda p: (p.path, p.problem.kind.value))
    tree = Tree(root=root, runs=(), path_problems=tuple(problems))
    stub = _Dir(rel=task.rel, name=task.entry.name, mtime=task.entry.mtime, has_run=True, emitted=True)
    return FolderWalk(stub, [(tree, task.above)], [], 0)


# ---------------------------------------------------------------------------------------------------------------
# Grouping


class _Grouper:
    """Turn walked folders into runs, checkpoints and loose files."""

    def __init__(self) -> None:
        self.runs: list[Run] = []
        self.loose: list[FileFacts] = []

    def visit_root(self, top: _Dir, root_name: str) -> None:
        """The root may be a run, a single checkpoint/model folder (standalone), or a folder of anything."""
        if _is_run(top) or not _looks_like_model(top):
            self.visit(top)
            return
        m = _RESUME_RE.search(root_name)
        role, step = (FolderRole.CHECKPOINT, int(m.group(1))) if m else (FolderRole.MODEL, None)
        inner = [d for d in top.dirs if not d.has_run]
        if titan_stack.is_layout([(root_name, top.file_names)]):  # one torchtitan `step-N` save, given directly
            ck = _checkpoint(top, FolderRole.CHECKPOINT, titan_stack.step_of(root_name), inner)
            settled, stack = [dataclasses.replace(ck, stack=Stack.TORCHTITAN)], Stack.TORCHTITAN
        else:
            settled, stack = settle([_checkpoint(top, role, step, inner)])
        self.runs.append(Run(path=".", checkpoints=tuple(settled), resume_pick=None, standalone=True, stack=stack))
        for d in top.dirs:
            if d.has_run:
                self.visit(d)

    def visit(self, node: _Dir) -> None:
        if node.emitted:  # judged as a part of its own already
            return
        if not node.has_run:
            self.loose.extend(_all_files(node))
            return
        if not _is_run(node):
            dirs = node.dirs
            if _is_lightning_folder(node):
                # ModelCheckpoint's dirpath: a run whose one checkpoint is the folder of `.ckpt` files
                dirs = [d for d in node.dirs if d.has_run]
                settled, stack = settle([_checkpoint(node, FolderRole.MODEL, None, [])])
                self.runs.append(Run(path=node.rel, checkpoints=tuple(settled), resume_pick=None, stack=stack))
                self.loose.extend(f for d in node.dirs if not d.has_run for f in _all_files(d))
            elif _is_framework_folder(node):
                # A TensorFlow checkpoint folder or Keras weights: one checkpoint, restored as a whole.
                dirs = [d for d in node.dirs if d.has_run]
                ck = _checkpoint(node, FolderRole.MODEL, None, [d for d in node.dirs if not d.has_run])
                settled, stack = settle([ck])
                self.runs.append(Run(path=node.rel, checkpoints=tuple(settled), resume_pick=None, standalone=True,
                                     stack=stack))
            else:
                self.loose.extend(node.files)
            for d in dirs:
                self.visit(d)
            return
        checkpoints: list[Checkpoint] = []
        others: list[_Dir] = []
        automatic = accelerate_stack.is_automatic_layout(node.name, node.dir_names)
        if _is_titan_run(node):
            self._titan_run(node)
            return
        for d in node.dirs:
            if _ROTATION_RE.search(d.name):
                checkpoints.append(_checkpoint(d, *_role(d.name), d.dirs))
            elif automatic and accelerate_stack.AUTOMATIC_RE.match(d.name):
                checkpoints.append(_checkpoint(d, FolderRole.CHECKPOINT, None, d.dirs))
            else:
                others.append(d)
        if any(_is_ckpt_file(f.name) for f in node.files) or _is_framework_folder(node):
            # save_model's final files at the run's top level (plus the subfolders such writers create there).
            parts = [d for d in others if not d.has_run and _is_model_subfolder(d)]
            checkpoints.append(_checkpoint(node, FolderRole.MODEL, None, parts))
            others = [d for d in others if d not in parts]
        else:
            self.loose.extend(node.files)
        for d in others:
            self.visit(d)
        settled, stack = settle(sorted(checkpoints, key=lambda c: c.path))
        # resume_pick stays the Trainer's pick (get_last_checkpoint) whoever wrote the run: the gate predicts a
        # Trainer resume; what the run's own stack resumes is its module's to say (ckptdoctor.stacks).
        entries = tuple(node.names) if automatic else ()  # what `load_state()`'s listing sorts by number
        self.runs.append(Run(path=node.rel, checkpoints=tuple(settled), resume_pick=_pick(node), stack=stack,
                             entries=entries))


    def _titan_run(self, node: _Dir) -> None:
        """A torchtitan checkpoint folder: each folder `_find_load_step` matches (`step-<N>`) is a checkpoint of
        torchtitan's, with that step; anything else in the folder is visited as usual."""
        checkpoints: list[Checkpoint] = []
        for d in node.dirs:
            step = titan_stack.step_of(d.name)
            if step is None:
                self.visit(d)
                continue
            ck = _checkpoint(d, FolderRole.CHECKPOINT, step, d.dirs)
            checkpoints.append(dataclasses.replace(ck, stack=Stack.TORCHTITAN))
        self.loose.extend(node.files)
        ordered = tuple(sorted(checkpoints, key=lambda c: c.path))
        self.runs.append(Run(path=node.rel, checkpoints=ordered, resume_pick=None, stack=Stack.TORCHTITAN))


def _is_titan_run(node: _Dir) -> bool:
    """torchtitan's checkpoint folder (``ckptdoctor.stacks.torchtitan.is_layout``) with no Trainer folder in it."""
    return titan_stack.is_layout((d.name, d.file_names) for d in node.dirs) and not any(
        _ROTATION_RE.search(n) for n in node.dir_names
    )


def _is_lightning_folder(node: _Dir) -> bool:
    """A folder holding PyTorch Lightning `.ckpt` files (``ckptdoctor.stacks.lightning``)."""
    return any(lightning_stack.signed(f) for f in node.files)


def _mark_lightning(node: _Dir) -> None:
    """Mark Lightning checkpoint folders, and the folders above them, as holding a run: only once the files are read
    (the walk decides `has_run` before pooled reads finish, and a Lightning `.ckpt` is known by its content)."""
    for d in node.dirs:
        _mark_lightning(d)
    node.has_run = node.has_run or _is_lightning_folder(node) or any(d.has_run for d in node.dirs)


def _is_run(node: _Dir) -> bool:
    return (
        any(_ROTATION_RE.search(n) for n in node.dir_names)
        or accelerate_stack.is_automatic_layout(node.name, node.dir_names)
        or _is_titan_run(node)
    )


def _role(name: str) -> tuple[FolderRole, int | None]:
    m = _RESUME_RE.search(name)
    if m:
        return FolderRole.CHECKPOINT, int(m.group(1))
    if name.startswith(_TEMP_PREFIX):
        return FolderRole.TEMP, None
    return FolderRole.OTHER, None


def _pick(node: _Dir) -> str | None:
    """What ``get_last_checkpoint(run)`` returns, relative to the root.

    Ties between names of the same number (``checkpoint-10`` and ``checkpoint-0010``), which the library breaks by
    os.listdir order, are broken deterministically: the canonical ``checkpoint-<n>`` the Trainer writes, else the
    name that sorts first.
    """
    name = last_checkpoint(node.dir_names)
    if name is None:
        return None
    name = display(name)
    return name if node.rel == "." else f"{node.rel}/{name}"


def last_checkpoint(names: Iterable[str]) -> str | None:
    """The folder name ``get_last_checkpoint`` returns among a run's subfolder ``names`` (None: no `checkpoint-N`);
    ties between names of the same number go to the canonical ``checkpoint-<n>``, else the name that sorts first.
    Discovery picks with it, and ``fix --dry-run`` predicts the pick once folders are quarantined."""
    numbered: list[tuple[int, str]] = []
    for n in names:
        m = _RESUME_RE.search(n)
        if m:
            numbered.append((int(m.group(1)), n))
    if not numbered:
        return None
    top = max(step for step, _ in numbered)
    tied = sorted(n for step, n in numbered if step == top)
    canonical = f"checkpoint-{top}"
    return canonical if canonical in tied else tied[0]


def _is_ckpt_file(name: str) -> bool:
    lower = name.lower()
    return lower in _CKPT_NAMES or lower.endswith(_CKPT_SUFFIXES)


def _is_model_subfolder(node: _Dir) -> bool:
    """Subfolders writers put inside a model/checkpoint folder: extra adapters, DeepSpeed tags, DCP folders."""
    # an emitted folder keeps the names of the files it held once read (what ``files`` said of it)
    names = set(node.read_names) if node.emitted else {f.name for f in node.files}
    if is_deepspeed_tag(node.name, names):
        return True
    return bool(
        names & {"adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", ".metadata"}
        or any(n.endswith(".distcp") for n in names)
    )


def _looks_like_model(node: _Dir) -> bool:
    return (
        any(_is_ckpt_file(f.name) for f in node.files)
        or _is_framework_folder(node)
        or any(_is_model_subfolder(d) for d in node.dirs)
    )


def _is_framework_folder(node: _Dir) -> bool:
    """A TensorFlow checkpoint folder (a `checkpoint` state file or a bundle index), or Keras `.h5` weights with no
    torch weights beside them (a model repository often ships `tf_model.h5` next to `model.safetensors`)."""
    kinds = {f.kind for f in node.files}
    return bool(kinds & _TF_BUNDLE_KINDS) or (FileKind.HDF5 in kinds and not kinds & _TORCH_KINDS)


def framework_of(files: Iterable[FileFacts], base: str) -> Framework:
    """Which stack wrote the checkpoint folder ``base`` holding ``files``: MindNLP by its Trainer's file names or a
    MindSpore `.ckpt`, TensorFlow by its bundle files or HDF5 weights without torch weights, else PyTorch."""
    kinds: set[FileKind] = set()
    for f in files:
        rel = f.path[len(base) + 1 :] if base not in ("", ".") else f.path
        if f.kind is FileKind.MINDSPORE or ("/" not in rel and rel in _MINDNLP_NAMES):
            return Framework.MINDNLP
        kinds.add(f.kind)
    if kinds & _TF_KINDS and not kinds & _TORCH_KINDS:
        return Framework.TENSORFLOW
    return Framework.PYTORCH


def _all_files(node: _Dir) -> list[FileFacts]:
    out = list(node.files)
    for d in node.dirs:
        out.extend(_all_files(d))
    return out


def _newest(node: _Dir) -> float:
    return max([node.mtime, *(f.mtime for f in node.files), *(_newest(d) for d in node.dirs)])


def _checkpoint(node: _Dir, role: FolderRole, step: int | None, subdirs: list[_Dir]) -> Checkpoint:
    """A checkpoint of ``node``'s own files plus every file under the given ``subdirs``."""
    files = list(node.files)
    mtime = max([node.mtime, *(f.mtime for f in node.files)])
    for d in subdirs:
        files.extend(_all_files(d))
        mtime = max(mtime, _newest(d))
    ordered = tuple(sorted(files, key=lambda f: f.path))
    return Checkpoint(
        path=node.rel,
        role=role,
        step=step,
        files=ordered,
        mtime=mtime,
        framework=framework_of(files, node.rel),
        deepspeed_tags=deepspeed_tags(node.rel, ordered),
        folder_mtime=node.mtime,
    )


def deepspeed_tags(folder: str, files: Iterable[FileFacts]) -> tuple[DeepSpeedTag, ...]:
    """The DeepSpeed tag folders directly inside the checkpoint ``folder`` (relative to the root) among its
    ``files`` (``is_deepspeed_tag``), in the order their files come, with the partitions and model states each
    holds by name."""
    prefix = "" if folder in ("", ".") else folder + "/"
    found: dict[str, list[str]] = {}
    for f in files:
        parts = f.path[len(prefix) :].split("/")
        if len(parts) == 2:
            found.setdefault(parts[0], []).append(parts[1])
    return tuple(
        DeepSpeedTag(
            tag,
            tuple(names),
            tuple(sorted(int(m.group(1)) for n in names if (m := DS_OPTIM_RE.match(n)))),
            tuple(n for n in names if DS_MODEL_RE.match(n)),
        )
        for tag, names in found.items()
        if is_deepspeed_tag(tag, names)
    )
