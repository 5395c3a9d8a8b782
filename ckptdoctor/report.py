"""Render a scan ``Report`` as a text table or as the ``ckptdoctor.report/1`` JSON document."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from ckptdoctor import __version__, views
from ckptdoctor.findings import Finding, Severity
from ckptdoctor.model import Checkpoint, FolderRole, Run, Tree
from ckptdoctor.scanner import Report

SCHEMA = "ckptdoctor.report/1"

_COLORS = {Severity.ERROR: "\x1b[31m", Severity.WARNING: "\x1b[33m", Severity.INFO: "\x1b[36m"}
_BOLD, _DIM, _RESET = "\x1b[1m", "\x1b[2m", "\x1b[0m"


def display_path(root: str, path: str) -> str:
    """A path as the user can paste it: the root they gave joined with the relative path."""
    if path in ("", "."):
        return root
    return path if root in ("", ".") else os.path.join(root, path)


def _lr(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def checkpoint_row(ck: Checkpoint) -> dict[str, Any]:
    """One checkpoint as the JSON report describes it."""
    ts = views.trainer_state(ck)
    return {
        "path": ck.path,
        "step": ck.step,
        "global_step": ts.global_step if ts else None,
        "max_steps": ts.max_steps if ts else None,
        "kinds": views.kinds(ck),
        "files": len(ck.files),
        "bytes": sum(f.size for f in ck.files),
        "tensors": views.tensor_count(ck),
        "learning_rate": _lr(views.checkpoint_lr(ck)),
    }


def ordered(run: Run) -> list[Checkpoint]:
    """Checkpoints in step order (numeric, so checkpoint-12 follows checkpoint-8), then the others by path."""
    return sorted(run.checkpoints, key=lambda c: (c.step is None, c.step or 0, c.path))


def finding_json(f: Finding) -> dict[str, Any]:
    """One finding in the shape every JSON document of ckptdoctor uses (scan, gate, fix)."""
    return {
        "rule": f.rule,
        "name": f.name,
        "severity": f.severity.value,
        "path": f.path,
        "message": f.message,
        "fix": {"applicability": f.fix.applicability.value, "title": f.fix.title} if f.fix else None,
        "root": f.root,
    }


def to_json(report: Report) -> dict[str, Any]:
    """The report as the documented ``ckptdoctor.report/1`` document."""
    runs = []
    for tree in report.trees:
        for run in tree.runs:
            runs.append(
                {
                    "root": tree.root,
                    "path": run.path,
                    "resume_pick": run.resume_pick,
                    "checkpoints": [checkpoint_row(ck) for ck in ordered(run)],
                }
            )
    return {
        "schema": SCHEMA,
        "version": __version__,
        "roots": [t.root for t in report.trees],
        "runs": runs,
        "findings": [finding_json(f) for f in report.findings],
        "summary": {
            "error": report.count(Severity.ERROR),
            "warning": report.count(Severity.WARNING),
            "info": report.count(Severity.INFO),
            "files": report.files,
            "seconds": round(report.seconds, 4),
        },
    }


def render_json(report: Report) -> str:
    """The JSON document as text (strict JSON: non-finite numbers were already mapped to null)."""
    return json.dumps(to_json(report), indent=2, allow_nan=False)


def human_bytes(n: int) -> str:
    """``1.3 KB``, ``52.4 MB``: decimal units, like ``ls -h --si``."""
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"  # pragma: no cover


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 error``, ``2 errors``, ``1,297 bytes``."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"


class _Style:
    def __init__(self, color: bool) -> None:
        self.color = color

    def sev(self, s: Severity, text: str) -> str:
        return f"{_COLORS[s]}{text}{_RESET}" if self.color else text

    def bold(self, text: str) -> str:
        return f"{_BOLD}{text}{_RESET}" if self.color else text

    def dim(self, text: str) -> str:
        return f"{_DIM}{text}{_RESET}" if self.color else text


def _status(ck: Checkpoint, run: Run, by_path: dict[str, list[Finding]]) -> str:
    worst: Severity | None = None
    n = 0
    prefix = "" if ck.path in ("", ".") else ck.path + "/"
    for path, fs in by_path.items():
        if path == ck.path or path.startswith(prefix) or (ck.path in ("", ".") and "/" not in path):
            for f in fs:
                n += 1
                if worst is None or f.severity.rank > worst.rank:
                    worst = f.severity
    label = "ok" if worst is None else f"{worst.value} ({n})"
    if run.resume_pick is not None and run.resume_pick == ck.path:
        label += "  <- resume picks"
    return label


def _run_table(tree: Tree, run: Run, findings: list[Finding]) -> str:
    from tabulate import tabulate  # only the text report needs it

    by_path: dict[str, list[Finding]] = {}
    for f in findings:
        by_path.setdefault(f.path, []).append(f)
    rows = []
    for ck in ordered(run):
        row = checkpoint_row(ck)
        name = ck.path if run.path in ("", ".") else ck.path[len(run.path) + 1 :] or "."
        if ck.role == FolderRole.MODEL and name == ".":
            name = ". (model files)"
        lr = row["learning_rate"]
        rows.append(
            [
                name,
                "" if row["step"] is None else row["step"],
                ",".join(k for k in row["kinds"] if k not in ("optimizer", "scheduler", "trainer-state")) or "-",
                "-" if row["tensors"] is None else f"{row['tensors']:,}",
                human_bytes(row["bytes"]),
                "-" if lr is None else f"{lr:.3g}",
                _status(ck, run, by_path),
            ]
        )
    headers = ["checkpoint", "step", "weights", "tensors", "size", "lr", "status"]
    return str(tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True))


def render_text(report: Report, *, color: bool = False) -> str:
    """Tables of checkpoints per run, then findings grouped like a linter's, then a one-line summary."""
    st = _Style(color)
    out: list[str] = []
    for tree in report.trees:
        tree_findings = [f for f in report.findings if f.root == tree.root]
        for run in tree.runs:
            title = display_path(tree.root, run.path)
            pick = run.resume_pick
            pick_txt = (
                f"resume_from_checkpoint=True picks `{display_path(tree.root, pick)}`"
                if pick
                else ("given directly (pass it as resume_from_checkpoint)" if run.standalone else "nothing to resume")
            )
            out.append(st.bold(f"{title}") + st.dim(f"  ({pick_txt})"))
            out.append(_run_table(tree, run, tree_findings))
            out.append("")
    if report.findings:
        for f in report.findings:
            where = display_path(f.root, f.path)
            sev = st.sev(f.severity, f.severity.value)
            out.append(f"{st.bold(where)}: {st.bold(f.rule)} [{sev}] {f.message}")
            if f.fix is not None:
                out.append(st.dim(f"  fix ({f.fix.applicability.value}): {f.fix.title}"))
        out.append("")
    out.append(summary_line(report))
    return "\n".join(out)


def summary_line(report: Report) -> str:
    """``Found 2 errors, 1 warning, 0 infos in 37 files (0.04 s).`` or ``No problems found in ...``."""
    e, w, i = (report.count(s) for s in (Severity.ERROR, Severity.WARNING, Severity.INFO))
    where = f"in {plural(report.files, 'file')} ({report.seconds:.2f} s)"
    if e + w + i == 0:
        return f"No problems found {where}."
    return f"Found {plural(e, 'error')}, {plural(w, 'warning')}, {plural(i, 'info')} {where}."
