"""End to end: each hazard damages a real resume, and the cure by hand restores the uninterrupted losses.

Each test builds the scenario with the reference trainer, resumes the way a user would
(``resume_from_checkpoint=True`` with the run's own arguments) and shows the damage. Then it applies by hand what
``ckptdoctor fix`` is meant to do and shows the resume matches the uninterrupted run to 1e-6.

Marked places for the scanner and fixer issues:
- ``SCAN-FINDING``: assert ``ckptdoctor scan`` reports the hazard on the damaged folder (and not on the healthy one).
- ``FIX``: replace the hand-made cure with ``ckptdoctor fix`` and keep the loss assertions as they are.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ckptdoctor.fixer import undo
from ckptdoctor.reference.fsdp import train_fsdp
from ckptdoctor.reference.scenarios import (
    PREEMPT_STEP,
    RUN_STEPS,
    base_config,
    fsdp_config,
    stale_higher_second_run,
)
from ckptdoctor.reference.train import TinyCausalLM, set_seed, train
from tests.helpers.e2e import ckptdoctor_fix, found, tree_digest
from tests.helpers.reference import DEPARTS, TOL, build_scenario, max_difference, resume_copy, uninterrupted_losses


def test_stub_shadow_resume_departs_and_moving_the_stub_aside_restores_it(tmp_path: Path) -> None:
    out = build_scenario("stub-shadow", tmp_path)
    cfg = base_config(out, use_lora=True)
    expected = uninterrupted_losses(cfg)

    damaged = resume_copy(out, tmp_path / "damaged", cfg)
    assert damaged.resumed_from is not None and damaged.resumed_from.name == f"checkpoint-{PREEMPT_STEP}"
    assert damaged.load_report is not None and damaged.load_report.branch == "full"  # the adapter is never loaded
    assert damaged.optimizer_restored  # ... while the Adam state is: the silent part
    assert max_difference(expected, damaged.losses) > DEPARTS
    # SCAN-FINDING: the stub `pytorch_model.bin` shadows `adapter_model.safetensors` in checkpoint-8.
    assert ("CKD201", f"checkpoint-{PREEMPT_STEP}/pytorch_model.bin") in found(out)

    # FIX: `ckptdoctor fix` quarantines the stubs; the resume then loads the adapter.
    before = tree_digest(out)
    ckptdoctor_fix(out)
    assert not {(rule, path) for rule, path in found(out) if path.startswith(f"checkpoint-{PREEMPT_STEP}/")}
    cured = resume_copy(out, tmp_path / "cured", cfg)
    assert cured.load_report is not None and cured.load_report.branch == "adapter"
    assert max_difference(expected, cured.losses) <= TOL
    undo(str(out))  # and `ckptdoctor undo` gives back the tree byte for byte
    assert tree_digest(out) == before


def test_stale_higher_checkpoint_is_picked_and_trains_nothing(tmp_path: Path) -> None:
    out = build_scenario("stale-higher", tmp_path)
    cfg = stale_higher_second_run(out)
    # The two runs of this scenario are seconds apart; in real life they are hours apart. Age the first run's
    # leftover so file times tell which run is newer, as they do on a real disk.
    for p in [out / f"checkpoint-{RUN_STEPS}", *(out / f"checkpoint-{RUN_STEPS}").rglob("*")]:
        st = p.stat()
        os.utime(p, (st.st_atime - 3600, st.st_mtime - 3600))

    damaged = resume_copy(out, tmp_path / "damaged", cfg)
    assert damaged.resumed_from is not None and damaged.resumed_from.name == f"checkpoint-{RUN_STEPS}"
    # global_step 12 >= max_steps 10, no warning: at most the one step the Trainer takes before it checks
    # should_training_stop (12 is mid-epoch here), continuing the old run's weights.
    assert sorted(damaged.losses) in ([], [RUN_STEPS + 1])
    assert damaged.global_step >= RUN_STEPS
    # SCAN-FINDING: checkpoint-12 belongs to another run (max_steps / learning_rate / log_history disagree).
    assert ("CKD101", f"checkpoint-{RUN_STEPS}") in found(out)

    # FIX: `ckptdoctor fix --unsafe-fixes` quarantines the stale checkpoint.
    ckptdoctor_fix(out, unsafe=True)
    assert "CKD101" not in {rule for rule, _ in found(out)}
    cured = resume_copy(out, tmp_path / "cured", cfg)
    assert cured.resumed_from is not None and cured.resumed_from.name == f"checkpoint-{PREEMPT_STEP}"
    assert sorted(cured.losses) == [9, 10]
    assert max_difference(uninterrupted_losses(cfg), cured.losses) <= TOL


def test_interrupted_save_crashes_the_resume_and_the_last_complete_checkpoint_restores_it(tmp_path: Path) -> None:
    out = build_scenario("interrupted-save", tmp_path)
    cfg = base_config(out, atomic_save=False)
    torn = out / f"checkpoint-{PREEMPT_STEP}"
    assert not (torn / "trainer_state.json").exists() and (torn / "scheduler.pt").exists()

    with pytest.raises(FileNotFoundError, match=r"trainer_state\.json"):
        resume_copy(out, tmp_path / "damaged", cfg)
    # SCAN-FINDING: checkpoint-8 is incomplete and is the one resume_from_checkpoint=True picks.
    assert ("CKD102", f"checkpoint-{PREEMPT_STEP}") in found(out)

    # FIX: `ckptdoctor fix` quarantines the torn folder, out of get_last_checkpoint's reach.
    ckptdoctor_fix(out)
    assert ("CKD102", f"checkpoint-{PREEMPT_STEP}") not in found(out)
    cured = resume_copy(out, tmp_path / "cured", cfg)
    assert cured.resumed_from is not None and cured.resumed_from.name == "checkpoint-4"
    assert sorted(cured.losses) == list(range(5, RUN_STEPS + 1))
    assert max_difference(uninterrupted_losses(cfg), cured.losses) <= TOL


def rebuild_index_from_shard_headers(folder: Path) -> None:
    """What the fixer will do: map every tensor to the shard whose header lists it."""
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = {}
    for shard in sorted(folder.glob("model-*-of-*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            weight_map.update(dict.fromkeys(f.keys(), shard.name))
    index["weight_map"] = weight_map
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def test_wrong_shard_index_silently_keeps_fresh_tensors_and_a_rebuilt_index_restores_it(tmp_path: Path) -> None:
    out = build_scenario("sharded-wrong-index", tmp_path)
    cfg = base_config(out, weights_format="sharded")

    damaged = resume_copy(out, tmp_path / "damaged", cfg)
    assert damaged.load_report is not None and damaged.load_report.branch == "sharded"
    assert damaged.load_report.missing_keys == [] and damaged.load_report.unexpected_keys == []  # no warning at all
    assert max_difference(uninterrupted_losses(cfg), damaged.losses) > DEPARTS
    # SCAN-FINDING: the index maps tensors to a shard whose header does not hold them.
    assert ("CKD205", f"checkpoint-{PREEMPT_STEP}/model.safetensors.index.json") in found(out)

    # FIX: `ckptdoctor fix` rebuilds the index from the shard headers.
    before = tree_digest(out)
    ckptdoctor_fix(out)
    assert not {rule for rule, _ in found(out)} & {"CKD205", "CKD204"}
    cured = resume_copy(out, tmp_path / "cured", cfg)
    assert max_difference(uninterrupted_losses(cfg), cured.losses) <= TOL
    undo(str(out))
    assert tree_digest(out) == before


def test_wrong_index_resume_keeps_the_orphaned_tensor_at_its_initial_value(tmp_path: Path) -> None:
    out = build_scenario("sharded-wrong-index", tmp_path)
    cfg = base_config(out, weights_format="sharded", max_steps=PREEMPT_STEP)  # resume trains 0 steps: inspect
    latest = out / f"checkpoint-{PREEMPT_STEP}"
    orphaned = sorted(load_file(str(sorted(latest.glob("model-*-of-*.safetensors"))[-1])))
    loaded = resume_copy(out, tmp_path / "damaged", cfg).model.state_dict()
    set_seed(cfg.seed)
    fresh = TinyCausalLM(cfg).state_dict()
    saved = load_file(str(sorted(latest.glob("model-*-of-*.safetensors"))[-1]))
    for key in orphaned:
        assert torch.equal(loaded[key], fresh[key]) and not torch.equal(loaded[key], saved[key])


@pytest.mark.parametrize("name, error", [("sharded-missing-shard", FileNotFoundError),
                                         ("sharded-truncated-shard", SafetensorError)])
def test_broken_shards_fail_the_resume(tmp_path: Path, name: str, error: type[Exception]) -> None:
    out = build_scenario(name, tmp_path)
    with pytest.raises(error):
        resume_copy(out, tmp_path / "damaged", base_config(out, weights_format="sharded"))
    # SCAN-FINDING: missing shard / truncated shard in checkpoint-8.
    codes = {rule for rule, path in found(out) if path.startswith(f"checkpoint-{PREEMPT_STEP}")}
    assert ("CKD204" if name == "sharded-missing-shard" else "CKD202") in codes


@pytest.mark.parametrize("name, wrapper, prefix", [("prefixed-keys-compile", "compile", "_orig_mod."),
                                                   ("prefixed-keys-ddp", "ddp", "module.")])
def test_prefixed_keys_resume_from_fresh_weights(tmp_path: Path, name: str, wrapper: str, prefix: str) -> None:
    out = build_scenario(name, tmp_path)
    cfg = base_config(out, wrapper=wrapper)
    damaged = resume_copy(out, tmp_path / "damaged", cfg)
    report = damaged.load_report
    assert report is not None and report.unexpected_keys and all(k.startswith(prefix) for k in report.unexpected_keys)
    assert len(report.missing_keys) == len(report.unexpected_keys)
    assert max_difference(uninterrupted_losses(cfg), damaged.losses) > DEPARTS
    # SCAN-FINDING: every key carries the `_orig_mod.` / `module.` prefix.
    assert ("CKD207", f"checkpoint-{PREEMPT_STEP}/model.safetensors") in found(out)

    # FIX (if the fixer offers it): strip the prefix; here by hand.
    weights = out / f"checkpoint-{PREEMPT_STEP}" / "model.safetensors"
    tensors = load_file(str(weights))
    save_file({k.removeprefix(prefix): v for k, v in tensors.items()}, str(weights), metadata={"format": "pt"})
    cured = resume_copy(out, tmp_path / "cured", cfg)
    assert max_difference(uninterrupted_losses(cfg), cured.losses) <= TOL


def test_lr_finished_resume_with_more_steps_starts_at_lr_zero_then_jumps(tmp_path: Path) -> None:
    out = build_scenario("lr-finished", tmp_path)
    latest = out / f"checkpoint-{PREEMPT_STEP}"
    assert torch.load(latest / "scheduler.pt", weights_only=True)["_last_lr"] == [0.0, 0.0]
    cfg = base_config(out, max_steps=16)  # "train a bit longer"
    resumed = train(cfg, resume_from_checkpoint=True)
    assert resumed.resumed_from == latest
    base = cfg.learning_rate
    assert resumed.learning_rates[9] == 0.0  # the LR stored in optimizer.pt
    assert resumed.learning_rates[10] == pytest.approx(base * (16 - 9) / 16)  # the middle of the new schedule
    # SCAN-FINDING: the latest checkpoint's schedule is finished (LR 0, last_epoch == max_steps).
    assert ("CKD401", f"checkpoint-{PREEMPT_STEP}") in found(out)


def test_optimizer_mismatch_resume_is_silent_and_changes_the_adapter(tmp_path: Path) -> None:
    out = build_scenario("optimizer-mismatch", tmp_path)
    before = json.loads((out / f"checkpoint-{PREEMPT_STEP}" / "adapter_config.json").read_text())
    after = json.loads((out / f"checkpoint-{RUN_STEPS}" / "adapter_config.json").read_text())
    assert sorted(before["target_modules"]) == ["q_proj", "v_proj"]
    assert sorted(after["target_modules"]) == ["k_proj", "v_proj"]
    state = json.loads((out / f"checkpoint-{RUN_STEPS}" / "trainer_state.json").read_text())
    assert [e["step"] for e in state["log_history"]] == list(range(1, RUN_STEPS + 1))  # looks continuous
    # The resumed steps are not the run that was interrupted:
    changed = base_config(tmp_path / "x", use_lora=True, lora_target_modules=("k_proj", "v_proj"))
    resumed = resume_copy(out, tmp_path / "again", changed, resume=f"checkpoint-{PREEMPT_STEP}")
    assert resumed.optimizer_restored
    assert max_difference(uninterrupted_losses(base_config(out, use_lora=True)), resumed.losses) > DEPARTS
    # SCAN-FINDING: checkpoint-12's adapter targets differ from checkpoint-8's within one run.
    assert ("CKD405", f"checkpoint-{RUN_STEPS}") in found(out)


@pytest.mark.slow
def test_fsdp_resume_reproduces_and_a_missing_rank_file_fails_it(tmp_path: Path) -> None:
    cfg = fsdp_config(tmp_path / "run")
    full = train_fsdp(cfg)  # writes checkpoint-4 and checkpoint-8
    shutil.rmtree(tmp_path / "run" / f"checkpoint-{PREEMPT_STEP}")
    resumed = train_fsdp(cfg, resume_from_checkpoint=tmp_path / "run" / "checkpoint-4")
    assert sorted(resumed) == [5, 6, 7, 8]
    assert max_difference(full, resumed) <= TOL

    shutil.rmtree(tmp_path / "run" / f"checkpoint-{PREEMPT_STEP}")
    (tmp_path / "run" / "checkpoint-4" / "pytorch_model_fsdp_0" / "__1_0.distcp").unlink()
    with pytest.raises(RuntimeError, match="FSDP rank"):
        train_fsdp(cfg, resume_from_checkpoint=tmp_path / "run" / "checkpoint-4")
    # SCAN-FINDING: pytorch_model_fsdp_0/.metadata names rank 1's file, which is missing.
    assert ("CKD501", "checkpoint-4/pytorch_model_fsdp_0/__1_0.distcp") in found(tmp_path / "run")
