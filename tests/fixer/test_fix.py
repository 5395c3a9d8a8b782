"""The fixer: plan, dry run, apply, rescan, undo; each shipped fix's round trip; the refusals (links, outside the
root, read-only, busy, locked, changed since the fix)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ckptdoctor import fixer as fixmod
from ckptdoctor.findings import Applicability, Finding, FixOp, FixPlan, OpKind, Severity
from ckptdoctor.rules import Selection
from ckptdoctor.scanner import scan
from tests.helpers.builders import make_checkpoint, make_run
from tests.helpers.fixing import (
    age,
    clone,
    deepspeed_checkpoint,
    mixed_run,
    run_cli,
    sharded_checkpoint,
    stub_run,
    tree_state,
)
from tests.helpers.paths import TESTS

# ---------------------------------------------------------------------------------------------------------------
# Helpers shared with test_fix_crash.py and test_fix_faults.py


def codes(root: Path, select: str | None = None) -> list[str]:
    sel = Selection(select=(select,)) if select else Selection()
    return [f.rule for f in scan(str(root), selection=sel).findings]


@pytest.fixture(scope="module")
def fix_scenarios(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each scenario built once; tests work on copies."""
    base = tmp_path_factory.mktemp("built")
    torn = make_run(base / "torn", (2, 4, 6))
    (torn / "checkpoint-6" / "trainer_state.json").unlink()
    temp = make_run(base / "temp", (2, 4))
    shutil.copytree(temp / "checkpoint-4", temp / "tmp-checkpoint-6")
    (temp / "tmp-checkpoint-6" / "trainer_state.json").unlink()
    shard = base / "shard"
    sharded_checkpoint(shard / "checkpoint-4", wrong=True)
    make_checkpoint(shard / "checkpoint-2", 2)
    best = make_run(base / "best", (2, 4))
    state = json.loads((best / "checkpoint-4" / "trainer_state.json").read_text())
    state["best_model_checkpoint"] = "/home/alice/runs/best/checkpoint-2"
    state["best_metric"] = float("nan")  # Python's json writes NaN: the rewrite must keep it
    (best / "checkpoint-4" / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    gone = make_run(base / "gone", (2, 4))
    state = json.loads((gone / "checkpoint-4" / "trainer_state.json").read_text())
    state["best_model_checkpoint"] = "gone/checkpoint-1"
    (gone / "checkpoint-4" / "trainer_state.json").write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    ds = base / "ds"
    make_checkpoint(ds / "checkpoint-4", 4)
    deepspeed_checkpoint(ds / "checkpoint-8")
    stale = make_run(base / "stale", (4, 8, 12), max_steps=12)
    for s in (4, 8):  # a second run with other settings overwrote 4 and 8 later
        time.sleep(0.01)
        shutil.rmtree(stale / f"checkpoint-{s}")
        make_checkpoint(stale / f"checkpoint-{s}", s, max_steps=10, lr=5e-4)
    side = make_run(base / "side", (2, 4))  # a side file no resume opens, cut short (CKD202)
    (side / "checkpoint-4" / "ema_backup.safetensors").write_bytes(b"x")
    sidept = make_run(base / "sidept", (2, 4))  # the same as a torch file (CKD203)
    (sidept / "checkpoint-4" / "ema.pt").write_bytes((sidept / "checkpoint-4" / "optimizer.pt").read_bytes()[:200])
    from tests.helpers.accelerate_run import (
        Program,  # real accelerate 1.15 saves: an interrupted one, an unsortable entry
    )

    for name in ("acc-torn", "acc-entry"):
        Program(base / name).train(3)  # checkpoints/checkpoint_0 to _2
    for lost in ("scheduler.bin", "random_states_0.pkl"):
        (base / "acc-torn" / "checkpoints" / "checkpoint_2" / lost).unlink()
    (base / "acc-entry" / "checkpoints" / "notes").mkdir()
    for name in ("stub", "mixed"):
        (base / name).mkdir()
    stub_run(base / "stub")
    mixed_run(base / "mixed")
    # real Lightning 2.6 output with its `save_last="link"` link left dangling (CKD441, an unsafe fix)
    lightning = shutil.copytree(TESTS / "data" / "lightning-2.6.6" / "plain", base / "lightning")
    (lightning / "checkpoints" / "last.ckpt").unlink()
    (lightning / "checkpoints" / "last.ckpt").symlink_to("epoch=2-step=6.ckpt")
    out = {p.name: age(p) for p in base.iterdir()}
    os.utime(stale / "checkpoint-12", ns=(0, (time.time_ns() - 7200 * 10**9)))  # older than the second run
    for f in (stale / "checkpoint-12").iterdir():
        os.utime(f, ns=(0, (time.time_ns() - 7200 * 10**9)))
    return out


@pytest.fixture
def scenario_copy(fix_scenarios: dict[str, Path], tmp_path: Path) -> Any:
    def make(name: str) -> Path:
        return clone(fix_scenarios[name], tmp_path / name)

    return make


# ---------------------------------------------------------------------------------------------------------------
# Round trips: dry run writes nothing; fix -> rescan clean for the rule -> undo -> byte-identical


ROUND_TRIPS = [
    ("stub", "CKD201", ["checkpoint-4/pytorch_model.bin"]),
    ("torn", "CKD102", ["checkpoint-6"]),
    ("acc-torn", "CKD121", ["checkpoints/checkpoint_2"]),
    ("acc-entry", "CKD120", ["checkpoints/notes"]),
    ("temp", "CKD103", ["tmp-checkpoint-6"]),
    ("shard", "CKD205", []),
    ("best", "CKD105", []),
    ("gone", "CKD105", []),
    ("ds", "CKD503", []),
    ("side", "CKD202", ["checkpoint-4/ema_backup.safetensors"]),
    ("sidept", "CKD203", ["checkpoint-4/ema.pt"]),
]


@pytest.mark.parametrize(("name", "rule", "moved"), ROUND_TRIPS, ids=[r[0] for r in ROUND_TRIPS])
def test_round_trip(scenario_copy: Any, name: str, rule: str, moved: list[str]) -> None:
    root = scenario_copy(name)
    assert rule in codes(root), scan(str(root)).findings
    before = tree_state(root)

    code, out = run_cli("fix", "--dry-run", str(root))
    assert code == 1, out
    assert "would " in out and rule in out
    assert tree_state(root) == before  # names, contents, modes and mtimes
    assert not (root / ".ckptdoctor").exists()

    code, out = run_cli("fix", "--select", rule, str(root))
    assert "Fixed 1 problem" in out, out
    assert rule not in codes(root)
    for rel in moved:
        assert not (root / rel).exists()
        (journal,) = fixmod.load_journals(str(root))
        kept = root / ".ckptdoctor" / "quarantine" / journal.txid / rel
        assert kept.exists()
        assert tree_state(kept, mtimes=False)["."] == before[rel][1:2]  # the mode travels with it
    # Folders keep their mtimes (the Trainer's rotation orders checkpoints by them).
    after = tree_state(root)
    assert all(after[k][-1] == v[-1] for k, v in before.items() if k in after and v[0] == stat.S_IFDIR)

    code, out = run_cli("undo", str(root))
    assert code == 0, out
    assert "restored" in out
    assert tree_state(root) == before


def test_mixed_plan_lists_every_operation_with_diffs(scenario_copy: Any) -> None:
    root = scenario_copy("mixed")
    before = tree_state(root)
    code, out = run_cli("fix", "--dry-run", str(root))
    assert code == 1
    assert "would move `checkpoint-4/pytorch_model.bin` to `.ckptdoctor/quarantine/<txid>/" in out
    assert "would move `tmp-checkpoint-6/` to" in out
    assert "would rewrite `checkpoint-1/model.safetensors.index.json`: 1 entry changed" in out
    assert "+    \"head.bias\": \"model-00002-of-00002.safetensors\"," in out
    assert "would rewrite `checkpoint-3/latest`: `global_step9` -> `global_step8`" in out
    assert "Would fix 4 problems with 4 operations" in out
    code, out = run_cli("fix", "--dry-run", "--format", "json", str(root))
    doc = json.loads(out)
    assert doc["schema"] == "ckptdoctor.fix/1" and doc["dry_run"] is True
    kinds = sorted(op["kind"] for op in doc["roots"][0]["operations"])
    assert kinds == ["quarantine", "quarantine", "rewrite-json", "rewrite-text"]
    assert tree_state(root) == before and not (root / ".ckptdoctor").exists()

    code, out = run_cli("fix", "--format", "json", str(root))
    doc = json.loads(out)
    assert doc["summary"]["fixed"] == 4, out
    assert not {"CKD201", "CKD103", "CKD205", "CKD503"} & {f["rule"] for f in doc["remaining"]}
    (j,) = fixmod.load_journals(str(root))
    assert j.state == "applied" and all(op.status == "done" for op in j.ops)
    raw = json.loads((root / ".ckptdoctor" / "journal" / f"{j.txid}.json").read_text())
    assert raw["schema"] == "ckptdoctor.journal/1"
    for op in raw["ops"]:
        assert {"size", "sha256"} <= set(op["before"])
        assert (op["after"] is None) == (op["kind"] == "quarantine")
    # the original of each rewrite is kept, byte for byte, in the quarantine
    q = root / ".ckptdoctor" / "quarantine" / j.txid
    assert (q / "checkpoint-3" / "latest").read_text() == "global_step9"
    assert (root / "checkpoint-3" / "latest").read_text() == "global_step8"

    code, out = run_cli("fix", "--dry-run", str(root))
    assert code == 0 and "Nothing ckptdoctor can fix automatically; 7 problems remain:" in out
    code, out = run_cli("undo", "--list", str(root))
    assert j.txid in out and "applied" in out
    assert run_cli("undo", str(root))[0] == 0
    assert tree_state(root) == before
    code, out = run_cli("undo", str(root))
    assert code == 2 and "no fix transaction to undo" in out


def test_best_model_checkpoint_rewrite_keeps_format_and_values(scenario_copy: Any) -> None:
    root = scenario_copy("best")
    path = root / "checkpoint-4" / "trainer_state.json"
    old = path.read_text()
    run_cli("fix", "--select", "CKD105", str(root))
    new = path.read_text()
    diff = [ln for ln in zip(old.splitlines(), new.splitlines(), strict=True) if ln[0] != ln[1]]
    assert diff == [(
        '  "best_model_checkpoint": "/home/alice/runs/best/checkpoint-2",',
        '  "best_model_checkpoint": "best/checkpoint-2",',
    )]
    assert '"best_metric": NaN' in new and new.endswith("}\n")
    gone = scenario_copy("gone")
    run_cli("fix", "--select", "CKD105", str(gone))
    assert json.loads((gone / "checkpoint-4" / "trainer_state.json").read_text())["best_model_checkpoint"] is None


def test_unsafe_fix_needs_the_flag(scenario_copy: Any) -> None:
    root = scenario_copy("stale")
    assert "CKD101" in codes(root)
    before = tree_state(root)
    code, out = run_cli("fix", "--select", "CKD101", str(root))
    assert "skipped [CKD101]" in out and "--unsafe-fixes" in out
    assert code == 1 and tree_state(root) == before
    code, out = run_cli("fix", "--select", "CKD101", "--unsafe-fixes", str(root))
    assert "Fixed 1 problem" in out, out
    assert not (root / "checkpoint-12").exists()
    assert scan(str(root)).trees[0].runs[0].resume_pick == "checkpoint-8"
    run_cli("undo", str(root))
    assert tree_state(root) == before


def test_rewritten_file_keeps_mode_and_undo_restores_it(scenario_copy: Any) -> None:
    root = scenario_copy("ds")
    latest = root / "checkpoint-8" / "latest"
    os.chmod(latest, 0o640)
    before = tree_state(root)
    run_cli("fix", str(root))
    assert stat.S_IMODE(latest.stat().st_mode) == 0o640
    assert latest.stat().st_mtime_ns == before["checkpoint-8/latest"][-1]
    run_cli("undo", str(root))
    assert tree_state(root) == before


# ---------------------------------------------------------------------------------------------------------------
# Refusals


def test_undo_refuses_when_a_file_changed_since_the_fix(scenario_copy: Any) -> None:
    root = scenario_copy("shard")
    run_cli("fix", str(root))
    index = root / "checkpoint-4" / "model.safetensors.index.json"
    index.write_text(index.read_text().replace("total_size", "total_size_"))
    edited = tree_state(root)
    code, out = run_cli("undo", str(root))
    assert code == 2
    assert "changed after the fix" in out and "model.safetensors.index.json" in out
    assert tree_state(root) == edited


def test_undo_refuses_when_a_quarantined_path_was_recreated(scenario_copy: Any) -> None:
    root = scenario_copy("stub")
    run_cli("fix", str(root))
    (root / "checkpoint-4" / "pytorch_model.bin").write_bytes(b"new")
    code, out = run_cli("undo", str(root))
    assert code == 2 and "exists again" in out
    assert (root / "checkpoint-4" / "pytorch_model.bin").read_bytes() == b"new"


def test_plans_outside_the_root_or_into_own_folder_are_rejected(scenario_copy: Any, tmp_path: Path) -> None:
    root = scenario_copy("stub")
    (tmp_path / "outside.json").write_text("{}")
    tree = scan(str(root)).trees[0]
    bad = [
        Finding("CKD999", "x", Severity.ERROR, ".", "m",
                FixPlan("t", Applicability.SAFE, (FixOp(OpKind.REWRITE_JSON, "../outside.json", "[]"),))),
        Finding("CKD999", "x", Severity.ERROR, ".", "m",
                FixPlan("t", Applicability.SAFE, (FixOp(OpKind.QUARANTINE, "/etc/passwd"),))),
        Finding("CKD999", "x", Severity.ERROR, ".", "m",
                FixPlan("t", Applicability.SAFE, (FixOp(OpKind.QUARANTINE, ".ckptdoctor/journal"),))),
        Finding("CKD999", "x", Severity.ERROR, ".", "m",
                FixPlan("t", Applicability.SAFE, (FixOp(OpKind.REWRITE_TEXT, "checkpoint-4/pytorch_model.bin", "x"),))),
        Finding("CKD999", "x", Severity.ERROR, ".", "m",
                FixPlan("t", Applicability.SAFE, (FixOp(OpKind.REWRITE_JSON, "checkpoint-4/optimizer.pt", "{}"),))),
    ]
    plan = fixmod.plan_root(tree, bad)
    assert plan.ops == ()
    reasons = [s.reason for s in plan.skipped]
    assert "not a path inside the root" in reasons[0] and "not a path inside the root" in reasons[1]
    assert "ckptdoctor's own" in reasons[2]
    assert "never rewritten" in reasons[3] and "never rewritten" in reasons[4]
    assert (tmp_path / "outside.json").read_text() == "{}"


def test_never_through_a_symlink(scenario_copy: Any) -> None:
    root = scenario_copy("stub")
    (root / "store").mkdir()
    os.rename(root / "checkpoint-4", root / "store" / "data")  # not a run: only the link makes it a checkpoint
    os.symlink("store/data", root / "checkpoint-4")
    age(root)
    before = tree_state(root)
    code, out = run_cli("fix", "--select", "CKD201", str(root))
    assert code == 1 and "symbolic link" in out, out
    assert tree_state(root) == before


def test_read_only_tree_is_refused(scenario_copy: Any) -> None:
    root = scenario_copy("stub")
    before = tree_state(root)
    modes = {p: p.stat().st_mode for p in [root, *root.rglob("*")] if p.is_dir()}
    for p in modes:
        os.chmod(p, 0o555)
    try:
        code, out = run_cli("fix", str(root))
        assert code == 2 and "read-only" in out and "nothing was changed" in out
    finally:
        for p, m in modes.items():
            os.chmod(p, m)
    assert tree_state(root, mtimes=False) == {k: v[:-1] if k != "." else v[:1] for k, v in before.items()}
    assert not (root / ".ckptdoctor").exists()


def test_a_run_being_written_is_refused_unless_forced(scenario_copy: Any) -> None:
    root = scenario_copy("temp")
    (root / "tmp-checkpoint-6" / "optimizer.pt").touch()  # the save is still going on
    before = tree_state(root)
    code, out = run_cli("fix", str(root))
    assert code == 2 and "being written" in out and "--force" in out
    assert tree_state(root) == before and not (root / ".ckptdoctor").exists()
    code, out = run_cli("fix", "--force", str(root))
    assert "Fixed 1 problem" in out


def test_lock_held_by_a_live_fixer_refuses_and_a_stale_lock_is_taken_over(scenario_copy: Any) -> None:
    root = scenario_copy("stub")
    (root / ".ckptdoctor").mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import socket

        (root / ".ckptdoctor" / "lock").write_text(f"{holder.pid} {socket.gethostname()} 0\n")
        before = tree_state(root)
        code, out = run_cli("fix", str(root))
        assert code == 2 and f"pid {holder.pid}" in out
        assert tree_state(root) == before
        code, out = run_cli("undo", str(root))
        assert code == 2 and "another ckptdoctor" in out
    finally:
        holder.kill()
        holder.wait()
    code, out = run_cli("fix", str(root))  # the holder is gone: its lock is stale
    assert "Fixed 1 problem" in out, out
    assert not (root / ".ckptdoctor" / "lock").exists()


def test_a_file_changed_between_plan_and_apply_is_refused(scenario_copy: Any) -> None:
    root = scenario_copy("shard")
    report = scan(str(root))
    plan = fixmod.plan_root(report.trees[0], report.findings, root=str(root))
    assert len(plan.ops) == 1
    index = root / "checkpoint-4" / "model.safetensors.index.json"
    index.write_text(index.read_text() + " ")
    age(root)
    before = tree_state(root)
    with pytest.raises(fixmod.FixRefused, match="changed while the fix was planned"):
        fixmod.apply_plan(plan)
    assert tree_state(root) == before


def test_fix_refuses_files_and_nested_roots(scenario_copy: Any) -> None:
    root = scenario_copy("stub")
    code, out = run_cli("fix", str(root / "checkpoint-4" / "pytorch_model.bin"))
    assert code == 2 and "not a folder" in out
    code, out = run_cli("fix", str(root), str(root / "checkpoint-4"))
    assert code == 2 and "inside" in out


def test_discovery_never_sees_the_quarantine(scenario_copy: Any) -> None:
    root = scenario_copy("torn")
    run_cli("fix", str(root))
    tree = scan(str(root)).trees[0]
    assert all(".ckptdoctor" not in f.path for f in tree.all_files())
    assert tree.runs[0].resume_pick == "checkpoint-4"


# ---------------------------------------------------------------------------------------------------------------
# End to end with the reference trainer


@pytest.mark.slow
def test_stub_shadow_resume_matches_the_uninterrupted_run_after_fix(tmp_path: Path) -> None:
    pytest.importorskip("ckptdoctor.reference.scenarios")
    from ckptdoctor.reference.scenarios import base_config
    from tests.helpers.reference import TOL, build_scenario, max_difference, resume_copy, uninterrupted_losses

    out = age(build_scenario("stub-shadow", tmp_path))
    before = tree_state(out)
    assert "CKD201" in codes(out)
    _, text = run_cli("fix", "--select", "CKD201", str(out))
    assert "CKD201" not in codes(out), text
    cfg = base_config(out, use_lora=True)  # how the stub-shadow scenario trains
    resumed = resume_copy(out, tmp_path / "resumed", cfg)
    assert max_difference(uninterrupted_losses(cfg), resumed.losses) < TOL
    run_cli("undo", str(out))
    assert tree_state(out) == before


# ---------------------------------------------------------------------------------------------------------------
# Several roots; many operations


def test_each_root_is_fixed_under_its_own_settings_file(scenario_copy: Any) -> None:
    """A settings file travels with its checkpoint: the first root's must not decide what the others get fixed for."""
    quiet, stub = scenario_copy("shard"), scenario_copy("stub")
    (quiet / ".ckptdoctor.toml").write_text('ignore = ["CKD2"]\n')
    age(quiet)
    _, out = run_cli("fix", str(quiet), str(stub))
    assert "Fixed 1 problem" in out, out  # before: the first root's `ignore` silenced the second root too
    assert not (stub / "checkpoint-4" / "pytorch_model.bin").exists()
    assert "CKD205" in codes(quiet)  # its own file says: not CKD2


def test_an_inside_root_is_refused_whatever_the_settings(scenario_copy: Any) -> None:
    root = scenario_copy("stub")
    (root / "checkpoint-4" / ".ckptdoctor.toml").write_text('ignore = ["CKD2"]\n')
    code, out = run_cli("fix", str(root), str(root / "checkpoint-4"))
    assert code == 2 and "is inside" in out, out


@pytest.mark.parametrize("seed", range(20))
def test_operations_inside_quarantined_folders_are_dropped_as_before(seed: int) -> None:
    """The ancestor lookup that replaced comparing every path with every folder decides the same."""
    import random

    from ckptdoctor.fixer.paths import is_under
    from ckptdoctor.fixer.plan import _below

    rng = random.Random(seed)
    names = ["a", "b", "ab", "a.b", "c"]
    paths = {"/".join(rng.choice(names) for _ in range(rng.randint(1, 4))) for _ in range(40)}
    folders = {p for p in paths if rng.random() < 0.3}
    for p in paths:
        assert _below(p, folders) == any(p != d and is_under(p, d) for d in folders), (p, folders)


def test_the_catalog_says_which_fixes_need_the_flag(fix_scenarios: dict[str, Path]) -> None:
    """`ckptdoctor rules` shows each rule's fix as safe or unsafe: it must be what its findings' plans carry."""
    from ckptdoctor.rules import all_rules

    declared = {r.code: r.fix for r in all_rules()}
    seen: dict[str, set[str]] = {}
    for root in fix_scenarios.values():
        for f in scan(str(root)).findings:
            if f.fix is not None and f.fix.applicability != Applicability.MANUAL:
                seen.setdefault(f.rule, set()).add(f.fix.applicability.value)
    assert {code: {fix} for code, fix in declared.items() if fix} == seen
