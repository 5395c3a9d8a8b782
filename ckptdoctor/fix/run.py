"""The fix run (API): plan, apply and rescan each root."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckptdoctor.findings import Finding
from ckptdoctor.fix.errors import FixRefused
from ckptdoctor.fix.journal import load_journals
from ckptdoctor.fix.plan import RootPlan, plan_root
from ckptdoctor.fix.transaction import apply_plan, complete_interrupted


@dataclass(frozen=True, slots=True)
class FixResult:
    """One ``fix`` over several roots: the plans, the transactions applied, and the rescan."""

    plans: tuple[RootPlan, ...]
    txids: tuple[str | None, ...]
    dry_run: bool
    fixed: int = 0
    remaining: tuple[Finding, ...] = ()
    failed_on: bool = False  # a remaining finding is at or above --fail-on

    @property
    def would_change(self) -> bool:
        return any(p.ops or p.interrupted for p in self.plans)

    def exit_code(self) -> int:
        if self.dry_run:
            return 1 if self.would_change else 0
        return 1 if self.failed_on else 0


def _check_roots(paths: Sequence[str]) -> None:
    from ckptdoctor.remote import is_remote

    reals: list[tuple[str, str]] = []
    for p in paths:
        if is_remote(p):
            raise FixRefused(
                f"{p}: `ckptdoctor fix` refuses remote roots: object storage has no atomic rename, lock or fsync, "
                f"so it cannot keep its guarantees (journal, undo byte for byte) there. Nothing was changed. "
                f"`ckptdoctor scan {p}` reads it; fix a local copy and upload that."
            )
        if not os.path.isdir(p):
            raise FixRefused(f"{p} is not a folder; `ckptdoctor fix` works on a run, checkpoint or model folder")
        reals.append((p, os.path.realpath(p)))
    for a, ra in reals:
        for b, rb in reals:
            if a != b and (ra == rb or rb.startswith(ra.rstrip(os.sep) + os.sep)):
                raise FixRefused(f"{b} is inside {a}: give each folder once")


def fix(
    paths: Sequence[str] | str,
    *,
    selection: Any = None,
    unsafe: bool = False,
    dry_run: bool = False,
    force: bool = False,
    fail_on: str = "error",
) -> FixResult:
    """Plan and (unless ``dry_run``) apply the fixes for each root, then rescan.

    ``selection`` is a ``ckptdoctor.rules.Selection``. Interrupted transactions are completed first (a dry run
    only reports them). A dry run writes nothing at all: no journal, no lock, no ``.ckptdoctor`` folder.
    """
    from ckptdoctor.scanner import scan

    roots = [paths] if isinstance(paths, str) else list(paths)
    _check_roots(roots)
    plans: list[RootPlan] = []
    txids: list[str | None] = []
    for root in roots:
        if dry_run:
            interrupted = tuple(j.txid for j in load_journals(root) if j.state in ("applying", "undoing"))
        else:
            interrupted = tuple(complete_interrupted(root))
        report = scan(root, selection=selection)
        (tree,) = report.trees
        plan = plan_root(tree, report.findings, unsafe=unsafe, root=root)
        plan = RootPlan(plan.root, plan.abs_root, tree, plan.ops, plan.planned, plan.skipped, plan.manual, interrupted)
        plans.append(plan)
        if dry_run:
            txids.append(None)
            continue
        j = apply_plan(plan, force=force)
        txids.append(None if j is None else j.txid)
    if dry_run:
        return FixResult(tuple(plans), tuple(txids), True)
    after = scan(roots, selection=selection)
    left = {(f.root, f.rule, f.path) for f in after.findings}
    fixed = sum(
        1
        for plan, tx in zip(plans, txids, strict=True)
        if tx is not None
        for f in plan.planned
        if (f.root, f.rule, f.path) not in left
    )
    return FixResult(tuple(plans), tuple(txids), False, fixed, after.findings, after.failed(fail_on))
