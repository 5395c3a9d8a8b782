"""Security rules: pickles that would run code when loaded, unknown globals, pickles no one can analyse, links that
leave the scan root, archives laid out to evade scanners."""

from __future__ import annotations

from collections.abc import Iterator

from ckptdoctor.findings import Severity
from ckptdoctor.model import FileFacts, ProblemKind, Tree
from ckptdoctor.pickle_verdict.judge import Verdict
from ckptdoctor.rules import Hit, judged, rule


def _verdicts(tree: Tree) -> tuple[tuple[FileFacts, Verdict], ...]:
    """Every file holding pickle streams with the verdict judged once, by ``judged`` under the selection's
    allowances (``run_rules`` judges a tree that comes without verdicts); a rule function called on its own, with
    no selection, judges through the same function with no allowances."""
    by_path = dict(judged(tree).pickle_verdicts or ())
    return tuple((f, by_path[f.path]) for f in tree.all_files() if f.path in by_path)


def _names(items: tuple[str, ...], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


# a pickle that calls os.system, eval & co runs that code at torch.load: code execution
@rule("CKD601", "unsafe-pickle-global", Severity.ERROR, security_severity="9.0")
def unsafe_pickle_global(tree: Tree) -> Iterator[Hit]:
    """A pickle names a callable that can run code when it is loaded.

    ## What it does
    Walks every pickle statically (never loading it) and judges each global it names by facts, never by importing
    it (docs/security.md): globals that execute code or reach the operating system (`os.system`, `subprocess`,
    `builtins.eval` / `exec` / `getattr`, `importlib`, `operator.methodcaller`, `functools.partial`, `runpy`,
    `socket`, `torch.load`, `numpy.load` ...) are errors wherever they appear; so is any other global that is not
    on the allowlist generated from real stacks' files, not proved by its installed source to be a class of a
    known package (or a class deriving from one, or an enum) in a module a resuming process has already imported
    (naming a class makes the unpickler import its module, running its top level), and not rebuilt by the stream
    as TrainingArguments data: functions and unproven names are denied by default. A call with arguments (`REDUCE`,
    `OBJ`, `INST`, `NEWOBJ` with arguments, `NEWOBJ_EX`, `SETITEM`/`APPEND`/`BUILD` on an object the stream made, or a
    class handed to a call) is admitted only for an entry reviewed harmless for any arguments, whatever package the
    class is from: a class's `__init__` is code (`numpy.memmap` writes a file, `torch.utils.benchmark`'s `Timer` execs
    its statement). A class of another package is an error when the stream calls it or passes it to a call (arguments,
    dict keys and sets included). Your own classes can be allowed with `--allow-global` or the user configuration; each
    use is shown in the report.

    ## Why is this bad?
    `pickle.load` calls these while reading: loading the file runs the attacker's code with your credentials.
    `torch.distributed.checkpoint` reads `.metadata` with plain `pickle.load`; DeepSpeed loads its states with
    `weights_only=False`; `training_args.bin` can only be loaded with `weights_only=False`.

    ## Example
    A `pytorch_model.bin` whose `data.pkl` starts with `GLOBAL posix system` + `REDUCE`.

    ## Fix safety
    No automatic fix. Do not load the file. Obtain the checkpoint from a trusted source.

    ## References
    `torch/_weights_only_unpickler.py`; `torch/distributed/checkpoint/filesystem.py` (`read_metadata`);
    trailofbits/fickling; mmaitre314/picklescan.
    """
    for f, verdict in _verdicts(tree):
        unresolved = any(p.kind == ProblemKind.MALFORMED_PICKLE for p in f.problems)
        if verdict.unsafe:
            verb = "calls" if verdict.calls_unsafe else "imports"
            note = f" ({verdict.limit})" if verdict.limit else ""
            yield Hit(f.path, f"pickle {verb} {_names(verdict.unsafe)}: loading this file can run code{note}")
        elif unresolved and verdict.unknown:
            yield Hit(f.path, "pickle could not be fully analysed and imports globals outside the allowlist")


# an unknown import is executed on load; usually a custom class, sometimes a payload
@rule("CKD602", "unknown-pickle-global", Severity.WARNING, security_severity="5.0")
def unknown_pickle_global(tree: Tree) -> Iterator[Hit]:
    """A pickle names a class of a package outside the known ones, without calling it.

    ## What it does
    Reports globals that the installed package's source proves to be classes, of a package other than the ones
    checkpoints come from (torch, transformers, TRL, accelerate, peft, DeepSpeed ...), in a module a resuming
    process has already imported, which the stream names but never calls nor hands to a call. Anything called,
    anything not proved a class, and a class whose module loading would import, is CKD601.

    ## Why is this bad?
    `pickle.load` imports the class's module (running its top-level code), and `weights_only=True` loads refuse
    it. It often means a custom class in a checkpoint that will not load elsewhere; allow it with
    `--allow-global` when it is yours.

    ## Example
    `optimizer.pt` from a third-party optimizer that stores `mylib.schedules.WarmupState` objects.

    ## Fix safety
    No automatic fix. Check where the class comes from; if it is yours, this is informational.

    ## References
    `torch/_weights_only_unpickler.py` `_get_allowed_globals`; docs/security.md ("The policy", "Real stacks
    covered": the allowlist generated from genuine files).
    """
    for f, verdict in _verdicts(tree):
        if verdict.unknown and not verdict.unsafe:
            yield Hit(
                f.path,
                f"pickle imports {_names(verdict.unknown)}, outside the allowlist of globals genuine checkpoints use",
            )


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


# a link out of the folder: the load reads files outside what was reviewed
@rule(
    "CKD604",
    "link-escapes-root",
    Severity.WARNING,
    security_severity="4.0",
    severity_when=((Severity.ERROR, "the resume loads through the link"),),
)
def link_escapes_root(tree: Tree) -> Iterator[Hit]:
    """A symbolic link inside the scanned folder points outside it.

    ## What it does
    Reports links whose target resolves outside the scan root. ckptdoctor does not follow them: a folder may come
    from anyone, and a link to `~/.ssh` or `/usr` must not put their contents in a report or walk them. It is an
    error when the checkpoint `resume_from_checkpoint=True` picks is such a link, or holds one: the resume loads
    files nobody checked. Scan the link's target itself to check it.

    ## Why is this bad?
    The Trainer follows the link and loads whatever is there now: a checkpoint that looks self-contained depends on
    a path that may change, vanish, or be writable by someone else. Copies of the folder lose the target, and
    `ckptdoctor fix` never acts through a link.

    ## Example
    `checkpoint-8/model.safetensors -> /mnt/shared/other-run/model.safetensors`, or a whole
    `checkpoint-8 -> /mnt/disk2/checkpoint-8` kept on another disk: `ckptdoctor scan /mnt/disk2/checkpoint-8`.

    ## Fix safety
    No automatic fix: replace the link with the file it points to, if that is what you mean to keep.

    ## References
    `src/transformers/trainer_utils.py` `get_last_checkpoint` (`os.listdir`, `os.path.isdir`) and
    `src/transformers/trainer.py` `Trainer._load_from_checkpoint` (`os.path.isfile`, `open`): both follow links.
    """
    picks = [r.resume_pick for r in tree.runs if r.resume_pick is not None]
    for pp in tree.path_problems:
        if pp.problem.kind == ProblemKind.LINK_ESCAPES_ROOT:
            target = f" (-> `{pp.target}`)" if pp.target else ""
            pick = next((p for p in picks if p in (".", "") or pp.path == p or pp.path.startswith(p + "/")), None)
            if pick is None:
                yield Hit(pp.path, f"{pp.problem.message}{target}")
            else:  # what the resume loads through it was not checked
                yield Hit(pp.path, f"{pp.problem.message}{target}; resume_from_checkpoint=True loads through it, "
                          "and what it loads was not checked: scan the target", Severity.ERROR)  # fmt: skip


# an evasion layout no library writes: a loader may see a payload a scanner does not
@rule("CKD605", "suspicious-archive-layout", Severity.ERROR, security_severity="8.0")
def suspicious_archive_layout(tree: Tree) -> Iterator[Hit]:
    """A torch archive, `.distcp` file or pickle laid out the way scanner-evasion tricks are, never the way
    `torch.save` or `pickle.dump` write.

    ## What it does
    Reports zip archives with duplicate record names, records outside the archive folder, compressed records,
    more than one pickle record (or a zip inside the zip), data before or after the archive, local headers that
    disagree with the central directory (of every record a loader parses; of the tensor data records too with
    `--deep`, which reads them anyway: a plain scan costs one read per file, not one per tensor), and pickle files
    with more bytes after their STOP opcode. Also tar archives and compressed streams that go past the scan's bounds
    (members, nesting, decompressed bytes, header sizes: a decompression bomb), whose rest is then unchecked, and zip
    or tar records whose first byte is no pickle opcode before a pickle that imports or calls (a payload staged for
    a loader that skips that byte). Every pickle found this way is walked too, and judged by CKD601.

    ## Why is this bad?
    Two zip readers can see two different archives in the same bytes: a scanner reads the harmless `data.pkl`,
    `torch.load` (miniz) or another tool reads the other one. No library writes these layouts by accident.

    ## Example
    A `pytorch_model.bin` holding two `archive/data.pkl` records, the second with a `posix.system` payload.

    ## Fix safety
    No automatic fix. Do not load the file; obtain it from a trusted source.

    ## References
    pytorch `caffe2/serialize/inline_container.cc` (`PyTorchStreamWriter`, what torch.save writes;
    `PyTorchStreamReader::init`, what torch.load accepts), `torch/serialization.py` `_load`; PKWARE APPNOTE 4.3
    (the zip format); picklescan and modelscan bypass reports (zip member confusion).
    """
    for f in tree.all_files():
        tricks = [p.message for p in f.problems if p.kind == ProblemKind.SUSPICIOUS_ARCHIVE]
        if tricks:  # one finding per file: the tricks are facets of one hazard
            yield Hit(f.path, "; ".join(tricks))
