"""torchtitan's ``CheckpointManager`` as a stack: the layout of its runs, what its ``load()`` picks and what it loads.

torchtitan 0.3.0 (``torchtitan/components/checkpointer/dcp.py``, ``CheckpointManager``; the old import path
``torchtitan/components/checkpoint.py`` re-exports it) saves with ``torch.distributed.checkpoint.save`` into
``<dump_folder>/<checkpoint.folder>/step-<N>/`` (``_create_checkpoint_id``; the folder defaults to ``checkpoint``):
every rank writes its ``__<rank>_<i>.distcp`` data files, then the coordinator writes ``.metadata`` last. A save
holds the model's state dict flattened at the top level (``_flattened_model_states_sd``) beside the Stateful
``optimizer``, ``lr_scheduler``, ``dataloader`` (``dp_rank_<r>`` per data-parallel rank and ``world_size``) and
``train_state`` (``step``, ``ntokens_seen``); with the default ``last_save_model_only=True`` the final step holds
the model alone (``_save_last_step``).

``load(step=-1)`` (``_load``) takes ``checkpoint.load_step``, or with -1 the highest ``step-<N>`` that holds
``.metadata`` or ``model.safetensors.index.json`` (``_find_load_step``: a folder without one is skipped without a
word, so a save cut short falls back to the one before), and loads every state but those in
``exclude_from_loading`` (the model alone for step 0) with ``dcp.load``, which raises on any key it does not find.
Pure functions of names and walked facts: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ckptdoctor.model import Checkpoint, DcpMetadataFacts, PickleFacts, Run
from ckptdoctor.patterns import lazy

# `_find_load_step` and `_purge_stale_checkpoints` match names with `re.search(r"step-(\d+)", name)`.
STEP_RE = lazy(r"step-(\d+)")
# What `_create_checkpoint_id` writes: the names a run of this layout is recognised by.
_OWN_STEP_RE = re.compile(r"^step-(\d+)$")
# `FileSystemWriter` data files: `__<rank>_<i>.distcp` (torch/distributed/checkpoint/filesystem.py `_generate_uuid`
# free naming: `{prefix}{rank}_{i}{suffix}` with prefix `__`).
DATA_RE = lazy(r"^__(\d+)_(\d+)\.distcp$")
METADATA = ".metadata"
HF_INDEX = "model.safetensors.index.json"
# The Stateful keys `CheckpointManager.__init__` adds beside the model (torchtitan/components/checkpointer/base.py)
STATES = ("optimizer", "lr_scheduler", "dataloader", "train_state")
# at most 4,000 digits: int() refuses over 4,300, and no rank has a longer number (such a key is never loaded)
_DP_RANK_RE = lazy(r"^dataloader\.dp_rank_(\d{1,4000})$")


def is_dcp_folder(names: Iterable[str]) -> bool:
    """Whether a folder holding files ``names`` is a DCP save (its ``.metadata`` or ``__<rank>_<i>.distcp``)."""
    return any(n == METADATA or DATA_RE.match(n) for n in names)


def is_layout(subfolders: Iterable[tuple[str, Iterable[str]]]) -> bool:
    """Whether a folder whose subfolders are ``(name, file names)`` is a torchtitan checkpoint folder: some
    ``step-<N>`` subfolder holds a DCP save."""
    return any(_OWN_STEP_RE.match(name) and is_dcp_folder(files) for name, files in subfolders)


def step_of(name: str) -> int | None:
    """The step ``_find_load_step`` reads from a folder name (the first ``step-<N>`` in it), or None."""
    m = STEP_RE.search(name)
    return int(m.group(1)) if m else None


def loadable(ck: Checkpoint) -> bool:
    """Whether ``_find_load_step`` counts the folder: it holds ``.metadata`` or an HF safetensors index."""
    return ck.file(METADATA) is not None or ck.file(HF_INDEX) is not None


def load_pick(run: Run) -> Checkpoint | None:
    """The folder ``load(step=-1)`` loads: the highest step among those ``loadable`` (None: none, a fresh start)."""
    found = [ck for ck in run.checkpoints if ck.step is not None and loadable(ck)]
    return max(found, key=lambda c: c.step or 0, default=None)


def metadata(ck: Checkpoint) -> DcpMetadataFacts | None:
    """The walked ``.metadata`` of a step folder (None: absent or not DCP metadata)."""
    f = ck.file(METADATA)
    return f.content if f is not None and isinstance(f.content, DcpMetadataFacts) else None


def missing_states(meta: DcpMetadataFacts) -> list[str]:
    """The Stateful states a full ``load()`` asks ``dcp.load`` for that the save does not hold (``optimizer``,
    ``lr_scheduler``, ``dataloader``, ``train_state``): all of them in a ``last_save_model_only`` save."""
    held = {k.split(".", 1)[0] for k in meta.keys}
    return [s for s in STATES if s not in held]


def dataloader_ranks(meta: DcpMetadataFacts) -> list[int]:
    """The data-parallel ranks whose dataloader state the save holds (``dataloader.dp_rank_<r>``)."""
    return sorted(int(m.group(1)) for k in meta.keys if (m := _DP_RANK_RE.match(k)))


def item_value(ck: Checkpoint, meta: DcpMetadataFacts, fqn: str) -> object:
    """The walked value of the non-tensor item ``fqn`` (``train_state.step``, ``dataloader.world_size``), read from
    the `.distcp` blob ``.metadata`` locates (``readers.dcp.read_dcp_items``); None when it cannot be told."""
    for ref in meta.storage:
        if ref.fqn != fqn or not ref.is_bytes:
            continue
        f = ck.file(ref.relative_path)
        pf = f.content if f is not None else None
        values = pf.value if isinstance(pf, PickleFacts) else None
        if isinstance(values, dict):
            return values.get(ref.offset)
    return None


def int_value(value: object) -> int | None:
    """``value`` when it is a plain int (not a bool)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


_STATE_LABELS = {
    "optimizer": "optimizer",
    "lr_scheduler": "scheduler",
    "dataloader": "dataloader",
    "train_state": "train-state",
}


def kinds(ck: Checkpoint) -> list[str]:
    """``dcp``, then the states the save's ``.metadata`` holds besides the model (none: a model-only save)."""
    meta = metadata(ck)
    out = ["dcp"] if meta is not None or any(DATA_RE.match(ck.relname(f)) for f in ck.files) else []
    if meta is not None:
        out.extend(_STATE_LABELS[s] for s in STATES if s not in missing_states(meta))
    return out


def resume_text(run: Run) -> str:
    """What ``CheckpointManager.load()`` loads for ``run``, in torchtitan's own words."""
    pick = load_pick(run)
    if run.standalone:
        return "torchtitan `step-N` save; `load(step=N)` loads it"
    if pick is None:
        return "torchtitan; `load()` finds no `step-N` with `.metadata`: a fresh start"
    return f"torchtitan; `load()` loads `{pick.path.rsplit('/', 1)[-1]}`"
