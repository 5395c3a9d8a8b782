"""Facts about checkpoints that several rule families and the gate read, in one home: derived from the model (no
I/O), so no rule family borrows another's helpers.

What the Trainer picks and loads is ``trainer_view``'s; here is what the files say about how the checkpoint was
saved (how many ranks wrote it, what its shards hold, which tensors are LoRA B matrices), whether a tree holds
checkpoint state at all, and the words findings share (``plural``).
"""

from __future__ import annotations

import math
import posixpath
import re

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

# The path problems CKD001 reports; the corrupt-file rules (CKD202, CKD203, CKD211) leave them to it.
PATH_KINDS = (
    ProblemKind.UNREADABLE,
    ProblemKind.SYMLINK_LOOP,
    ProblemKind.BAD_NAME,
    ProblemKind.SPECIAL_FILE,
    ProblemKind.LIMIT,
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


# A shard of a sharded transformers checkpoint, as `save_pretrained` names it (one pattern, the Trainer view's).
SHARD_RE = trainer_view.SHARD_RE


def shard_contents(ck: Checkpoint, idx: FileFacts, wm: dict[str, str]) -> tuple[dict[str, list[TensorInfo]], bool]:
    """The tensors of every shard the index names or that sits beside it in the index's format (their own headers),
    and whether every one of them was readable."""
    suffix = ".safetensors" if idx.name == trainer_view.SAFE_INDEX else ".bin"
    on_disk = {
        ck.relname(f)
        for f in ck.files
        if "/" not in ck.relname(f) and SHARD_RE.match(f.name) and f.name.endswith(suffix)
    }
    content: dict[str, list[TensorInfo]] = {}
    complete = True
    for shard in sorted(set(wm.values()) | on_disk):
        ts = trainer_view.tensors_of(ck.file(shard))
        if ts is None:
            complete = False
            continue
        content[shard] = list(ts)
    return content, complete


def saved_shard_tensors(ck: Checkpoint) -> tuple[TensorInfo, ...] | None:
    """Every tensor the shards of a sharded checkpoint hold by their own headers, not by its index: what the model
    saved, and what a rebuilt index maps (the shards the index a resume reads names, plus any other shard of its
    format beside it). None when that index is not valid, a shard it names is missing, a shard is unreadable, or a
    tensor sits in two shards: nothing whole to compare with."""
    idx = ck.file(trainer_view.SAFE_INDEX) or ck.file(trainer_view.BIN_INDEX)
    wm = trainer_view.weight_map(idx) if idx is not None else None
    if idx is None or wm is None or any(ck.file(s) is None for s in set(wm.values())):
        return None
    content, complete = shard_contents(ck, idx, wm)
    out = tuple(t for ts in content.values() for t in ts)
    if not complete or len({t.name for t in out}) != len(out):
        return None
    return out


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
        m = _DCP_RANK_RE.match(f.name) or _DS_RANK_RE.search(f.name)
        if m:
            ranks.add(int(m.group(1)))
    return max(ranks) + 1 if ranks else None


# ---------------------------------------------------------------------------------------------------------------
# Where a run started (CKD422): what its newest checkpoint shows, kept when a scan judging run by run releases it.

_CHECKPOINT_NAME = re.compile(r"^checkpoint-\d+$")


def _losses(ts: trainer_view.TrainerStateView) -> list[tuple[int, float]]:
    """``(step, loss)`` of the training logs in ``log_history``, in file order."""
    out: list[tuple[int, float]] = []
    for entry in ts.log_history:
        step, loss = trainer_view.integer(entry.get("step")), trainer_view._num(entry.get("loss"))
        if step is not None and loss is not None and math.isfinite(loss):
            out.append((step, loss))
    return out


def _newest(run: Run) -> Checkpoint | None:
    cks = [c for c in run.checkpoints if c.role == FolderRole.CHECKPOINT and c.step is not None]
    return max(cks, key=lambda c: c.step or 0) if cks else None


def _layout(ck: Checkpoint) -> frozenset[tuple[str, tuple[int, ...]]] | None:
    tensors = trainer_view.tensors_of(trainer_view.loaded_weight_file(ck))
    return None if not tensors else frozenset((t.name, tuple(t.shape)) for t in tensors)


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
        losses=tuple(_losses(ts)) if ts is not None else (),
    )
