"""Security rules: pickles that would run code when loaded, unknown globals, pickles no one can analyse, links that
leave the scan root, archives laid out to evade scanners."""

from __future__ import annotations

from collections.abc import Iterator

from ckptdoctor.findings import Severity
from ckptdoctor.model import DcpMetadataFacts, FileFacts, NumpyFacts, PickleFacts, ProblemKind, TorchFacts, Tree
from ckptdoctor.pickle_analysis import Verdict, judge
from ckptdoctor.readers.pickle_walk import merge_pickles
from ckptdoctor.rules import Hit, rule


def _verdicts(tree: Tree) -> tuple[tuple[FileFacts, Verdict], ...]:
    """Every file holding pickle streams (raw, torch zip or legacy, DCP .metadata and .distcp) with its verdict.

    Judged once per scan: CKD601 and CKD602 both read the verdicts, and judging walks every value of every pickle.
    The last tree's verdicts are kept (the rules of one scan run one after another on the same tree).
    """
    if _last and _last[0][0] is tree:
        return _last[0][1]
    out = tuple((f, judge(pf)) for f in tree.all_files() if (pf := _pickle(f)) is not None)
    _last[:] = [(tree, out)]
    return out


_last: list[tuple[Tree, tuple[tuple[FileFacts, Verdict], ...]]] = []


def _names(items: tuple[str, ...], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def _pickle(f: FileFacts) -> PickleFacts | None:
    """Every stream a loader could unpickle from the file: its own, and those another loader reads (polyglots)."""
    c = f.content
    own: PickleFacts | None = None
    if isinstance(c, PickleFacts):
        own = c
    elif isinstance(c, (TorchFacts, DcpMetadataFacts, NumpyFacts)):
        own = c.pickle
    if f.alt_pickle is None or own is None:
        return own or f.alt_pickle
    return merge_pickles(own, [f.alt_pickle])


# a pickle that calls os.system, eval & co runs that code at torch.load: code execution
@rule("CKD601", "unsafe-pickle-global", Severity.ERROR, security_severity="9.0")
def unsafe_pickle_global(tree: Tree) -> Iterator[Hit]:
    """A pickle imports a callable that can run code, or calls a global the analysis does not know.

    ## What it does
    Walks every pickle statically (never loading it) and lists the globals it imports and calls. Reports globals
    that execute code or reach the operating system (`os.system`, `posix.system`, `subprocess`, `builtins.eval` /
    `exec` / `getattr` / `__import__`, `importlib`, `operator.methodcaller` / `attrgetter`, `functools.partial`,
    `runpy`, `pty`, `socket`, `torch.load`, `numpy.load` ...), and any call of a global outside the allowlist.

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
            yield Hit(f.path, f"pickle {verb} {_names(verdict.unsafe)}: loading this file can run code")
        elif unresolved and verdict.unknown:
            yield Hit(f.path, "pickle could not be fully analysed and imports globals outside the allowlist")


# an unknown import is executed on load; usually a custom class, sometimes a payload
@rule("CKD602", "unknown-pickle-global", Severity.WARNING, security_severity="5.0")
def unknown_pickle_global(tree: Tree) -> Iterator[Hit]:
    """A pickle imports a global outside the allowlist that is not known to be dangerous.

    ## What it does
    Compares every imported global with an allowlist built from what torch, transformers, accelerate, peft, numpy
    and DeepSpeed really write, and reports the others (globals that are called are CKD601).

    ## Why is this bad?
    An unknown class is imported (and its module executed) by `pickle.load`, and `weights_only=True` loads refuse
    it. It often means a custom class in a checkpoint that will not load elsewhere; sometimes it is a payload.

    ## Example
    `optimizer.pt` from a third-party optimizer that stores `mylib.schedules.WarmupState` objects.

    ## Fix safety
    No automatic fix. Check where the class comes from; if it is yours, this is informational.

    ## References
    `torch/_weights_only_unpickler.py` (`_get_allowed_globals`); ANATOMY of genuine files' globals.
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
@rule("CKD604", "link-escapes-root", Severity.WARNING, security_severity="4.0")
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
    `os.path.isdir`/`open` in `trainer_utils.get_last_checkpoint` and `_load_from_checkpoint` follow links.
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
    with more bytes after their STOP opcode. Every pickle found this way is walked too, and judged by CKD601.

    ## Why is this bad?
    Two zip readers can see two different archives in the same bytes: a scanner reads the harmless `data.pkl`,
    `torch.load` (miniz) or another tool reads the other one. No library writes these layouts by accident.

    ## Example
    A `pytorch_model.bin` holding two `archive/data.pkl` records, the second with a `posix.system` payload.

    ## Fix safety
    No automatic fix. Do not load the file; obtain it from a trusted source.

    ## References
    `caffe2/serialize/inline_container.cc` (what torch.save writes); PKWARE APPNOTE 4.3; picklescan and
    modelscan bypass reports (zip member confusion).
    """
    for f in tree.all_files():
        tricks = [p.message for p in f.problems if p.kind == ProblemKind.SUSPICIOUS_ARCHIVE]
        if tricks:  # one finding per file: the tricks are facets of one hazard
            yield Hit(f.path, "; ".join(tricks))
