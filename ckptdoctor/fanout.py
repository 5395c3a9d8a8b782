"""A scan fanned out over a Dask cluster (``scan --dask``, ``ckptdoctor.scan_many(client=...)``): one task per run.

The client plans each root by listing it (``discover.plan_folders``: nothing is read) and hands each folder that
holds a run (or a whole root that is one run) to a worker, which reads it, walks its pickles to verdicts and sends
back the parts discovery would have handed on (``discover.walk_folder``); the client walks the rest of the root
itself and puts each folder's parts where its own walk reaches it (``discover.discover_opened``'s ``handed``).
Everything that compares runs (CKD422 reads the histories of the runs judged before), the settings files and the
rules then run on the client exactly as in a serial scan, in the serial scan's order, so the report is the same
byte for byte.

A task that fails is retried as Dask retries (``retries`` times for an error; a worker lost is rescheduled up to
Dask's ``distributed.scheduler.allowed-failures``); a folder whose task still fails comes back as one part that
says it was not checked (``ProblemKind.NOT_CHECKED``: CKD001, an error), never as a folder missing from the
report. At most ``window`` tasks are in the cluster at once (submitted and not yet taken), so neither the workers
nor the client hold more than that many runs' facts.

Dask is imported by the caller that builds the ``Client``; this module imports none of it, and nothing imports
this module unless a scan is given a client.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptdoctor.discover import (
    Cache,
    FolderTask,
    FolderWalk,
    Opened,
    PartCallback,
    discover_opened,
    lost_folder,
    open_root,
    plan_folders,
    walk_folder,
)
from ckptdoctor.limits import Limits
from ckptdoctor.model import PathProblem, ProblemKind, ReadProblem, Tree
from ckptdoctor.sources.interface import Source
from ckptdoctor.version import __version__

if TYPE_CHECKING:
    from ckptdoctor.cache.source import FactsCache
    from ckptdoctor.rules import Selection

# How many times a task that raised is run again (Dask's ``retries=``); a worker lost is Dask's to reschedule.
RETRIES = 2


@dataclass(slots=True)
class RootWalk:
    """A root walked whole by one task: the parts discovery handed on, judged, in walk order, and the rest."""

    parts: list[tuple[Tree, tuple[str, ...]]]
    rest: Tree


@dataclass(slots=True)
class Done:
    """What a task sends back: its value, and the ckptdoctor that made it (a worker running another version would
    judge differently: its result is not taken)."""

    version: str
    value: Any


def walk_root(opened: Opened[Any, Any], jobs: int, selection: Selection, cache: bool | None = False) -> Done:
    """The task of a root that is one run (or one checkpoint, or one file): discovered whole, each part's pickles
    and the rest's judged (``rules.judged``) where they were read. ``cache``: through this worker's own verdict
    cache (``worker_cache``)."""
    from ckptdoctor.rules import judged
    from ckptdoctor.scanner import forget_run

    parts: list[tuple[Tree, tuple[str, ...]]] = []
    memo = None if cache is False else worker_cache(opened.source, cache is True)
    if memo is not None:  # a copy: a task run again, or run in the client's process, finds the root as planned
        opened = Opened(opened.root, memo.source(opened.source), opened.found, list(opened.problems))

    def take(tree: Tree, above: tuple[str, ...]) -> None:
        parts.append((judged(tree, selection, memo), above))
        forget_run()

    rest = discover_opened(opened, jobs, None, take, left=None if memo is None else memo.left)
    rest = judged(rest, selection, memo)
    if memo is not None:
        memo.close()
    return Done(__version__, RootWalk(parts, rest))


def walk_one_folder(
    root: str, source: Source[Any, Any], task: FolderTask, jobs: int, selection: Selection, cache: bool | None = False
) -> Done:
    """The task of one folder of a root (``discover.walk_folder``), its parts' pickles judged where they were read.
    ``cache``: through this worker's own verdict cache (``worker_cache``), written once the task's parts are
    judged."""
    from ckptdoctor.rules import judged
    from ckptdoctor.scanner import forget_run

    memo = None if cache is False else worker_cache(source, cache is True)
    walked = walk_folder(root, source if memo is None else memo.source(source), task, jobs)
    walked.parts = [(judged(tree, selection, memo), above) for tree, above in walked.parts]
    forget_run()  # the worker's next task is another run
    if memo is not None:
        memo.close()  # the task's facts and verdicts, kept for the next scan that sends this run here
    return Done(__version__, walked)


def worker_cache(source: Source[Any, Any], fill: bool = True) -> FactsCache | None:
    """The verdict cache of the process running a task: its own user's cache folder (``cache.store.cache_dir``),
    as a serial scan on that machine would use; None when that folder cannot be used. The cache files are named
    after the root's real path or URL (``Source.where``, as the client resolved it), so a run's file is the same
    whichever task or scan wrote it."""
    from ckptdoctor.scanner import open_cache

    url = source.abs_root != ""  # a local source leaves ``abs_root`` to the scanner
    return open_cache(source.where, url, fill)


@dataclass(slots=True)
class _Root:
    """A root announced (``DaskFanOut.expect``), planned when the window reaches it."""

    path: str
    selection: Selection
    limits: Limits
    jobs: int
    cache: bool | None  # the workers read through their own verdict cache (``worker_cache``)


@dataclass(slots=True)
class _Plan:
    """A root planned: opened (its listing, for a URL), and whether one task walks it whole."""

    path: str
    opened: Opened[Any, Any]
    whole: bool


@dataclass(slots=True)
class _Task:
    """One task, in the order the scan takes the results: the function, its arguments, its future once submitted."""

    plan: _Plan
    rel: str  # the folder it walks ("." for a whole root)
    run: Callable[..., Done]
    args: tuple[Any, ...]
    future: Any = field(default=None)


class DaskFanOut:
    """Runs the tasks of a scan on a Dask ``distributed.Client`` (``client``), in order, at most ``window`` at a time
    (default: four per worker thread, at least 8). ``root_task`` and ``folder_task`` are the functions the workers
    run (``walk_root``, ``walk_one_folder``). ``taken`` counts the tasks whose results the scan took, ``lost`` those
    it reported as not checked."""

    root_task: Callable[..., Done] = staticmethod(walk_root)
    folder_task: Callable[..., Done] = staticmethod(walk_one_folder)

    def __init__(self, client: Any, *, retries: int = RETRIES, window: int | None = None) -> None:
        self.client = client
        self.retries = retries
        if window is None:
            window = max(8, 4 * sum(client.nthreads().values()))
        self.window = window
        self._roots: deque[_Root] = deque()  # announced, not planned yet
        self._plans: deque[_Plan] = deque()  # planned, not taken yet
        self._tasks: deque[_Task] = deque()  # planned, in the order they are taken
        self._flying = 0  # the first tasks of ``_tasks``, submitted
        self.taken = 0
        self.lost = 0

    def expect(self, path: str, selection: Selection, limits: Limits, jobs: int, cache: bool | None = False) -> None:
        """Announce a root the scan will ask for (``discover``), in order: its tasks may start before it is asked.
        ``cache``: its tasks read through their worker's verdict cache."""
        self._roots.append(_Root(path, selection, limits, jobs, cache))

    def discover(
        self,
        path: str,
        selection: Selection,
        limits: Limits,
        jobs: int,
        on_part: PartCallback,
        progress: Callable[[], None] | None = None,
        memo: Cache | None = None,
        cache: bool | None = False,
    ) -> Tree:
        """``discover.discover(path, ..., on_part=on_part)`` with each run's folder walked by a worker: the parts,
        then the rest of the root returned, exactly as the serial walk gives them (the parts' pickles judged under
        ``selection``'s allowances already). ``path`` must be the next root announced, if any was. ``memo``: the
        verdict cache the folders walked here read through (``discover``'s ``cache``); ``cache``: whether the
        workers use theirs, for a root not announced."""
        if not self._roots and not self._plans:
            self.expect(path, selection, limits, jobs, cache)
        while not self._plans:
            self._plan_next()
        plan = self._plans.popleft()
        if plan.path != path:
            raise ValueError(f"fan-out: asked for {path!r}, the next root announced is {plan.path!r}")
        self._fill()  # the workers start on its runs while the walk here lists the folders above them
        if plan.whole:
            done = self._take(self._tasks.popleft())
            if isinstance(done, str):
                return _lost_root(plan.opened, done)
            walked: RootWalk = done
            for tree, above in walked.parts:
                _tick(progress, tree.files_seen)
                on_part(tree, above)
            _tick(progress, walked.rest.files_seen)
            return walked.rest

        def handed(rel: str) -> FolderWalk | None:
            if not self._tasks or self._tasks[0].plan is not plan or self._tasks[0].rel != rel:
                return None  # not planned (the folder came after the listing): walked here
            task = self._tasks.popleft()
            done = self._take(task)
            if isinstance(done, str):
                folder: FolderTask = task.args[2]
                return lost_folder(plan.path, folder, done)
            return done  # type: ignore[no-any-return]

        opened = plan.opened
        if memo is not None:
            opened = Opened(opened.root, memo.source(opened.source), opened.found, opened.problems)
        try:
            return discover_opened(opened, jobs, progress, on_part, handed, None if memo is None else memo.left)
        finally:
            while self._tasks and self._tasks[0].plan is plan:  # planned folders gone since: nothing to take
                self._drop(self._tasks.popleft())

    def _plan_next(self) -> None:
        """Open and plan the next root announced, queueing its tasks."""
        root = self._roots.popleft()
        opened = open_root(root.path, root.limits)
        folders = plan_folders(opened)
        plan = _Plan(root.path, opened, folders is None)
        self._plans.append(plan)
        if folders is None:
            self._tasks.append(_Task(plan, ".", self.root_task, (opened, root.jobs, root.selection, root.cache)))
            return
        for folder in folders:
            source = opened.source.part(folder.entry.path)
            args = (root.path, source, folder, root.jobs, root.selection, root.cache)
            self._tasks.append(_Task(plan, folder.rel, self.folder_task, args))

    def _fill(self) -> None:
        """Submit tasks (planning roots as needed) until ``window`` are in the cluster."""
        while self._flying < self.window:
            if self._flying < len(self._tasks):
                self._submit(self._tasks[self._flying])
                self._flying += 1
            elif self._roots and len(self._plans) < self.window:
                self._plan_next()
            else:
                return

    def _submit(self, task: _Task) -> None:
        task.future = self.client.submit(task.run, *task.args, retries=self.retries, pure=False)

    def _take(self, task: _Task) -> Any:
        """The value of ``task`` (taken off the queue), or why it has none: a failure after the retries, or a
        worker running another ckptdoctor."""
        if task.future is None:
            self._submit(task)
        else:
            self._flying -= 1
        self._fill()  # keep the cluster busy while this result is waited for and judged
        where = "the root" if task.rel == "." else "this folder"
        self.taken += 1
        try:
            done = task.future.result()
        except BaseException as exc:  # asyncio's CancelledError (a cancelled future) is a BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            self.lost += 1
            why = " ".join(f"{type(exc).__name__}: {exc}".split())
            return f"not checked: the Dask task that reads {where} failed ({self.retries} retries): {why}"
        finally:
            task.future.release()
        if not isinstance(done, Done) or done.version != __version__:
            self.lost += 1
            theirs = done.version if isinstance(done, Done) else "an unknown version"
            return (
                f"not checked: a Dask worker runs ckptdoctor {theirs} and this scan {__version__}; "
                "install the same version on the workers"
            )
        return done.value

    def _drop(self, task: _Task) -> None:
        if task.future is not None:
            self._flying -= 1
            task.future.cancel()
            task.future.release()


def _lost_root(opened: Opened[Any, Any], why: str) -> Tree:
    """A root whose task failed for good: a tree that says it was not checked."""
    problem = PathProblem(".", ReadProblem(ProblemKind.NOT_CHECKED, why))
    problems = sorted([*opened.problems, problem], key=lambda p: (p.path, p.problem.kind.value))
    return Tree(root=opened.root, runs=(), path_problems=tuple(problems))


def _tick(progress: Callable[[], None] | None, n: int) -> None:
    if progress is not None:
        for _ in range(n):
            progress()
