"""Rules that report what could not be read: unreadable paths, corrupt weights files and archives, broken JSON.

Every read problem a reader or discovery records reaches the user through exactly one of these rules.
"""

from __future__ import annotations

from collections.abc import Iterator

from ckptdoctor.findings import Severity
from ckptdoctor.model import FileFacts, FileKind, ProblemKind, Tree
from ckptdoctor.rules import Hit, rule

_TORCH_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".distcp")
_PATH_KINDS = (
    ProblemKind.UNREADABLE,
    ProblemKind.SYMLINK_LOOP,
    ProblemKind.BAD_NAME,
    ProblemKind.SPECIAL_FILE,
    ProblemKind.LIMIT,
)
# JSON files whose corruption has its own rule elsewhere.
_JSON_OWNED = ("trainer_state.json", "adapter_config.json")


def _family(f: FileFacts) -> str:
    """Which format family a file belongs to, by content when it was recognised, else by name."""
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


def _problems(f: FileFacts) -> Iterator[str]:
    for p in f.problems:
        if p.kind not in _PATH_KINDS and p.kind not in (ProblemKind.MALFORMED_PICKLE, ProblemKind.SUSPICIOUS_ARCHIVE):
            yield p.message
    if f.kind == FileKind.EMPTY and _family(f) in ("safetensors", "torch", "json"):
        yield f"`{f.path}` is empty (0 bytes)"


# Paths a resume cannot open: in the checkpoint it picks, one of them is an error.
_BLOCKING_KINDS = (ProblemKind.UNREADABLE, ProblemKind.SPECIAL_FILE, ProblemKind.SYMLINK_LOOP)
# What a resume opens in the checkpoint folder itself: weights, adapters, optimizer, scheduler, scaler and RNG
# states, DCP pieces, and the JSON files `_load_from_checkpoint` and `train()` parse. Anything in a subfolder
# (DeepSpeed tags, FSDP and DCP folders, extra adapters) and names without a suffix (`latest`, folders) count too.
_LOADED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".distcp", ".metadata", ".index.json")
_LOADED_JSON = ("config.json", "trainer_state.json", "adapter_config.json")


def _picked(tree: Tree) -> list[str]:
    """The folders `resume_from_checkpoint=True` picks, one per run, and standalone checkpoints."""
    out = [run.resume_pick for run in tree.runs if run.resume_pick is not None]
    out.extend(ck.path for run in tree.runs if run.standalone for ck in run.checkpoints)
    return out


def _loaded(rel: str) -> bool:
    """Whether a resume may open ``rel`` (relative to the checkpoint folder; "" is the folder itself)."""
    name = rel.lower()
    return rel == "" or "/" in rel or "." not in name or name.endswith(_LOADED_SUFFIXES) or name in _LOADED_JSON


def _severity(path: str, kind: ProblemKind, picked: list[str]) -> Severity:
    """Error when the resume would open ``path``: the folder it picks, or a file there a loader opens."""
    if kind not in _BLOCKING_KINDS:
        return Severity.WARNING
    for ck in picked:
        if ck in (".", ""):
            rel = "" if path in (".", "") else path
        elif path == ck or path.startswith(f"{ck}/"):
            rel = path[len(ck) + 1 :]
        else:
            continue
        if _loaded(rel):
            return Severity.ERROR
    return Severity.WARNING


@rule("CKD001", "unreadable-path", Severity.WARNING)
def unreadable_path(tree: Tree) -> Iterator[Hit]:
    """A file or folder the scan could not read: permission denied, symlink loop, undecodable name, device file,
    or a resource limit reached.

    ## What it does
    Reports every path discovery or a reader could not open or fully analyse. The scan goes on with the rest.
    It is an error when the path is in the checkpoint `resume_from_checkpoint=True` picks (the folder itself, or a
    file there a loader opens: weights, optimizer, scheduler and RNG states, `trainer_state.json`, `config.json`,
    anything in its subfolders), a warning otherwise.

    ## Why is this bad?
    What ckptdoctor could not read, it could not check: a hazard may hide there. A resume that needs the file will
    fail, or (for a name the Trainer's pattern does not match) silently ignore it. A file that vanished while
    being scanned is not corrupt: a save or the Trainer's rotation (`save_total_limit`) was at work; scan again.

    ## Example
    `checkpoint-8/optimizer.pt` with mode 000 owned by another user.

    ## Fix safety
    No automatic fix: fix permissions or names by hand, then scan again.

    ## References
    Principle 4 of ckptdoctor: bad input is a finding, not a traceback.
    """
    picked = _picked(tree)
    for pp in tree.path_problems:
        if pp.problem.kind in _PATH_KINDS:
            yield Hit(pp.path, pp.problem.message, _severity(pp.path, pp.problem.kind, picked))
    for f in tree.all_files():
        for p in f.problems:
            if p.kind in _PATH_KINDS:
                yield Hit(f.path, p.message, _severity(f.path, p.kind, picked))


@rule("CKD202", "corrupt-safetensors", Severity.ERROR)
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

    ## Fix safety
    No automatic fix: tensor data cannot be invented. Restore the file from a copy, or resume from an earlier
    checkpoint (quarantining this one with `ckptdoctor fix` when it is the one resume would pick).

    ## References
    `safetensors/src/tensor.rs` (`SafeTensors::read_metadata`, `Metadata::validate`).
    """
    for f in tree.all_files():
        if _family(f) == "safetensors":
            for msg in _problems(f):
                yield Hit(f.path, msg)


@rule("CKD203", "corrupt-torch-archive", Severity.ERROR)
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

    ## Fix safety
    No automatic fix: restore the file or resume from an earlier checkpoint.

    ## References
    `torch/serialization.py` (`_load`, `_save`), `caffe2/serialize/inline_container.cc`.
    """
    for f in tree.all_files():
        if _family(f) == "torch":
            for msg in _problems(f):
                yield Hit(f.path, msg)


@rule("CKD211", "corrupt-json", Severity.ERROR)
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
        if _family(f) == "json" and f.name not in _JSON_OWNED:
            sev = Severity.ERROR if f.name == "config.json" or f.name.endswith(".index.json") else Severity.WARNING
            for msg in _problems(f):
                yield Hit(f.path, msg, sev)


# a pickle no one can walk statically: whatever it would import and call is unchecked
@rule("CKD603", "malformed-pickle", Severity.ERROR, security_severity="7.0")
def malformed_pickle(tree: Tree) -> Iterator[Hit]:
    """A pickle stream that is truncated, inconsistent, or built to confuse analysis.

    ## What it does
    Walks every pickle (inside torch archives, DCP `.metadata`, raw pickles) opcode by opcode without executing it,
    and reports streams that no honest writer produces: no STOP, stack underflow, unknown opcodes, memo misses.

    ## Why is this bad?
    A loader either fails on it, or, worse, a crafted stream is read differently by a scanner and by
    `pickle.load`, which is how payloads slip past security scanners.

    ## Example
    A `data.pkl` whose last bytes were cut off, or with opcodes after STOP.

    ## Fix safety
    No automatic fix. Do not load the file; restore it from a trusted copy.

    ## References
    CPython `Lib/pickletools.py`; picklescan and fickling bypass reports.
    """
    for f in tree.all_files():
        for p in f.problems:
            if p.kind == ProblemKind.MALFORMED_PICKLE:
                yield Hit(f.path, p.message)
