"""Weights rules: what a resume would load, and whether it is what the run trained."""

from __future__ import annotations

import functools
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckptdoctor import trainer_view
from ckptdoctor.findings import Applicability, FixOp, FixPlan, OpKind, Severity
from ckptdoctor.model import Checkpoint, FileFacts, FolderRole, JsonFacts, TensorInfo, Tree
from ckptdoctor.rules import Hit, rule

STUB_MAX_TENSORS = 8  # "a few": more than this and it is a real (if wrong) model file, still reported
_SHARD_RE = re.compile(r"^(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)$")


def _checkpoints(tree: Tree) -> Iterator[tuple[Checkpoint, bool]]:
    """Every checkpoint-like folder with whether resume would (or the user will) load it."""
    for run in tree.runs:
        for ck in run.checkpoints:
            if ck.role in (FolderRole.CHECKPOINT, FolderRole.MODEL):
                yield ck, run.resume_pick == ck.path or run.standalone


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 tensor``, ``2 tensors``, ``1,297 bytes`` (``many`` for irregular plurals). Shared by the rule modules."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"


def _fmt_bytes(n: int) -> str:
    return plural(n, "byte")


def adapter_tensor_names(ck: Checkpoint) -> set[str]:
    names: set[str] = set()
    for rel in (trainer_view.ADAPTER_SAFE, trainer_view.ADAPTER_BIN):
        ts = trainer_view.tensors_of(ck.file(rel))
        if ts:
            names.update(t.name for t in ts)
    return names


@rule("CKD201", "stub-weights-shadow-adapter", Severity.ERROR, fix="safe")
def stub_weights_shadow_adapter(tree: Tree) -> Iterator[Hit]:
    """A full-weights file beside adapter files is loaded instead of the adapter, and holds none of its weights.

    ## What it does
    In a folder with `adapter_model.safetensors` / `adapter_model.bin`, looks for `model.safetensors` or
    `pytorch_model.bin` and checks whether it holds any of the adapter's tensors.

    ## Why is this bad?
    `Trainer._load_from_checkpoint` tries the full-weights files first, loads them with `strict=False`, and never
    calls the adapter loader. Training goes on from a freshly initialised adapter with the restored optimizer
    state: the loss jumps and the only trace is a "There were missing keys" log line.

    ## Example
    A callback saved `torch.save({}, "pytorch_model.bin")` (about 1.3 KB) into every LoRA checkpoint.

    ## Fix safety
    Safe: the stub is quarantined (moved, restorable with `ckptdoctor undo`), so the adapter loads. Nothing the
    adapter resume reads is touched.

    ## References
    `src/transformers/trainer.py` `_load_from_checkpoint` (branch order); ANATOMY H18 and "Stub shadowing".
    """
    for ck, _ in _checkpoints(tree):
        if not trainer_view.has_adapter(ck):
            continue
        stub = trainer_view.loaded_weight_file(ck)
        tensors = trainer_view.tensors_of(stub)
        if stub is None or tensors is None:
            continue
        adapter_names = adapter_tensor_names(ck)
        shared = [t for t in tensors if t.name in adapter_names or ".lora_" in t.name]
        if shared:
            continue
        adapter = ck.file(trainer_view.ADAPTER_SAFE) or ck.file(trainer_view.ADAPTER_BIN)
        target = f"`{ck.relname(adapter)}`" if adapter else "the adapter"
        kind = "a stub" if len(tensors) <= STUB_MAX_TENSORS else "a full model without adapter weights"
        msg = (
            f"`{stub.path}` holds {plural(len(tensors), 'tensor')} "
            f"({_fmt_bytes(stub.size)}), none of the adapter's, and would be loaded instead of {target} ({kind})"
        )
        plan = FixPlan(f"Quarantine `{stub.path}`", Applicability.SAFE, (FixOp(OpKind.QUARANTINE, stub.path),))
        yield Hit(stub.path, msg, fix=plan)


def _index_files(ck: Checkpoint) -> list[FileFacts]:
    return [f for f in (ck.file(trainer_view.SAFE_INDEX), ck.file(trainer_view.BIN_INDEX)) if f is not None]


@rule("CKD204", "missing-shard", Severity.ERROR)
def missing_shard(tree: Tree) -> Iterator[Hit]:
    """A shard index names a shard file that does not exist.

    ## What it does
    Reads `model.safetensors.index.json` / `pytorch_model.bin.index.json` and checks every shard it names exists.

    ## Why is this bad?
    A sharded resume (`load_sharded_checkpoint`) and `from_pretrained` fail with `FileNotFoundError` after start-up.

    ## Example
    `model-00002-of-00003.safetensors` lost in a partial copy.

    ## Fix safety
    No automatic fix: the tensor data is gone. Restore the shard or use an earlier checkpoint.

    ## References
    `src/transformers/trainer_utils.py` `load_sharded_checkpoint`.
    """
    for ck, _ in _checkpoints(tree):
        for idx in _index_files(ck):
            wm = trainer_view.weight_map(idx)
            if wm is None:
                continue
            counts = Counter(wm.values())
            for shard in sorted(counts):
                if ck.file(shard) is None:
                    n = counts[shard]
                    # The loader joins the name to the folder: `/x` or `../x` opens a file outside the checkpoint.
                    outside = shard.startswith("/") or ".." in shard.replace("\\", "/").split("/")
                    where = "a path outside the checkpoint folder" if outside else "which does not exist"
                    yield Hit(
                        idx.path,
                        f"`{ck.relname(idx)}` maps {plural(n, 'tensor')} to `{shard}`, {where}",
                    )


def _shard_contents(ck: Checkpoint, idx: FileFacts, wm: dict[str, str]) -> tuple[dict[str, list[TensorInfo]], bool]:
    """The tensors of every shard the index names or that sits beside it in the index's format (their own headers),
    and whether every one of them was readable."""
    suffix = ".safetensors" if idx.name == trainer_view.SAFE_INDEX else ".bin"
    on_disk = {
        ck.relname(f)
        for f in ck.files
        if "/" not in ck.relname(f) and _SHARD_RE.match(f.name) and f.name.endswith(suffix)
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
    content, complete = _shard_contents(ck, idx, wm)
    out = tuple(t for ts in content.values() for t in ts)
    if not complete or len({t.name for t in out}) != len(out):
        return None
    return out


@dataclass(frozen=True, slots=True)
class _IndexCheck:
    """What is wrong with a shard index against its shards' headers, and what it costs a load."""

    problems: list[str]
    lossy: bool  # some tensor is read by no loader (or a shard is unreadable, so that cannot be ruled out)
    misrouted: bool  # some entry names a shard that lacks its tensor (only a by-entry reader trips on it)
    rebuilt: str | None  # the corrected index text, when the shards allow a rebuild


def _index_problems(ck: Checkpoint, idx: FileFacts, wm: dict[str, str]) -> _IndexCheck:
    """Mismatches between an index and its shards' headers, whether they lose tensors, and the rebuilt index."""
    problems: list[str] = []
    shards = set(wm.values())
    content, complete = _shard_contents(ck, idx, wm)
    names_in = {shard: {t.name for t in tensors} for shard, tensors in content.items()}
    # The loaders (load_sharded_checkpoint, from_pretrained, accelerate) read every tensor of every shard the index
    # names, whatever the entries say: only a tensor outside those shards is never loaded.
    loaded = set().union(*(names_in[s] for s in shards if s in names_in))
    lossy = not complete
    misrouted = False
    for name, shard in sorted(wm.items()):
        if shard in names_in and name not in names_in[shard]:
            misrouted = True
            where = [s for s, held in names_in.items() if name in held]
            also = f" (it is in `{where[0]}`)" if where else ", and no shard does"
            problems.append(f"index maps `{name}` to `{shard}`, which does not hold it{also}")
            lossy = lossy or name not in loaded
    for shard, tensors in sorted(content.items()):
        extra = [t.name for t in tensors if t.name not in wm]
        if extra:
            problems.append(f"`{shard}` holds {plural(len(extra), 'tensor')} the index omits (e.g. `{extra[0]}`)")
        if shard not in shards:
            problems.append(f"`{shard}` is on disk but no index entry references it")
            lossy = lossy or any(t.name not in loaded for t in tensors)
    value: Any = idx.content.value if isinstance(idx.content, JsonFacts) else None
    meta = value.get("metadata") if isinstance(value, dict) else None
    declared = meta.get("total_size") if isinstance(meta, dict) else None
    if complete and all(s in content for s in shards):
        actual = sum(t.nbytes for s in shards for t in content[s])
        if isinstance(declared, int) and declared != actual:
            problems.append(f"total_size is {declared:,} but the indexed tensors span {actual:,} bytes")
    if not problems:
        return _IndexCheck(problems, lossy, misrouted, None)
    # Rebuild only when every shard on disk is readable and no tensor lives in two shards.
    names = [t.name for ts in content.values() for t in ts]
    if not complete or len(names) != len(set(names)) or not content:
        return _IndexCheck(problems, lossy, misrouted, None)
    new_map = {t.name: s for s, ts in content.items() for t in ts}
    new_meta: dict[str, Any] = dict(meta) if isinstance(meta, dict) else {}
    new_meta["total_size"] = sum(t.nbytes for ts in content.values() for t in ts)
    if "total_parameters" in new_meta:
        new_meta["total_parameters"] = sum(t.numel for ts in content.values() for t in ts)
    rebuilt = dict(value) if isinstance(value, dict) else {}
    rebuilt["metadata"] = new_meta
    rebuilt["weight_map"] = new_map
    return _IndexCheck(problems, lossy, misrouted, json.dumps(rebuilt, indent=2, sort_keys=True) + "\n")


@rule("CKD205", "shard-index-mismatch", Severity.ERROR, fix="safe")
def shard_index_mismatch(tree: Tree) -> Iterator[Hit]:
    """A shard index disagrees with the shards' own headers.

    ## What it does
    Compares `weight_map` with the tensors each shard really holds: a tensor mapped to a shard that lacks it, a
    shard holding tensors the index omits, a shard on disk no entry references, or a wrong `total_size`. An error
    when a tensor would not be loaded; a warning when the index is wrong but every tensor still loads.

    ## Why is this bad?
    The loaders take only the list of shard files from the index, then load every tensor of each of those files
    by the file's own header: `load_sharded_checkpoint` (a Trainer resume, `strict=False`), `from_pretrained` and
    accelerate's `load_checkpoint_in_model`. A shard that no entry names is never read, so its tensors keep their
    fresh values and no loader raises (the Trainer does not even warn). Measured with transformers 5.23 and
    accelerate 1.15 on a sharded Llama:

    | the index | resume | `from_pretrained` | accelerate |
    | --- | --- | --- | --- |
    | entries swapped, or naming another named shard | all loaded | all loaded (disk offload raises) | all loaded |
    | a shard no entry names | fresh, no warning | fresh, warns | fresh, no warning |
    | an entry missing, its shard named by others | all loaded, warns "missing keys" | all loaded | all loaded |
    | an entry for a tensor no shard holds | fresh if the model has it, no warning | fresh, warns | fresh |

    The first and third rows, and a wrong `total_size` alone (no loader reads it), are warnings: every tensor still
    loads, though with disk offload `from_pretrained` looks tensors up by entry and raises `SafetensorError` on the
    first row. The others are errors, and so is an unreadable shard (nothing shows its tensors are loaded).

    ## Example
    An index hand-edited after re-sharding, still mapping `lm_head.weight` to `model-00001-of-00002.safetensors`
    while no entry names `model-00002-of-00002.safetensors`, the shard that holds it.

    ## Fix safety
    Safe when the shards are complete and disjoint: the index is rebuilt from the shard headers (the original kept
    in quarantine). Nothing else changes.

    ## References
    `src/transformers/trainer_utils.py` `load_sharded_checkpoint`; `utils/hub.py` `get_checkpoint_shard_files`;
    `modeling_utils.py` `_load_pretrained_model`; accelerate `utils/modeling.py` `load_checkpoint_in_model`;
    `huggingface_hub.split_torch_state_dict_into_shards`.
    """
    for ck, _ in _checkpoints(tree):
        for idx in _index_files(ck):
            wm = trainer_view.weight_map(idx)
            if wm is None:
                continue
            if any(ck.file(s) is None for s in set(wm.values())):
                continue  # CKD204 reports missing shards; a rebuild would drop their tensors
            check = _index_problems(ck, idx, wm)
            if not check.problems:
                continue
            plan = (
                FixPlan(
                    f"Rebuild `{idx.path}` from the shard headers",
                    Applicability.SAFE,
                    (FixOp(OpKind.REWRITE_JSON, idx.path, check.rebuilt),),
                )
                if check.rebuilt is not None
                else None
            )
            n = len(check.problems)
            msg = "; ".join(check.problems[:3]) + (f" (and {n - 3} more)" if n > 3 else "")
            if check.lossy:
                yield Hit(idx.path, msg, Severity.ERROR, fix=plan)
                continue
            offload = " (`from_pretrained` offloading to disk reads by entry and raises)" if check.misrouted else ""
            msg += (
                "; resume and `from_pretrained` still load every tensor, because they read every shard the index "
                f"names{offload}"
            )
            yield Hit(idx.path, msg, Severity.WARNING, fix=plan)


def _signature(ts: tuple[TensorInfo, ...]) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {t.name: (t.dtype, t.shape) for t in ts}


@rule("CKD206", "conflicting-weights-files", Severity.WARNING)
def conflicting_weights_files(tree: Tree) -> Iterator[Hit]:
    """Several full-weight forms sit in one folder and differ; only one of them is loaded.

    ## What it does
    Finds folders holding more than one of `model.safetensors`, `pytorch_model.bin` and a shard index, compares
    their tensor names, dtypes and shapes, and says which one the Trainer loads.

    ## Why is this bad?
    The Trainer loads `model.safetensors`, else `pytorch_model.bin`, and a sharded set only when neither single
    file exists: a stale single file left by an older save beats a newer sharded set, silently.

    ## Example
    A folder re-saved with sharding that still holds the old `model.safetensors`.

    ## Fix safety
    No automatic fix: decide which form is current and quarantine the other.

    ## References
    `src/transformers/trainer.py` `_load_from_checkpoint`; ANATOMY H5, H18.
    """
    for ck, _ in _checkpoints(tree):
        present = sum(ck.file(rel) is not None for rel in (trainer_view.SAFE_WEIGHTS, trainer_view.BIN_WEIGHTS))
        if present + len(_index_files(ck)) < 2:
            continue  # one form: nothing to compare (its signature would walk every shard's header)
        forms: list[tuple[str, dict[str, tuple[str, tuple[int, ...]]] | None]] = []
        for rel in (trainer_view.SAFE_WEIGHTS, trainer_view.BIN_WEIGHTS):
            f = ck.file(rel)
            if f is not None:
                ts = trainer_view.tensors_of(f)
                forms.append((rel, _signature(ts) if ts is not None else None))
        for idx in _index_files(ck):
            wm = trainer_view.weight_map(idx)
            if wm is None:
                forms.append((idx.name, None))
                continue
            sig: dict[str, tuple[str, tuple[int, ...]]] = {}
            for shard in set(wm.values()):
                ts = trainer_view.tensors_of(ck.file(shard))
                if ts:
                    sig.update(_signature(ts))
            forms.append((idx.name, sig))
        if len(forms) < 2:
            continue
        loaded = forms[0][0]
        sigs = [s for _, s in forms]
        if all(s is not None for s in sigs) and all(s == sigs[0] for s in sigs):
            continue
        others = ", ".join(f"`{name}`" for name, _ in forms[1:])
        yield Hit(
            ck.path, f"holds {len(forms)} differing full-weight forms; a resume loads `{loaded}` and ignores {others}"
        )


@rule("CKD207", "prefixed-state-dict-keys", Severity.WARNING)
def prefixed_state_dict_keys(tree: Tree) -> Iterator[Hit]:
    """Every key of a weights file starts with `_orig_mod.` (torch.compile) or `module.` (DDP).

    ## What it does
    Checks the full-weights file a resume loads for keys that all carry a wrapper's prefix.

    ## Why is this bad?
    The Trainer loads full weights with `strict=False`: prefixed keys match no parameter, so the resume
    "succeeds" with fresh weights and only missing/unexpected-key warnings.

    ## Example
    A state dict saved from `torch.compile(model)` (`_orig_mod.transformer.h.0...`).

    ## Fix safety
    No automatic fix yet (it would rewrite tensor files); strip the prefix when saving.

    ## References
    `src/transformers/trainer.py` `_load_from_checkpoint` (`load_state_dict(state_dict, False)`); ANATOMY
    "Silent fresh weights".
    """
    for ck, _ in _checkpoints(tree):
        f = trainer_view.loaded_weight_file(ck)
        ts = trainer_view.tensors_of(f)
        if f is None or not ts:
            continue
        for prefix in ("_orig_mod.", "module."):
            if all(t.name.startswith(prefix) for t in ts):
                keys = "its only key starts" if len(ts) == 1 else f"all {len(ts):,} keys start"
                yield Hit(f.path, f"{keys} with `{prefix}`, so a strict=False load matches none")
                break


_EMBED_RE = re.compile(r"(embed_tokens|wte|word_embeddings|tok_embeddings|embed)\.weight$")
_LAYER_RE = re.compile(r"\.(?:layers|h|layer|blocks)\.(\d+)\.")


# Every checkpoint of a run holds the same tensor names: match each name once, not once per checkpoint.
@functools.lru_cache(maxsize=1 << 16)
def _is_embedding(name: str) -> bool:
    return _EMBED_RE.search(name) is not None


@functools.lru_cache(maxsize=1 << 16)
def _layer_index(name: str) -> int | None:
    m = _LAYER_RE.search(name)
    return None if m is None else int(m.group(1))


def _config(ck: Checkpoint) -> dict[str, Any] | None:
    f = ck.file("config.json")
    if f is not None and isinstance(f.content, JsonFacts) and isinstance(f.content.value, dict):
        return f.content.value
    return None


def _all_weight_tensors(ck: Checkpoint) -> list[TensorInfo]:
    out: list[TensorInfo] = []
    for f in ck.files:
        rel = ck.relname(f)
        if rel in trainer_view.FULL_WEIGHT_FILES or (_SHARD_RE.match(rel) is not None):
            out.extend(trainer_view.tensors_of(f) or ())
    return out


@rule("CKD208", "config-shape-mismatch", Severity.WARNING)
def config_shape_mismatch(tree: Tree) -> Iterator[Hit]:
    """`config.json` sizes disagree with the tensor shapes in the weights.

    ## What it does
    Compares `vocab_size` and `hidden_size` with the embedding matrix, and `num_hidden_layers` with the layer
    indices in tensor names.

    ## Why is this bad?
    A resume does not read these sizes and goes on, but `from_pretrained` of the same folder fails with a size
    mismatch: the checkpoint is broken for deployment and evaluation.

    ## Example
    `vocab_size` bumped in `config.json` after `resize_token_embeddings` was not saved.

    ## Fix safety
    No automatic fix: which side is right depends on what you trained.

    ## References
    `PreTrainedModel.from_pretrained` size checks; ANATOMY "What resume does not read".
    """
    for ck, _ in _checkpoints(tree):
        cfg = _config(ck)
        tensors = _all_weight_tensors(ck)
        if cfg is None or not tensors:
            continue
        cfg_path = ck.file("config.json")
        assert cfg_path is not None
        problems: list[str] = []
        embeds = [t for t in tensors if _is_embedding(t.name) and len(t.shape) == 2]
        if embeds:
            e = embeds[0]
            vocab, hidden = cfg.get("vocab_size"), cfg.get("hidden_size", cfg.get("n_embd", cfg.get("d_model")))
            if isinstance(vocab, int) and vocab != e.shape[0]:
                problems.append(f"vocab_size {vocab} but `{e.name}` has {e.shape[0]} rows")
            if isinstance(hidden, int) and hidden != e.shape[1]:
                problems.append(f"hidden_size {hidden} but `{e.name}` has {e.shape[1]} columns")
        layers = {i for t in tensors if (i := _layer_index(t.name)) is not None}
        n_layers = cfg.get("num_hidden_layers", cfg.get("n_layer", cfg.get("num_layers")))
        if layers and isinstance(n_layers, int) and n_layers != max(layers) + 1:
            problems.append(f"num_hidden_layers {n_layers} but the weights hold {max(layers) + 1} layers")
        if problems:
            yield Hit(cfg_path.path, "; ".join(problems))


@rule("CKD210", "empty-weights-file", Severity.ERROR)
def empty_weights_file(tree: Tree) -> Iterator[Hit]:
    """The weights or adapter file a resume loads holds no tensors, or only empty ones.

    ## What it does
    Checks the file the Trainer's weight branch loads (full weights, or the adapter) for tensors with data.

    ## Why is this bad?
    An adapter file with no tensors resumes from a fresh adapter with no warning at all; an empty full-weights
    file resumes from the initial weights with only a missing-keys warning. DeepSpeed ZeRO-3 without
    `stage3_gather_16bit_weights_on_model_save` writes exactly this.

    ## Example
    `adapter_model.safetensors` of 40 bytes next to `global_step500/` holding the real partitions.

    ## Fix safety
    No automatic fix: consolidate the weights (e.g. `zero_to_fp32.py`) or resume with the backend that wrote them.

    ## References
    `src/transformers/trainer.py` `_load_from_checkpoint`; deepspeedai/DeepSpeed#7900; huggingface/trl#4416.
    """
    for ck, _ in _checkpoints(tree):
        branch = trainer_view.weights_branch(ck)
        if branch == "full" and not trainer_view.has_adapter(ck):
            files = [trainer_view.loaded_weight_file(ck)]
        elif branch == "adapter":
            files = [ck.file(trainer_view.ADAPTER_SAFE) or ck.file(trainer_view.ADAPTER_BIN)]
        else:
            continue
        for f in files:
            ts = trainer_view.tensors_of(f)
            if f is None or ts is None:
                continue
            if not ts or all(t.numel == 0 for t in ts):
                what = "no tensors" if not ts else f"{plural(len(ts), 'tensor')}, all of them empty"
                yield Hit(f.path, f"`{ck.relname(f)}` holds {what} ({_fmt_bytes(f.size)}): a resume loads nothing")
