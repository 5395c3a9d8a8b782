"""Render a scan ``Report`` as a text table or as the ``ckptdoctor.report/1`` JSON document."""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from json.encoder import encode_basestring_ascii as _quoted
from typing import Any, NamedTuple

from ckptdoctor import stacks, trainer_view
from ckptdoctor.facts import plural
from ckptdoctor.findings import Finding, Severity, display_path, finding_json, path_order
from ckptdoctor.model import Checkpoint, FolderRole, Framework, Run, Stack, Tree
from ckptdoctor.patterns import lazy
from ckptdoctor.scanner import Report
from ckptdoctor.stacks import accelerate as acc
from ckptdoctor.stacks import lightning
from ckptdoctor.stacks import torchtitan as titan
from ckptdoctor.version import __version__

SCHEMA = "ckptdoctor.report/1"
# `scan --format jsonl`: one finding per line, then one summary line, each naming its schema.
FINDING_SCHEMA = "ckptdoctor.finding/1"
SUMMARY_SCHEMA = "ckptdoctor.summary/1"

_COLORS = {Severity.ERROR: "\x1b[31m", Severity.WARNING: "\x1b[33m", Severity.INFO: "\x1b[36m"}
_BOLD, _DIM, _RESET = "\x1b[1m", "\x1b[2m", "\x1b[0m"


# What a terminal would act on rather than show: C0/C1 controls (ESC starts colour and cursor sequences, CR and LF
# forge lines) and the bidirectional overrides that reorder text ("Trojan Source"). File names and strings read
# from checkpoints reach the text report, so they are shown escaped.
_UNPRINTABLE = lazy("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with control and bidi-override characters as ``\\xNN`` / ``\\uNNNN`` escapes, for a terminal."""
    return _UNPRINTABLE.sub(lambda m: f"\\x{ord(m[0]):02x}" if ord(m[0]) < 0x100 else f"\\u{ord(m[0]):04x}", text)


def _lr(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


_FRAMEWORK_NAMES = {Framework.PYTORCH: "PyTorch", Framework.MINDNLP: "MindNLP", Framework.TENSORFLOW: "TensorFlow"}


def checkpoint_row(ck: Checkpoint) -> dict[str, Any]:
    """One checkpoint as the JSON report describes it."""
    ts = trainer_view.trainer_state(ck)
    step, global_step = ck.step, ts.global_step if ts else None
    if step is None and ck.stack is Stack.ACCELERATE:
        step = acc.shown_step(ck)
    elif ck.stack is Stack.LIGHTNING:  # a folder of .ckpt files: the counters of the one "last" loads
        step, global_step = lightning.shown_steps(ck)
    return {
        "path": ck.path,
        "step": step,
        "global_step": global_step,
        "max_steps": ts.max_steps if ts else None,
        "kinds": titan.kinds(ck) if ck.stack is Stack.TORCHTITAN else trainer_view.kinds(ck),
        "framework": ck.framework.value,
        "stack": ck.stack.value,
        "files": len(ck.files),
        "bytes": sum(f.size for f in ck.files),
        "tensors": trainer_view.tensor_count(ck),
        "learning_rate": _lr(trainer_view.checkpoint_lr(ck)),
    }


def ordered(run: Run) -> list[Checkpoint]:
    """Checkpoints in step order (numeric, so checkpoint-12 follows checkpoint-8), then the others by path."""
    return sorted(run.checkpoints, key=lambda c: (c.step is None, c.step or 0, path_order(c.path)))


def allowances(report: Report, pieces: RunPieces | None = None) -> list[dict[str, str]]:
    """Each pickle global only the user's allowances let through: file, global, pattern, origin (``--allow-global``
    or the user configuration file's path)."""
    return (pieces or RunPieces.of(report, "json")).allowed()


def _allowances(tree: Tree) -> list[tuple[tuple[Any, ...], dict[str, str]]]:
    """``tree``'s allowances (``allowances``), each with its place in ``Tree.all_files`` order: the run's path and
    the file's index in it, or the loose file's path (``RunPieces`` sorts the parts of a root with it)."""
    used = [(path, v) for path, v in tree.pickle_verdicts or () if v.allowed_by_user]
    if not used:
        return []
    where: dict[str, tuple[Any, ...]] = {f.path: (1, f.path, 0) for f in tree.loose_files}
    for run in tree.runs:
        i = 0
        for ck in run.checkpoints:
            for f in ck.files:
                where[f.path] = (0, run.path, i)
                i += 1
    out = []
    for path, verdict in used:
        for dotted, pattern, origin in verdict.allowed_by_user:
            file = display_path(tree.root, path)
            out.append((where[path], {"file": file, "global": dotted, "pattern": pattern, "origin": origin}))
    return out


def run_entry(root: str, run: Run) -> dict[str, Any]:
    """One run as the JSON report's ``runs`` lists it."""
    return {
        "root": root,
        "path": run.path,
        "resume_pick": run.resume_pick,
        "stack": run.stack.value,
        "checkpoints": [checkpoint_row(ck) for ck in ordered(run)],
    }


class RunPieces:
    """What a report keeps of each run once its part of the scan is judged (``api.scan_roots``'s ``on_part``): its
    rendered table (text) or its ``runs`` entry (JSON) and the pickle globals the user's allowances let through,
    never its facts, which the scan then releases. Pieces are put back in the report's order (roots in order, runs
    by path) whatever order the parts came in."""

    def __init__(self, fmt: str, *, color: bool = False, width: int | None = None) -> None:
        self.fmt = fmt  # "text" keeps tables, "json" keeps entries, anything else keeps allowances only
        self.style = _Style(color)
        self.width = width
        self._runs: list[tuple[int, str, Any]] = []
        self._allowed: list[tuple[int, tuple[Any, ...], dict[str, str]]] = []

    @classmethod
    def of(cls, report: Report, fmt: str, *, color: bool = False, width: int | None = None) -> RunPieces:
        """The pieces of a report that holds its trees whole."""
        pieces = cls(fmt, color=color, width=width)
        for i, tree in enumerate(report.trees):
            pieces.add(i, tree, [f for f in report.findings if f.root == tree.root])
        return pieces

    def add(self, index: int, tree: Tree, findings: Sequence[Finding]) -> None:
        """Keep the pieces of ``tree`` (the root ``index``-th in the report, or a part of it) and its ``findings``."""
        for run in tree.runs:
            if self.fmt == "text":
                self._runs.append((index, run.path, _run_facts(tree.root, run, self.style, self.width)))
            elif self.fmt == "json":
                # As compact JSON text, compressed, decoded again by ``runs``: one object per run instead of a dict,
                # a list and their values per checkpoint, which a fleet's report kept to its end; its rows repeat
                # (a 100-checkpoint 7B run: 29 KB of text, 2 KB compressed; bench/RESULTS.md, issue 27). The values
                # are JSON's own (str, int, float, None, lists), so the text decodes to equal values.
                text = json.dumps(run_entry(tree.root, run)).encode()
                self._runs.append((index, run.path, zlib.compress(text, 1)))
        self._allowed.extend((index, where, a) for where, a in _allowances(tree))

    def runs(self) -> list[Any]:
        """Each run's piece, in the report's order."""
        return list(self.each_run())

    def each_run(self) -> Iterator[Any]:
        """Each run's piece, in the report's order, a JSON entry decoded only when it is asked for."""
        pieces = (piece for _, _, piece in sorted(self._runs, key=lambda r: (r[0], r[1])))
        return (json.loads(zlib.decompress(p)) for p in pieces) if self.fmt == "json" else pieces

    def text(self, report: Report) -> list[str]:
        """The text report's runs: each one's title and table (by the findings of its root) and a blank line."""
        out: list[str] = []
        tallies: dict[int, dict[str, dict[Severity, int]]] = {}
        for index, _, facts in sorted(self._runs, key=lambda r: (r[0], r[1])):
            if index not in tallies:
                root = report.trees[index].root
                tallies[index] = _tally([f for f in report.findings if f.root == root])
            out.extend(facts.head)
            out.append(_run_table(facts, tallies[index], self.width))
            out.append("")
        return out

    def allowed(self) -> list[dict[str, str]]:
        """Each allowance (``allowances``), in the report's order."""
        return [a for _, _, a in sorted(self._allowed, key=lambda r: (r[0], r[1]))]


def to_json(report: Report, pieces: RunPieces | None = None) -> dict[str, Any]:
    """The report as the documented ``ckptdoctor.report/1`` document: ``settings`` lists each settings file applied
    with the folders it governed (``allowed_globals`` when a user allowance let a pickle global through).
    ``pieces``: the runs, kept as the scan went (``RunPieces``), when ``report`` holds no runs itself."""
    pieces = pieces or RunPieces.of(report, "json")
    return _document(report, pieces, pieces.runs())


def _document(report: Report, pieces: RunPieces, runs: list[Any]) -> dict[str, Any]:
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
    allowed = pieces.allowed()
    if allowed:
        doc["allowed_globals"] = allowed
    return doc


def render_json(report: Report, pieces: RunPieces | None = None) -> str:
    """The JSON document as text (strict JSON: non-finite numbers were already mapped to null)."""
    return "".join(json_chunks(report, pieces))


def json_chunks(report: Report, pieces: RunPieces | None = None) -> Iterator[str]:
    """``render_json``'s text in pieces, each run's entry made when its turn comes: a fleet's document is never
    held whole. Made whole, the 10,000 checkpoints of 100 runs (a 4.8 MB document) took about 40 MB while
    ``json.dumps`` decoded every entry and joined its chunks, more than the scan of one run (bench/RESULTS.md,
    issue 27). The text is ``json.dumps(to_json(...), indent=2)``'s, byte for byte: each entry is indented as the
    items of the top-level ``runs`` list are (two levels; a JSON string holds no raw newline)."""
    pieces = pieces or RunPieces.of(report, "json")
    head, tail = json.dumps(_document(report, pieces, []), indent=2, allow_nan=False).split(_NO_RUNS, 1)
    yield head
    end = _NO_RUNS
    for entry in pieces.each_run():
        text = _indented(entry, "\n    ")
        yield ('"runs": [\n    ' if end == _NO_RUNS else ",\n    ") + text
        end = "\n  ]"
    yield end + tail


def _indented(value: Any, pad: str) -> str:
    """``json.dumps(value, indent=2, allow_nan=False)`` with every line break followed by ``pad``'s indentation
    (``pad``: a line break and the indentation ``value`` starts at), byte for byte, for what ``json.loads`` gives
    (text, numbers, null, booleans, lists, objects with text keys). ``json.dumps`` with an indent runs the pure-Python
    encoder, a generator per container yielding each token: this builds each container's text at once (writing a
    100-checkpoint run's document took 15.3 M instructions that way, 11.7 M this one). Anything else is
    ``json.dumps``'s."""
    kind = value.__class__
    if kind is str:
        return _quoted(value)
    if kind is dict and all(k.__class__ is str for k in value):
        if not value:
            return "{}"
        inner = pad + "  "
        return "{" + inner + ("," + inner).join([_quoted(k) + ": " + _indented(v, inner) for k, v in value.items()]) + (
            pad + "}")
    if kind is list:
        if not value:
            return "[]"
        inner = pad + "  "
        return "[" + inner + ("," + inner).join([_indented(v, inner) for v in value]) + pad + "]"
    if kind is int:
        return int.__repr__(value)
    if kind is float and math.isfinite(value):
        return float.__repr__(value)
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    return json.dumps(value, indent=2, allow_nan=False).replace("\n", pad)  # e.g. a non-finite number: json's error


# ``runs`` when there is none, as ``json.dumps(indent=2)`` writes the top-level key (a JSON string holding this text
# escapes its quotes, so the first occurrence is the key's)
_NO_RUNS = '"runs": []'


def human_bytes(n: int) -> str:
    """``1.3 KB``, ``52.4 MB``: decimal units, like ``ls -h --si``."""
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"  # pragma: no cover


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


# What a checkpoint holds besides weights: the table's weights column omits them
_STATE_KINDS = ("optimizer", "scheduler", "trainer-state", "dataloader", "train-state")
_PICKS = "  <- resume picks"


def _status(path: str, pick: str | None, tally: dict[str, dict[Severity, int]]) -> str:
    """``ok``, or each severity's count, worst first (``2 errors, 1 info``), worded as the summary line counts them
    (one count labelled with the worst severity, ``error (3)``, read as three errors), for the checkpoint at
    ``path`` of a run whose resume picks ``pick``."""
    found = tally.get("." if path in ("", ".") else path)
    if found is None:
        label = "ok"
    else:
        worst_first = sorted(found, key=lambda s: -s.rank)
        label = ", ".join(plural(found[s], s.value) for s in worst_first)
    if pick is not None and pick == path:
        label += _PICKS
    return label


def _fact_rows(run: Run) -> list[tuple[list[Any], str]]:
    """Each checkpoint's table cells but its status (what its facts say), with its path."""
    rows = []
    for ck in ordered(run):
        row = checkpoint_row(ck)
        name = ck.path if run.path in ("", ".") else ck.path[len(run.path) + 1 :] or "."
        if ck.role == FolderRole.MODEL and name == ".":
            name = ". (model files)"
        lr = row["learning_rate"]
        rows.append((
            [
                printable(name),
                "" if row["step"] is None else row["step"],
                ",".join(k for k in row["kinds"] if k not in _STATE_KINDS) or "-",
                "-" if row["tensors"] is None else f"{row['tensors']:,}",
                human_bytes(row["bytes"]),
                "-" if lr is None else f"{lr:.3g}",
            ],
            ck.path,
        ))  # fmt: skip
    return rows


_HEADERS = ["checkpoint", "step", "weights", "tensors", "size", "lr", "status"]
# On a narrow terminal the table loses columns in this order (their index in _HEADERS) until it fits: the counts
# and sizes first, then the weights form, the step, and the LR last (LR 0 is what a finished schedule is about). A
# column that says nothing the others do not goes before them all (``_drop_order``).
_DROP_ORDER = (3, 4, 2, 1, 5)
_STEP, _LR = 1, 5


def _drop_order(rows: list[list[Any]]) -> list[int]:
    """``_DROP_ORDER``, led by the columns that tell nothing here: ``step`` when every step is the number in its
    folder's name (``checkpoint-8``, step 8), ``lr`` when no checkpoint holds one."""
    idle = []
    if all(r[_STEP] == "" or str(r[0]).rsplit("-", 1)[-1] == str(r[_STEP]) for r in rows):
        idle.append(_STEP)
    if all(r[_LR] == "-" for r in rows):
        idle.append(_LR)
    return idle + [i for i in _DROP_ORDER if i not in idle]


def _run_table(facts: _RunFacts, tally: dict[str, dict[Severity, int]], width: int | None = None) -> str:
    """A run's table: its checkpoints' cells (``_fact_rows``) and each one's status by the root's ``tally``."""
    from tabulate import tabulate  # only the text report needs it

    every = [[*cells, _status(path, facts.pick, tally)] for cells, path in facts.rows]
    shown = list(range(len(every))) if width is None else _shown_rows(every)
    rows = [every[i] for i in shown]
    keep = list(range(len(_HEADERS)))
    drop = _drop_order(rows)
    while True:
        table = str(
            tabulate(
                [[r[i] for i in keep] for r in rows],
                headers=[_HEADERS[i] for i in keep],
                tablefmt="simple",
                disable_numparse=True,
            )
        )
        if width is None or max(map(len, table.splitlines())) <= width:
            lines = table.splitlines()  # the header, its rule, then one line per row
            return "\n".join([*lines[:2], *_with_gaps([[ln] for ln in lines[2:]], shown, every, width)])
        if not drop:
            break
        keep.remove(drop.pop(0))
    # Not even checkpoint and status fit side by side: one wrapped line per checkpoint.
    return "\n".join(_with_gaps([fit(f"{r[0]}: {r[-1]}", width) for r in rows], shown, every, width))


# On a terminal a run's table shows at most this many checkpoints, as ruff's terminal output keeps to what needs
# attention: the first and last few, the one the resume picks and those with findings; the rows left out are one
# line that counts them. A pipe or a file gets every row (`--format json` too).
TABLE_MAX = 20
_TABLE_ENDS = 3


def _shown_rows(rows: list[list[Any]]) -> list[int]:
    """Which of ``rows`` a terminal table shows (indexes, in order): all of them up to ``TABLE_MAX``, else the
    first and last ``_TABLE_ENDS``, the resume's pick, then rows with findings while there is room."""
    if len(rows) <= TABLE_MAX:
        return list(range(len(rows)))
    ends = {*range(_TABLE_ENDS), *range(len(rows) - _TABLE_ENDS, len(rows))}
    flagged = [i for i, r in enumerate(rows) if r[-1] != "ok" and i not in ends]
    picked = [i for i in flagged if str(rows[i][-1]).endswith(_PICKS)]
    others = [i for i in flagged if i not in picked]
    return sorted({*ends, *picked, *others[: max(TABLE_MAX - len(ends) - len(picked), 0)]})


def _with_gaps(lines: list[list[str]], shown: list[int], every: list[list[Any]], width: int | None) -> list[str]:
    """The lines of the shown rows (``lines[k]`` is row ``shown[k]``'s), with one line in place of each run of rows
    left out, counting them."""
    out: list[str] = []
    for k, i in enumerate(shown):
        prev = shown[k - 1] if k else -1
        if i - prev > 1:
            gap = every[prev + 1 : i]
            ok = sum(1 for r in gap if r[-1] == "ok")
            counts = ((ok, "ok"), (len(gap) - ok, "with findings"))
            what = ", ".join(f"{n:,} {label}" for n, label in counts if n)
            out.extend(fit(f"... {len(gap):,} more checkpoints ({what}; --format json lists each)", width))
        out.extend(lines[k])
    return out


def fit(line: str, width: int | None, indent: str = "  ") -> list[str]:
    """``line`` as it is when ``width`` is None (a pipe, a file), else wrapped to ``width`` columns, continuation
    lines indented by ``indent`` more than the first; a word longer than a line (a long path) is broken."""
    if width is None or len(line) <= width:
        return [line]
    import textwrap  # only a terminal narrower than a line needs it

    lead = line[: len(line) - len(line.lstrip(" "))]
    return textwrap.wrap(
        line[len(lead) :],
        width=width,
        initial_indent=lead,
        subsequent_indent=lead + indent,
        break_on_hyphens=False,
        drop_whitespace=True,
    ) or [line[:width]]


def _fit_styled(line: str, width: int | None, style: Any, indent: str = "  ") -> list[str]:
    """``fit`` with each resulting line styled as a whole (``style`` is one of ``_Style``'s methods)."""
    return [style(ln) for ln in fit(line, width, indent)]


def render_text(
    report: Report,
    *,
    color: bool = False,
    width: int | None = None,
    quiet: bool = False,
    clock: Callable[[], float] | None = None,
    pieces: RunPieces | None = None,
) -> str:
    """Tables of checkpoints per run, then findings grouped like a linter's, then a one-line summary.

    ``width`` None (a pipe, a file) prints each finding on one line, as scripts grepping ``path: CODE`` expect; on a
    terminal the caller passes its width and every line fits it: a short header per finding (``path: CODE
    [severity] name``) with the message wrapped below it. ``quiet`` prints the findings only (``-q``). ``clock()``,
    asked once everything above the summary line is rendered, is the time the summary shows (the command's whole
    time); without it the summary shows the scan's own time. ``pieces``: the runs' tables, kept as the scan went
    (``RunPieces``, made with the same ``color`` and ``width``), when ``report`` holds no runs itself.
    """
    st = _Style(color)
    out: list[str] = []
    if not quiet:
        out.extend((pieces or RunPieces.of(report, "text", color=color, width=width)).text(report))
    if report.findings:
        out.extend(finding_entries(report.findings, st, width))
        if not quiet:
            out.append("")
    if quiet:
        return "\n".join(out)
    allowed = allowances(report, pieces)
    for a in allowed:
        origin = a["origin"] if a["origin"] == "--allow-global" else f"allow-globals in {a['origin']}"
        line = (f"{printable(a['file'])}: pickle global `{printable(a['global'])}` allowed by "
                f"{printable(origin)} `{printable(a['pattern'])}`")  # fmt: skip
        out.extend(_fit_styled(line, width, st.dim))
    if allowed:
        out.append("")
    out.extend(fit(summary_line(report, None if clock is None else clock()), width))
    return "\n".join(out)


class _RunFacts(NamedTuple):
    """What the text report shows of a run, but the status of its checkpoints (which take every finding of the
    root: a run's model files count the findings of a run in a folder below them)."""

    head: list[str]  # its title and what a resume picks
    pick: str | None
    rows: list[tuple[list[Any], str]]  # ``_fact_rows``


def _run_facts(root: str, run: Run, st: _Style, width: int | None) -> _RunFacts:
    """One run in the text report: its title, what a resume picks, its table's cells."""
    out: list[str] = []
    title = printable(display_path(root, run.path))
    pick = run.resume_pick
    pick_txt = (
        f"resume_from_checkpoint=True picks `{printable(display_path(root, pick))}`"
        if pick
        else ("given directly (pass it as resume_from_checkpoint)" if run.standalone else "nothing to resume")
    )
    pick_txt = stacks.resume_text(run) or pick_txt
    frameworks = sorted({ck.framework for ck in run.checkpoints if ck.framework is not Framework.PYTORCH})
    if frameworks:  # another stack's checkpoints: say whose, and how it restores a TF folder
        names = ", ".join(_FRAMEWORK_NAMES[fw] for fw in frameworks)
        if frameworks == [Framework.TENSORFLOW] and not pick:
            bundle = any(f.name == "checkpoint" for ck in run.checkpoints for f in ck.files)
            pick_txt = "a restart restores the bundle `checkpoint` names" if bundle else "weights for Keras"
        pick_txt = f"{names}; {pick_txt}"
    if width is None or len(title) + len(pick_txt) + 4 <= width:
        out.append(st.bold(f"{title}") + st.dim(f"  ({pick_txt})"))
    else:
        out.extend(_fit_styled(title, width, st.bold))
        out.extend(_fit_styled(f"  ({pick_txt})", width, st.dim))
    return _RunFacts(out, run.resume_pick, _fact_rows(run))


# Findings of one rule whose messages differ only by their own path (300 copies of one folder) are shown as one
# entry from this many on; fewer are listed one by one. JSON, SARIF and github outputs list every finding.
GROUP_MIN = 5
GROUP_EXAMPLES = 3


def _path_tokens(f: Finding) -> list[str]:
    """What of a finding's own path its message may repeat: the path as shown, as relative to the root, its
    components and the numbers in it (``checkpoint-105`` says ``step 105``), longest first."""
    shown = display_path(f.root, f.path)
    tokens = {shown, f.path, *shown.split("/"), *re.findall(r"\d+", f.path)}
    return sorted((t for t in tokens if t and t != "."), key=len, reverse=True)


def group_key(f: Finding) -> tuple[str, str, str]:
    """What findings of one group share: rule, severity and the message with the finding's own path taken out."""
    message = f.message
    for token in _path_tokens(f):
        pattern = rf"(?<!\d){re.escape(token)}(?!\d)" if token.isdigit() else re.escape(token)
        message = re.sub(pattern, "\x00", message)
    return f.rule, f.severity.value, message


def group_findings(findings: Sequence[Finding]) -> list[list[Finding]]:
    """The findings in their order, those of one ``group_key`` gathered at the place of the first when there are
    ``GROUP_MIN`` or more of them; every other finding alone."""
    keys = [group_key(f) for f in findings]
    groups: dict[tuple[str, str, str], list[Finding]] = {}
    for f, key in zip(findings, keys, strict=True):
        groups.setdefault(key, []).append(f)
    out: list[list[Finding]] = []
    for f, key in zip(findings, keys, strict=True):
        group = groups[key]
        if len(group) < GROUP_MIN:
            out.append([f])
        elif group[0] is f:
            out.append(group)
    return out


def finding_entries(
    findings: Sequence[Finding],
    st: _Style | None = None,
    width: int | None = None,
    *,
    fix_line: bool = True,
    hint: Any = None,
) -> list[str]:
    """The findings as the text reports print them: each (or each group of repeats) as ``finding_text`` shows it,
    a group followed by its count and a few of its other paths. ``hint(finding)`` may add a last line."""
    st = st or _Style(False)
    out: list[str] = []
    for group in group_findings(findings):
        first = group[0]
        head, fix = _finding_text(first, st, width)
        out.extend(head + fix if fix_line else head)
        if len(group) > 1:
            more = [printable(display_path(f.root, f.path)) for f in group[1 : 1 + GROUP_EXAMPLES]]
            etc = ", ..." if len(group) > 1 + GROUP_EXAMPLES else ""
            line = (f"  and {len(group) - 1:,} more {first.rule} findings like it: {', '.join(more)}{etc} "
                    "(--format json lists each)")  # fmt: skip
            out.extend(_fit_styled(line, width, st.dim))
        extra = hint(first) if hint is not None else None
        if extra:
            out.extend(fit(f"  hint: {extra}", width))
    return out


def finding_text(f: Finding, width: int | None = None) -> list[str]:
    """One finding as the text report prints it: ``path: CODE [severity] message``, then its fix, if it has one
    (on a terminal of ``width`` columns: ``path: CODE [severity] name``, the message wrapped below it)."""
    head, fix = _finding_text(f, _Style(False), width)
    return head + fix


def _finding_text(f: Finding, st: _Style, width: int | None = None) -> tuple[list[str], list[str]]:
    """The finding's own lines and its fix's lines."""
    where = printable(display_path(f.root, f.path))
    sev = st.sev(f.severity, f.severity.value)
    if width is None:
        head = [f"{st.bold(where)}: {st.bold(f.rule)} [{sev}] {printable(f.message)}"]
    else:
        header = f"{where}: {f.rule} [{f.severity.value}] {f.name}"
        if len(header) <= width:
            head = [f"{st.bold(where)}: {st.bold(f.rule)} [{sev}] {f.name}"]
        else:  # a long path: alone on its line(s), the rule below it
            head = _fit_styled(f"{where}:", width, st.bold)
            rule = f"  {f.rule} [{f.severity.value}] {f.name}"
            fits = len(rule) <= width
            head += [f"  {st.bold(f.rule)} [{sev}] {f.name}"] if fits else _fit_styled(rule, width, st.bold)
        head.extend(fit(f"  {printable(f.message)}", width, ""))
    fix: list[str] = []
    if f.fix is not None:
        fix = _fit_styled(f"  fix ({f.fix.applicability.value}): {printable(f.fix.title)}", width, st.dim)
    return head, fix


def summary_line(report: Report, seconds: float | None = None) -> str:
    """``Found 2 errors, 1 warning, 0 infos in 37 files (0.04 s).`` or ``No problems found in ...``. ``seconds``
    is the time to show (the command's whole time, rendering included), else the scan's own."""
    e, w, i = (report.count(s) for s in (Severity.ERROR, Severity.WARNING, Severity.INFO))
    where = f"in {plural(report.files, 'file')} ({report.seconds if seconds is None else seconds:.2f} s)"
    if e + w + i == 0:
        return f"No problems found {where}."
    return f"Found {plural(e, 'error')}, {plural(w, 'warning')}, {plural(i, 'info')} {where}."


STATISTICS_SCHEMA = "ckptdoctor.statistics/1"


def statistics(findings: Sequence[Finding]) -> list[dict[str, Any]]:
    """Findings counted per rule, most frequent first (then by code), as ``ruff check --statistics`` counts them:
    ``code``, ``name``, ``count``, ``severity`` (the worst reported) and ``fixable`` (how many carry a fix)."""
    rows: dict[str, dict[str, Any]] = {}
    for f in findings:
        new = {"code": f.rule, "name": f.name, "count": 0, "severity": f.severity, "fixable": 0}
        row = rows.setdefault(f.rule, new)
        row["count"] += 1
        row["fixable"] += f.fix is not None
        if f.severity.rank > row["severity"].rank:
            row["severity"] = f.severity
    out = sorted(rows.values(), key=lambda r: (-r["count"], r["code"]))
    return [{**r, "severity": r["severity"].value} for r in out]


def statistics_json(report: Report, pieces: RunPieces | None = None) -> dict[str, Any]:
    """The ``ckptdoctor.statistics/1`` document of ``scan --statistics --format json``: the per-rule counts and the
    report's summary counts."""
    doc = to_json(report, pieces or RunPieces("none"))
    return {
        "schema": STATISTICS_SCHEMA,
        "version": __version__,
        "roots": doc["roots"],
        "statistics": statistics(report.findings),
        "summary": doc["summary"],
    }


def render_statistics(report: Report, width: int | None = None) -> str:
    """``scan --statistics`` as text: one line per rule (count, code, severity, name, how many have a fix), then
    the summary line."""
    out = []
    for r in statistics(report.findings):
        fixable = f"  ({r['fixable']:,} with a fix)" if r["fixable"] else ""
        severity = f"[{r['severity']}]"
        out.extend(fit(f"{r['count']:>6,}  {r['code']:<7}  {severity:<9}  {r['name']}{fixable}", width, " " * 8))
    if out:
        out.append("")
    out.extend(fit(summary_line(report), width))
    return "\n".join(out)
