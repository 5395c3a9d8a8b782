"""The rule registry and engine: rules are pure functions of a ``Tree`` that yield hits; the engine makes findings.

A rule is registered with ``@rule(code, name, severity, ...)``: every fact about one rule (its fix safety, whether
it needs ``--deep`` or a planned resume, its security severity) is given there and read from its ``Rule``. Its
docstring is its user-facing document, with the sections What it does / Why is this bad? / Example / Fix safety /
References. Each code family has its module: 0xx-1xx ``discovery``, 2xx ``weights``, 3xx ``adapters``, 4xx
``training``, 5xx ``distributed``, 6xx ``security``. The gate-only rules, whatever their family, live with the gate
(``ckptdoctor.resume_gate.rules``): each is a function of one planned resume, which only ``ckptdoctor gate`` runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import field, replace
from typing import TYPE_CHECKING, Any, TypeVar

from ckptdoctor.findings import Applicability, Finding, FixPlan, Severity
from ckptdoctor.model import Tree, frozen

if TYPE_CHECKING:
    from ckptdoctor.pickle_verdict.judge import VerdictMemo

DOC_SECTIONS = ("What it does", "Why is this bad?", "Example", "Fix safety", "References")


@frozen
class Hit:
    """What a rule function yields: where, why, and optionally a severity for this hit and a fix plan."""

    path: str
    message: str
    severity: Severity | None = None
    fix: FixPlan | None = None
    file: str | None = None  # the file at fault in the folder ``path`` names, when the rule knows one


def file_at_fault(h: Hit, files: frozenset[str]) -> str | None:
    """``Finding.file`` for ``h``: the file the rule named, else ``h.path`` when it is one of ``files`` (the
    paths of the tree's files), else None (a folder, or a path nothing was read at)."""
    if h.file is not None:
        return h.file
    return h.path if h.path in files else None


def file_paths(tree: Tree) -> frozenset[str]:
    """The paths of every file ``tree`` holds, for ``file_at_fault``."""
    return frozenset(f.path for f in tree.all_files())


RuleFunc = Callable[[Tree], Iterable[Hit]]
# A gate rule's function takes the gate's context (``ckptdoctor.resume_gate.rules.ResumeContext``: the checkpoint, the
# plan, the prediction), a layer above this one, so typed here as Any. ``run_rules`` never calls one.
GateRuleFunc = Callable[[Any], Iterable[Hit]]
_F = TypeVar("_F", RuleFunc, GateRuleFunc)


@frozen
class Rule:
    """One registered rule: stable code and name, default severity, its document and its check."""

    code: str
    name: str
    severity: Severity
    func: RuleFunc | GateRuleFunc = field(compare=False, repr=False)
    doc: str = ""
    fix: Applicability | None = None  # SAFE (applied by `ckptdoctor fix`), UNSAFE (only with --unsafe-fixes), None
    deep_only: bool = False
    gate_only: bool = False  # emitted by `ckptdoctor gate` (needs the planned resume), documented here
    # GitHub rates a security alert by its rule's SARIF ``security-severity`` (a CVSS-like score as a string,
    # 0.0-10.0: >= 9.0 critical, 7.0-8.9 high, 4.0-6.9 medium, 0.1-3.9 low). A rule with one is a security rule:
    # a settings file cannot turn it off or lower it, nor let its errors pass (``keep_security_rules``).
    security_severity: str | None = None
    superseded_by_gate: bool = False  # `ckptdoctor gate` replaces this scan rule's finding by its exact prediction
    # the other severities a finding of this rule can be reported at, each with when: (ERROR, "the resume picks
    # the folder"). A hit at a severity the catalog does not declare is an internal error (``run_rules``).
    severity_when: tuple[tuple[Severity, str], ...] = ()
    # runs even when a select leaves it out, so that no selection makes a check of nothing pass; only an ignore
    # (or `--allow-empty`, which ignores it) turns it off (CKD002)
    unless_ignored: bool = False

    @property
    def security(self) -> bool:
        """Whether this is a security rule (it has a ``security_severity``)."""
        return self.security_severity is not None

    @property
    def fixable(self) -> bool:
        """Whether ``ckptdoctor fix`` repairs what the rule finds (with ``--unsafe-fixes`` when ``fix`` is unsafe)."""
        return self.fix is not None

    @property
    def severities(self) -> frozenset[Severity]:
        """Every severity a finding of this rule can be reported at (before a user's severity override)."""
        return frozenset((self.severity, *(sev for sev, _ in self.severity_when)))

    @property
    def severity_text(self) -> str:
        """The default severity and when it changes: ``warning (error when the resume picks the folder)``."""
        if not self.severity_when:
            return self.severity.value
        return f"{self.severity.value} ({'; '.join(f'{sev.value} when {when}' for sev, when in self.severity_when)})"

    @property
    def summary(self) -> str:
        """The first paragraph of the document, on one line."""
        para = self.doc.strip().split("\n\n", 1)[0]
        return " ".join(line.strip() for line in para.splitlines())


_REGISTRY: dict[str, Rule] = {}

# Modules that register rules when imported. Kept explicit so the registry's content never depends on import order.
RULE_MODULES = (
    "ckptdoctor.rules.discovery",
    "ckptdoctor.rules.weights",
    "ckptdoctor.rules.adapters",
    "ckptdoctor.rules.training",
    "ckptdoctor.rules.distributed",
    "ckptdoctor.rules.security",
    "ckptdoctor.resume_gate.rules",
    "ckptdoctor.resume_gate.torchtitan",
    "ckptdoctor.resume_gate.accelerate_rules",
)


def rule(
    code: str,
    name: str,
    severity: Severity,
    *,
    fix: Applicability | None = None,
    deep_only: bool = False,
    gate_only: bool = False,
    security_severity: str | None = None,
    superseded_by_gate: bool = False,
    severity_when: Sequence[tuple[Severity, str]] = (),
    unless_ignored: bool = False,
) -> Callable[[_F], _F]:
    """Register ``func`` as rule ``code``. Codes and names are a public contract: never renumber or rename.

    ``fix`` is the applicability of the fix plans the rule attaches (SAFE or UNSAFE, None for no fix; a test checks
    the plans). ``deep_only``: it judges tensor data, so it runs only with ``--deep``. ``gate_only``: ``ckptdoctor
    gate`` emits it for a planned resume; a scan never runs it. ``security_severity``: SARIF's score, and what makes
    it a security rule. ``superseded_by_gate``: the gate replaces its finding by an exact prediction.
    ``severity_when``: the other severities a hit may carry, each with the condition, so that the catalog (``rules``,
    ``explain``, the README table, SARIF) says every severity a finding of the rule can have. ``unless_ignored``:
    it runs whatever ``select`` says, and only ``ignore`` turns it off.
    """
    when = tuple(severity_when)
    if any(sev == severity for sev, _ in when) or len({sev for sev, _ in when}) != len(when):
        raise ValueError(f"rule {code}: severity_when repeats a severity: {when!r}")
    if fix not in (None, Applicability.SAFE, Applicability.UNSAFE):
        raise ValueError(f"rule {code}: fix must be Applicability.SAFE, Applicability.UNSAFE or None, not {fix!r}")

    def register(func: _F) -> _F:
        if code in _REGISTRY:
            raise ValueError(f"rule {code} registered twice")
        _REGISTRY[code] = Rule(
            code, name, severity, func, func.__doc__ or "", fix, deep_only, gate_only, security_severity,
            superseded_by_gate, when, unless_ignored,
        )
        return func

    return register


def _load() -> None:
    for mod in RULE_MODULES:  # a module missing from the package is a bug: its rules would silently not run
        importlib.import_module(mod)


def all_rules() -> list[Rule]:
    """Every registered rule, sorted by code."""
    _load()
    return [_REGISTRY[c] for c in sorted(_REGISTRY)]


def get_rule(code_or_name: str) -> Rule | None:
    """Look a rule up by code (``CKD201``) or name (``stub-weights-shadow-adapter``)."""
    _load()
    key = code_or_name.strip()
    if key.upper() in _REGISTRY:
        return _REGISTRY[key.upper()]
    for r in _REGISTRY.values():
        if r.name == key.lower():
            return r
    return None


def _matches(code: str, patterns: Sequence[str]) -> bool:
    return any(code.startswith(p.strip().upper()) for p in patterns if p.strip())


@frozen
class Selection:
    """Which rules run and at what severity: ``--select``/``--ignore`` by code or prefix, plus overrides."""

    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    severity: Mapping[str, Severity] = field(default_factory=dict)
    deep: bool = False
    keep: tuple[str, ...] = ()  # codes that run whatever select/ignore say (see ``keep_security_rules``)
    # the user's pickle-global allowances, (pattern, origin): ``--allow-global`` or the user configuration file,
    # never a settings file in the scanned folder (``ckptdoctor.pickle_verdict.policy.Allowance``)
    allow_globals: tuple[tuple[str, str], ...] = ()

    def enabled(self, r: Rule) -> bool:
        if r.gate_only:
            return False
        if r.deep_only and not self.deep:
            return False
        if r.code in self.keep:
            return True
        if self.select and not _matches(r.code, self.select) and not r.unless_ignored:
            return False
        return not _matches(r.code, self.ignore)


def security_codes() -> frozenset[str]:
    """The codes of the security rules (those with a ``security_severity``)."""
    return frozenset(r.code for r in all_rules() if r.security)


def keep_security_rules(combined: Selection, command_line: Selection) -> tuple[Selection, tuple[str, ...]]:
    """``combined`` (command line plus a settings file) with the security rules the settings file alone turned off
    or downgraded put back, and their codes.

    A settings file is read from the scanned folder, and a checkpoint folder may come from anyone: one that ships
    ``ignore = ["CKD6"]`` must not make its own malicious pickle pass. Only the command line (``command_line``,
    the --select/--ignore given there) can turn a security rule off.
    """
    kept: list[str] = []
    changed: list[str] = []
    severity = dict(combined.severity)
    for r in all_rules():
        if not r.security or r.gate_only or r.deep_only:
            continue
        if not combined.enabled(r) and command_line.enabled(r):
            kept.append(r.code)
            changed.append(r.code)
        override = severity.get(r.code)
        if override is not None and override.rank < r.severity.rank:
            del severity[r.code]
            changed.append(r.code)
    return replace(combined, keep=tuple(kept), severity=severity), tuple(sorted(set(changed)))


def judged(tree: Tree, selection: Selection | None = None, memo: VerdictMemo | None = None) -> Tree:
    """``tree`` carrying the verdict of each of its pickles (``Tree.pickle_verdicts``), judged once under the
    selection's allowances (``Selection.allow_globals``); a tree that carries verdicts already is returned as is.
    The one place verdicts are made: the scanner, ``run_rules`` and the security rules all come through here.
    ``memo`` (the verdict cache) gives the verdicts a scan judged before of the same bytes (``judge.tree_verdicts``)."""
    if tree.pickle_verdicts is not None:
        return tree
    from ckptdoctor.pickle_verdict.judge import with_verdicts  # imports the policy: only for a tree not judged yet

    return with_verdicts(tree, (selection or Selection()).allow_globals, memo)


def run_rules(tree: Tree, selection: Selection | None = None) -> list[Finding]:
    """Apply every enabled rule to ``tree``; findings are deduplicated and sorted deterministically.

    A tree without pickle verdicts is judged first, under ``selection``'s allowances (``judged``). A rule that
    raises is itself a bug; it is reported as an internal error finding instead of aborting the scan (``evaluate``).
    """
    selection = selection or Selection()
    tree = judged(tree, selection)
    return evaluate((r for r in all_rules() if selection.enabled(r)), tree, tree, selection)


def evaluate(rules: Iterable[Rule], subject: Any, tree: Tree, selection: Selection) -> list[Finding]:
    """The one rule engine, for scan rules (``subject``: a ``Tree``) and gate rules (the gate's ``ResumeContext``)
    alike: each rule's function is applied to ``subject`` and its hits become findings, at the
    severity ``selection`` overrides, else the hit's, else the rule's; deduplicated and sorted deterministically.
    ``tree`` is the tree judged (the gate's checkpoint tree): findings are under its root, each naming its file at
    fault (``file_at_fault``).

    A rule that raises is itself a bug: it is reported as an internal error finding (an error at ``.``) and the
    other rules still run, so one broken rule never hides the others' findings, in a scan or in a gate.
    """
    found: dict[tuple[str, str, str], Finding] = {}
    files = file_paths(tree)
    for r in rules:
        default = selection.severity.get(r.code, r.severity)
        try:
            hits: Iterator[Hit] | Iterable[Hit] = declared(r, r.func(subject))
        except Exception as exc:  # defence in depth: one broken rule must not hide the others' findings
            hits = [Hit(".", f"internal error in rule {r.code}: {type(exc).__name__}: {exc}", Severity.ERROR)]
        for h in hits:
            sev = selection.severity.get(r.code, h.severity or default)
            f = Finding(r.code, r.name, sev, h.path, h.message, h.fix, root=tree.root, file=file_at_fault(h, files))
            found.setdefault((r.code, h.path, h.message), f)
    return sorted(found.values(), key=Finding.sort_key)


def declared(r: Rule, hits: Iterable[Hit]) -> list[Hit]:
    """``hits`` as a list; ``ValueError`` for one at a severity ``r``'s catalog entry does not declare (a rule bug:
    a script mapping rule to severity from the catalog would be wrong)."""
    out = list(hits)
    for h in out:
        if h.severity is not None and h.severity not in r.severities:
            raise ValueError(f"{r.code} reported at {h.severity.value}, which its catalog entry does not declare")
    return out


def rules_markdown() -> str:
    """The rule catalog as the Markdown table embedded in the README (kept in sync by a test)."""
    lines = ["| code | name | severity | fix | what it finds |", "| --- | --- | --- | --- | --- |"]
    for r in all_rules():
        fix = r.fix.value if r.fix is not None else ""
        deep = " (`--deep`)" if r.deep_only else " (`gate`)" if r.gate_only else ""
        lines.append(f"| {r.code} | `{r.name}` | {r.severity_text} | {fix} | {r.summary}{deep} |")
    return "\n".join(lines)
