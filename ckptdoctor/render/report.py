"""Render a scan ``Report`` as a text table or as the ``ckptdoctor.report/1`` JSON document."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ckptdoctor import __version__, trainer_view
from ckptdoctor.findings import Finding, Severity, display_path, finding_json
from ckptdoctor.model import Checkpoint, FolderRole, Framework, Run, Tree
from ckptdoctor.scanner import Report

SCHEMA = "ckptdoctor.report/1"

_COLORS = {Severity.ERROR: "\x1b[31m", Severity.WARNING: "\x1b[33m", Severity.INFO: "\x1b[36m"}
_BOLD, _DIM, _RESET = "\x1b[1m", "\x1b[2m", "\x1b[0m"


# What a terminal would act on rather than show: C0/C1 controls (ESC starts colour and cursor sequences, CR and LF
# forge lines) and the bidirectional overrides that reorder text ("Trojan Source"). File names and strings read
# from checkpoints reach the text report, so they are shown escaped.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with control and bidi-override characters as ``\\xNN`` / ``\\uNNNN`` escapes, for a terminal."""
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)


def _lr(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


_FRAMEWORK_NAMES = {Framework.PYTORCH: "PyTorch", Framework.MINDNLP: "MindNLP", Framework.TENSORFLOW: "TensorFlow"}


def checkpoint_row(ck: Checkpoint) -> dict[str, Any]:
    """One checkpoint as the JSON report describes it."""
    ts = trainer_view.trainer_state(ck)
    return {
        "path": ck.path,
        "step": ck.step,
        "global_step": ts.global_step if ts else None,
        "max_steps": ts.max_steps if ts else None,
        "kinds": trainer_view.kinds(ck),
        "framework": ck.framework.value,
        "files": len(ck.files),
        "bytes": sum(f.size for f in ck.files),
        "tensors": trainer_view.tensor_count(ck),
        "learning_rate": _lr(trainer_view.checkpoint_lr(ck)),
    }


def ordered(run: Run) -> list[Checkpoint]:
    """Checkpoints in step order (numeric, so checkpoint-12 follows checkpoint-8), then the others by path."""
    return sorted(run.checkpoints, key=lambda c: (c.step is None, c.step or 0, c.path))


def allowances(report: Report) -> list[dict[str, str]]:
    """Each pickle global only the user's allowances let through: file, global, pattern, origin (``--allow-global``
    or the user configuration file's path)."""
    out = []
    for tree in report.trees:
        for path, verdict in tree.pickle_verdicts or ():
            for dotted, pattern, origin in verdict.allowed_by_user:
                file = display_path(tree.root, path)
                out.append({"file": file, "global": dotted, "pattern": pattern, "origin": origin})
    return out


def to_json(report: Report) -> dict[str, Any]:
    """The report as the documented ``ckptdoctor.report/1`` document: ``settings`` lists each settings file applied
    with the folders it governed (``allowed_globals`` when a user allowance let a pickle global through)."""
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
    doc: dict[str, Any] = {
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
        "settings": [{"path": u.path, "trusted": u.trusted, "folders": list(u.folders)} for u in report.settings],
    }
    allowed = allowances(report)
    if allowed:
        doc["allowed_globals"] = allowed
    return doc


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


def _tally(findings: list[Finding]) -> dict[str, dict[Severity, int]]:
    """For every folder that holds a finding's path (the path itself included, ``.`` for all): the count of each
    severity.

    One pass over the findings' path prefixes, so a run of 10,000 checkpoints renders in linear time.
    """
    out: dict[str, dict[Severity, int]] = {}
    for f in findings:
        parts = f.path.split("/")
        for key in {".", *("/".join(parts[:i]) for i in range(1, len(parts) + 1))}:
            counts = out.setdefault(key, {})
            counts[f.severity] = counts.get(f.severity, 0) + 1
    return out


def _status(ck: Checkpoint, run: Run, tally: dict[str, dict[Severity, int]]) -> str:
    """``ok``, or each severity's count, worst first (``2 errors, 1 info``), worded as the summary line counts them
    (one count labelled with the worst severity, ``error (3)``, read as three errors)."""
    found = tally.get("." if ck.path in ("", ".") else ck.path)
    if found is None:
        label = "ok"
    else:
        worst_first = sorted(found, key=lambda s: -s.rank)
        label = ", ".join(plural(found[s], s.value) for s in worst_first)
    if run.resume_pick is not None and run.resume_pick == ck.path:
        label += "  <- resume picks"
    return label


def _run_table(tree: Tree, run: Run, findings: list[Finding]) -> str:
    from tabulate import tabulate  # only the text report needs it

    tally = _tally(findings)
    rows = []
    for ck in ordered(run):
        row = checkpoint_row(ck)
        name = ck.path if run.path in ("", ".") else ck.path[len(run.path) + 1 :] or "."
        if ck.role == FolderRole.MODEL and name == ".":
            name = ". (model files)"
        lr = row["learning_rate"]
        rows.append(
            [
                printable(name),
                "" if row["step"] is None else row["step"],
                ",".join(k for k in row["kinds"] if k not in ("optimizer", "scheduler", "trainer-state")) or "-",
                "-" if row["tensors"] is None else f"{row['tensors']:,}",
                human_bytes(row["bytes"]),
                "-" if lr is None else f"{lr:.3g}",
                _status(ck, run, tally),
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
            title = printable(display_path(tree.root, run.path))
            pick = run.resume_pick
            pick_txt = (
                f"resume_from_checkpoint=True picks `{printable(display_path(tree.root, pick))}`"
                if pick
                else ("given directly (pass it as resume_from_checkpoint)" if run.standalone else "nothing to resume")
            )
            frameworks = sorted({ck.framework for ck in run.checkpoints if ck.framework is not Framework.PYTORCH})
            if frameworks:  # another stack's checkpoints: say whose, and how it restores a TF folder
                names = ", ".join(_FRAMEWORK_NAMES[fw] for fw in frameworks)
                if frameworks == [Framework.TENSORFLOW] and not pick:
                    bundle = any(f.name == "checkpoint" for ck in run.checkpoints for f in ck.files)
                    pick_txt = "a restart restores the bundle `checkpoint` names" if bundle else "weights for Keras"
                pick_txt = f"{names}; {pick_txt}"
            out.append(st.bold(f"{title}") + st.dim(f"  ({pick_txt})"))
            out.append(_run_table(tree, run, tree_findings))
            out.append("")
    if report.findings:
        for f in report.findings:
            out.extend(_finding_text(f, st))
        out.append("")
    allowed = allowances(report)
    for a in allowed:
        origin = a["origin"] if a["origin"] == "--allow-global" else f"allow-globals in {a['origin']}"
        out.append(st.dim(f"{printable(a['file'])}: pickle global `{printable(a['global'])}` allowed by "
                          f"{printable(origin)} `{printable(a['pattern'])}`"))  # fmt: skip
    if allowed:
        out.append("")
    out.append(summary_line(report))
    return "\n".join(out)


def finding_text(f: Finding) -> list[str]:
    """One finding as the text report prints it: ``path: CODE [severity] message``, then its fix, if it has one."""
    return _finding_text(f, _Style(False))


def _finding_text(f: Finding, st: _Style) -> list[str]:
    where = printable(display_path(f.root, f.path))
    sev = st.sev(f.severity, f.severity.value)
    lines = [f"{st.bold(where)}: {st.bold(f.rule)} [{sev}] {printable(f.message)}"]
    if f.fix is not None:
        lines.append(st.dim(f"  fix ({f.fix.applicability.value}): {printable(f.fix.title)}"))
    return lines


def summary_line(report: Report) -> str:
    """``Found 2 errors, 1 warning, 0 infos in 37 files (0.04 s).`` or ``No problems found in ...``."""
    e, w, i = (report.count(s) for s in (Severity.ERROR, Severity.WARNING, Severity.INFO))
    where = f"in {plural(report.files, 'file')} ({report.seconds:.2f} s)"
    if e + w + i == 0:
        return f"No problems found {where}."
    return f"Found {plural(e, 'error')}, {plural(w, 'warning')}, {plural(i, 'info')} {where}."
