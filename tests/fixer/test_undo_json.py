"""`undo --format json` and `undo --list --format json` on a real fix of a shipped fixture, and the run table's
status column counting each severity (both from the same review of the CLI's output)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from ckptdoctor.fixer.journal import load_journals
from ckptdoctor.render.report import render_text
from ckptdoctor.scanner import scan
from tests.helpers.cli import FIXTURES, copy_fixture, invoke
from tests.helpers.fixing import age, tree_state

UNDO_KEYS = {"schema", "version", "action", "root", "refused"}


def _doc(out: str) -> dict[str, Any]:
    doc = json.loads(out)  # nothing but the document on stdout
    assert isinstance(doc, dict) and doc["schema"] == "ckptdoctor.undo/1"
    return doc


def _fixed(tmp_path: Path) -> tuple[Path, dict[str, tuple[Any, ...]]]:
    """stub-shadow copied and aged (a fresh copy is "being written"), its state, then fixed: 2 quarantines."""
    root = age(copy_fixture("stub-shadow", tmp_path / "run"))
    before = tree_state(root)
    status, _, err = invoke("fix", str(root))
    assert status == 0, err
    return root, before


def test_list_then_undo_as_json(tmp_path: Path) -> None:
    root, before = _fixed(tmp_path)
    (j,) = load_journals(str(root))

    status, out, err = invoke("undo", "--list", "--format", "json", str(root))
    assert status == 0, err
    doc = _doc(out)
    assert doc.keys() == UNDO_KEYS | {"transactions"}
    assert (doc["action"], doc["root"], doc["refused"]) == ("list", str(root), None)
    (tx,) = doc["transactions"]
    assert tx.keys() == {"txid", "state", "created", "created_utc", "operations", "rules"}
    assert (tx["txid"], tx["state"], tx["operations"], tx["rules"]) == (j.txid, "applied", 2, ["CKD201"])
    assert abs(tx["created"] - time.time()) < 600
    assert tx["created_utc"] == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(tx["created"]))
    # the text table shows the same transaction
    status, text, _ = invoke("undo", "--list", str(root))
    assert status == 0 and re.search(rf"^{j.txid} .* applied +2 +CKD201$", text, re.MULTILINE)

    status, out, err = invoke("undo", "--format", "json", str(root))
    assert status == 0, err
    doc = _doc(out)
    assert doc.keys() == UNDO_KEYS | {"txid", "operations", "restored"}
    assert doc["action"] == "undo" and doc["root"] == str(root) and doc["refused"] is None
    assert (doc["txid"], doc["operations"], doc["restored"]) == (j.txid, 2, 2)
    assert tree_state(root) == before  # byte for byte, times included

    _, out, _ = invoke("undo", "--list", "--format", "json", str(root))
    assert [t["state"] for t in _doc(out)["transactions"]] == ["undone"]


def test_undo_by_txid_as_json(tmp_path: Path) -> None:
    root, _ = _fixed(tmp_path)
    (j,) = load_journals(str(root))
    status, out, err = invoke("undo", "--txid", j.txid, "--format", "json", str(root))
    assert status == 0, err
    assert (_doc(out)["txid"], _doc(out)["restored"]) == (j.txid, 2)


def test_refusals_are_documents_with_exit_2(tmp_path: Path) -> None:
    root, _ = _fixed(tmp_path)
    assert invoke("undo", str(root))[0] == 0
    # nothing left to undo: the document says why, the error line still goes to stderr
    status, out, err = invoke("undo", "--format", "json", str(root))
    doc = _doc(out)
    assert status == 2 and doc["refused"] == f"no fix transaction to undo under {root}" and doc["refused"] in err
    assert (doc["action"], doc["txid"], doc["operations"], doc["restored"]) == ("undo", None, None, 0)
    # an unknown transaction: the one asked for is named
    status, out, err = invoke("undo", "--txid", "20000101T000000Z-000000", "--format", "json", str(root))
    doc = _doc(out)
    assert status == 2 and doc["txid"] == "20000101T000000Z-000000" and "no transaction" in doc["refused"]
    # the text output of a refusal is unchanged: nothing on stdout
    status, out, err = invoke("undo", str(root))
    assert status == 2 and out == "" and "no fix transaction to undo" in err


def test_list_of_nothing_and_of_an_unreadable_journal(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    status, out, _ = invoke("undo", "--list", "--format", "json", str(empty))
    assert status == 0 and _doc(out)["transactions"] == [] and _doc(out)["refused"] is None
    assert invoke("undo", "--list", str(empty))[1] == f"No fix transactions under {empty}.\n"
    # a .ckptdoctor/journal that is a file (came with a download): refused, listed as such
    (empty / ".ckptdoctor").mkdir()
    (empty / ".ckptdoctor" / "journal").write_text("x")
    status, out, err = invoke("undo", "--list", "--format", "json", str(empty))
    doc = _doc(out)
    assert status == 2 and doc["transactions"] == [] and "not a plain folder" in doc["refused"] and "Error:" in err


def test_list_of_a_journal_with_an_impossible_time(tmp_path: Path) -> None:
    """A journal comes from disk: a creation time past year 9999 (or not finite) is shown as unknown, not a crash
    (``time.localtime`` overflows; strict JSON has no infinity)."""
    root, _ = _fixed(tmp_path)
    (path,) = (root / ".ckptdoctor" / "journal").glob("*.json")
    text = path.read_text()
    created = json.loads(text)["created"]
    path.write_text(text.replace(f'"created": {created}', '"created": 1e300'))
    status, out, err = invoke("undo", "--list", "--format", "json", str(root))
    (tx,) = _doc(out)["transactions"]
    assert status == 0 and tx["created"] is None and tx["created_utc"] is None, err
    status, text_out, err = invoke("undo", "--list", str(root))
    assert status == 0 and re.search(r" +- +applied +2 +CKD201$", text_out, re.MULTILINE), err


def test_status_column_counts_each_severity() -> None:
    """stale-higher's resume pick has 1 error and 1 info: the row says so, not `error (2)`."""
    text = render_text(scan(str(FIXTURES / "stale-higher")))
    assert re.search(r"^checkpoint-12 .*  1 error, 1 info  <- resume picks$", text, re.MULTILINE), text
    assert re.search(r"^checkpoint-8 .*  ok$", text, re.MULTILINE), text
    # several of one severity are counted in the plural
    text = render_text(scan(str(FIXTURES / "sharded-truncated-shard")))
    assert re.search(r"  2 errors  <- resume picks$", text, re.MULTILINE), text
