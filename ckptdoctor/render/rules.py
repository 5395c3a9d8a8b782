"""The rule catalog as a table and one rule's document, as text: whole lines through a pipe, fitted to a terminal."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

from ckptdoctor.render.report import fit
from ckptdoctor.rules import Rule

_HEADERS = ["code", "name", "severity", "fix", "summary"]


def render_catalog(rules: Sequence[Rule], width: int | None = None) -> str:
    """One row per rule (code, name, severity and when it changes, fix safety, summary). ``width`` None (a pipe, a
    file) prints the table with every line whole; on a terminal narrower than the table each rule is a header line
    (``CKD001 unreadable-path [warning] (safe fix)``) with the other severities and the summary wrapped below it."""
    from tabulate import tabulate  # only the text catalog needs it

    rows = [[r.code, r.name, r.severity_text, r.fix.value if r.fix is not None else "", r.summary] for r in rules]
    table = str(tabulate(rows, headers=_HEADERS, tablefmt="simple"))
    if width is None or max(map(len, table.splitlines())) <= width:
        return table
    out: list[str] = []
    for r in rules:
        fix = f" ({r.fix.value} fix)" if r.fix is not None else ""
        out.extend(fit(f"{r.code} {r.name} [{r.severity.value}]{fix}", width))
        for sev, when in r.severity_when:
            out.extend(fit(f"  ({sev.value} when {when})", width))
        out.extend(fit(f"  {r.summary}", width, ""))
    return "\n".join(out)


def render_document(r: Rule, width: int | None = None) -> str:
    """``explain``'s text: a title, the other severities, then the rule's document. ``width`` None prints the
    document's lines as written; on a terminal each paragraph is rewrapped to the width when a line is wider."""
    header = f"{r.code} {r.name} ({r.severity.value}{f', {r.fix.value} fix' if r.fix is not None else ''})"
    lines = [header, "=" * len(header)]
    lines += [f"Reported as {sev.value} when {when}." for sev, when in r.severity_when]
    if r.severity_when:
        lines.append("")
    lines += inspect.cleandoc(r.doc).splitlines()
    if width is None or max(map(len, lines)) <= width:
        return "\n".join(lines)
    out: list[str] = []
    paragraph: list[str] = []

    def flush() -> None:
        if paragraph:
            out.extend(fit(" ".join(paragraph), width, ""))
            paragraph.clear()

    for line in lines:
        if not line.strip() or line.startswith(("#", "=")):  # headings and rules keep their own line
            flush()
            out.extend(fit(line, width, "") if line.strip() else [""])
        elif line.startswith("Reported as "):  # one sentence per line, as in the catalog
            flush()
            out.extend(fit(line, width))
        else:
            paragraph.append(line.strip())
    flush()
    return "\n".join(out)
