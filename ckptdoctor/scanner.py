"""Orchestrates one scan: discover each root, run the rules, and collect a ``Report``."""

from __future__ import annotations

import dataclasses
import errno
import gc
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import field
from typing import TYPE_CHECKING, TextIO

from ckptdoctor.findings import Finding, Severity
from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import Tree, frozen
from ckptdoctor.roots import PathArg, Roots
from ckptdoctor.rules import Selection, judged, run_rules
from ckptdoctor.settings.exit import ExitPolicy, Outcome, fails
from ckptdoctor.settings.selection import SettingsUse

if TYPE_CHECKING:
    from ckptdoctor.cache.source import FactsCache
    from ckptdoctor.fanout import DaskFanOut

CHECKSUMS = ("write", "verify")
NO_CHECKPOINT = "CKD002"  # a root holding no checkpoint: judged on what the whole root held, on its last part


@frozen
class Part:
    """One piece of a root's scan, judged on its own: a run folder (or a folder of runs) as discovery finished it
    (``discover``'s ``on_part``), or the rest of the root, last. A scan that keeps everything has one part per root.

    ``tree`` holds the part's runs, loose files and path problems, with their pickle verdicts (and ``--deep`` data);
    ``above`` the paths of the files listed in the folders above it (where the settings files that govern it are);
    ``whole`` is the tree CKD002 judges (the last part, counting every file of the root) or None (not judged here).
    """

    tree: Tree
    above: tuple[str, ...] = ()
    last: bool = False
    whole: Tree | None = None


def part_findings(part: Part, selection: Selection) -> list[Finding]:
    """The findings of the rules ``selection`` enables on ``part``, sorted as a whole root's are: each rule judges
    the part's tree, and CKD002 the whole root's (``Part.whole``), so the parts of a root together give exactly the
    findings of the root judged whole."""
    from ckptdoctor.rules import all_rules, evaluate

    rules = [r for r in all_rules() if selection.enabled(r)]
    tree = judged(part.tree, selection)
    out = evaluate([r for r in rules if r.code != NO_CHECKPOINT], tree, tree, selection)
    if part.whole is not None:
        whole = part.whole
        out.extend(evaluate([r for r in rules if r.code == NO_CHECKPOINT], whole, whole, selection))
    return sorted(out, key=Finding.sort_key)


@frozen
class Report(Outcome):
    """The result of scanning one or more roots: what was found on disk and the findings about it.

    ``policy`` decides ``exit_code()`` as the command line does: ``ckptdoctor.scan`` sets the caller's fail-on and
    each folder's settings file's; the default fails on errors. ``settings`` lists the settings files applied and
    the folders each governed (empty from ``scan``, which reads none).
    """

    trees: tuple[Tree, ...]
    findings: tuple[Finding, ...]
    seconds: float
    policy: ExitPolicy = field(default_factory=ExitPolicy)
    settings: tuple[SettingsUse, ...] = ()

    def count(self, severity: Severity) -> int:
        return sum(1 for f in self.findings if f.severity == severity)

    @property
    def files(self) -> int:
        return sum(t.files_seen for t in self.trees)

    def failed(self, fail_on: str = "error") -> bool:
        """True when a finding is at or above ``fail_on`` (``never`` never fails)."""
        return fails(self.findings, fail_on)

    def exit_code(self, fail_on: str | None = None) -> int:
        """0 when nothing reaches ``fail_on``, else 1 (2 is reserved for usage errors).

        Without ``fail_on``: the code the command line gives, by ``policy`` (each folder's settings file's fail-on
        unless the caller gave one; a security error fails even a settings file's "never").
        """
        if fail_on is not None:
            return 1 if self.failed(fail_on) else 0
        return self.exit_status()

    def exit_policy(self) -> ExitPolicy:
        return self.policy

    def judged_findings(self) -> Sequence[Finding]:
        return self.findings


def scan_tree(tree: Tree, selection: Selection | None = None) -> list[Finding]:
    """Run the rules on one discovered tree (``run_rules`` judges its pickles first, under the selection's
    allowances, when it was not)."""
    return run_rules(tree, selection)


def scan(
    paths: Sequence[PathArg] | PathArg | Roots,
    *,
    selection: Selection | None = None,
    limits: Limits = DEFAULT_LIMITS,
    jobs: int | None = None,
    deep: bool = False,
    progress: TextIO | None = None,
    checksums: str | None = None,
    fanout: DaskFanOut | None = None,
    cache: bool | None = False,
) -> Report:
    """Scan checkpoint folders or files without loading or executing anything, and return a ``Report``.

    Each path is a root: an output_dir, a checkpoint folder, a model folder, a folder of runs, or one file.
    ``jobs`` files are read at once (default: ``discover.default_jobs(root)``: one on a local disk, a few threads
    per core on network file systems and object storage); the report is the same for any value.
    ``deep`` also streams tensor data (needs numpy; raises ``ckptdoctor.deep.DeepUnavailable`` without it) and
    enables the deep-only rules. ``progress`` (a terminal stream) shows how far the reads got: a file counter when
    a scan takes more than half a second, erased when done, and the bytes and ETA of ``--deep``.
    ``checksums`` (``write`` or ``verify``, ``deep`` only) also reads every file whole for its sha256; with
    ``verify`` each root's ``.ckptdoctor/manifest.json`` is read and compared (CKD214). Writing the manifest is
    the caller's step (``ckptdoctor.fixer.write_manifest``): a scan never writes into the roots. ``cache`` (off
    here by default) takes the facts and pickle verdicts of files unchanged since an earlier scan from the user's
    cache folder, and keeps those of the files read (True: ``--cache``), or, None (the command's default), notes
    them and keeps them once a later scan finds them unchanged (``ckptdoctor.cache``); the report is the same
    without it.

    ``paths`` is one path (``str`` or ``os.PathLike``) or a sequence of them. ``selection`` is used as given: this
    function reads no settings file (``.ckptdoctor.toml``, ``[tool.ckptdoctor]``); the ``ckptdoctor`` command
    reads each root's. Its codes may be codes, prefixes or rule names (``unsafe-pickle-global``), resolved to
    codes; a ``severity`` key that is a prefix applies to every rule it matches.

    Raises, as the command line exits 2 (a usage error, not a finding): ``FileNotFoundError`` for a local root that
    does not exist, ``PermissionError`` for one this user cannot read (another ``OSError`` when it cannot be looked
    at: a link loop), ``ValueError`` for one that is not a folder or a regular file (a FIFO, socket or device is
    never read), ``ValueError`` naming a selection code, prefix or name
    that matches no rule (it would silently select nothing) or for an empty ``paths``, ``TypeError`` for a path that
    is not one.

    ``fanout`` (``ckptdoctor.fanout.DaskFanOut``) reads each run on a Dask worker; the report is the same.
    """
    roots = check_roots(paths)  # a Roots checked at the door (api.scan, fixer.fix) is not checked again
    if checksums is not None and (checksums not in CHECKSUMS or not deep):
        raise ValueError(f"checksums={checksums!r}: expected one of {CHECKSUMS}, with deep=True")
    sel = checked_selection(selection or Selection())
    if deep and not sel.deep:
        sel = dataclasses.replace(sel, deep=True)
    start = time.perf_counter()
    trees: list[Tree] = []
    findings: list[Finding] = []
    for p in roots:
        kept = _Kept(sel)
        scan_root(
            p, roots.url(p), sel, kept, limits=limits, jobs=jobs, progress=progress, checksums=checksums, fanout=fanout,
            cache=cache,
        )
        trees.append(merged(kept.trees))
        findings.extend(sorted(kept.findings, key=Finding.sort_key))
    return Report(tuple(trees), tuple(findings), time.perf_counter() - start)


def scan_root(
    path: str,
    url: bool,
    selection: Selection,
    on_part: Callable[[Part], None],
    *,
    limits: Limits = DEFAULT_LIMITS,
    jobs: int | None = None,
    progress: TextIO | None = None,
    checksums: str | None = None,
    split: bool = True,
    fanout: DaskFanOut | None = None,
    cache: bool | None = False,
) -> None:
    """Discover one root (``url``: a URL, read through fsspec) and hand its parts to ``on_part`` as discovery
    finishes them, each with its pickle verdicts (under ``selection``'s allowances), the rest of the root last
    (``Part.last``): a run is read, handed on and released before the next is read, so memory holds one run at a
    time. ``split`` False (and ``--deep``, whose data and checksums are the whole root's) hands the root whole, in
    one part. ``selection`` is checked already (``checked_selection``); the rest is ``scan``'s (``cache``: read and
    keep facts and verdicts in the user's cache folder, ``open_cache``).

    ``fanout`` walks each run's folder on a Dask worker (``fanout.DaskFanOut``, not with ``--deep``): the parts
    come back in the same order with the same facts; a folder it could not have checked is one part that says so
    (CKD001), and counts as holding a checkpoint (CKD002 does not claim the root is empty). Its workers use their
    own user's cache when ``cache`` is on (``fanout.walk_one_folder``)."""
    from ckptdoctor import trainer_view
    from ckptdoctor.discover import default_jobs, discover  # imported here so `ckptdoctor --version` stays instant
    from ckptdoctor.facts import SiblingRuns, holds_checkpoint, run_history
    from ckptdoctor.progress import Counter

    if selection.deep:  # tensor records are read whole anyway: check their zip local headers too
        limits = dataclasses.replace(limits, zip_data_local_headers=True)
    held = False  # whether a part handed on held a checkpoint (CKD002 is judged on the whole root)
    counted = 0  # the files of the parts handed on

    def placed(tree: Tree) -> Tree:
        return tree if tree.abs_root else dataclasses.replace(tree, abs_root=os.path.abspath(path))

    # what sibling-run rules (CKD422) need of the runs judged and released: one index, each part sees those before it
    siblings = SiblingRuns()

    def with_siblings(tree: Tree) -> Tree:
        nonlocal siblings
        out = dataclasses.replace(placed(tree), siblings=siblings) if siblings else placed(tree)
        siblings = siblings.extended(h for run in tree.runs if (h := run_history(run, tree.root)) is not None)
        return out

    memo = None if cache is False else open_cache(path, url, fill=cache is True)

    def part(tree: Tree, above: tuple[str, ...]) -> None:
        nonlocal held, counted
        held = held or holds_checkpoint(tree) or _unchecked(tree)
        counted += tree.files_seen
        on_part(Part(judged(with_siblings(tree), selection, memo), above))
        forget_run()

    split = split and not selection.deep
    if fanout is not None and (selection.deep or not split):
        raise ValueError("a scan fanned out over Dask hands runs on as parts: not with deep (or split=False)")
    with _gc_paused():
        counter = Counter(progress) if progress is not None else None
        at_once = jobs if jobs is not None else default_jobs(path)
        try:
            if fanout is not None:
                tree = fanout.discover(
                    path, selection, limits, at_once, part, counter.tick if counter else None, memo, cache
                )
            else:
                tree = discover(
                    path, limits, at_once, counter.tick if counter else None, part if split else None, memo
                )
        finally:
            if counter is not None:
                counter.close()
        tree = placed(tree)
        if selection.deep:
            from ckptdoctor.deep import DeepUnavailable, check_tree, read_manifest  # numpy: only for --deep

            if url:  # object storage (ckptdoctor.sources.fsspec): no local file to stream
                raise DeepUnavailable(f"{path}: deep checks read every tensor byte and work on local files only")
            workers = jobs if jobs is not None else default_jobs()  # numpy and hashing release the GIL
            compared = trainer_view.value_compared_files(ck for run in tree.runs for ck in run.checkpoints)
            data = check_tree(tree, workers, progress, checksums=checksums is not None, values=compared)
            manifest = read_manifest(tree.abs_root) if checksums == "verify" else None
            tree = dataclasses.replace(tree, data=data, manifest=manifest)
        tree = judged(with_siblings(tree), selection, memo)
        if memo is not None:
            memo.close()  # every verdict is judged: the cache files still open are written
        whole = None if held or _unchecked(tree) else dataclasses.replace(tree, files_seen=counted + tree.files_seen)
        on_part(Part(tree, (), True, whole))


def forget_run() -> None:
    """Release what the rules' views and the readers kept of a run once it is judged (a part of ``scan_root``, a
    Dask task): another run's checkpoints take none of it."""
    from ckptdoctor import trainer_view

    trainer_view.forget()  # the views the rules built of the run hold its facts
    # the log histories its checkpoints' reads kept for the next checkpoint, the containers its walks shared and the
    # listings of them: a reader not imported (a warm rescan reads no file) kept nothing
    for reader in ("jsonfiles", "pickle_values", "torchstore"):
        if (module := sys.modules.get(f"ckptdoctor.readers.{reader}")) is not None:
            module.forget()


def _unchecked(tree: Tree) -> bool:
    """Whether a folder of ``tree`` was never checked (a fan-out's task failed): it may hold checkpoints."""
    from ckptdoctor.model import ProblemKind

    return any(pp.problem.kind is ProblemKind.NOT_CHECKED for pp in tree.path_problems)


def open_cache(path: str, url: bool, fill: bool = True) -> FactsCache | None:
    """The verdict cache for a scan of the root ``path``: None when the user's cache folder cannot be used
    (``cache.store.Store.open`` says why: ``ckptdoctor cache info`` shows it) or lies inside the root (a scan writes
    nothing into what it scans). ``fill``: keep the facts of every file read (``--cache``), else first sight them
    (``cache.source.FactsCache``)."""
    from ckptdoctor.cache.source import FactsCache
    from ckptdoctor.cache.store import Store, cache_dir

    folder = cache_dir()
    if not url:
        root = os.path.realpath(path)
        if os.path.realpath(folder).startswith(root.rstrip(os.sep) + os.sep):
            return None

    def opened() -> Store | None:  # when the walk first reads a file: a root with none opens no cache folder
        store = Store.open(folder)
        return None if isinstance(store, str) else store

    return FactsCache(opened, fill)


class _Kept:
    """Keeps each part of a root and its findings (``scan``: a Report holds every tree)."""

    def __init__(self, selection: Selection) -> None:
        self.selection = selection
        self.trees: list[Tree] = []
        self.findings: list[Finding] = []

    def __call__(self, part: Part) -> None:
        self.trees.append(part.tree)
        self.findings.extend(part_findings(part, self.selection))


def merged(parts: Sequence[Tree]) -> Tree:
    """The parts of one root (``scan_root``, the rest last) as the one Tree discovery gives without parts: runs,
    loose files and path problems sorted as it sorts them, pickle verdicts and TensorFlow shard problems in
    ``Tree.all_files`` order."""
    rest = parts[-1]
    if len(parts) == 1:
        return rest
    from ckptdoctor.discover import tf_shard_problems

    runs = tuple(sorted((r for t in parts for r in t.runs), key=lambda r: r.path))
    loose = tuple(sorted((f for t in parts for f in t.loose_files), key=lambda f: f.path))
    problems = sorted((p for t in parts for p in t.path_problems), key=lambda p: (p.path, p.problem.kind.value))
    tree = dataclasses.replace(
        rest,
        runs=runs,
        loose_files=loose,
        path_problems=tuple(problems),
        files_seen=sum(t.files_seen for t in parts),
        pickle_verdicts=None,
    )
    files = tree.all_files()
    if rest.pickle_verdicts is None:  # parts not judged yet
        return dataclasses.replace(tree, tf_shard_problems=tf_shard_problems(files))
    verdicts = {path: v for t in parts for path, v in t.pickle_verdicts or ()}
    return dataclasses.replace(
        tree,
        tf_shard_problems=tf_shard_problems(files),
        pickle_verdicts=tuple((f.path, verdicts[f.path]) for f in files if f.path in verdicts),
    )


def check_roots(paths: Sequence[PathArg] | PathArg | Roots) -> Roots:
    """``paths`` as ``Roots`` checked for a scan (a checked ``Roots`` is returned as it is): raises for a local
    root that cannot be scanned, as the command line exits 2 for it.

    ``FileNotFoundError`` when it does not exist or is a symbolic link to nothing, ``OSError`` (``ELOOP``) for a
    symbolic link loop, ``PermissionError`` when this user may not read it (or list it, for a folder), the
    ``OSError`` of ``stat`` when it cannot be looked at otherwise, and ``ValueError`` when it is neither a folder
    nor a regular file. Each error's ``strerror`` says what the root is. URL roots are left to the remote backend.
    The one check of a local root: the commands' path arguments (``cli.options.ScanRoot``) call it too.
    """
    import stat

    from ckptdoctor.sources.interface import display

    roots = Roots.of(paths)
    if roots.checked:
        return roots
    for p in roots:
        if roots.url(p):
            continue
        try:
            mode = os.stat(p).st_mode
        except FileNotFoundError:
            try:
                target = display(os.readlink(p))
            except OSError:  # not a link (or gone by now): it does not exist
                target = None
            if target is not None:
                why = f"a symbolic link to `{target}`, which does not exist"
                raise FileNotFoundError(errno.ENOENT, why, p) from None
            raise FileNotFoundError(errno.ENOENT, "does not exist: no such file or folder to scan", p) from None
        except OSError as e:
            if e.errno == errno.ELOOP:  # `ln -s a a`, or links that lead back to each other
                why = "a symbolic link loop: following it never reaches a file or folder"
                raise OSError(errno.ELOOP, why, p) from None
            raise
        if not os.access(p, os.R_OK | (os.X_OK if stat.S_ISDIR(mode) else 0)):
            # Nothing in it can be checked: a usage error, as a missing root is, not a clean or empty scan.
            raise PermissionError(errno.EACCES, "cannot be read (permission denied)", p)
        if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
            raise ValueError(f"{p}: not a folder or a regular file (a FIFO, socket or device is never read)")
    return roots.passed()


def checked_selection(selection: Selection) -> Selection:
    """``selection`` with rule names resolved to codes and ``severity`` prefixes expanded to the codes they match.

    Raises ``ValueError`` naming a code, prefix or name that matches no rule: a typo would select nothing, and a
    malicious checkpoint would pass a scan that checked nothing.
    """
    from ckptdoctor.settings.codes import UnknownRule, rule_patterns, severity_overrides

    try:
        select, ignore = rule_patterns(selection.select), rule_patterns(selection.ignore)
    except UnknownRule as exc:
        raise ValueError(f"Selection: {exc}") from None
    try:
        severity = severity_overrides(_levels(selection.severity))
    except UnknownRule as exc:
        raise ValueError(f"Selection.severity: {exc}") from None
    return dataclasses.replace(selection, select=select, ignore=ignore, severity=severity)


def _levels(severity: Mapping[str, Severity | str]) -> dict[str, Severity]:
    """The overrides' values as ``Severity`` (``"info"`` is accepted as ``Severity.INFO``); ValueError otherwise."""
    try:
        return {k: Severity(v) for k, v in severity.items()}
    except ValueError:
        raise ValueError(f"Selection.severity: values must be error, warning or info: {dict(severity)!r}") from None


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector during a scan.

    A scan builds a large heap of acyclic values (parsed pickles, JSON histories); every GC generation-2 pass
    re-walks all of it, which cost 15% of a 100-checkpoint scan (bench/RESULTS.md). Reference counting still frees
    everything as usual; the collector's state is restored afterwards.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
