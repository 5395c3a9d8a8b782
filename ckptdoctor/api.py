"""The Python API behind ``ckptdoctor.scan`` and ``ckptdoctor.fix``: the command line's ``scan`` and ``fix``, each
folder under its closest settings file, returning what the command renders and the exit code it would give.

The request is built once at this door: ``scan`` and ``fix`` take the documented keywords, build one
``Options`` (``settings.selection.Options.build``: checked once) and one ``Roots`` (``roots.Roots.of``: each root
named once, URL or path decided once, checked once) and hand them to ``scan_roots`` and ``fix_roots``, which the
command line calls with the same two values. ``scanner.scan`` and ``fixer.fix`` are the lower-level calls: they
take a ``Selection`` as given and read no settings file.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

from ckptdoctor.errors import UsageError
from ckptdoctor.findings import Finding
from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.roots import PathArg, Roots
from ckptdoctor.settings.selection import (
    Codes,
    KeptCallback,
    Options,
    RootSettings,
    Scope,
    check_runnable,
    exit_policy,
    selection_groups,
    settings_used,
    warn_kept,
    with_nested,
)

if TYPE_CHECKING:
    from ckptdoctor.fanout import DaskFanOut
    from ckptdoctor.fixer.run import FixResult
    from ckptdoctor.model import Tree
    from ckptdoctor.rules import Selection
    from ckptdoctor.scanner import Part, Report

NO_CHECKPOINT = "CKD002"  # a root holding no checkpoint: what allow_empty accepts (scanner.NO_CHECKPOINT)

# ``scan_roots``'s ``on_part``: each part of a root as it is judged (the root's index in the report, the part's
# tree, its findings under the settings that govern it).
PartSink = Callable[[int, "Tree", "list[Finding]"], None]


def scan(
    paths: Sequence[PathArg] | PathArg,
    *,
    select: Codes = (),
    ignore: Codes = (),
    fail_on: str | None = None,
    no_config: bool = False,
    deep: bool = False,
    jobs: int | None = None,
    checksums: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
    progress: TextIO | None = None,
    on_kept: KeptCallback | None = None,
    allow_global: Codes = (),
    allow_empty: bool = False,
    cache: bool | None = None,
) -> Report:
    """Scan checkpoint folders or files as ``ckptdoctor scan`` does, and return the ``Report``.

    Each run and checkpoint folder is checked under the closest settings file from it upward (``.ckptdoctor.toml``,
    or ``[tool.ckptdoctor]`` in ``pyproject.toml``; else the user configuration; none with ``no_config``) plus
    ``select``/``ignore``, exactly as the command line resolves them; ``report.settings`` lists the files applied
    and where. ``report.exit_code()`` is the command's exit code: ``fail_on`` (error, warning, info or never) when
    given, else each folder's settings file's fail-on, else error; a security error fails even a project file's
    "never". A project file that tries to turn off security rules keeps them on and ``on_kept(source, codes)`` is
    told (default: a ``UserWarning``). ``deep``, ``jobs``, ``checksums``, ``limits`` and ``progress`` are
    ``scanner.scan``'s; with ``checksums="write"`` the sums are computed, and writing the manifest is the caller's
    step (``ckptdoctor.fixer.write_manifest``), as a scan never writes. ``allow_global`` are ``--allow-global``
    patterns (``pkg.mod.Name`` or ``pkg.mod.*``), joined by the user configuration's; each use is in the report.
    A root holding no checkpoint at all (empty, only logs: a mistyped path) is CKD002, an error, unless
    ``allow_empty`` (``--allow-empty``). ``cache`` is the verdict cache in the user's cache folder
    (``ckptdoctor.cache``): a file unchanged since its facts and verdict were kept is not read again. None (the
    default) keeps a file's facts once a second scan finds it unchanged; True (``--cache``) keeps them at once;
    False (``--no-cache``) leaves the cache alone. The report is the same every way.

    Raises ``UsageError`` (a ``ValueError``) where the command exits 2: an unknown rule code, a selection that never
    runs, an unusable settings file, a bad ``fail_on`` or ``checksums``; and what ``scanner.scan`` raises for a
    root that cannot be scanned (``FileNotFoundError``, ``ValueError``), and ``deep.DeepUnavailable`` (a
    ``UsageError``) for ``deep`` without numpy or on a remote root.
    """
    options = Options.build(
        select=select, ignore=ignore, fail_on=fail_on, no_config=no_config, allow_global=allow_global,
        allow_empty=allow_empty, on_kept=on_kept or warn_kept,
    )
    return scan_roots(
        Roots.of(paths), options, deep=deep, jobs=jobs, checksums=checksums, limits=limits, progress=progress,
        cache=cache,
    )


def scan_many(
    roots: Sequence[PathArg] | PathArg,
    *,
    client: Any = None,
    select: Codes = (),
    ignore: Codes = (),
    fail_on: str | None = None,
    no_config: bool = False,
    jobs: int | None = None,
    limits: Limits = DEFAULT_LIMITS,
    progress: TextIO | None = None,
    on_kept: KeptCallback | None = None,
    allow_global: Codes = (),
    allow_empty: bool = False,
    retries: int = 2,
    cache: bool | None = None,
) -> Report:
    """Scan many roots as ``scan`` does, each run read on a Dask cluster: ``client`` is a ``distributed.Client``
    (``Client("tcp://scheduler:8786")``, or a ``LocalCluster``'s), as ``ckptdoctor scan --dask ADDRESS`` does.

    One task per run: each root is listed here (nothing read), each folder holding a run (or a root that is one
    run) is read and its pickles judged on a worker, and the rules, the settings files and everything that compares
    runs run here, in the order of a serial scan: the ``Report`` is the one ``scan`` returns, byte for byte in
    every output. A task that raises is run again up to ``retries`` times, and a task whose worker is lost is
    rescheduled by Dask (``distributed.scheduler.allowed-failures``); a folder or root whose task still fails is
    reported as not checked (CKD001, an error, with the reason), never left out, so ``report.exit_code()`` is 1.
    ``client=None`` scans here, serially: ``scan`` without ``deep``. ``cache`` as ``scan``'s: each worker then
    keeps and takes the facts of the runs it reads in its own user's cache folder (``fanout.walk_one_folder``).

    Workers must run the same ckptdoctor (a result from another version is not taken: CKD001) and reach the roots
    at the same paths: a local root on a file system every worker mounts there, a URL root with credentials of
    their own (the client sends its fsspec options, not its environment). A worker sees the checkpoints' bytes
    only; it runs nothing they hold, but the cluster runs what its clients submit: use one you trust.
    Raises what ``scan`` raises.
    """
    options = Options.build(
        select=select, ignore=ignore, fail_on=fail_on, no_config=no_config, allow_global=allow_global,
        allow_empty=allow_empty, on_kept=on_kept or warn_kept,
    )
    return scan_roots(
        Roots.of(roots), options, jobs=jobs, limits=limits, progress=progress, fanout=_fanout(client, retries),
        cache=cache,
    )


def _fanout(client: Any, retries: int) -> DaskFanOut | None:
    """``scan_many``'s and ``iter_scan``'s ``client`` as the scan takes it (None: read here, serially)."""
    if client is None:
        return None
    from ckptdoctor.fanout import DaskFanOut

    return DaskFanOut(client, retries=retries)


def iter_scan(
    roots: Sequence[PathArg] | PathArg,
    *,
    client: Any = None,
    select: Codes = (),
    ignore: Codes = (),
    fail_on: str | None = None,
    no_config: bool = False,
    jobs: int | None = None,
    limits: Limits = DEFAULT_LIMITS,
    progress: TextIO | None = None,
    on_kept: KeptCallback | None = None,
    allow_global: Codes = (),
    allow_empty: bool = False,
    retries: int = 2,
    cache: bool | None = None,
) -> ScanStream:
    """``scan_many`` as a stream, for a fleet: each run handed out as it is judged (a ``ScannedPart``: its tree and
    findings), then released, so memory holds about one run whatever the fleet's size; ``stream.report`` once the
    stream is exhausted.

    ::

        with ckptdoctor.iter_scan(["s3://bucket/runs/"], client=client) as stream:
            for part in stream:
                for finding in part.findings:
                    ...  # store it, alert on it
        sys.exit(stream.report.exit_code())

    The parts come in the order of a serial scan: root by root, each run folder (or folder of runs) as discovery
    finishes it, the files left in the root last; each part's findings are judged under the settings files that
    govern it, as ``scan`` judges them. ``stream.report`` is the ``Report`` of the whole scan without the runs'
    facts: its findings, in the order and with the exit code of ``scan(roots)`` (``scan_many``'s with a client),
    each root's settings and file count, and for each root a tree of no runs. Keeping a part past the next one keeps
    its facts; nothing else does. The keywords are ``scan_many``'s (``client=None``: read here, serially).

    The scan runs in a thread of its own while the loop asks for parts, one part ahead at most: the thread waits for
    the next ``next()``. Leaving the loop early (``break``, an exception) and then ``close()`` (or the ``with``
    block's end, or the stream's release) stops the scan and its Dask tasks; ``report`` is then unavailable. This
    call raises for bad keywords (``UsageError``) and a missing local root (``FileNotFoundError``); what the scan
    raises once started (an unusable settings file: ``UsageError``) is raised by the ``next()`` that meets it.
    """
    from ckptdoctor.scanner import check_roots

    options = Options.build(
        select=select, ignore=ignore, fail_on=fail_on, no_config=no_config, allow_global=allow_global,
        allow_empty=allow_empty, on_kept=on_kept or warn_kept,
    )
    checked = check_roots(Roots.of(roots))
    fanout = _fanout(client, retries)

    def run(sink: PartSink) -> Report:
        return scan_roots(
            checked, options, jobs=jobs, limits=limits, progress=progress, on_part=sink, fanout=fanout, cache=cache
        )

    return ScanStream(run)


class ScannedPart:
    """One part of a scan as ``iter_scan`` hands it out: a run folder (or a folder of runs) of a root, or the files
    left in the root (the root's last part). ``index``: the root's place in the roots scanned (and in
    ``stream.report.trees``); ``tree``: what was read there, its runs and checkpoints (``ckptdoctor.model.Tree``,
    ``tree.root`` the root as given); ``findings``: the part's, judged under the settings that govern it."""

    # A plain class, not a dataclass: making one costs about 3 M instructions at import (bench/RESULTS.md), which
    # every scan would pay for a name only a stream uses.
    __slots__ = ("findings", "index", "tree")

    def __init__(self, index: int, tree: Tree, findings: tuple[Finding, ...]) -> None:
        self.index = index
        self.tree = tree
        self.findings = findings

    def __repr__(self) -> str:
        runs = [run.path for run in self.tree.runs]
        return f"ScannedPart(index={self.index}, root={self.root!r}, runs={runs!r}, findings={len(self.findings)})"

    @property
    def root(self) -> str:
        """The root this part belongs to, as given."""
        return self.tree.root


class ScanStream:
    """The iterator ``iter_scan`` returns: ``ScannedPart`` after ``ScannedPart``, then ``report``. A context manager
    whose end (as ``close()``) stops a scan not run to its end."""

    def __init__(self, run: Callable[[PartSink], Report]) -> None:
        self._handoff = _Handoff(run)

    def __iter__(self) -> ScanStream:
        return self

    def __next__(self) -> ScannedPart:
        return self._handoff.next()

    def __enter__(self) -> ScanStream:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __del__(self) -> None:
        self._handoff.close()

    def close(self) -> None:
        """Stop the scan if it is still running (its thread ends, its Dask tasks are cancelled); idempotent."""
        self._handoff.close()

    @property
    def report(self) -> Report:
        """The scan's ``Report`` (findings, settings, exit code; trees without runs), once every part was taken;
        ``RuntimeError`` before, or after ``close()`` stopped the scan."""
        if self._handoff.report is None:
            raise RuntimeError("the report is there once the stream is exhausted (every part taken)")
        return self._handoff.report


class _Closed(BaseException):
    """Raised in the scan's thread by the part handed out when the stream was closed: ends the scan. A
    ``BaseException``, as ``GeneratorExit`` is, so that no ``except Exception`` on the way takes it for a bad file."""


class _Handoff:
    """The scan's thread and the loop taking its parts, strictly in turn: the thread hands one part and waits until
    the loop asks for the next (or closes). The stream holds this, and the thread holds only this, so a stream the
    caller drops is released (``ScanStream.__del__``) and stops its thread."""

    def __init__(self, run: Callable[[PartSink], Report]) -> None:
        import gc
        import queue
        import threading

        self.run = run
        self.report: Report | None = None
        self.out: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=1)
        self.resume = threading.Semaphore(0)
        self.thread: threading.Thread | None = None
        self.closing = False
        self.done = False
        # A scan pauses the cyclic garbage collector (``scanner._gc_paused``); the caller's code between two parts
        # runs with it as the caller had it, or the cycles it makes would stay until the scan ends.
        self.collect = gc.isenabled()

    def next(self) -> ScannedPart:
        import threading

        if self.done:
            raise StopIteration
        if self.thread is None:
            self.thread = threading.Thread(target=self._produce, name="ckptdoctor-iter-scan", daemon=True)
            self.thread.start()
        else:
            self.resume.release()  # the thread leaves the part handed out last and reads the next
        kind, value = self.out.get()
        if kind == "part":
            return value  # type: ignore[no-any-return]
        self.done = True
        self.thread.join()
        if kind == "report":
            self.report = value
            raise StopIteration
        raise value

    def close(self) -> None:
        if self.done:
            return
        self.done = True
        if self.thread is not None and self.thread.is_alive():
            self.closing = True
            self.resume.release()
            self.thread.join()

    def _produce(self) -> None:
        try:
            report = self.run(self._hand)
        except _Closed:
            return
        except BaseException as exc:  # the loop's next() raises it
            self.out.put(("error", exc))
            return
        self.out.put(("report", report))

    def _hand(self, index: int, tree: Tree, findings: list[Finding]) -> None:
        import gc

        paused = self.collect and not gc.isenabled()
        if paused:
            gc.enable()
        self.out.put(("part", ScannedPart(index, tree, tuple(findings))))
        self.resume.acquire()
        if paused:
            gc.disable()
        if self.closing:
            raise _Closed


def scan_roots(
    roots: Roots,
    options: Options,
    *,
    deep: bool = False,
    jobs: int | None = None,
    checksums: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
    progress: TextIO | None = None,
    on_part: PartSink | None = None,
    fanout: DaskFanOut | None = None,
    cache: bool | None = False,
) -> Report:
    """``scan`` of a request built at the door: ``roots`` (checked here, once) under ``options``.

    With ``on_part`` the scan keeps one run in memory at a time: each part of a root (a run folder, or a folder of
    runs, as discovery finishes it; the rest of the root last) is judged under the settings that govern it and
    handed to ``on_part(index, tree, findings)`` (``index``: the root's place in the report), then released. The
    Report then holds each root's findings, settings and file count, and a tree of no runs (``--deep`` still hands
    each root whole). The findings are those of the scan without ``on_part``, in the same order.

    ``fanout`` (``scan_many``'s ``client``) reads each run on a Dask worker; not with ``deep``.
    """
    from ckptdoctor.scanner import check_roots, merged

    check_runnable(options.select, deep)
    if options.allow_empty:
        options = options.ignoring(NO_CHECKPOINT)
    groups = selection_groups(roots.paths, options)
    if checksums is not None:
        _check_checksums(roots.paths, checksums, deep)
    roots = check_roots(roots)
    if fanout is not None:
        if deep:
            raise UsageError("--dask reads headers on the workers; --deep reads every byte here: drop one of them")
        _announce(fanout, groups, limits, jobs, cache)
    if on_part is not None:
        return _scan_parts(roots, options, groups, on_part, deep, jobs, checksums, limits, progress, fanout, cache)
    # Kept whole: the same part-by-part judging (each part under the settings files that govern it), each root's
    # parts merged into its tree, as ``scanner.scan`` merges them.
    kept: dict[int, list[Tree]] = {}

    def keep(index: int, tree: Tree, findings: list[Finding]) -> None:
        kept.setdefault(index, []).append(tree)

    report = _scan_parts(roots, options, groups, keep, deep, jobs, checksums, limits, progress, fanout, cache)
    return dataclasses.replace(report, trees=tuple(merged(kept[i]) for i in range(len(report.trees))))


def _announce(
    fanout: DaskFanOut,
    groups: Sequence[tuple[list[str], Selection, str | None, list[RootSettings]]],
    limits: Limits,
    jobs: int | None,
    cache: bool | None,
) -> None:
    """Tell ``fanout`` every root in the order the scan asks for them, so the runs of the next roots are read
    while this one is judged."""
    from ckptdoctor.discover import default_jobs
    from ckptdoctor.scanner import checked_selection

    for ps, selection, _, _ in groups:
        sel = checked_selection(selection)
        for p in ps:
            fanout.expect(p, sel, limits, jobs if jobs is not None else default_jobs(p), cache)


def _scan_parts(
    roots: Roots,
    options: Options,
    groups: Sequence[tuple[list[str], Selection, str | None, list[RootSettings]]],
    on_part: PartSink,
    deep: bool,
    jobs: int | None,
    checksums: str | None,
    limits: Limits,
    progress: TextIO | None,
    fanout: DaskFanOut | None = None,
    cache: bool | None = False,
) -> Report:
    """``scan_roots`` with ``on_part``: each root scanned part by part (``scanner.scan_root``)."""
    import time

    from ckptdoctor.model import Tree
    from ckptdoctor.scanner import Report, checked_selection, scan_root

    start = time.perf_counter()
    trees: list[Tree] = []
    findings: list[Finding] = []
    settings: list[RootSettings] = []
    folders: list[Iterable[str]] = []
    for ps, selection, _, group_settings in groups:
        sel = checked_selection(selection)
        if deep and not sel.deep:
            sel = dataclasses.replace(sel, deep=True)
        for p, rs in zip(ps, group_settings, strict=True):
            judge = _PartJudge(len(trees), rs, sel, options, deep, on_part)
            scan_root(
                p, roots.url(p), sel, judge, limits=limits, jobs=jobs, progress=progress, checksums=checksums,
                fanout=fanout, cache=cache,
            )
            trees.append(Tree(root=p, runs=(), files_seen=judge.files, abs_root=judge.abs_root))
            findings.extend(sorted(judge.findings, key=Finding.sort_key))
            settings.append(judge.settings())
            folders.append(judge.folders())
    return Report(
        tuple(trees),
        tuple(findings),
        time.perf_counter() - start,
        exit_policy(options.fail_on, settings),
        settings_used(zip(settings, folders, strict=True)),
    )


class _PartJudge:
    """Judges each part of one root under the settings files that govern it (those in the folders above it, found
    in the listing, and its own) and hands it on; keeps only its findings, folders and file count."""

    def __init__(
        self, index: int, settings: RootSettings, selection: Selection, options: Options, deep: bool, sink: PartSink
    ) -> None:
        self.index = index
        self.own = settings
        self.selection = selection
        self.options = options
        self.deep = deep
        self.sink = sink
        self.findings: list[Finding] = []
        # each part's folders as one text, NUL between them (no path holds one): one object a part, not one a
        # checkpoint, kept to the end of a fleet's scan (bench/RESULTS.md, issue 27)
        self._folders: list[str] = []
        self.files = 0
        self.abs_root = ""
        self.found: set[str] = set()  # those of the parts judged (what the whole root's listing holds)
        self._scopes: dict[str, Scope | None] = {}  # each settings file's folder resolved once (``with_nested``)

    def __call__(self, part: Part) -> None:
        from ckptdoctor.scanner import part_findings
        from ckptdoctor.settings.files import CONFIG_NAMES

        tree = part.tree
        found = part_findings(part, self.selection)
        if not self.options.no_config:
            own = {f.path for f in tree.all_files() if f.name in CONFIG_NAMES}
            governing = own | {p for p in part.above if p.rsplit("/", 1)[-1] in CONFIG_NAMES}
            self.found |= own
            # Only the files in the part's folders and those above it govern its paths (a sibling run's governs
            # none of them): judging each part under every file listed so far was quadratic in a fleet's runs.
            found = _judged(part, self._settings(governing), found, self.deep)
        self.findings.extend(found)
        self._folders.append("\0".join(_folders(tree)))
        self.files += tree.files_seen
        self.abs_root = tree.abs_root
        self.sink(self.index, tree, found)

    def folders(self) -> Iterator[str]:
        """The run and checkpoint folders of the parts judged, in order."""
        return (folder for text in self._folders if text for folder in text.split("\0"))

    def _settings(self, configs: set[str]) -> RootSettings:
        """The root's settings with the files ``configs`` below it (each file resolved once per scan)."""
        return with_nested(self.own, configs, self.options, self._scopes)

    def settings(self) -> RootSettings:
        """The root's settings with every settings file its listing held, as ``Report.settings`` lists them."""
        return self.own if self.options.no_config else self._settings(self.found)


def _folders(tree: Tree) -> list[str]:
    """The run and checkpoint folders discovery found in ``tree``, relative to its root."""
    return [p for run in tree.runs for p in (run.path, *(ck.path for ck in run.checkpoints))]


def _nested_settings(
    tree: Tree, settings: RootSettings, findings: Sequence[Finding], options: Options, deep: bool
) -> tuple[RootSettings, list[Finding]]:
    """The settings files below ``tree``'s root applied to the folders they govern, as ruff applies the closest
    configuration to each file (``_judged``). The scan's own listing finds the files (no extra look at the disk); a
    tree without one is returned as it is."""
    from ckptdoctor.scanner import Part

    nested = with_nested(settings, (f.path for f in tree.all_files()), options)
    return nested, _judged(Part(tree, last=True, whole=tree), nested, findings, deep)


def _judged(part: Part, settings: RootSettings, findings: Sequence[Finding], deep: bool) -> list[Finding]:
    """``findings`` (a scan of ``part`` under the root's own scope) with each nested scope's instead for the folders
    it governs: the rules are run again under each nested file's selection and each finding is kept from the run of
    the scope holding its path."""
    if len(settings.scopes) == 1:
        return list(findings)
    from ckptdoctor.scanner import part_findings

    out = [f for f in findings if settings.scope_of(f.path) is settings.scopes[0]]
    # the rules run once per distinct selection, not once per file: a fleet's runs often hold the same file (a
    # team's template), and ``fix`` and ``--deep`` judge a root whole under each one
    passes: list[tuple[Selection, list[Finding]]] = []
    for scope in settings.scopes[1:]:
        selection = dataclasses.replace(scope.selection, deep=deep or scope.selection.deep)
        found = next((done for seen, done in passes if seen == selection), None)
        if found is None:
            found = part_findings(part, selection)
            passes.append((selection, found))
        out.extend(f for f in found if settings.scope_of(f.path) is scope)
    return sorted(out, key=Finding.sort_key)


def _check_checksums(paths: Sequence[str], mode: str, deep: bool) -> None:
    """Usage errors of ``checksums``, raised before a long ``deep`` read rather than after it."""
    if mode not in ("write", "verify"):
        raise UsageError(f"checksums={mode!r}: expected write or verify")
    if not deep:
        raise UsageError(f"--checksums {mode} needs --deep: checksums are computed while --deep reads every byte")
    for p in paths:
        if not os.path.isdir(p):
            raise UsageError(f"--checksums {mode}: {p} is not a folder (the manifest lives at a folder's root)")
    if mode == "write":
        from ckptdoctor.fixer import manifest_refusal

        for p in paths:
            why = manifest_refusal(p)
            if why is not None:
                raise UsageError(f"--checksums write: {why}")
    else:
        from ckptdoctor.deep import MANIFEST_PATH, manifest_exists

        for p in paths:
            if not manifest_exists(p):
                raise UsageError(
                    f"--checksums verify: {p} has no {MANIFEST_PATH}; write one with `--deep --checksums write`"
                )


def fix(
    paths: Sequence[PathArg] | PathArg,
    *,
    select: Codes = (),
    ignore: Codes = (),
    fail_on: str | None = None,
    no_config: bool = False,
    unsafe: bool = False,
    dry_run: bool = False,
    force: bool = False,
    on_kept: KeptCallback | None = None,
    allow_global: Codes = (),
    allow_empty: bool = False,
) -> FixResult:
    """Fix folders as ``ckptdoctor fix`` does: plan, journal, apply atomically (unless ``dry_run``), rescan.

    Each folder is fixed under the closest settings file from it upward plus ``select``/``ignore``, as ``scan``
    reads them (a run folder whose own file ignores a rule gets no fix for it, and what remains there is judged
    under that file); ``fail_on``, ``no_config``, ``on_kept``,
    ``allow_global`` and ``allow_empty`` are ``scan``'s. ``result.exit_code()`` is the command's exit code (a dry
    run: 1 when it would change something). Raises ``UsageError`` where the command exits 2,
    ``FixRefused`` (one) included: a remote root, a root inside another, a read-only tree, a run being written
    (``force`` acts anyway).
    """
    options = Options.build(
        select=select, ignore=ignore, fail_on=fail_on, no_config=no_config, allow_global=allow_global,
        allow_empty=allow_empty, on_kept=on_kept or warn_kept,
    )
    return fix_roots(Roots.of(paths), options, unsafe=unsafe, dry_run=dry_run, force=force)


def fix_roots(
    roots: Roots, options: Options, *, unsafe: bool = False, dry_run: bool = False, force: bool = False
) -> FixResult:
    """``fix`` of a request built at the door: ``roots`` (checked here, once) under ``options``."""
    from ckptdoctor.fixer.run import FixResult, check_fix_roots
    from ckptdoctor.fixer.run import fix as fix_trees

    check_runnable(options.select, deep=False)
    if options.allow_empty:
        options = options.ignoring(NO_CHECKPOINT)
    # Before the roots are grouped: one inside another is refused whatever their settings.
    roots = check_fix_roots(roots)
    groups = selection_groups(roots.paths, options)
    own = {rs.root: rs for g in groups for rs in g.settings}
    nested: dict[str, RootSettings] = {}

    def rescope(root: str, tree: Tree, findings: Sequence[Finding]) -> list[Finding]:
        # Resolved once per root, from the listing before the fix: the rescan is judged under the same files.
        if root not in nested:
            nested[root], _ = _nested_settings(tree, own[root], (), options, False)
        from ckptdoctor.scanner import Part

        return _judged(Part(tree, last=True, whole=tree), nested[root], findings, False)

    results = [
        fix_trees(
            roots.only(ps),
            selection=selection,
            unsafe=unsafe,
            dry_run=dry_run,
            force=force,
            fail_on=options.fail_on or cfg_fail_on or "error",
            rescope=None if options.no_config else rescope,
        )
        for ps, selection, cfg_fail_on, _ in groups
    ]
    # Each remaining finding judged under its own folder's fail-on, as scan judges it.
    policy = exit_policy(options.fail_on, [nested.get(r, rs) for r, rs in own.items()])
    return FixResult.merge(results, policy)
