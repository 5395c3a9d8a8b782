"""The resume hazards users report most, each reproduced with the real Trainer and resumed in a fresh process.

Every run is written by tests/gate/hazard_trainer.py in one subprocess and resumed by it in another (a resume in the
process that trained would share its in-memory model and hide what the files alone give). Each test shows the
damage the hazard does, that ckptdoctor names it, and that the same run without the hazard raises nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from ckptdoctor.findings import Finding
from ckptdoctor.scanner import scan

SCRIPT = Path(__file__).with_name("hazard_trainer.py")


def trainer(
    jobs: list[dict[str, Any]], tmp: Path, python: str = sys.executable, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Run ``jobs`` in a fresh ``python`` process (tests/gate/hazard_trainer.py) and return their results."""
    tmp.mkdir(parents=True, exist_ok=True)
    jobs_file, results_file = tmp / "jobs.json", tmp / "results.json"
    jobs_file.write_text(json.dumps(jobs))
    proc = subprocess.run([python, str(SCRIPT), str(jobs_file), str(results_file)], capture_output=True, text=True,
                          timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results: list[dict[str, Any]] = json.loads(results_file.read_text())
    return results


def codes(root: Path, code: str) -> list[Finding]:
    """The findings of rule ``code`` a scan of ``root`` reports."""
    return [f for f in scan(str(root)).findings if f.rule == code]


# ---- 1. tied weights: config.json says untied, the weights hold no head ----


def test_a_config_untied_after_tying_saves_no_head_and_is_found(tmp_path: Path) -> None:
    run, clean = tmp_path / "untied-config", tmp_path / "clean"
    trainer([{"out": str(run), "untie_config": True, "args": {"max_steps": 4}},
             {"out": str(clean), "args": {"max_steps": 4}}], tmp_path / "train")
    ck = run / "checkpoint-2"
    resumed = trainer([
        # the checkpoint's own config builds an untied model: one parameter more than the optimizer state
        {"out": str(run), "from_config": str(ck), "resume": str(ck), "args": {"max_steps": 4}, "check_head": str(ck)},
        # the script that wrote it resumes fine (its model is tied in memory): why this goes unnoticed
        {"out": str(run), "untie_config": True, "resume": str(ck), "args": {"max_steps": 4}},
        {"out": str(clean), "check_head": str(clean / "checkpoint-2")},
    ], tmp_path / "resume")
    from_config, same_script, clean_load = resumed
    assert from_config["error"][0] == "ValueError" and "parameter group" in from_config["error"][1]
    assert from_config["head_is_embedding"] is False  # from_pretrained: a random head
    assert "error" not in same_script and same_script["steps"] == [3, 4]
    assert clean_load["head_is_embedding"] is True

    found = codes(run, "CKD217")
    assert {f.path for f in found} == {f"checkpoint-{n}/config.json" for n in (2, 4)}
    assert "`tie_word_embeddings` is false" in found[0].message and "`model.embed_tokens.weight`" in found[0].message
    assert codes(clean, "CKD217") == []



def test_the_sharded_save_of_an_untied_config_leaves_the_head_out_of_its_index_too(tmp_path: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=True))
    model.config.tie_word_embeddings = False
    model.save_pretrained(tmp_path / "sharded", max_shard_size="4KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"] and "model.embed_tokens.weight" in index["weight_map"]
    found = codes(tmp_path / "sharded", "CKD217")
    assert len(found) == 1 and "`model.safetensors.index.json` holds no `lm_head.weight`" in found[0].message
    assert codes(tmp_path / "sharded", "CKD205") == []  # the index agrees with its shards: only CKD217 sees it

# ---- 6. an early-stopped run resumed trains on ----

EARLY = {"max_steps": 16, "eval_strategy": "steps", "eval_steps": 2, "metric_for_best_model": "loss",
         "load_best_model_at_end": True}


def test_an_early_stopped_run_resumed_trains_past_the_stop_and_the_gate_says_so(tmp_path: Path) -> None:
    import shutil

    from ckptdoctor.resume_gate import gate

    run = tmp_path / "early"
    first = trainer([{"out": str(run), "early_stopping": 1, "args": EARLY}], tmp_path / "train")[0]
    assert first["steps"][-1] == 4 and first["folders"] == ["checkpoint-2", "checkpoint-4"]  # stopped at 4 of 16
    copy = tmp_path / "early-restore"
    shutil.copytree(run, copy)
    before = gate(run)
    restored = gate(copy, checkpoint="checkpoint-2")  # saved before the stop: nothing to say

    resumed = trainer([
        {"out": str(run), "early_stopping": 1, "resume": True, "args": EARLY},
        # restoring the callback states (patience counter and TrainerControl) does not keep the stop either
        {"out": str(copy), "early_stopping": 1, "resume": True,
         "args": {**EARLY, "restore_callback_states_from_checkpoint": True}},
    ], tmp_path / "resume")
    for r in resumed:
        assert r["start"] == 4 and r["steps"] == [5, 6]  # trains on until the next evaluation stops it again

    found = [f for f in before.findings if f.rule == "CKD420"]
    assert len(found) == 1 and found[0].path == "checkpoint-4/trainer_state.json"
    assert "stopped itself early at global_step 4 of max_steps 16" in found[0].message
    assert "`EarlyStoppingCallback` stopped it: 1 evaluations without improvement, patience 1" in found[0].message
    assert "up to 12 more steps" in found[0].message and before.steps_to_train == 12
    assert [f for f in restored.findings if f.rule == "CKD420"] == []


# ---- 7. rotation by modification time ----


def test_rotation_by_mtime_deletes_the_checkpoint_the_resume_started_from_and_the_gate_names_it(
    tmp_path: Path,
) -> None:
    import os
    import shutil
    import time

    from ckptdoctor.resume_gate import gate

    run = tmp_path / "touched"
    trainer([{"out": str(run), "args": {"max_steps": 4, "save_total_limit": 2}}], tmp_path / "train")
    now = time.time()
    for name, age in (("checkpoint-2", 200), ("checkpoint-4", 100)):  # written in order, minutes ago
        os.utime(run / name, (now - age, now - age))
    clean = tmp_path / "clean"
    shutil.copytree(run, clean)
    for name, age in (("checkpoint-2", 200), ("checkpoint-4", 100)):  # copytree keeps times; say it plainly
        os.utime(clean / name, (now - age, now - age))
    os.utime(run / "checkpoint-2", (now, now))  # restored from a backup without its times

    touched_gate, clean_gate = gate(run, max_steps=6), gate(clean, max_steps=6)
    resumed = trainer([{"out": str(d), "resume": True, "args": {"max_steps": 6, "save_total_limit": 2}}
                       for d in (run, clean)], tmp_path / "resume")
    assert resumed[0]["start"] == 4 and resumed[0]["folders"] == ["checkpoint-2", "checkpoint-6"]  # 4 deleted
    assert resumed[1]["folders"] == ["checkpoint-4", "checkpoint-6"]

    found = [f for f in touched_gate.findings if f.rule == "CKD417"]
    assert len(found) == 1 and found[0].path == "checkpoint-4"
    assert ("deletes `checkpoint-4` (the checkpoint this resume starts from) and keeps `checkpoint-2`"
            in found[0].message)
    assert [f for f in clean_gate.findings if f.rule == "CKD417"] == []


# ---- 3. weights_only refusals ----

NUMPY1 = os.environ.get("CKPTDOCTOR_NUMPY1_LAYER", "")  # a `pip install --target` layer of numpy 1.26 (.ci/run)


def test_numpy_scalars_in_the_optimizer_state_are_refused_by_the_resume_and_the_gate_says_so(tmp_path: Path) -> None:
    from ckptdoctor.resume_gate import gate

    run, clean = tmp_path / "numpy-lr", tmp_path / "clean"
    trainer([{"out": str(run), "numpy_lr": True, "args": {"max_steps": 4}},
             {"out": str(clean), "args": {"max_steps": 4}}], tmp_path / "train")
    resumed = trainer([{"out": str(d), "numpy_lr": d == run, "resume": str(d / "checkpoint-2"),
                        "args": {"max_steps": 4}} for d in (run, clean)], tmp_path / "resume")
    assert resumed[0]["error"][0] == "UnpicklingError"
    assert "Unsupported global: GLOBAL numpy._core.multiarray.scalar" in resumed[0]["error"][1]
    assert "error" not in resumed[1] and resumed[1]["steps"] == [3, 4]

    found = [f for f in gate(run, checkpoint="checkpoint-2").findings if f.rule == "CKD418"]
    assert {f.path for f in found} == {"optimizer.pt", "scheduler.pt"}  # paths under the checkpoint given
    assert all("names `numpy._core.multiarray.scalar`" in f.message for f in found)
    assert [f for f in gate(clean, checkpoint="checkpoint-2").findings if f.rule == "CKD418"] == []
    assert codes(run, "CKD601") == codes(run, "CKD602") == []  # harmless to the security rules, and still unloadable


@pytest.mark.skipif(not NUMPY1, reason="CKPTDOCTOR_NUMPY1_LAYER is not set: no numpy 1.x to write the RNG state with")
def test_an_rng_state_written_under_numpy_1_is_refused_under_numpy_2_and_the_gate_says_so(tmp_path: Path) -> None:
    from ckptdoctor.resume_gate import gate

    run = tmp_path / "numpy1"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (NUMPY1, os.environ.get("PYTHONPATH")) if p)}
    trainer([{"out": str(run), "args": {"max_steps": 4}}], tmp_path / "train", env=env)
    resumed = trainer([{"out": str(run), "resume": str(run / "checkpoint-2"), "args": {"max_steps": 4}}],
                      tmp_path / "resume")[0]  # this interpreter's numpy 2
    assert resumed["error"][0] == "UnpicklingError"
    assert "Unsupported global: GLOBAL numpy.core.multiarray._reconstruct" in resumed["error"][1]

    found = [f for f in gate(run, checkpoint="checkpoint-2").findings if f.rule == "CKD418"]
    assert [f.path for f in found] == ["rng_state.pth"]
    assert "names `numpy.core.multiarray._reconstruct`" in found[0].message and "under numpy 2" in found[0].message


# ---- 4. trainer_state.json written by one transformers, resumed by another ----

TF440 = os.environ.get("CKPTDOCTOR_TF440_LAYER", "")  # a `pip install --target` layer of transformers 4.40 (.ci/run)
TF4_PYTHON = os.environ.get("CKPTDOCTOR_TF4_PYTHON", "")  # an interpreter of transformers 4.57 (.ci/run)


def _layered(layer: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (layer, os.environ.get("PYTHONPATH")) if p)}


@pytest.mark.skipif(not TF440, reason="CKPTDOCTOR_TF440_LAYER is not set: no transformers 4.40 to resume with")
def test_a_5x_state_resumed_by_440_raises_at_train_start_and_the_gate_says_so(tmp_path: Path) -> None:
    from ckptdoctor.resume_gate import gate

    run = tmp_path / "v5"
    trainer([{"out": str(run), "args": {"max_steps": 4}}], tmp_path / "train")
    job = [{"out": str(run), "resume": str(run / "checkpoint-2"), "args": {"max_steps": 4}}]
    resumed = trainer(job, tmp_path / "resume-440", env=_layered(TF440))[0]
    assert resumed["error"] == ["TypeError", "TrainerState.__init__() got an unexpected keyword argument "
                                             "'best_global_step'"]
    found = [f for f in gate(run, checkpoint="checkpoint-2", transformers_version="4.40").findings
             if f.rule == "CKD419"]
    assert len(found) == 1 and "`best_global_step`, `stateful_callbacks`" in found[0].message
    assert "train() raises TypeError" in found[0].message
    assert [f for f in gate(run, checkpoint="checkpoint-2", transformers_version="4.57").findings
            if f.rule == "CKD419"] == []
    if TF4_PYTHON:  # and 4.57 does resume it
        assert "error" not in trainer(job, tmp_path / "resume-457", python=TF4_PYTHON)[0]


@pytest.mark.skipif(not TF440, reason="CKPTDOCTOR_TF440_LAYER is not set: no transformers 4.40 to write with")
def test_a_440_state_resumed_by_5x_raises_at_its_first_save_and_the_gate_says_so(tmp_path: Path) -> None:
    from ckptdoctor.resume_gate import gate

    run = tmp_path / "v440"
    trainer([{"out": str(run), "args": {"max_steps": 4}}], tmp_path / "train", env=_layered(TF440))
    prediction = gate(run, checkpoint="checkpoint-2", transformers_version="5.24")
    resumed = trainer([{"out": str(run), "resume": str(run / "checkpoint-2"), "args": {"max_steps": 4}}],
                      tmp_path / "resume")[0]  # this interpreter's transformers 5.x
    assert resumed["steps"] == [3, 4] and resumed["error"] == ["KeyError", "'TrainerControl'"]
    found = [f for f in prediction.findings if f.rule == "CKD419"]
    assert len(found) == 1 and "written by transformers 4.40.2" in found[0].message
    assert "raises KeyError: 'TrainerControl'" in found[0].message
