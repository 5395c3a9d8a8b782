"""Severity, Finding and FixPlan: what rules produce and reports and the fixer consume; a finding's JSON shape and
the path a user can paste. No I/O but the one ``lstat`` that tells a single-file root."""

from __future__ import annotations

import enum
import os
import re
from dataclasses import field
from typing import Any

from ckptdoctor.model import frozen


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


@frozen
class FixOp:
    """One operation on one path (relative to the scan root). ``content`` is the new text for rewrites."""

    kind: OpKind
    path: str
    content: str | None = None


@frozen
class FixPlan:
    """A repair a rule proposes: an imperative title, its applicability and the operations that perform it."""

    title: str
    applicability: Applicability
    ops: tuple[FixOp, ...] = ()


@frozen
class Finding:
    """One hazard at one path. ``path`` is relative to the root given by the user, with ``/`` separators."""

    rule: str
    name: str
    severity: Severity
    path: str
    message: str
    fix: FixPlan | None = None
    root: str = field(default="", compare=False)
    # The file at fault, relative to the root: ``path`` itself when it names a file, a file in the folder ``path``
    # names when the rule knows one (the cut `trainer_state.json` of an interrupted save), None when the finding is
    # about a folder as a whole. SARIF anchors the result to it; every other output shows ``path``.
    file: str | None = field(default=None, compare=False)

    def sort_key(self) -> tuple[str, tuple[Any, ...], str, str]:
        return (self.root, path_order(self.path), self.rule, self.message)


_DIGITS = re.compile(r"(\d+)")


def path_order(path: str) -> tuple[Any, ...]:
    """The one order of paths in every output: numbers by value, so `checkpoint-9` comes before `checkpoint-10`
    and `checkpoint-100` (a plain string sort gives `checkpoint-1, -10, -100, -1000, -2`); a folder before what
    it holds. Texts and numbers alternate in the key's first part, so any two keys compare; the path itself
    breaks ties (`step-01` and `step-1`)."""
    parts = _DIGITS.split(path)
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), path


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


def within(path: str, folder: str) -> bool:
    """Whether the root-relative ``path`` is ``folder`` or below it (every path is below the root, ``.``)."""
    return folder in ("", ".") or path == folder or path.startswith(folder + "/")


def display_path(root: str, path: str) -> str:
    """A path as the user can paste it: the root they gave joined with the relative path.

    A single-file root's one file has its own name as path (``model.bin``): it is the root itself, not
    ``model.bin/model.bin``.
    """
    if path in ("", "."):
        return root
    if root in ("", "."):
        return path
    if "/" not in path and _is_file_root(root, path):
        return root
    return os.path.join(root, path)


def _is_file_root(root: str, path: str) -> bool:
    """Whether ``root`` is a local non-folder whose name ``path`` shows (raw, or with undecodable bytes escaped)."""
    base = os.path.basename(root)
    shown = os.fsencode(base).decode("utf-8", "backslashreplace")
    # A root that exists on disk is a path, never a URL (as ``sources.is_remote`` decides): no scheme test needed.
    return path in (base, shown) and os.path.lexists(root) and not os.path.isdir(root)
