"""A fix keeps the root's checksum manifest true: files it quarantines leave the manifest, files it rewrites are
listed with their new sha256, in the same transaction (journaled, undone with the rest)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from ckptdoctor import deep
from ckptdoctor import fixer as fixmod
from ckptdoctor.findings import OpKind
from ckptdoctor.fixer.paths import OWN_MANIFEST
from tests.helpers.builders import make_run
from tests.helpers.checksums import _verify, _write
from tests.helpers.fixing import age, run_cli, stub_run, tree_state

MANIFEST = Path(OWN_MANIFEST)
STUB = "checkpoint-4/pytorch_model.bin"


def _write_manifest(root: Path) -> bytes:
    _write(root)
    return (root / MANIFEST).read_bytes()


def _listed(root: Path) -> dict[str, str]:
    return {e["path"]: e["sha256"] for e in json.loads((root / MANIFEST).read_text())["files"]}


@pytest.fixture
def manifest_stub(tmp_path: Path) -> Path:
    root = stub_run(tmp_path / "stub")
    _write_manifest(root)
    return age(root)


@pytest.fixture
def best(tmp_path: Path) -> Path:
    """CKD105: best_model_checkpoint names a folder of another machine (the fix rewrites trainer_state.json)."""
    root = make_run(tmp_path / "best", (2, 4))
    state_path = root / "checkpoint-4" / "trainer_state.json"
    state = json.loads(state_path.read_text())
    state["best_model_checkpoint"] = "/home/alice/runs/best/checkpoint-2"
    state_path.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    _write_manifest(root)
    return age(root)


def test_the_path_is_the_one_scans_write() -> None:
    assert OWN_MANIFEST == deep.MANIFEST_PATH


def test_a_quarantined_file_leaves_the_manifest_and_undo_puts_it_back(manifest_stub: Path) -> None:
    before, files = (manifest_stub / MANIFEST).read_bytes(), tree_state(manifest_stub)
    assert STUB in _listed(manifest_stub) and _verify(manifest_stub) == []

    code, out = run_cli("fix", "--dry-run", str(manifest_stub))
    assert code == 1 and f"rewrite `{OWN_MANIFEST}`: 1 quarantined file no longer listed" in out, out
    assert (manifest_stub / MANIFEST).read_bytes() == before

    code, out = run_cli("fix", str(manifest_stub))
    assert "Fixed 1 problem" in out, out
    assert STUB not in _listed(manifest_stub) and len(_listed(manifest_stub)) == len(json.loads(before)["files"]) - 1
    assert _verify(manifest_stub) == []  # without the update: "listed file is missing"
    (journal,) = fixmod.load_journals(str(manifest_stub))
    ops = [(op.kind, op.path) for op in journal.ops]
    assert ops == [(OpKind.QUARANTINE, STUB), (OpKind.REWRITE_JSON, OWN_MANIFEST)]

    code, out = run_cli("undo", str(manifest_stub))
    assert code == 0, out
    assert (manifest_stub / MANIFEST).read_bytes() == before
    assert tree_state(manifest_stub) == files
    assert _verify(manifest_stub) == []


def test_a_rewritten_file_is_listed_with_its_new_sha256(best: Path) -> None:
    rel = "checkpoint-4/trainer_state.json"
    old = _listed(best)[rel]
    _code, out = run_cli("fix", "--select", "CKD105", str(best))
    assert "Fixed 1 problem" in out, out
    assert _listed(best)[rel] != old
    assert _verify(best) == []
    assert hashlib.sha256((best / rel).read_bytes()).hexdigest() == _listed(best)[rel]


def test_other_fields_and_entries_are_kept(manifest_stub: Path) -> None:
    doc = json.loads((manifest_stub / MANIFEST).read_text())
    run_cli("fix", str(manifest_stub))
    after = json.loads((manifest_stub / MANIFEST).read_text())
    assert {k: v for k, v in after.items() if k != "files"} == {k: v for k, v in doc.items() if k != "files"}
    assert after["files"] == [e for e in doc["files"] if e["path"] != STUB]


def test_no_manifest_no_manifest_operation(tmp_path: Path) -> None:
    root = age(stub_run(tmp_path / "plain"))
    _code, out = run_cli("fix", str(root))
    assert "Fixed 1 problem" in out, out
    assert not (root / MANIFEST).exists()
    (journal,) = fixmod.load_journals(str(root))
    assert [op.path for op in journal.ops] == [STUB]


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b'{"schema": "other"}',
        b"\xff\xfe",
        # a valid manifest with a NaN beside its files: json.loads takes it, dumping it back failed (found in review)
        b'{"schema": "ckptdoctor.manifest/1", "note": NaN, "files": [{"path": "checkpoint-4/pytorch_model.bin",'
        b' "size": 1, "sha256": "' + b"0" * 64 + b'"}]}',
    ],
)
def test_a_manifest_that_is_not_one_is_left_alone(manifest_stub: Path, content: bytes) -> None:
    (manifest_stub / MANIFEST).write_bytes(content)
    age(manifest_stub)
    _code, out = run_cli("fix", str(manifest_stub))
    assert "Fixed 1 problem" in out, out
    assert (manifest_stub / MANIFEST).read_bytes() == content


def test_an_unlisted_change_needs_no_manifest_operation(manifest_stub: Path) -> None:
    doc = json.loads((manifest_stub / MANIFEST).read_text())
    doc["files"] = [e for e in doc["files"] if e["path"] != STUB]
    (manifest_stub / MANIFEST).write_text(json.dumps(doc, indent=2) + "\n")
    age(manifest_stub)
    _code, out = run_cli("fix", "--dry-run", str(manifest_stub))
    assert OWN_MANIFEST not in out, out


def test_no_rule_plan_may_name_the_manifest(manifest_stub: Path) -> None:
    """Only the planner's own update passes: a rule's plan naming the manifest is rejected like any own path."""
    assert fixmod.check_path(str(manifest_stub), OWN_MANIFEST)[0] is None
    assert fixmod.check_path(str(manifest_stub), OWN_MANIFEST, own_manifest=True)[0] is not None
    assert fixmod.check_path(str(manifest_stub), ".ckptdoctor/journal", own_manifest=True)[0] is None
