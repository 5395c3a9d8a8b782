"""`fix --dry-run` predicts the real run: what it would fix, what would remain (text and JSON), the exit code, and
whether the real run would be refused (a run written in the last 60 s). Also: a root named twice is fixed once.

Every tree is a copy of a fixture the reference trainer wrote (transformers' Trainer layout), damaged one way.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckptdoctor import fixer as fixmod
from ckptdoctor.cli import main
from tests.helpers.fixing import (
    FIXTURES,
    age,
    deepspeed_checkpoint,
    fixture,
    sharded_checkpoint,
    stubs_and_hostile_pickle,
    tree_state,
)
from tests.helpers.payloads import hostile_payloads


def invoke(*args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of one in-process run."""
    result = CliRunner().invoke(main, list(args))
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def missing_shard(tmp_path: Path) -> Path:
    return fixture("sharded-missing-shard", tmp_path)  # CKD204: the real resume raises FileNotFoundError


def posix_system(tmp_path: Path) -> Path:
    """Three pickles that would call posix.system if loaded (CKD601 three times)."""
    root = fixture("clean-bin", tmp_path)
    payload = hostile_payloads(tmp_path / "canary")["posix.system protocol 0"][0]
    for rel in ("checkpoint-4/rng_state.pth", "checkpoint-8/rng_state.pth", "checkpoint-8/training_args.bin"):
        (root / rel).write_bytes(payload)
    return age(root)


def truncated_state(tmp_path: Path) -> Path:
    """A checkpoint folder given directly whose trainer_state.json a crash cut in half (CKD402, and CKD102 without a
    fix: the fixer never moves the root itself)."""
    run = fixture("clean-full", tmp_path)
    state = run / "checkpoint-8" / "trainer_state.json"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])
    return age(run) / "checkpoint-8"


UNFIXABLE = [(missing_shard, {"CKD204"}), (posix_system, {"CKD601"}), (truncated_state, {"CKD402", "CKD102"})]


def _remaining(doc: dict[str, Any]) -> list[tuple[str, str]]:
    return sorted((f["rule"], f["path"]) for f in doc["remaining"])


@pytest.mark.parametrize(("make", "rules"), UNFIXABLE, ids=[m.__name__ for m, _ in UNFIXABLE])
def test_unfixable_findings_are_listed_and_exit_like_the_real_run(make: Any, rules: set[str], tmp_path: Path) -> None:
    root = make(tmp_path)
    before = tree_state(root)
    code, out, _ = invoke("fix", "--force", "--dry-run", str(root))
    assert "Nothing to fix." not in out
    assert "Nothing ckptdoctor can fix automatically;" in out and "remain" in out
    assert "  nothing ckptdoctor can fix automatically" in out  # the root's line does not say "nothing to fix"
    for rule in rules:
        assert f": {rule} [error] " in out, out
    assert "  hint: No automatic fix" in out  # the rule's "Fix safety" line
    dry_code, dry_json, _ = invoke("fix", "--force", "--dry-run", "--format", "json", str(root))
    doc = json.loads(dry_json)
    assert doc["dry_run"] is True and doc["roots"][0]["refused"] is None
    assert isinstance(doc["summary"]["remain"], int) and doc["summary"]["remain"] == len(doc["remaining"]) > 0
    assert {f["rule"] for f in doc["remaining"]} >= rules
    assert tree_state(root) == before and not (root / ".ckptdoctor").exists()  # the dry run wrote nothing

    real_code, real_out, _ = invoke("fix", "--force", "--format", "json", str(root))
    real = json.loads(real_out)
    assert code == dry_code == real_code == 1
    assert _remaining(real) == _remaining(doc) and real["summary"]["remain"] == doc["summary"]["remain"]
    # --fail-on never: the real run exits 0, and so does its dry run
    assert invoke("fix", "--dry-run", "--fail-on", "never", str(root))[0] == 0
    assert invoke("fix", "--fail-on", "never", str(root))[0] == 0


def test_what_would_remain_after_a_partial_fix_is_what_remains(tmp_path: Path) -> None:
    """Two stubs the fix quarantines, a hostile pickle it cannot fix: text and JSON, each against a real run."""
    root, twin = stubs_and_hostile_pickle(tmp_path / "a"), stubs_and_hostile_pickle(tmp_path / "b")
    code, out, _ = invoke("fix", "--dry-run", str(root))
    assert code == 1
    assert "would move `checkpoint-4/pytorch_model.bin`" in out
    *_, header, finding, hint, last = out.rstrip().splitlines()
    assert header == "Predicted to remain after the fix (1 problem would remain):"
    assert finding.endswith("checkpoint-4/rng_state.pth: CKD601 [error] pickle calls `posix.system`: loading this file "
                            "can run code")  # fmt: skip
    assert hint.startswith("  hint: No automatic fix.")
    assert last == "Would fix 2 problems with 2 operations, 1 problem would remain; run without --dry-run to apply."
    real_code, real_out, _ = invoke("fix", str(root))
    assert real_code == code and f"\n{finding}\n{hint}\nTransaction " in real_out

    dry_code, dry_json, _ = invoke("fix", "--dry-run", "--format", "json", str(twin))
    dry = json.loads(dry_json)
    assert dry["summary"] == {"operations": 2, "fixed": 0, "would_fix": 2, "remain": 1}
    real_code, real_json, _ = invoke("fix", "--format", "json", str(twin))
    real = json.loads(real_json)
    assert real_code == dry_code == 1 and real["summary"]["fixed"] == 2
    assert real["remaining"] == dry["remaining"] and _remaining(real) == [("CKD601", "checkpoint-4/rng_state.pth")]
    # Fixed: a dry run now has nothing to change, and says what remains.
    code, again, _ = invoke("fix", "--dry-run", str(twin))
    block = f"Nothing ckptdoctor can fix automatically; 1 problem remains:\n{finding}\n{hint}\n"
    assert code == 1 and again.endswith(block.replace(str(root), str(twin)))


def test_findings_inside_a_quarantined_folder_are_predicted_gone(tmp_path: Path) -> None:
    """In a run, the checkpoint with the truncated trainer_state.json is quarantined (CKD102): CKD402 goes with it."""
    run = truncated_state(tmp_path).parent
    code, out, _ = invoke("fix", "--dry-run", "--format", "json", str(run))
    dry = json.loads(out)
    assert code == 1 and [op["path"] for op in dry["roots"][0]["operations"]] == ["checkpoint-8"]
    assert dry["remaining"] == [] and dry["summary"]["remain"] == 0
    code, out, _ = invoke("fix", "--format", "json", str(run))
    assert code == 0 and json.loads(out)["remaining"] == []


def test_prediction_of_a_mixed_plan_is_the_rescan(tmp_path: Path) -> None:
    """Quarantines of files and a folder, both rewrite kinds: what is left is predicted exactly."""
    root = fixture("stub-shadow", tmp_path)  # CKD201 x2: quarantine files
    shutil.copytree(FIXTURES / "clean-full" / "checkpoint-8", root / "tmp-checkpoint-12")  # CKD103: a folder
    (root / "tmp-checkpoint-12" / "trainer_state.json").unlink()
    sharded_checkpoint(root / "checkpoint-1", wrong=True)  # CKD205: rewrite JSON
    deepspeed_checkpoint(root / "checkpoint-3")  # CKD503: rewrite text
    age(root)
    dry_code, out, _ = invoke("fix", "--dry-run", "--format", "json", str(root))
    dry = json.loads(out)
    assert sorted(op["kind"] for op in dry["roots"][0]["operations"]) == [
        "quarantine", "quarantine", "quarantine", "rewrite-json", "rewrite-text"
    ]  # fmt: skip
    real_code, out, _ = invoke("fix", "--format", "json", str(root))
    real = json.loads(out)
    assert real["summary"]["fixed"] == 5 and real["summary"]["remain"] == dry["summary"]["remain"] > 0
    assert real["remaining"] == dry["remaining"]
    assert (dry_code, real_code) == (1, 1 if any(f["severity"] == "error" for f in real["remaining"]) else 0)


def test_everything_fixable_exits_1_as_a_diff_does_while_the_real_run_exits_0(tmp_path: Path) -> None:
    root = fixture("stub-shadow", tmp_path)
    code, out, _ = invoke("fix", "--dry-run", str(root))
    assert code == 1 and "Predicted to remain" not in out
    assert out.rstrip().splitlines()[-1] == "Would fix 2 problems with 2 operations; run without --dry-run to apply."
    doc = json.loads(invoke("fix", "--dry-run", "--format", "json", str(root))[1])
    assert doc["summary"]["remain"] == 0 and doc["remaining"] == []
    assert invoke("fix", str(root))[0] == 0


def test_nothing_found_is_nothing_to_fix(tmp_path: Path) -> None:
    root = fixture("clean-full", tmp_path)
    code, out, _ = invoke("fix", "--dry-run", str(root))
    assert code == 0 and out.rstrip().endswith("Nothing to fix.") and "  nothing to fix" in out
    doc = json.loads(invoke("fix", "--dry-run", "--format", "json", str(root))[1])
    assert doc["summary"] == {"operations": 0, "fixed": 0, "would_fix": 0, "remain": 0} and doc["remaining"] == []


def test_recency_refusal_is_predicted_not_failed(tmp_path: Path) -> None:
    root = fixture("stub-shadow", tmp_path)
    os.utime(root / "checkpoint-8")  # a save just happened
    code, out, err = invoke("fix", "--dry-run", str(root))
    assert code == 1 and not err
    assert "without --dry-run this fix would be refused now:" in out and "pass --force" in out
    assert "`checkpoint-8`" in out and "run without --dry-run to apply" not in out
    assert out.rstrip().endswith("without --dry-run the fix would be refused now (see above).")
    code, dry_json, _ = invoke("fix", "--dry-run", "--format", "json", str(root))
    refused = json.loads(dry_json)["roots"][0]["refused"]
    assert code == 1 and "pass --force" in refused and "nothing was changed" not in refused

    # The real run is refused as predicted: exit 2, nothing on stdout (as scan's usage errors), one line on stderr.
    code, out, err = invoke("fix", "--format", "json", str(root))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "pass --force" in err
    # With --force nothing is predicted refused, and the real run applies.
    code, out, _ = invoke("fix", "--dry-run", "--force", str(root))
    assert "refused" not in out and "run without --dry-run to apply" in out
    assert invoke("fix", "--force", str(root))[0] == 0


@pytest.mark.parametrize("spelling", ["same", "dot-slash"])
def test_a_root_named_twice_is_fixed_once(spelling: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = stubs_and_hostile_pickle(tmp_path)
    monkeypatch.chdir(tmp_path)
    second = "stub-shadow" if spelling == "same" else "./stub-shadow/"
    _, once, _ = invoke("fix", "--dry-run", "stub-shadow")
    code, twice, err = invoke("fix", "--dry-run", "stub-shadow", second)
    assert code == 1 and twice == once and not err
    code, out, err = invoke("fix", "stub-shadow", second)
    assert code == 1 and not err, err
    assert out.count("Transaction ") == 1 and out.count("CKD601 [error]") == 1
    assert out.rstrip().endswith("Fixed 2 problems, 1 remains.")
    assert len(fixmod.load_journals(str(root))) == 1
    assert fixmod.fix([str(root), str(root) + "/"], dry_run=True).plans[0].root == str(root)
