"""The fix run as text (the plan, diffs, what is skipped, the summary) and as a ``ckptdoctor.fix/1`` document."""

from __future__ import annotations

from typing import Any

from ckptdoctor.fix.paths import quarantine_path
from ckptdoctor.fix.run import FixResult

FIX_SCHEMA = "ckptdoctor.fix/1"


def render_fix_text(result: FixResult) -> str:
    """The plan (every operation, diffs of rewrites), what is skipped and why, then the summary lines."""
    from ckptdoctor.report import display_path, plural

    out: list[str] = []
    verb = "would " if result.dry_run else ""
    for plan, tx in zip(result.plans, result.txids, strict=True):
        out.append(f"{plan.root}:")
        for t in plan.interrupted:
            out.append(f"  {'would complete' if result.dry_run else 'completed'} interrupted transaction {t}")
        if not plan.ops:
            out.append("  nothing to fix")
        for op in plan.ops:
            out.append(f"  [{','.join(op.rules)}] {op.title}")
            out.append(f"    {verb}{op.describe(tx or '<txid>')}")
            out.extend("    " + ln for ln in op.diff.rstrip("\n").splitlines())
        for s in plan.skipped:
            out.append(f"  skipped [{s.finding.rule}] {s.finding.fix.title if s.finding.fix else ''}: {s.reason}")
        for f in plan.manual:
            out.append(f"  manual [{f.rule}] {f.fix.title if f.fix else f.message}")
    out.append("")
    n_ops = sum(len(p.ops) for p in result.plans)
    n_planned = sum(len(p.planned) for p in result.plans)
    if result.dry_run:
        if result.would_change:
            out.append(
                f"Would fix {plural(n_planned, 'problem')} with {plural(n_ops, 'operation')}; "
                "run without --dry-run to apply."
            )
        else:
            out.append("Nothing to fix.")
        return "\n".join(out)
    for f in result.remaining:
        out.append(f"{display_path(f.root, f.path)}: {f.rule} [{f.severity.value}] {f.message}")
    for plan, tx in zip(result.plans, result.txids, strict=True):
        if tx is not None:
            out.append(f"Transaction {tx} applied to {plan.root}; `ckptdoctor undo {plan.root}` restores it.")
    n_left = len(result.remaining)
    out.append(f"Fixed {plural(result.fixed, 'problem')}, {n_left:,} remain{'s' if n_left == 1 else ''}.")
    return "\n".join(out)


def fix_json(result: FixResult) -> dict[str, Any]:
    """The ``ckptdoctor.fix/1`` document."""
    from ckptdoctor import __version__
    from ckptdoctor.report import to_json
    from ckptdoctor.scanner import Report

    roots = []
    for plan, tx in zip(result.plans, result.txids, strict=True):
        roots.append(
            {
                "root": plan.root,
                "txid": tx,
                "interrupted": list(plan.interrupted),
                "operations": [
                    {
                        "rules": list(op.rules),
                        "title": op.title,
                        "kind": op.kind.value,
                        "path": op.path,
                        "is_dir": op.is_dir,
                        "quarantine": quarantine_path(tx or "<txid>", op.path),
                        "change": op.change or None,
                        "diff": op.diff or None,
                    }
                    for op in plan.ops
                ],
                "skipped": [{"rule": s.finding.rule, "path": s.finding.path, "reason": s.reason} for s in plan.skipped],
                "manual": [{"rule": f.rule, "path": f.path} for f in plan.manual],
            }
        )
    remaining = to_json(Report((), result.remaining, 0.0))["findings"]
    return {
        "schema": FIX_SCHEMA,
        "version": __version__,
        "dry_run": result.dry_run,
        "roots": roots,
        "summary": {
            "operations": sum(len(p.ops) for p in result.plans),
            "fixed": result.fixed,
            "remain": None if result.dry_run else len(result.remaining),
        },
        "remaining": None if result.dry_run else remaining,
    }
