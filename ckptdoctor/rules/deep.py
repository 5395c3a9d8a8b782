"""Tensor-data rules (``--deep`` only): judgments on what ``ckptdoctor.deep`` measured in the bytes of each file."""

from __future__ import annotations

from collections.abc import Iterator

from ckptdoctor import trainer_view
from ckptdoctor.findings import Severity
from ckptdoctor.model import Checkpoint, FileData, FileKind, TensorData, Tree
from ckptdoctor.rules import Hit, rule

_FLOATS = frozenset({"F16", "BF16", "F32", "F64"})
_EXAMPLES = 3


def _by_path(tree: Tree) -> dict[str, FileData]:
    return {d.path: d for d in tree.data}


def _examples(names: list[str]) -> str:
    shown = ", ".join(names[:_EXAMPLES])
    return shown + (f" and {len(names) - _EXAMPLES} more" if len(names) > _EXAMPLES else "")


def is_lora_b(name: str) -> bool:
    """Whether a tensor is a LoRA B matrix (``...lora_B.weight``, ``...lora_embedding_B``): PEFT zero-inits them."""
    parts = name.split(".")
    return "lora_B" in parts or "lora_embedding_B" in parts


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
    `torch.isfinite`; transformers `Trainer` logs `grad_norm` but never checks saved weights.
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
    safetensors stores raw little-endian bytes after the header; nothing in the format checks their content.
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


@rule("CKD303", "untrained-adapter", Severity.WARNING, deep_only=True)
def untrained_adapter(tree: Tree) -> Iterator[Hit]:
    """Every LoRA B matrix of an adapter is still zero although training ran.

    ## What it does
    With `--deep`, looks at the adapter weights (`adapter_model.safetensors` / `adapter_model.bin`, and those of
    extra adapters in subfolders) of each checkpoint whose `global_step` is above 0, and reports the adapter when
    every `lora_B` matrix is all zeros.

    ## Why is this bad?
    PEFT initializes `lora_B` to zeros so that a fresh adapter changes nothing; the first optimizer step moves
    it. After training steps, all-zero B matrices mean the adapter never learned: its parameters were frozen or
    not handed to the optimizer, the learning rate was 0, or the adapter saved is not the one that trained. The
    checkpoint loads and evaluates exactly like the base model, and resuming from it trains from scratch.

    ## Example
    A script that called `get_peft_model` after building the optimizer: 500 steps later,
    `checkpoint-500/adapter_model.safetensors` holds the initial adapter.

    ## Fix safety
    No automatic fix: check that the adapter's parameters are trainable and in the optimizer, then retrain.

    ## References
    peft `src/peft/tuners/lora/layer.py` (`reset_lora_parameters`: `nn.init.zeros_(self.lora_B[...])`).
    """
    data = _by_path(tree)
    for run in tree.runs:
        for ck in run.checkpoints:
            step = _global_step(ck)
            if not step:
                continue
            for d in _adapter_dirs(ck):
                for fname in (trainer_view.ADAPTER_SAFE, trainer_view.ADAPTER_BIN):
                    f = ck.file(f"{d}/{fname}" if d else fname)
                    measured = data.get(f.path) if f is not None else None
                    if measured is None:
                        continue
                    b = [t for t in measured.tensors if is_lora_b(t.name)]
                    if b and all(t.all_zero for t in b):
                        yield Hit(
                            measured.path,
                            f"all {len(b)} LoRA B matrices are zero after {step:,} training steps: "
                            "the adapter is still at its initialization",
                        )


def _global_step(ck: Checkpoint) -> int | None:
    state = trainer_view.trainer_state(ck)
    if state is not None and state.global_step is not None:
        return state.global_step
    return ck.step


def _adapter_dirs(ck: Checkpoint) -> tuple[str, ...]:
    return ("", *trainer_view.adapter_subdirs(ck))


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
    `ckptdoctor.deep` lists the decoded dtypes: F32, F64, F16, BF16.
    """
    for d in tree.data:
        if d.problems:
            yield Hit(d.path, "; ".join(p.message for p in d.problems[:_EXAMPLES]))
        if d.skipped:
            yield Hit(d.path, f"{len(d.skipped)} floating-point tensor(s) not checked: {_examples(list(d.skipped))}")


@rule("CKD214", "checksum-mismatch", Severity.ERROR, deep_only=True)
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
    `hashlib.sha256`; `sha256sum -c`, which does the same for a list of files without knowing checkpoints.
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
