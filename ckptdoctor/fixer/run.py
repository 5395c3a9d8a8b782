"""The fix run (API): plan, apply and rescan each root; a dry run predicts what the real run would leave."""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptdoctor.findings import Finding, OpKind
from ckptdoctor.fixer.errors import FixRefused
from ckptdoctor.fixer.guard import preflight
from ckptdoctor.fixer.journal import load_journals
from ckptdoctor.fixer.paths import is_under
from ckptdoctor.fixer.plan import RootPlan, plan_root
from ckptdoctor.fixer.transaction import apply_plan, complete_interrupted
from ckptdoctor.model import FolderRole, Tree
from ckptdoctor.roots import PathArg, Roots
from ckptdoctor.settings.exit import ExitPolicy, Outcome

Rescope = Callable[[str, Tree, Sequence[Finding]], list[Finding]]
"""``(root, tree, findings) -> findings``: a scan's findings of one root judged under the settings files below it."""


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where ``resume_from_checkpoint=True`` picks up in one run of a fixed root, before and after the fix: the
    folder ``get_last_checkpoint`` returns, relative to the root (None: none, and ``train()`` raises). After a real
    fix it is the rescan's pick (what ``ckptdoctor gate`` loads); after a dry run, predicted from the plan."""

    root: str
    run: str
    before: str | None
    after: str | None

    @property
    def moved(self) -> bool:
        """Whether the fix changes where the resume picks up (it quarantined the folder picked before)."""
        return self.before != self.after


@dataclass(frozen=True, slots=True)
class FixResult(Outcome):
    """One ``fix`` over several roots: the plans, the transactions applied, and the rescan.

    In a dry run ``remaining`` is the prediction (what the plan leaves) and ``refusals`` says, per plan, why the
    real run would be refused now (None: it would not be). ``policy`` judges what remains: the caller's fail-on,
    and (set by ``ckptdoctor.fix``) each folder's settings file's, as the command line does: a security error fails
    even under a settings file's "never".
    """

    plans: tuple[RootPlan, ...]
    txids: tuple[str | None, ...]
    dry_run: bool
    fixed: int = 0
    remaining: tuple[Finding, ...] = ()
    refusals: tuple[str | None, ...] = ()
    policy: ExitPolicy = field(default_factory=ExitPolicy)
    resume_points: tuple[ResumePoint, ...] = ()  # each run's pick before and after (predicted in a dry run)

    @property
    def would_change(self) -> bool:
        """Whether the plans hold an operation or an interrupted transaction to complete."""
        return any(p.ops or p.interrupted for p in self.plans)

    def exit_code(self, *, on_security_kept: Callable[[], None] | None = None) -> int:
        """1 when findings at or above the fail-on remain (a dry run: would remain, or it would change something):
        ``exit_status``, whose ``on_security_kept()`` is called when only a settings file's fail-on = "never" would
        pass a security error that remains (the command line says so on stderr)."""
        return self.exit_status(on_security_kept=on_security_kept)

    def exit_policy(self) -> ExitPolicy:
        return self.policy

    def judged_findings(self) -> Sequence[Finding]:
        return self.remaining

    def pending_change(self) -> bool:
        # A dry run, as `ruff --diff`: 1 when it would change something. And 1 when the real run would exit 1, so a
        # dry run never passes a check the real run fails. A predicted refusal is not 2: the dry run did its job.
        return self.dry_run and self.would_change

    @classmethod
    def merge(cls, results: Sequence[FixResult], policy: ExitPolicy) -> FixResult:
        """The results of several ``fix`` calls (one per settings group) as one, judged by ``policy``; all dry runs
        or all real runs."""
        return cls(
            tuple(p for r in results for p in r.plans),
            tuple(t for r in results for t in r.txids),
            all(r.dry_run for r in results),
            sum(r.fixed for r in results),
            tuple(f for r in results for f in r.remaining),
            tuple(x for r in results for x in r.refusals),
            policy,
            resume_points=tuple(p for r in results for p in r.resume_points),
        )


def check_fix_roots(paths: Sequence[PathArg] | PathArg | Roots) -> Roots:
    """``paths`` as ``Roots`` checked for a fix (a checked ``Roots`` is returned as it is): ``FixRefused`` for a
    URL root, one that is not a folder, and one inside another (whatever their settings)."""
    roots = Roots.of(paths)
    if roots.checked:
        return roots
    reals: list[tuple[str, str]] = []
    for p in roots:
        if roots.url(p):
            raise FixRefused(
                f"{p}: `ckptdoctor fix` refuses remote roots: object storage has no atomic rename, lock or fsync, "
                f"so it cannot keep its guarantees (journal, undo byte for byte) there. Nothing was changed. "
                f"`ckptdoctor scan {p}` reads it; fix a local copy and upload that."
            )
        if not os.path.lexists(p):
            raise FixRefused(f"{p} does not exist; `ckptdoctor fix` works on a run, checkpoint or model folder")
        if not os.path.isdir(p):
            what = "a link to nothing" if not os.path.exists(p) else "not a folder"
            raise FixRefused(f"{p} is {what}; `ckptdoctor fix` works on a run, checkpoint or model folder")
        reals.append((p, os.path.realpath(p)))
    for a, ra in reals:
        for b, rb in reals:
            if a != b and (ra == rb or rb.startswith(ra.rstrip(os.sep) + os.sep)):
                raise FixRefused(f"{b} is inside {a}: give each folder once")
    return roots.passed()


def predicted_remaining(plan: RootPlan, findings: Iterable[Finding]) -> list[Finding]:
    """What a rescan after applying ``plan`` would still find, predicted from the scan the plan was made from.

    The findings the plan fixes go, and so does every finding inside a file or folder it quarantines (the move
    takes it away). A fix can change more than that (quarantining a stale checkpoint changes which one a resume
    picks), so this is a prediction; the real run rescans.
    """
    fixed = {id(f) for f in plan.planned}
    moved = tuple(op.path for op in plan.ops if op.kind == OpKind.QUARANTINE)
    return [f for f in findings if id(f) not in fixed and not any(is_under(f.path, m) for m in moved)]


def resume_points(plan: RootPlan, after: Tree | None) -> list[ResumePoint]:
    """Each run's pick in ``plan.tree`` and in ``after`` (the rescan: discovery's pick, which the gate loads), or,
    without a rescan (a dry run), the pick once the plan's quarantines are done: ``get_last_checkpoint`` over the
    run's `checkpoint-N` folders that stay (``discover.last_checkpoint``, the rule discovery picks by)."""
    from ckptdoctor.discover import last_checkpoint

    moved = tuple(op.path for op in plan.ops if op.kind == OpKind.QUARANTINE)
    later = {r.path: r.resume_pick for r in after.runs} if after is not None else {}
    out: list[ResumePoint] = []
    for run in plan.tree.runs:
        if run.standalone:
            continue  # a checkpoint given by path: nothing picks it
        if after is not None:
            pick = later.get(run.path)
        elif run.resume_pick is None or not any(is_under(run.resume_pick, m) for m in moved):
            pick = run.resume_pick  # quarantines only take folders away: the pick moves only when it goes
        else:
            kept = [
                c.path
                for c in run.checkpoints
                if c.role is FolderRole.CHECKPOINT and not any(is_under(c.path, m) for m in moved)
            ]
            name = last_checkpoint(posixpath.basename(p) for p in kept)
            pick = None if name is None else name if run.path == "." else f"{run.path}/{name}"
        out.append(ResumePoint(plan.root, run.path, run.resume_pick, pick))
    return out


def _refusal(plan: RootPlan, force: bool) -> str | None:
    """Why ``apply_plan`` would refuse ``plan`` now (read-only tree, a run being written), or None. Reads only."""
    if not plan.ops:
        return None
    try:
        preflight(plan, force=force)
    except FixRefused as e:
        return str(e).removesuffix("; nothing was changed")
    return None


def fix(
    paths: Sequence[PathArg] | PathArg | Roots,
    *,
    selection: Any = None,
    unsafe: bool = False,
    dry_run: bool = False,
    force: bool = False,
    fail_on: str = "error",
    rescope: Rescope | None = None,
) -> FixResult:
    """Plan and (unless ``dry_run``) apply the fixes for each root, then rescan.

    ``paths`` is one folder (``str`` or ``os.PathLike``) or a sequence of them. ``selection`` is a
    ``ckptdoctor.rules.Selection``, checked as ``scan`` checks it; no settings file is read (the command reads
    each root's). ``rescope(root, tree, findings)``, when given, returns the findings a scan of ``tree`` keeps once
    the settings files below the root are applied (``ckptdoctor.fix`` passes it): the plan and the rescan use those,
    so a folder whose own file ignores a rule gets no fix for it. A root named twice (same real path) is fixed once.
    Interrupted transactions are completed first (a dry run only reports them). A dry run writes nothing at all
    (no journal, no lock, no ``.ckptdoctor`` folder); it predicts what would remain and whether the real run
    would be refused (``FixResult.refusals``).
    """
    from ckptdoctor.scanner import Report, checked_selection, scan

    roots = check_fix_roots(paths)  # a Roots checked at the door (api.fix) is not checked again
    if selection is not None:  # before anything is written: a bad code fails the call, not the second root
        selection = checked_selection(selection)
    plans: list[RootPlan] = []
    txids: list[str | None] = []
    predicted: list[Finding] = []
    points: list[ResumePoint] = []
    for root in roots:
        if dry_run:
            interrupted = tuple(j.txid for j in load_journals(root) if j.state in ("applying", "undoing"))
        else:
            interrupted = tuple(complete_interrupted(root))
        report = scan(roots.only([root]), selection=selection)
        (tree,) = report.trees
        found = list(report.findings) if rescope is None else rescope(root, tree, report.findings)
        plan = plan_root(tree, found, unsafe=unsafe, root=root)
        plan = RootPlan(plan.root, plan.abs_root, tree, plan.ops, plan.planned, plan.skipped, plan.manual, interrupted)
        plans.append(plan)
        if dry_run:
            txids.append(None)
            predicted.extend(predicted_remaining(plan, found))
            points.extend(resume_points(plan, None))
            continue
        j = apply_plan(plan, force=force)
        txids.append(None if j is None else j.txid)
    if dry_run:
        refusals = tuple(_refusal(p, force) for p in plans)
        return FixResult(
            tuple(plans), tuple(txids), True, 0, tuple(predicted), refusals, ExitPolicy(fail_on),
            resume_points=tuple(points),
        )
    after = scan(roots, selection=selection)
    if rescope is not None:
        kept = [rescope(root, tree, [f for f in after.findings if f.root == tree.root])
                for root, tree in zip(roots, after.trees, strict=True)]
        after = Report(after.trees, tuple(f for part in kept for f in part), after.seconds)
    for plan, tree in zip(plans, after.trees, strict=True):
        points.extend(resume_points(plan, tree))
    left_keys = {(f.root, f.rule, f.path) for f in after.findings}
    fixed = sum(
        1
        for plan, tx in zip(plans, txids, strict=True)
        if tx is not None
        for f in plan.planned
        if (f.root, f.rule, f.path) not in left_keys
    )
    return FixResult(
        tuple(plans), tuple(txids), False, fixed, after.findings, (None,) * len(plans), ExitPolicy(fail_on),
        resume_points=tuple(points),
    )
