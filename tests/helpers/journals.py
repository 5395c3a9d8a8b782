"""Helpers shared by several test files (moved from tests/fixer/test_fix_adversarial.py)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptdoctor import fixer as fixmod
from ckptdoctor.findings import OpKind

TXID = "20260101T000000Z-abcdef"


def journal_op(
    kind: OpKind, path: str, before: fixmod.Digest, *, content: str | None = None, status: str = "pending"
) -> fixmod.JournalOp:
    data = None if content is None else content.encode()
    after = None if data is None else fixmod.Digest("file", len(data), hashlib.sha256(data).hexdigest(), 0o644)
    return fixmod.JournalOp(1, kind, path, ["CKD201"], "t", before, after, content, None, status)


def forge(
    root: Path,
    ops: list[fixmod.JournalOp],
    *,
    state: str = "applied",
    txid: str = TXID,
    name: str | None = None,
    dir_times: dict[str, tuple[int, int]] | None = None,
    edit: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    """Write a journal the way the fixer does (same schema), as an attacker shipping it would."""
    doc = fixmod.Journal(txid, "/somewhere/else", 1.0, state, ops, dir_times or {}).to_json()
    if edit is not None:
        edit(doc)
    folder = root / ".ckptdoctor" / "journal"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name or txid}.json"
    path.write_text(json.dumps(doc))
    return path
