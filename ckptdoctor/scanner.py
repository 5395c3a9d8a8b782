"""Orchestrates one scan: discover each root, run the rules, and collect a ``Report``."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ckptdoctor.findings import Finding, Severity
from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import Tree
from ckptdoctor.rules import Selection, run_rules

FAIL_ON = ("error", "warning", "info", "never")


@dataclass(frozen=True, slots=True)
class Report:
    """The result of scanning one or more roots: what was found on disk and the findings about it."""

    trees: tuple[Tree, ...]
    findings: tuple[Finding, ...]
    seconds: float

    def count(self, severity: Severity) -> int:
        return sum(1 for f in self.findings if f.severity == severity)

    @property
    def files(self) -> int:
        return sum(t.files_seen for t in self.trees)

    def failed(self, fail_on: str = "error") -> bool:
        """True when a finding is at or above ``fail_on`` (``never`` never fails)."""
        if fail_on == "never":
            return False
        threshold = Severity(fail_on).rank
        return any(f.severity.rank >= threshold for f in self.findings)

    def exit_code(self, fail_on: str = "error") -> int:
        """0 when nothing reaches ``fail_on``, else 1 (2 is reserved for usage errors)."""
        return 1 if self.failed(fail_on) else 0


def scan_tree(tree: Tree, selection: Selection | None = None) -> list[Finding]:
    """Run the rules on one discovered tree."""
    return run_rules(tree, selection or Selection())


def scan(
    paths: Sequence[str] | str,
    *,
    selection: Selection | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> Report:
    """Scan checkpoint folders or files without loading or executing anything, and return a ``Report``.

    Each path is a root: an output_dir, a checkpoint folder, a model folder, a folder of runs, or one file.
    """
    from ckptdoctor.discover import discover  # imported here so `ckptdoctor --version` stays instant

    if isinstance(paths, str):
        paths = [paths]
    sel = selection or Selection()
    start = time.perf_counter()
    trees: list[Tree] = []
    findings: list[Finding] = []
    for p in paths:
        tree = discover(p, limits)
        if not tree.abs_root:
            tree = dataclasses.replace(tree, abs_root=os.path.abspath(p))
        trees.append(tree)
        findings.extend(scan_tree(tree, sel))
    return Report(tuple(trees), tuple(findings), time.perf_counter() - start)
