"""Helpers shared by several test files (moved from tests/gate/test_e2e_resume.py)."""

from __future__ import annotations

from pathlib import Path

from ckptdoctor.fixer import fix
from ckptdoctor.scanner import scan


def tree_digest(root: Path) -> dict[str, tuple[int, bytes]]:
    """Names, modes and contents of every file under ``root`` outside ckptdoctor's own folder."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and not rel.startswith(".ckptdoctor"):
            out[rel] = (p.stat().st_mode, p.read_bytes())
    return out


def ckptdoctor_fix(root: Path, *, unsafe: bool = False) -> None:
    """What the user runs: `ckptdoctor fix` (the run was written seconds ago, hence force)."""
    result = fix([str(root)], unsafe=unsafe, force=True)
    assert result.fixed >= 1 and all(t is not None for t in result.txids)


def found(root: Path) -> set[tuple[str, str]]:
    """(rule, path) of every finding ckptdoctor's scan reports under ``root``."""
    return {(f.rule, f.path) for f in scan(str(root)).findings}
