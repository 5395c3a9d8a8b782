"""Severity, Finding and FixPlan: what rules produce and reports and the fixer consume. No I/O."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Severity(str, enum.Enum):
    """How bad a finding is. Ordered: ``INFO < WARNING < ERROR``."""

    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @property
    def rank(self) -> int:
        return _RANK[self]


_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.ERROR: 2}


class Applicability(str, enum.Enum):
    """Whether a fix may run by default (safe), only on request (unsafe), or is described only (manual)."""

    SAFE = "safe"
    UNSAFE = "unsafe"
    MANUAL = "manual"


class OpKind(str, enum.Enum):
    """The operations a fix plan may ask the fixer to perform. The fixer quarantines; it never deletes."""

    QUARANTINE = "quarantine"  # move a file or folder into <root>/.ckptdoctor/quarantine/<txid>/
    REWRITE_JSON = "rewrite-json"  # replace a JSON file with new content (original kept in quarantine)
    REWRITE_TEXT = "rewrite-text"  # replace a small text file (DeepSpeed ``latest``)


@dataclass(frozen=True, slots=True)
class FixOp:
    """One operation on one path (relative to the scan root). ``content`` is the new text for rewrites."""

    kind: OpKind
    path: str
    content: str | None = None


@dataclass(frozen=True, slots=True)
class FixPlan:
    """A repair a rule proposes: an imperative title, its applicability and the operations that perform it."""

    title: str
    applicability: Applicability
    ops: tuple[FixOp, ...] = ()


@dataclass(frozen=True, slots=True)
class Finding:
    """One hazard at one path. ``path`` is relative to the root given by the user, with ``/`` separators."""

    rule: str
    name: str
    severity: Severity
    path: str
    message: str
    fix: FixPlan | None = None
    root: str = field(default="", compare=False)

    def sort_key(self) -> tuple[str, str, str, str]:
        return (self.root, self.path, self.rule, self.message)
