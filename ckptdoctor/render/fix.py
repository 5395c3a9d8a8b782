"""The fix run as text (the plan, diffs, what is skipped, the summary) and as a ``ckptdoctor.fix/1`` document; undo's
list and result as text and as a ``ckptdoctor.undo/1`` document."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from typing import Any

from ckptdoctor.findings import Finding
from ckptdoctor.fixer.journal import Journal
from ckptdoctor.fixer.paths import quarantine_path
from ckptdoctor.fixer.run import FixResult

FIX_SCHEMA = "ckptdoctor.fix/1"
UNDO_SCHEMA = "ckptdoctor.undo/1"


@functools.cache
def fix_hint(code: str) -> str | None:
    """The first paragraph of rule ``code``'s "Fix safety" section on one line (``No automatic fix: ...``), for a
    rule without a fix; None for a fixable rule or an unknown code."""
    import inspect

    from ckptdoctor.rules import get_rule

    r = get_rule(code)
    if r is None or r.fixable:  # a fixable rule's section describes its fix, which this finding does not carry
        return None
    section = inspect.cleandoc(r.doc).partition("## Fix safety\n")[2].strip()
    para = section.split("\n\n", 1)[0].split("\n## ", 1)[0]
    return " ".join(para.split()) or None


def finding_lines(findings: Sequence[Finding], width: int | None = None) -> list[str]:
    """Each finding as the scan's text report shows it (names escaped, its fix title, repeats grouped, wrapped to a
    terminal's ``width``), plus the rule's hint (its "Fix safety" line) when the rule has no fix."""
    from ckptdoctor.render.report import finding_entries

    return finding_entries(findings, width=width, hint=lambda f: None if f.fix is not None else fix_hint(f.rule))


def render_fix_text(result: FixResult, *, width: int | None = None, quiet: bool = False) -> str:
    """The plan (every operation, diffs of rewrites), what is skipped and why, then what remains and the summary.

    A dry run shows what would remain (predicted) and, when the real run would be refused now, why. ``width`` (a
    terminal's) wraps every line but the diffs' to it; ``quiet`` prints what remains only (``-q``).
    """
    if quiet:
        return "\n".join(finding_lines(result.remaining, width))
    lines = _render_fix_text(result, width)
    if width is None:
        return "\n".join(lines)
    from ckptdoctor.render.report import fit

    return "\n".join(w for ln in lines for w in ([ln] if isinstance(ln, _Verbatim) else fit(ln, width)))


class _Verbatim(str):
    """A line shown as it is on any terminal: a diff line, whose wrapping would read as another change."""


def _render_fix_text(result: FixResult, width: int | None) -> list[str]:
    from ckptdoctor.facts import plural

    out: list[str] = []
    verb = "would " if result.dry_run else ""
    refusals = result.refusals or (None,) * len(result.plans)
    roots_left = {f.root for f in result.remaining}
    for plan, tx, refused in zip(result.plans, result.txids, refusals, strict=True):
        out.append(f"{plan.root}:")
        for t in plan.interrupted:
            out.append(f"  {'would complete' if result.dry_run else 'completed'} interrupted transaction {t}")
        if not plan.ops:
            left = plan.root in roots_left
            out.append("  nothing ckptdoctor can fix automatically" if left else "  nothing to fix")
        for op in plan.ops:
            out.append(f"  [{','.join(op.rules)}] {op.title}")
            out.append(f"    {verb}{op.describe(tx or '<txid>')}")
            out.extend(_Verbatim("    " + ln) for ln in op.diff.rstrip("\n").splitlines())
        for s in plan.skipped:
            out.append(f"  skipped [{s.finding.rule}] {s.finding.fix.title if s.finding.fix else ''}: {s.reason}")
        for f in plan.manual:
            out.append(f"  manual [{f.rule}] {f.fix.title if f.fix else f.message}")
        out.extend(_resume_lines(result, plan.root))
        if refused:
            out.append(f"  without --dry-run this fix would be refused now: {refused}")
    out.append("")
    n_left = len(result.remaining)
    if result.dry_run:
        return out + _dry_run_summary(result, width)
    out.extend(finding_lines(result.remaining, width))
    for plan, tx in zip(result.plans, result.txids, strict=True):
        if tx is not None:
            out.append(f"Transaction {tx} applied to {plan.root}; `ckptdoctor undo {plan.root}` restores it.")
    out.append(f"Fixed {plural(result.fixed, 'problem')}, {n_left:,} remain{'s' if n_left == 1 else ''}.")
    return out


def _resume_lines(result: FixResult, root: str) -> list[str]:
    """Where the resume picks up now in each run of ``root`` whose pick the fix moved (a dry run: would)."""
    from ckptdoctor.render.report import printable

    out: list[str] = []
    for p in result.resume_points:
        if p.root != root or not p.moved:
            continue
        run = "" if p.run in ("", ".") else f" in `{printable(p.run)}`"
        if p.after is None:
            now = "would find" if result.dry_run else "now finds"
            out.append(f"  resume_from_checkpoint=True{run} {now} no checkpoint: train() raises (start afresh)")
        else:
            now = "would pick up" if result.dry_run else "now picks up"
            was = f" instead of `{printable(p.before)}`" if p.before is not None else ""
            out.append(f"  resume_from_checkpoint=True{run} {now} from `{printable(p.after)}`{was}")
    return out


def _dry_run_summary(result: FixResult, width: int | None) -> list[str]:
    """What would remain (predicted, as the real run lists it) and the dry run's last line."""
    from ckptdoctor.facts import plural

    n_left = len(result.remaining)
    left = finding_lines(result.remaining, width)
    remain = f"{plural(n_left, 'problem')} would remain"
    if not result.would_change:
        if not n_left:
            return ["Nothing to fix."]
        return [
            f"Nothing ckptdoctor can fix automatically; {plural(n_left, 'problem')} remain{'s' * (n_left == 1)}:",
            *left,
        ]
    n_ops = sum(len(p.ops) for p in result.plans)
    n_planned = sum(len(p.planned) for p in result.plans)
    head = [f"Predicted to remain after the fix ({remain}):", *left] if n_left else []
    then = f"{plural(n_planned, 'problem')} with {plural(n_ops, 'operation')}" + (f", {remain}" if n_left else "")
    if any(result.refusals):
        return [*head, f"Would fix {then}; without --dry-run the fix would be refused now (see above)."]
    return [*head, f"Would fix {then}; run without --dry-run to apply."]


def fix_json(result: FixResult) -> dict[str, Any]:
    """The ``ckptdoctor.fix/1`` document.

    Each root's ``resume`` lists its runs' picks: ``{"run", "before", "after"}``, the folder
    ``resume_from_checkpoint=True`` picks up from before and after the fix (relative to the root; null: none), after
    the rescan in a real run and predicted in a dry run.
    In a dry run ``summary.fixed`` is 0, ``summary.would_fix`` the problems the plan fixes (the text's "Would fix N
    problems"; null in a real run, where ``fixed`` counts what the rescan no longer finds),
    ``summary.remain`` and ``remaining`` are the prediction (what the plan would leave) and each
    root's ``refused`` says why the real run would be refused now (null: it would not be; always null in a real
    run, where a refusal is exit 2 with the reason on stderr).
    """
    from ckptdoctor.findings import finding_json
    from ckptdoctor.version import __version__

    refusals = result.refusals or (None,) * len(result.plans)
    roots = []
    for plan, tx, refused in zip(result.plans, result.txids, refusals, strict=True):
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
                "refused": refused,
                "resume": [
                    {"run": p.run, "before": p.before, "after": p.after}
                    for p in result.resume_points
                    if p.root == plan.root
                ],
            }
        )
    return {
        "schema": FIX_SCHEMA,
        "version": __version__,
        "dry_run": result.dry_run,
        "roots": roots,
        "summary": {
            "operations": sum(len(p.ops) for p in result.plans),
            "fixed": result.fixed,
            "would_fix": sum(len(p.planned) for p in result.plans) if result.dry_run else None,
            "remain": len(result.remaining),
        },
        "remaining": [finding_json(f) for f in result.remaining],
    }


def _created(j: Journal) -> float | None:
    """When the transaction began (Unix seconds), or None: a journal is read from disk and may hold any number."""
    # `time.localtime` overflows on a huge or non-finite time, and strict JSON has no NaN.
    return j.created if math.isfinite(j.created) and 0 <= j.created < 253402300800 else None  # before year 10000


def render_undo_list(path: str, journals: Sequence[Journal]) -> str:
    """The transactions recorded under root ``path`` as a table (txid, local time, state, operations, rules)."""
    from tabulate import tabulate

    from ckptdoctor.render.report import printable

    if not journals:
        return f"No fix transactions under {printable(path)}."
    rows = []
    for j in journals:
        created = _created(j)
        when = "-" if created is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created))
        rows.append([j.txid, when, j.state, len(j.ops), printable(",".join(j.rules))])
    return str(tabulate(rows, headers=["txid", "created", "state", "ops", "rules"], tablefmt="simple"))


def _undo_head(path: str, action: str, refused: str | None) -> dict[str, Any]:
    from ckptdoctor.version import __version__

    return {"schema": UNDO_SCHEMA, "version": __version__, "action": action, "root": path, "refused": refused}


def undo_list_json(path: str, journals: Sequence[Journal], refused: str | None = None) -> dict[str, Any]:
    """The ``ckptdoctor.undo/1`` document of ``undo --list``: ``action`` is ``"list"``, ``transactions`` what the
    text table shows, oldest first (``created`` in Unix seconds and ``created_utc`` in ISO 8601, both null when the
    journal holds no usable time; ``operations`` the number of operations); ``refused`` why the journals could not
    be read (null: they could; then exit 0)."""
    transactions = []
    for j in journals:
        created = _created(j)
        transactions.append(
            {
                "txid": j.txid,
                "state": j.state,
                "created": created,
                "created_utc": None if created is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
                "operations": len(j.ops),
                "rules": j.rules,
            }
        )
    return {**_undo_head(path, "list", refused), "transactions": transactions}


def undo_json(
    path: str, txid: str | None, *, restored: int = 0, operations: int | None = None, refused: str | None = None
) -> dict[str, Any]:
    """The ``ckptdoctor.undo/1`` document of ``undo``: ``action`` is ``"undo"``, ``txid`` the transaction undone
    (when refused: the one asked for with --txid, else null), ``operations`` how many it holds (null when refused)
    and ``restored`` how many were put back (an operation a crash left unapplied has nothing to restore);
    ``refused`` why nothing was changed (null: the undo was done; then exit 0)."""
    return {**_undo_head(path, "undo", refused), "txid": txid, "operations": operations, "restored": restored}
