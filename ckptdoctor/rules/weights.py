"""Weights rules: what a resume would load, whether it is what the run trained, whether its files can be read at all,
and (``--deep``) what their tensor data holds."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from typing import Any

from ckptdoctor import trainer_view
from ckptdoctor.facts import PATH_KINDS, SHARD_RE, UNSUPPORTED_FORMATS, is_lora_b, plural, shard_contents
from ckptdoctor.findings import Applicability, FixOp, FixPlan, OpKind, Severity
from ckptdoctor.model import (
    Checkpoint,
    FileData,
    FileFacts,
    FileKind,
    FolderRole,
    JsonFacts,
    ProblemKind,
    TensorData,
    TensorInfo,
    Tree,
    frozen,
)
from ckptdoctor.patterns import lazy
from ckptdoctor.rules import Hit, rule

STUB_MAX_TENSORS = 8  # "a few": more than this and it is a real (if wrong) model file, still reported


def _checkpoints(tree: Tree) -> Iterator[tuple[Checkpoint, bool]]:
    """Every checkpoint-like folder with whether resume would (or the user will) load it."""
    for run in tree.runs:
        for ck in run.checkpoints:
            if ck.role in (FolderRole.CHECKPOINT, FolderRole.MODEL):
                yield ck, run.resume_pick == ck.path or run.standalone


def _fmt_bytes(n: int) -> str:
    return plural(n, "byte")


@rule("CKD201", "stub-weights-shadow-adapter", Severity.ERROR, fix=Applicability.SAFE, superseded_by_gate=True)
def stub_weights_shadow_adapter(tree: Tree) -> Iterator[Hit]:
    """A full-weights file beside adapter files is loaded instead of them and does not restore every adapter tensor.

    ## What it does
    In a folder with `adapter_model.safetensors` / `adapter_model.bin`, takes the full-weights file the resume
    loads (`model.safetensors`, else `pytorch_model.bin`) and counts the adapter tensors it restores: the
    PeftModel's adapter parameters (the adapter files' keys with the adapter name `default` put back, as peft loads
    them) whose exact name the file holds. Reports "restores N of M adapter tensors" when N is below M. The
    adapter files are the evidence that the Trainer holds a PeftModel, as they are for the resume's adapter branch
    (a model with transformers-native adapters, `model.add_adapter`, has the base model's names instead).

    ## Why is this bad?
    `Trainer._load_from_checkpoint` tries the full-weights files first, loads them into the PeftModel with
    `load_state_dict(state_dict, False)`, and never calls the adapter loader. An adapter tensor the file does not
    hold under its exact PeftModel name keeps its fresh initialisation (LoRA B: zeros) while the optimizer state is
    restored: the loss jumps and the only trace is a "There were missing keys" log line.

    ## Example
    A callback saved `torch.save({}, "pytorch_model.bin")` (about 1.3 KB) into every LoRA checkpoint; or
    `peft_model.get_base_model().save_pretrained(ckpt)`, whose `model.safetensors` holds the LoRA weights as
    `model.layers.0.self_attn.q_proj.lora_A.default.weight` where the PeftModel's parameter is
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight` (0 of them restored). A
    `torch.save(peft_model.state_dict(), "pytorch_model.bin")` holds the PeftModel's own names and is silent.

    ## Fix safety
    Safe: the file is quarantined (moved, restorable with `ckptdoctor undo`), so the adapter loads. Nothing the
    adapter resume reads is touched.

    ## References
    `src/transformers/trainer.py` `Trainer._load_from_checkpoint` (the full-weights branch comes before the PEFT
    `load_adapter` branch and loads with `load_state_dict(state_dict, False)`), `Trainer._issue_warnings_after_load`;
    `src/peft/utils/save_and_load.py` `set_peft_model_state_dict` and `get_peft_model_state_dict` (the adapter
    name removed on save and put back on load).
    """
    for ck, _ in _checkpoints(tree):
        found = trainer_view.adapter_restore(ck)
        if found is not None and not found.complete:
            yield adapter_restore_hit(ck, found)


def adapter_restore_hit(ck: Checkpoint, found: trainer_view.AdapterRestore) -> Hit:
    """CKD201's finding for ``found``, the incomplete restore of ``ck``'s adapter by the full-weights file the
    resume loads (the scan asks with ``model.safetensors`` first; the gate with the file its transformers reads)."""
    stub = found.file
    adapter = ck.file(trainer_view.ADAPTER_SAFE) or ck.file(trainer_view.ADAPTER_BIN)
    target = f"`{ck.relname(adapter)}`" if adapter else "the adapter"
    if found.foreign:
        kind = f"its adapter tensors are named like `{found.foreign[0]}`, not as the PeftModel's parameters"
    elif found.restored:
        kind = "it holds only some of the adapter's tensors"
    else:
        kind = "a stub" if found.tensors <= STUB_MAX_TENSORS else "a full model without adapter weights"
    msg = (
        f"`{stub.path}` holds {plural(found.tensors, 'tensor')} ({_fmt_bytes(stub.size)}) and would be loaded "
        f"instead of {target}: it restores {found.restored:,} of {plural(found.total, 'adapter tensor')} ({kind})"
    )
    plan = FixPlan(f"Quarantine `{stub.path}`", Applicability.SAFE, (FixOp(OpKind.QUARANTINE, stub.path),))
    return Hit(stub.path, msg, fix=plan)


# What a reader could not read in a weights, torch or JSON file. Every read problem reaches the user through
# exactly one rule: paths no one could open CKD001, malformed pickles CKD603, evasion layouts CKD605, the rest
# CKD202, CKD203 or CKD211 by the file's format.
_TORCH_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".distcp")
# Other frameworks' files, read by their own readers and judged by CKD215 (and CKD204, CKD107 for TF bundles).
_FORMAT_NAMES = {
    FileKind.MINDSPORE: "MindSpore checkpoint",
    FileKind.TF_INDEX: "TensorFlow bundle index",
    FileKind.TF_DATA: "TensorFlow data shard",
    FileKind.TF_CHECKPOINT_STATE: "TensorFlow `checkpoint` state",
    FileKind.HDF5: "HDF5 file",
}
_FRAMEWORK_KINDS = frozenset(_FORMAT_NAMES)
# Zip-based formats of other stacks that ckptdoctor does not read (a Keras 3 `.keras` archive, numpy's `.npz`).
_UNSUPPORTED_ZIPS = (".keras", ".npz")
# JSON files whose corruption has its own rule elsewhere (CKD402, CKD301).
_JSON_OWNED = ("trainer_state.json", "adapter_config.json")


def _family(f: FileFacts) -> str:
    """Which format family a file belongs to, by content when it was recognised, else by name."""
    if f.kind in _FRAMEWORK_KINDS:
        return "framework"
    if f.kind == FileKind.EMPTY and f.name.lower() == trainer_view.MS_WEIGHTS:
        return "framework"  # zero bytes is a MindSpore `Checkpoint` with no values (CKD210), not a torch archive
    if f.name.lower().endswith(_UNSUPPORTED_ZIPS):
        return "other"  # a zip of another format (CKD216 names it), not a torch archive
    if f.kind == FileKind.SAFETENSORS:
        return "safetensors"
    if f.kind in (FileKind.TORCH_ZIP, FileKind.TORCH_LEGACY, FileKind.DCP_DATA):
        return "torch"
    if f.kind in (FileKind.PICKLE, FileKind.DCP_METADATA):
        return "pickle"
    if f.kind == FileKind.JSON:
        return "json"
    name = f.name.lower()
    if name.endswith(".safetensors"):
        return "safetensors"
    if name.endswith(_TORCH_SUFFIXES):
        return "torch"
    if name.endswith(".json"):
        return "json"
    return "other"


_UNREAD = (
    Severity.WARNING,
    "no resume opens it: a side file in a Trainer checkpoint folder",
)


def _unread_side_files(tree: Tree) -> dict[str, str]:
    """Files of Trainer checkpoint folders that no resume opens (``trainer_view.resume_reads``), each with its path
    relative to its folder: damage there stops no resume, so it is the file's finding, not the checkpoint's."""
    out: dict[str, str] = {}
    for run in tree.runs:
        for ck in run.checkpoints:
            if ck.role is FolderRole.CHECKPOINT:
                for f in ck.files:
                    rel = ck.relname(f)
                    if not trainer_view.resume_reads(ck, rel):
                        out[f.path] = rel
    return out


def _corrupt_hits(tree: Tree, family: str) -> Iterator[Hit]:
    """CKD202/CKD203: each problem of each file of ``family``; a warning with a quarantine of the file alone when no
    resume opens it, an error otherwise."""
    unread: dict[str, str] | None = None  # looked up once a file has something to report (most trees: never)
    for f in tree.all_files():
        if not (f.problems or f.kind == FileKind.EMPTY) or _family(f) != family:  # a clean file: passed over at once
            continue
        if unread is None:
            unread = _unread_side_files(tree)
        rel = unread.get(f.path)
        plan = None if rel is None else FixPlan(
            f"Quarantine `{f.path}`", Applicability.SAFE, (FixOp(OpKind.QUARANTINE, f.path),)
        )
        for msg in _problems(f):
            if rel is None:
                yield Hit(f.path, msg)
            else:
                yield Hit(f.path, f"{msg} (no resume opens `{rel}`)", _UNREAD[0], plan)


def _problems(f: FileFacts) -> Iterator[str]:
    for p in f.problems:
        if p.kind not in PATH_KINDS and p.kind not in (ProblemKind.MALFORMED_PICKLE, ProblemKind.SUSPICIOUS_ARCHIVE):
            yield p.message
    if f.kind == FileKind.EMPTY and _family(f) in ("safetensors", "torch", "json"):
        yield f"`{f.path}` is empty (0 bytes)"


@rule("CKD202", "corrupt-safetensors", Severity.ERROR, fix=Applicability.SAFE, severity_when=(_UNREAD,))
def corrupt_safetensors(tree: Tree) -> Iterator[Hit]:
    """A safetensors file that the safetensors library would refuse to open.

    ## What it does
    Checks every `.safetensors` file the way `safetensors` itself validates it: header length, JSON header,
    known dtypes, offsets contiguous with no holes or overlaps, shape × itemsize = byte span, and a file size that
    covers the data exactly.

    ## Why is this bad?
    `safetensors.torch.load_file` raises (`SafetensorError: ... header too small`, `incomplete metadata`), so the
    resume crashes after minutes of start-up, or a loader that skips the file trains from fresh weights.

    ## Example
    A `model-00002-of-00003.safetensors` copied while still being written: 1,048,576 bytes shorter than its header
    declares.

    A file in a `checkpoint-N` folder that no resume opens (`ema_backup.safetensors` beside `model.safetensors`)
    is a warning: the resume does not meet it, and the checkpoint stays usable.

    ## Fix safety
    Safe for a file no resume opens: that file alone is quarantined (restorable with `ckptdoctor undo`), and the
    checkpoint keeps what the resume loads. Otherwise no automatic fix: tensor data cannot be invented. Restore the
    file from a copy, or resume from an earlier checkpoint (quarantining this one with `ckptdoctor fix` when it is
    the one resume would pick).

    ## References
    safetensors `safetensors/src/tensor.rs` (`SafeTensors::read_metadata`, `Metadata::validate`: the checks its
    loader makes before any tensor is read).
    """
    yield from _corrupt_hits(tree, "safetensors")


@rule("CKD203", "corrupt-torch-archive", Severity.ERROR, fix=Applicability.SAFE, severity_when=(_UNREAD,))
def corrupt_torch_archive(tree: Tree) -> Iterator[Hit]:
    """A `torch.save` file (`.bin`, `.pt`, `.pth`) that `torch.load` would refuse: broken zip, missing or short
    storage records, truncated legacy file.

    ## What it does
    Reads the zip central directory and walks the pickle statically, checking every storage record the pickle
    references exists with the size its tensor needs.

    ## Why is this bad?
    `torch.load` raises (`failed finding central directory`, `failed locating file data/0`, `record size ... does
    not match`), and the resume stops after the model was already partly restored.

    ## Example
    An `optimizer.pt` truncated by a full disk.

    A file in a `checkpoint-N` folder that no resume opens (`training_args.bin`, a callback's `ema.pt`) is a
    warning: the resume does not meet it.

    ## Fix safety
    Safe for a file no resume opens: that file alone is quarantined (restorable with `ckptdoctor undo`). Otherwise
    no automatic fix: restore the file or resume from an earlier checkpoint.

    ## References
    `torch/serialization.py` (`_load`, `_save`), `caffe2/serialize/inline_container.cc`; `src/transformers/trainer.py`
    `_load_from_checkpoint`, `_load_optimizer_and_scheduler`, `_load_rng_state` (the files a resume opens).
    """
    yield from _corrupt_hits(tree, "torch")


def _index_files(ck: Checkpoint) -> list[FileFacts]:
    return [f for f in (ck.file(trainer_view.SAFE_INDEX), ck.file(trainer_view.BIN_INDEX)) if f is not None]


@rule("CKD204", "missing-shard", Severity.ERROR)
def missing_shard(tree: Tree) -> Iterator[Hit]:
    """A shard index names a shard file that does not exist.

    ## What it does
    Reads `model.safetensors.index.json` / `pytorch_model.bin.index.json` and checks every shard it names exists;
    for a TensorFlow bundle, checks that every data shard `ckpt-N.index` places tensors in
    (`ckpt-N.data-0000K-of-0000M`) exists.

    ## Why is this bad?
    A sharded resume (`load_sharded_checkpoint`) and `from_pretrained` fail with `FileNotFoundError` after start-up;
    TensorFlow's `Checkpoint.restore` fails with `NotFoundError` on the missing data file.

    ## Example
    `model-00002-of-00003.safetensors` lost in a partial copy.

    ## Fix safety
    No automatic fix: the tensor data is gone. Restore the shard or use an earlier checkpoint.

    ## References
    `src/transformers/trainer_utils.py` `load_sharded_checkpoint`; TensorFlow
    `tensorflow/core/util/tensor_bundle/tensor_bundle.cc` (`BundleReader`, `DataFilename`).
    """
    for sp in tree.tf_shard_problems:
        if sp.problem.kind is ProblemKind.MALFORMED:  # a shard the index places tensors in is absent
            yield Hit(sp.index, sp.problem.message)
    for ck, _ in _checkpoints(tree):
        for idx in _index_files(ck):
            wm = trainer_view.weight_map(idx)
            if wm is None:
                continue
            counts = trainer_view.shard_counts(wm)
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


@frozen
class _IndexCheck:
    """What is wrong with a shard index against its shards' headers, and what it costs a load."""

    problems: list[str]
    lossy: bool  # some tensor is read by no loader (or a shard is unreadable, so that cannot be ruled out)
    misrouted: bool  # some entry names a shard that lacks its tensor (only a by-entry reader trips on it)
    rebuilt: str | None  # the corrected index text, when the shards allow a rebuild


def _index_problems(ck: Checkpoint, idx: FileFacts, wm: dict[str, str]) -> _IndexCheck:
    """Mismatches between an index and its shards' headers, whether they lose tensors, and the rebuilt index."""
    content, complete = shard_contents(ck, idx, wm)
    # a pure function of the index's map and value and of the shards' names and headers: the checkpoints of a run
    # hand the same objects when their files are alike, and are checked once
    return _index_check((wm, idx.content, complete, *content, *content.values()))


@trainer_view.per_parts
def _index_check(parts: tuple[Any, ...]) -> _IndexCheck:
    wm, idx_content, complete = parts[:3]
    shard_names = parts[3 : 3 + (len(parts) - 3) // 2]
    content: dict[str, tuple[TensorInfo, ...]] = dict(zip(shard_names, parts[3 + len(shard_names) :], strict=True))
    problems: list[str] = []
    shards = set(wm.values())
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
    value: Any = idx_content.value if isinstance(idx_content, JsonFacts) else None
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


@rule(
    "CKD205",
    "shard-index-mismatch",
    Severity.ERROR,
    fix=Applicability.SAFE,
    severity_when=((Severity.WARNING, "every tensor still loads: only routing or total_size is wrong"),),
)
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
            if any(ck.file(s) is None for s in trainer_view.shard_counts(wm)):
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
    their tensor names, dtypes and shapes, and says which one the Trainer loads. With `--deep`, forms alike in all
    of those are compared by value too (a digest of each tensor's bytes, read only in such folders).

    ## Why is this bad?
    The Trainer loads `model.safetensors`, else `pytorch_model.bin`, and a sharded set only when neither single
    file exists: a stale single file left by an older save beats a newer sharded set, silently. Two forms with
    the same names and shapes can still hold different steps' weights: whoever reads the other one (an export,
    an evaluation script, a tool that prefers `.bin`) gets another model than the resume.

    ## Example
    A folder re-saved with sharding that still holds the old `model.safetensors`; or a `pytorch_model.bin` copied
    from step 4 beside step 8's `model.safetensors` (same names and shapes: only `--deep` tells them apart).

    ## Fix safety
    No automatic fix: decide which form is current and quarantine the other.

    ## References
    `src/transformers/trainer.py` `Trainer._load_from_checkpoint` (`model.safetensors`, else `pytorch_model.bin`,
    else `load_sharded_checkpoint`); `src/transformers/modeling_utils.py` `PreTrainedModel.save_pretrained` (its
    clean-up removes only stale `-NNNNN-of-NNNNN` shards, so an older single file survives a sharded re-save).
    """
    data = {d.path: d for d in tree.data}
    for ck, _ in _checkpoints(tree):
        forms = trainer_view.competing_weight_forms(ck)
        if not forms:
            continue
        sigs = [_form_signature(name, files) for name, files in forms]
        loaded, others = forms[0][0], ", ".join(f"`{name}`" for name, _ in forms[1:])
        if not (all(s is not None for s in sigs) and all(s == sigs[0] for s in sigs)):
            yield Hit(
                ck.path,
                f"holds {len(forms)} differing full-weight forms; a resume loads `{loaded}` and ignores {others}",
            )
            continue
        values = [_form_values(files, data) for _, files in forms]
        shared = set.intersection(*(set(v) for v in values))
        differ = sorted(n for n in shared if len({v[n] for v in values}) > 1)
        if differ:
            yield Hit(
                ck.path,
                f"holds {len(forms)} full-weight forms with the same tensor names, dtypes and shapes but different "
                f"values ({len(differ):,} of {plural(len(shared), 'tensor')} compared differ, e.g. `{differ[0]}`); "
                f"a resume loads `{loaded}` and ignores {others}",
            )


def _form_signature(name: str, files: tuple[FileFacts, ...] | None) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """Names, dtypes and shapes of a weights form's tensors: None when its single file, or its index, cannot be
    read; a shard that cannot be read is left out (CKD202/CKD203 report it), the others still compare."""
    if files is None:
        return None
    if name in trainer_view.FULL_WEIGHT_FILES:
        ts = trainer_view.tensors_of(files[0])
        return None if ts is None else _signature(ts)
    sig: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in files:
        ts = trainer_view.tensors_of(f)
        if ts:
            sig.update(_signature(ts))
    return sig


def _form_values(files: tuple[FileFacts, ...] | None, data: dict[str, FileData]) -> dict[str, str]:
    """Each tensor's value digest in a weights form (``--deep``), for the tensors that have one."""
    out: dict[str, str] = {}
    for f in files or ():
        d = data.get(f.path)
        if d is not None:
            out.update((t.name, t.digest) for t in d.tensors if t.digest is not None)
    return out


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
    `src/transformers/trainer.py` `Trainer._load_from_checkpoint` (`load_state_dict(state_dict, False)`),
    `Trainer._issue_warnings_after_load` (warnings only); the prefixes come from `torch/_dynamo/eval_frame.py`
    `OptimizedModule` (`_orig_mod`) and `torch/nn/parallel/distributed.py` `DistributedDataParallel` (`module`).
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
# The list of layers as each architecture names it; the leftmost match is the layer, so T5's `block.N.layer.M.`
# (block N, its sub-layer M: self-attention, cross-attention, feed-forward) counts blocks.
_LAYER_RE = re.compile(r"\.(?:layers|h|layer|blocks|block)\.(\d+)\.")
# The stack of an encoder-decoder model a tensor belongs to (`encoder.block.0.`, `model.decoder.layers.1.`).
_CODER_RE = lazy(r"(?:^|\.)(encoder|decoder)\.")


# Every checkpoint of a run holds the same tensor names: match each name once, not once per checkpoint.
@functools.lru_cache(maxsize=1 << 16)
def _is_embedding(name: str) -> bool:
    return _EMBED_RE.search(name) is not None


@functools.lru_cache(maxsize=1 << 16)
def _layer_index(name: str) -> int | None:
    m = _LAYER_RE.search(name)
    return None if m is None else int(m.group(1))


def _layer_count_problems(cfg: dict[str, Any], tensors: list[TensorInfo]) -> list[str]:
    """The layer counts of ``cfg`` that the tensor names contradict.

    A decoder-only or encoder-only model has one list of layers (`num_hidden_layers`, `n_layer` or `num_layers`).
    An encoder-decoder model (`is_encoder_decoder`) has two, counted apart: T5's `num_layers` and
    `num_decoder_layers` (`T5Config`), BART's `encoder_layers` and `decoder_layers` (`BartConfig`).
    """
    if cfg.get("is_encoder_decoder") is True:
        wanted = {
            "encoder": ("encoder_layers", "num_layers", "num_hidden_layers"),
            "decoder": ("decoder_layers", "num_decoder_layers", "num_layers", "num_hidden_layers"),
        }
        out = []
        for side, keys in wanted.items():
            layers = {
                i for t in tensors
                if (m := _CODER_RE.search(t.name)) and m.group(1) == side and (i := _layer_index(t.name)) is not None
            }
            key = next((k for k in keys if isinstance(cfg.get(k), int)), None)
            if layers and key is not None and cfg[key] != max(layers) + 1:
                out.append(f"{key} {cfg[key]} but the {side} weights hold {max(layers) + 1} layers")
        return out
    layers = {i for t in tensors if (i := _layer_index(t.name)) is not None}
    n_layers = cfg.get("num_hidden_layers", cfg.get("n_layer", cfg.get("num_layers")))
    if layers and isinstance(n_layers, int) and n_layers != max(layers) + 1:
        return [f"num_hidden_layers {n_layers} but the weights hold {max(layers) + 1} layers"]
    return []


_MINDNLP_WEIGHT_FILES = (*trainer_view.FULL_WEIGHT_FILES, trainer_view.MS_WEIGHTS)


def _config(ck: Checkpoint) -> dict[str, Any] | None:
    f = ck.file("config.json")
    if f is not None and isinstance(f.content, JsonFacts) and isinstance(f.content.value, dict):
        return f.content.value
    return None


def _all_weight_tensors(ck: Checkpoint) -> tuple[tuple[TensorInfo, ...], ...]:
    """The tensors of every full-weights file and shard (MindNLP's `mindspore_model.ckpt` too), file by file."""
    names = _MINDNLP_WEIGHT_FILES if trainer_view.is_mindnlp(ck) else trainer_view.FULL_WEIGHT_FILES
    out: list[tuple[TensorInfo, ...]] = []
    for rel, f in ck.entries():
        if rel in names or (SHARD_RE.match(rel) is not None):
            out.append(trainer_view.tensors_of(f) or ())
    return tuple(out)


@trainer_view.per_parts
def _config_problems(parts: tuple[Any, ...]) -> list[str]:
    """What ``config.json``'s value (``parts[0]``) says against the tensors of the weight files (the rest), in
    CKD208's words: once for a run's checkpoints that hold alike config and headers (the same objects)."""
    cfg = parts[0]
    tensors = [t for ts in parts[1:] for t in ts]
    problems: list[str] = []
    embeds = [t for t in tensors if _is_embedding(t.name) and len(t.shape) == 2]
    if embeds:
        e = embeds[0]
        vocab, hidden = cfg.get("vocab_size"), cfg.get("hidden_size", cfg.get("n_embd", cfg.get("d_model")))
        if isinstance(vocab, int) and vocab != e.shape[0]:
            problems.append(f"vocab_size {vocab} but `{e.name}` has {e.shape[0]} rows")
        if isinstance(hidden, int) and hidden != e.shape[1]:
            problems.append(f"hidden_size {hidden} but `{e.name}` has {e.shape[1]} columns")
    problems.extend(_layer_count_problems(cfg, tensors))
    return problems


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
    `src/transformers/core_model_loading.py` `set_param_for_module` (records shape mismatches) and
    `src/transformers/utils/loading_report.py` `log_state_dict_report` (raises unless `ignore_mismatched_sizes`),
    both under `PreTrainedModel.from_pretrained`; `src/transformers/trainer.py` `Trainer._load_from_checkpoint`
    reads `config.json` only for its `transformers_version`.
    """
    for ck, _ in _checkpoints(tree):
        cfg = _config(ck)
        files = _all_weight_tensors(ck)
        if cfg is None or not any(files):
            continue
        cfg_path = ck.file("config.json")
        assert cfg_path is not None
        problems = _config_problems((cfg, *files))
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
    `stage3_gather_16bit_weights_on_model_save` writes exactly this. A MindNLP `mindspore_model.ckpt` with no
    tensors (zero bytes is a valid, empty MindSpore checkpoint) makes the resume raise instead.

    ## Example
    `adapter_model.safetensors` of 40 bytes next to `global_step500/` holding the real partitions.

    ## Fix safety
    No automatic fix: consolidate the weights (e.g. `zero_to_fp32.py`) or resume with the backend that wrote them.

    ## References
    `src/transformers/trainer.py` `_load_from_checkpoint`; deepspeedai/DeepSpeed#7900; huggingface/trl#4416;
    `mindspore/train/serialization.py` `load_checkpoint` (the empty parameter dict check).
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
                # MindSpore refuses a file that yields no parameter; torch, safetensors and peft load nothing quietly
                outcome = (
                    "mindspore.load_checkpoint raises ValueError (\"The loaded parameter dict is empty\")"
                    if ck.relname(f) == trainer_view.MS_WEIGHTS and not ts
                    else "a resume loads nothing"
                )
                yield Hit(f.path, f"`{ck.relname(f)}` holds {what} ({_fmt_bytes(f.size)}): {outcome}")


@rule(
    "CKD211",
    "corrupt-json",
    Severity.ERROR,
    severity_when=((Severity.WARNING, "the file is neither `config.json` nor a shard index"),),
)
def corrupt_json(tree: Tree) -> Iterator[Hit]:
    """A JSON file a loader reads (`config.json`, a `*.index.json`, ...) that is not valid JSON or has duplicate
    keys.

    ## What it does
    Parses every `.json` file strictly (duplicate keys rejected, with line and column). `trainer_state.json` and
    `adapter_config.json` are reported by their own rules (CKD402, CKD301).

    ## Why is this bad?
    transformers parses `config.json` during every resume only to compare versions, yet a corrupt one aborts the
    resume; a broken shard index fails `from_pretrained` and sharded resumes. Duplicate keys silently keep the last
    value.

    ## Example
    `checkpoint-500/config.json` cut off mid-object by a crash (JSON files are written in place, not atomically).

    ## Fix safety
    No automatic fix in general; a shard index can be rebuilt from the shard headers (CKD205).

    ## References
    `src/transformers/trainer.py` `_load_from_checkpoint` (config check); `TrainerState.save_to_json`.
    """
    for f in tree.all_files():
        if (f.problems or f.kind == FileKind.EMPTY) and _family(f) == "json" and f.name not in _JSON_OWNED:
            sev = Severity.ERROR if f.name == "config.json" or f.name.endswith(".index.json") else Severity.WARNING
            for msg in _problems(f):
                yield Hit(f.path, msg, sev)

# Tensor-data rules (``--deep`` only): judgments on what ``ckptdoctor.deep`` measured in the bytes of each file.
_FLOATS = frozenset({"F16", "BF16", "F32", "F64"})
_EXAMPLES = 3


def _examples(names: list[str]) -> str:
    shown = ", ".join(names[:_EXAMPLES])
    return shown + (f" and {len(names) - _EXAMPLES} more" if len(names) > _EXAMPLES else "")


def _is_weights_file(name: str) -> bool:
    """Model or adapter weights (not optimizer/scheduler/RNG state, whose zeros are often legitimate)."""
    lower = name.lower()
    if lower.endswith(".safetensors"):
        return True
    return lower.endswith(".bin") and lower.startswith(("pytorch_model", "adapter_model", "model"))


@rule("CKD209", "nonfinite-weights", Severity.ERROR, deep_only=True)
def nonfinite_weights(tree: Tree) -> Iterator[Hit]:
    """A tensor holds NaN or Inf values.

    ## What it does
    With `--deep`, streams every floating-point tensor (F32, F64, F16, BF16) of every safetensors file and
    `torch.save` archive (weights, adapters, optimizer state) in bounded chunks and counts NaN and Inf values.

    ## Why is this bad?
    A NaN in a weight or in Adam's `exp_avg`/`exp_avg_sq` spreads to every activation and gradient on the first
    step after the resume: the loss turns NaN and every later checkpoint inherits it. Loading does not check the
    values, so the resume itself succeeds and the damage shows up only in the logs, if someone reads them.

    ## Example
    A checkpoint saved on the step a loss spike overflowed in fp16: `model.layers.3.mlp.up_proj.weight` holds
    NaN; resuming from it diverges at once, while the checkpoint before it is healthy.

    ## Fix safety
    No automatic fix: resume from an earlier checkpoint (and lower the learning rate or fix the overflow).

    ## References
    `src/transformers/trainer.py` `Trainer._load_from_checkpoint` (loads the values as stored) and
    `Trainer._inner_training_loop` (logs `grad_norm`, never checks saved weights); `torch.isfinite`.
    """
    for d in tree.data:
        bad = [t for t in d.tensors if t.nan or t.inf]
        if not bad:
            continue
        nan, inf = sum(t.nan for t in bad), sum(t.inf for t in bad)
        counts = " and ".join(p for p in (f"{nan:,} NaN" if nan else "", f"{inf:,} Inf" if inf else "") if p)
        names = [f"`{t.name}` ({_count(t)})" for t in bad]
        yield Hit(
            d.path, f"{len(bad)} of {len(d.tensors)} floating-point tensors hold {counts} values: {_examples(names)}"
        )


def _count(t: TensorData) -> str:
    parts = [f"{t.nan:,} NaN" if t.nan else "", f"{t.inf:,} Inf" if t.inf else ""]
    return ", ".join(p for p in parts if p) + f" of {t.numel:,}"


@rule("CKD212", "all-zero-tensor", Severity.WARNING, deep_only=True)
def all_zero_tensor(tree: Tree) -> Iterator[Hit]:
    """A weight matrix holds nothing but zeros.

    ## What it does
    With `--deep`, reports floating-point tensors of more than one element in model and adapter weights files
    whose every value is zero. Biases (often zero-initialized and legitimately zero) and LoRA B matrices
    (zero-initialized by design; see CKD303) are left out, as are optimizer, scheduler and RNG files.

    ## Why is this bad?
    A trained weight matrix is never exactly zero. All zeros mean the bytes were never written or were lost: a
    preallocated file a crashed writer never filled, a sharded (ZeRO-3/FSDP) parameter saved without being
    gathered, or a copy that wrote holes. The file loads without error and the model silently computes garbage.

    ## Example
    `model-00002-of-00004.safetensors` has a valid header but a copy tool left its data region as a sparse hole:
    every tensor in it reads as zeros.

    ## Fix safety
    No automatic fix: restore the file from the source, or resume from another checkpoint.

    ## References
    safetensors `safetensors/src/tensor.rs` (`SafeTensors::deserialize` checks offsets, never values);
    `src/transformers/trainer.py` `Trainer._load_from_checkpoint` (loads the values as stored).
    """
    for d in tree.data:
        if not _is_weights_file(d.path.rsplit("/", 1)[-1]):
            continue
        zero = [
            t
            for t in d.tensors
            if t.all_zero and t.numel > 1 and t.dtype in _FLOATS and not is_lora_b(t.name) and not _is_bias(t.name)
        ]
        if zero:
            names = [f"`{t.name}`" for t in zero]
            yield Hit(
                d.path, f"{len(zero)} of {len(d.tensors)} floating-point tensors are all zeros: {_examples(names)}"
            )


def _is_bias(name: str) -> bool:
    return name.rsplit(".", 1)[-1] == "bias" or name.endswith("_bias")


@rule("CKD213", "tensor-data-unreadable", Severity.WARNING, deep_only=True)
def tensor_data_unreadable(tree: Tree) -> Iterator[Hit]:
    """`--deep` could not read or decode some tensor data.

    ## What it does
    Reports files whose tensor bytes `--deep` could not stream (the file changed or vanished since its header
    was read, a storage record has no local header, the data ends early) and floating-point tensors in dtypes it
    does not decode yet (8-, 6- and 4-bit floats, complex, big-endian archives).

    ## Why is this bad?
    Those tensors were not checked for NaN, Inf or zeros: a clean `--deep` report does not cover them.

    ## Example
    A checkpoint still being written while it is scanned: `model.safetensors` grew between the header read and
    the data read.

    ## Fix safety
    Nothing to fix in the files by itself; rescan when writers are done. Structural damage is reported by the
    corrupt-file rules (CKD202, CKD203).

    ## References
    `ckptdoctor/deep.py` (the dtypes `--deep` decodes: F32, F64, F16, BF16); safetensors
    `safetensors/src/tensor.rs` `Dtype` (every dtype a file may declare).
    """
    for d in tree.data:
        if d.problems:
            yield Hit(d.path, "; ".join(p.message for p in d.problems[:_EXAMPLES]))
        if d.skipped:
            yield Hit(d.path, f"{len(d.skipped)} floating-point tensor(s) not checked: {_examples(list(d.skipped))}")


@rule(
    "CKD214",
    "checksum-mismatch",
    Severity.ERROR,
    deep_only=True,
    severity_when=((Severity.WARNING, "a file is on disk but not in the manifest"),),
)
def checksum_mismatch(tree: Tree) -> Iterator[Hit]:
    """A file's size or sha256 differs from the checksum manifest, or a listed file is missing.

    ## What it does
    With `--deep --checksums verify`, reads every file under the root whole, computes its sha256 and compares size
    and digest with `.ckptdoctor/manifest.json`, written earlier by `--deep --checksums write`. A file that differs
    or that the manifest lists but the tree lacks is an error; a file the manifest does not list is a warning. A
    manifest that cannot be read or does not follow `ckptdoctor.manifest/1` is reported at its own path.

    ## Why is this bad?
    A copy (rsync, `aws s3 cp`, a tape restore, a flaky network mount) can lose or flip bytes without any error. A
    flipped byte inside a tensor's data keeps every header valid: the checkpoint loads, and the resume continues
    from weights or optimizer moments that are not the ones that were saved. Only the content digest sees it.

    ## Example
    `ckptdoctor scan --deep --checksums write runs/a/checkpoint-500` on the training host, then, after copying
    the folder to the cluster, `ckptdoctor scan --deep --checksums verify checkpoint-500`:
    `model.safetensors` has the same size but a different sha256 because one byte changed in transit.

    ## Fix safety
    No automatic fix: copy the file again from the source and verify again. If the change was intended (for
    instance `ckptdoctor fix` rewrote a JSON file), write a new manifest.

    ## References
    CPython `Lib/hashlib.py` (`sha256`); GNU coreutils `sha256sum -c`, which does the same for a list of files
    without knowing checkpoints.
    """
    m = tree.manifest
    if m is None:
        return
    if m.problems:
        yield Hit(m.path, "the checksum manifest cannot be used: " + "; ".join(p.message for p in m.problems))
        return
    files = {f.path: f for f in tree.all_files() if f.kind != FileKind.SPECIAL}
    digests = {d.path: d.sha256 for d in tree.data}
    for e in m.entries:
        f = files.get(e.path)
        sha = digests.get(e.path)
        if f is None:
            yield Hit(e.path, f"listed in the checksum manifest ({e.size:,} bytes) but missing")
        elif f.size != e.size:
            yield Hit(e.path, f"{f.size:,} bytes where the checksum manifest recorded {e.size:,}")
        elif sha is not None and sha != e.sha256:
            # sha is None when the file could not be read whole: CKD213 reports that.
            yield Hit(e.path, f"sha256 `{sha[:16]}…` differs from `{e.sha256[:16]}…` in the checksum manifest")
    listed = {e.path for e in m.entries}
    for path, f in sorted(files.items()):
        if path not in listed:
            yield Hit(path, f"not listed in the checksum manifest ({f.size:,} bytes)", Severity.WARNING)


@rule("CKD215", "corrupt-framework-checkpoint", Severity.ERROR)
def corrupt_framework_checkpoint(tree: Tree) -> Iterator[Hit]:
    """A MindSpore `.ckpt`, TensorFlow bundle file or HDF5 (Keras) weights file that its framework would refuse.

    ## What it does
    Walks a MindSpore `.ckpt` (protobuf `Checkpoint`: every value's length, tag, dims, dtype and byte count), a
    TensorFlow `ckpt-N.index` (LevelDB-format table: footer, block crcs, every `BundleEntryProto`) and the text
    `checkpoint` state; checks every data shard `ckpt-N.data-*` is long enough for the entries the index places
    in it (with `--deep`, their crc32c too) and an HDF5 file's superblock and end-of-file address against its size.
    Nothing is loaded and no framework needs to be installed.

    ## Why is this bad?
    `mindspore.load_checkpoint` (MindNLP's resume of `mindspore_model.ckpt`) raises on a cut protobuf; TensorFlow's
    `Checkpoint.restore` raises `DataLossError` on a short or corrupt shard; h5py and Keras refuse a truncated
    `.h5` ("truncated file"). The resume stops, or a script that catches the error trains from fresh weights.

    ## Example
    `ckpt-3.data-00000-of-00001` cut to 100 bytes by a full disk; `tf_model.h5` copied while still being written.

    ## Fix safety
    No automatic fix: the bytes are gone. Restore the file, or resume from an earlier checkpoint.

    ## References
    `mindspore/train/serialization.py` (`load_checkpoint`, `_parse_ckpt_proto`); TensorFlow
    `tensorflow/core/util/tensor_bundle/tensor_bundle.cc` (`BundleReader`;
    `BundleReader::GetValue` fails with "Checksum does not match" on an entry's crc32c), `tensorflow/python/checkpoint/
    checkpoint_management.py`; the HDF5 File Format Specification, "Superblock" (End of File Address).
    """
    for f in tree.all_files():
        if f.kind in _FRAMEWORK_KINDS:
            what = _FORMAT_NAMES[f.kind]
            for msg in _problems(f):
                yield Hit(f.path, f"{what}: {msg}")
    for sp in tree.tf_shard_problems:
        if sp.problem.kind is not ProblemKind.MALFORMED:  # missing shards are CKD204's
            yield Hit(sp.shard, f"TensorFlow data shard: {sp.problem.message}")
    for d in tree.data:  # --deep: entries whose bytes fail the crc32c their index records
        if d.corrupt:
            yield Hit(d.path, "TensorFlow data shard: " + "; ".join(p.message for p in d.corrupt[:_EXAMPLES])
                      + (f" and {len(d.corrupt) - _EXAMPLES} more" if len(d.corrupt) > _EXAMPLES else ""))


_UNSUPPORTED_SUFFIXES = tuple(suffix for suffix, _ in UNSUPPORTED_FORMATS)


@rule("CKD216", "unsupported-checkpoint-format", Severity.INFO)
def unsupported_checkpoint_format(tree: Tree) -> Iterator[Hit]:
    """A file that looks like a checkpoint in a format ckptdoctor does not read, so nothing in it was checked.

    ## What it does
    Names files of checkpoint formats outside what ckptdoctor reads (safetensors, torch, MindSpore `.ckpt`,
    TensorFlow bundles, HDF5): GGUF, Flax `.msgpack`, Keras 3 `.keras`, ONNX, TensorFlow Lite and SavedModel,
    TensorFlow 1.x `.meta`, PaddlePaddle `.pdparams`/`.pdopt`. (numpy `.npy`/`.npz` files are read: their headers,
    and the pickled body of an object array, which the security rules judge.) Also names a tar or gzip/bz2/xz
    archive (not named as a torch file: CKD203 reports those) that could not be read to its end, an invalid tar
    header after the first or a corrupt compressed stream, since its members past that point were not checked.

    ## Why is this bad?
    It is not bad in itself: the finding says that a clean report covers the other files only, so a damaged file of
    this format would go unnoticed here.

    ## Example
    A Flax run's `flax_model.msgpack` beside its `config.json`.

    ## Fix safety
    Nothing to fix; check the file with its own framework's tools.

    ## References
    The formats' own loaders: llama.cpp `gguf-py/gguf/gguf_reader.py` (`GGUFReader`), flax
    `flax/serialization.py` (`msgpack_restore`), keras `keras/src/saving/saving_api.py` (`load_model`), onnx
    `onnx/__init__.py` (`load_model`), tensorflow `tensorflow/python/saved_model/load.py` (`load`), paddle
    `python/paddle/framework/io.py` (`load`); for archives, CPython `Lib/tarfile.py` (`TarFile.next`: an invalid
    header after the first ends the listing without an error) and `Lib/gzip.py` (`BadGzipFile`, `EOFError`).
    """
    for f in tree.all_files():
        lower = f.path.rsplit("/", 1)[-1].lower()  # its name (``FileFacts.name``, inline: per file)
        if lower.endswith(_UNSUPPORTED_SUFFIXES) and f.kind is not FileKind.EMPTY:  # one look for all the suffixes
            what = next(what for suffix, what in UNSUPPORTED_FORMATS if lower.endswith(suffix))
            yield Hit(f.path, f"{what} file: ckptdoctor does not read this format, so it was not checked")
        else:
            if f.kind is FileKind.ARCHIVE and _family(f) != "torch":
                for p in f.problems:
                    if p.kind is ProblemKind.MALFORMED:
                        yield Hit(f.path, f"archive read only in part ({p.message}): the members past it were not "
                                          "checked")  # fmt: skip


# The output embedding a causal LM head ties to its input embedding (`_tied_weights_keys` of the *ForCausalLM,
# *LMHeadModel and *ForConditionalGeneration classes: `lm_head.weight`; GPT-NeoX's `embed_out.weight`).
_HEAD_NAMES = ("lm_head.weight", "embed_out.weight")
_HEAD_SUFFIXES = tuple("." + h for h in _HEAD_NAMES)
_INPUT_EMBED_RE = lazy(r"(?:^|\.)(?:embed_tokens|wte|word_embeddings|tok_embeddings|embed_in|shared)\.weight$")
_LM_ARCH_SUFFIXES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
# Config classes whose `tie_word_embeddings` defaults to False (`src/transformers/models/<type>/configuration_*.py`);
# every other class keeps `PreTrainedConfig`'s default, True. Only read when `config.json` does not say: transformers
# writes the key whenever it differs from that base default (4.x `PretrainedConfig.to_diff_dict`), and always in 5.x.
_UNTIED_BY_DEFAULT = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi", "phi3", "gpt_neox", "stablelm",
    "olmo", "olmo2", "gptj", "granite", "deepseek_v3",
})


def _tie_word_embeddings(cfg: dict[str, Any]) -> tuple[bool, str]:
    """Whether ``cfg`` ties the LM head to the input embedding, and where that comes from (for the message)."""
    for where, sub in (("", cfg), ("text_config.", cfg.get("text_config"))):
        if isinstance(sub, dict) and isinstance(sub.get("tie_word_embeddings"), bool):
            value = "true" if sub["tie_word_embeddings"] else "false"
            return bool(sub["tie_word_embeddings"]), f"`{where}tie_word_embeddings` is {value}"
    model_type = cfg.get("model_type")
    if model_type in _UNTIED_BY_DEFAULT:
        return False, f"`tie_word_embeddings` is absent and `{model_type}` models default to untied"
    return True, "`tie_word_embeddings` defaults to true"


def _saved_weight_names(ck: Checkpoint) -> tuple[FileFacts, list[str]] | None:
    """The file that says which full-model tensors ``ck`` holds (the single weights file, else the shard index) and
    their names; None for adapter, FSDP, DeepSpeed-only and MindNLP folders, or when that file was not readable."""
    if trainer_view.is_mindnlp(ck) or trainer_view.has_adapter(ck):
        return None
    single = trainer_view.loaded_weight_file(ck)
    if single is not None:
        ts = trainer_view.tensors_of(single)
        return None if ts is None else (single, [t.name for t in ts])
    idx = ck.file(trainer_view.SAFE_INDEX) or ck.file(trainer_view.BIN_INDEX)
    wm = trainer_view.weight_map(idx) if idx is not None else None
    return None if idx is None or wm is None else (idx, list(wm))


@rule("CKD217", "untied-head-not-saved", Severity.ERROR)
def untied_head_not_saved(tree: Tree) -> Iterator[Hit]:
    """`config.json` says the LM head is not tied to the input embedding, but the weights hold no head.

    ## What it does
    For a causal or seq2seq language model (`architectures` ends in `ForCausalLM`, `LMHeadModel` or
    `ForConditionalGeneration`) whose `config.json` says `tie_word_embeddings: false` (at the top or in
    `text_config`; when the key is absent, the default of the model type's config class), checks that the weights
    (`model.safetensors`, `pytorch_model.bin`, or the shard index's `weight_map`) hold the output embedding
    `lm_head.weight` (GPT-NeoX: `embed_out.weight`) beside the input embedding.

    ## Why is this bad?
    The model was tied in memory when it was saved: `save_pretrained` keeps one tensor of each pair that shares
    storage and drops the other, so the head was not written. Its `config.json` now says the two are separate, so
    `from_pretrained` of this folder builds an untied model and initialises `lm_head.weight` at random (the only
    trace is a MISSING line in the load report), and a model built from this `config.json` has one parameter more
    than the optimizer state, so a resume with it raises at the optimizer load. Resuming with the script that wrote
    it works, which is why this goes unnoticed until the model is evaluated or deployed. transformers logs "missing
    keys: [lm_head.weight]" on every correctly tied resume too: that line is not evidence either way.

    ## Example
    A script builds a model with tied embeddings, then sets `model.config.tie_word_embeddings = False` (to untie the
    head later, or copied from another recipe) and trains with the Trainer: every `checkpoint-N/` holds
    `model.embed_tokens.weight` and no `lm_head.weight`, with `"tie_word_embeddings": false`.

    ## Fix safety
    No automatic fix: if the head was tied, set `tie_word_embeddings` to true in `config.json`; if it should be a
    separate matrix, save it again from a model that really is untied (`model.lm_head.weight =
    torch.nn.Parameter(model.lm_head.weight.clone())`).

    ## References
    huggingface/transformers#38870 ("Safetensors deserializing silently mishandles tied parameters");
    `src/transformers/modeling_utils.py` `remove_tied_weights_from_state_dict` (drops a tensor that shares storage,
    under `PreTrainedModel.save_pretrained`), `PreTrainedModel.get_expanded_tied_weights_keys` (no tying when
    `config.tie_word_embeddings` is false) and `PreTrainedModel.tie_weights`; `src/transformers/trainer.py`
    `Trainer._load_optimizer_and_scheduler`.
    """
    for ck, _ in _checkpoints(tree):
        cfg = _config(ck)
        if cfg is None:
            continue
        archs = cfg.get("architectures")
        if not isinstance(archs, list) or not any(isinstance(a, str) and a.endswith(_LM_ARCH_SUFFIXES) for a in archs):
            continue
        tied, why = _tie_word_embeddings(cfg)
        saved = None if tied else _saved_weight_names(ck)
        if saved is None:
            continue
        source, names = saved
        # the head first: a plain suffix test, and the common case (a saved head) ends the check
        if any(n.endswith(_HEAD_SUFFIXES) or n in _HEAD_NAMES for n in names):
            continue
        embeds = [n for n in names if _INPUT_EMBED_RE.search(n)]
        if not embeds:
            continue
        cfg_file = ck.file("config.json")
        assert cfg_file is not None
        yield Hit(
            cfg_file.path,
            f"{why}, but `{ck.relname(source)}` holds no `lm_head.weight`, only the input embedding "
            f"`{embeds[0]}` it was tied to when saved: `from_pretrained` initialises the head at random, and a "
            "model built from this config does not match the optimizer state",
        )
