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
from tests.helpers.session import once_per_session

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
    # the resume's own save_total_limit, planned (before the resume rotates): 3 keeps every folder, 0 turns rotation off
    assert [f for f in gate(run, max_steps=6, save_total_limit=0).findings if f.rule == "CKD417"] == []
    from click.testing import CliRunner

    from ckptdoctor.cli import main

    out = CliRunner().invoke(main, ["gate", str(run), "--max-steps", "6", "--save-total-limit", "3"])
    assert out.exit_code == 0 and "CKD417" not in out.output
    out = CliRunner().invoke(main, ["gate", str(run), "--max-steps", "6", "--save-total-limit", "2"])
    assert "CKD417" in out.output and "with save_total_limit 2" in out.output
    assert CliRunner().invoke(main, ["gate", str(run), "--save-total-limit", "-1"]).exit_code == 2
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
    # the prediction says the resume raises (no steps), and CKD413 does not say it a second time
    refused = gate(run, checkpoint="checkpoint-2")
    assert refused.steps_to_train is None and "CKD413" not in {f.rule for f in refused.findings}


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


@pytest.mark.skipif(not NUMPY1, reason="CKPTDOCTOR_NUMPY1_LAYER is not set: no numpy 1.x to resume with")
def test_a_numpy_2_rng_state_resumed_under_numpy_1_raises_and_the_gate_with_numpy_version_says_so(
    tmp_path: Path,
) -> None:
    from click.testing import CliRunner

    from ckptdoctor.cli import main
    from ckptdoctor.resume_gate import gate

    run = tmp_path / "numpy2"
    trainer([{"out": str(run), "args": {"max_steps": 4}}], tmp_path / "train")  # this interpreter's numpy 2
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (NUMPY1, os.environ.get("PYTHONPATH")) if p)}
    resumed = trainer([{"out": str(run), "resume": str(run / "checkpoint-2"), "args": {"max_steps": 4}}],
                      tmp_path / "resume", env=env)[0]
    assert resumed["error"][0] == "UnpicklingError" and resumed["steps"] == []
    assert "Unsupported global: GLOBAL numpy._core.multiarray._reconstruct" in resumed["error"][1]

    planned = gate(run, checkpoint="checkpoint-2", numpy_version="1.26")
    found = [f for f in planned.findings if f.rule == "CKD418"]
    assert [f.path for f in found] == ["rng_state.pth"] and "under numpy 1 admits" in found[0].message
    assert planned.steps_to_train is None and planned.failed
    same = gate(run, checkpoint="checkpoint-2", numpy_version="2.3")
    assert same.steps_to_train == 2 and not [f for f in same.findings if f.rule == "CKD418"]
    out = CliRunner().invoke(main, ["gate", str(run), "--checkpoint", "checkpoint-2", "--numpy-version", "1.26"])
    assert out.exit_code == 1 and "CKD418" in out.output and "the resume raises before its first step" in out.output
    bad = CliRunner().invoke(main, ["gate", str(run), "--numpy-version", "two"])
    assert bad.exit_code == 2 and "numpy_version must be a version" in bad.output


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


@pytest.mark.skipif(not (TF440 and TF4_PYTHON), reason="CKPTDOCTOR_TF440_LAYER and CKPTDOCTOR_TF4_PYTHON are needed: "
                    "transformers 4.57 writes, 4.40 resumes")
def test_a_457_state_resumed_by_440_raises_at_train_start_and_the_gate_says_so(tmp_path: Path) -> None:
    from ckptdoctor.resume_gate import gate

    run = tmp_path / "v457"
    trainer([{"out": str(run), "args": {"max_steps": 4}}], tmp_path / "train", python=TF4_PYTHON)
    resumed = trainer([{"out": str(run), "resume": str(run / "checkpoint-2"), "args": {"max_steps": 4}}],
                      tmp_path / "resume-440", env=_layered(TF440))[0]
    assert resumed["error"][0] == "TypeError" and "unexpected keyword argument" in resumed["error"][1]
    found = [f for f in gate(run, checkpoint="checkpoint-2", transformers_version="4.40").findings
             if f.rule == "CKD419"]
    assert len(found) == 1 and "written by transformers 4.57.6" in found[0].message
    assert f"unexpected keyword argument {resumed['error'][1].split('argument ')[1]}" in found[0].message
    assert [f for f in gate(run, checkpoint="checkpoint-2", transformers_version="4.57").findings
            if f.rule == "CKD419"] == []


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
    if TF4_PYTHON:  # 4.57 reads `stateful_callbacks` back the same way: the same crash, and the gate says it for 4.57
        resumed = trainer([{"out": str(run), "resume": str(run / "checkpoint-2"), "args": {"max_steps": 4}}],
                          tmp_path / "resume-457", python=TF4_PYTHON)[0]
        assert resumed["steps"] == [3, 4] and resumed["error"] == ["KeyError", "'TrainerControl'"]
        found = [f for f in gate(run, checkpoint="checkpoint-2", transformers_version="4.57").findings
                 if f.rule == "CKD419"]
        assert len(found) == 1 and "transformers 4.57 trains until its first save" in found[0].message


def test_one_version_parser_reads_every_version_the_gate_compares() -> None:
    from ckptdoctor.facts import version_tuple
    from ckptdoctor.resume_gate.plan import version_major

    assert version_tuple("4.57.6") == (4, 57) and version_tuple("5.23.0.dev0") == (5, 23)
    assert version_tuple(" 2") == (2, 0) and version_tuple("1.26.4") == (1, 26)
    assert version_tuple("12345") is None and version_tuple("v4") is None and version_tuple(None) is None
    assert version_major("4.40.2") == 4 and version_major("x") is None


# ---- 5. the saved key layout differs from the live model's ----
#
# One 5.x and one 4.57 Mixtral run (written once per module: the suite's time matters), each beside a Mixtral of
# another size whose optimizer.pt stands for the one a user copies from another run; the 5.x one beside a Llama too.

BIGGER = {"hidden_size": 32, "intermediate_size": 64}  # another model size: every tensor's shape differs
MORE_EXPERTS = {"num_local_experts": 3}  # only the router and the experts differ: the fused tensors among them


def _mixtral_runs(root: Path, python: str = sys.executable, v5: bool = False) -> str:
    trainer([{"out": str(root / "mixtral"), "model": "mixtral", "args": {"max_steps": 4}},
             {"out": str(root / "bigger"), "model": "mixtral", "config": BIGGER, "args": {"max_steps": 2}},
             {"out": str(root / "experts3"), "model": "mixtral", "config": MORE_EXPERTS, "args": {"max_steps": 2}},
             *([{"out": str(root / "llama"), "args": {"max_steps": 4}},
                {"out": str(root / "qwen3_5_moe"), "model": "qwen3_5_moe", "args": {"max_steps": 4}},
                {"out": str(root / "gte"), "model": "gte", "args": {"max_steps": 4}},
                {"out": str(root / "inkling2"), "model": "inkling2", "args": {"max_steps": 4}}] if v5 else [])],
            root / "train", python=python)
    return str(root)


@pytest.fixture(scope="module")
def mixtral5(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This interpreter's transformers 5.x Mixtral runs (``mixtral``, ``bigger``, ``experts3``), a Llama run, a
    Qwen3.5-MoE run, a GTE run and an Inkling2 run, written once per session. Tests copy what they change and resume
    into another output_dir."""
    return Path(once_per_session(tmp_path_factory, "mixtral5", lambda root: _mixtral_runs(root, v5=True)))


@pytest.fixture(scope="module")
def mixtral457(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """transformers 4.57's Mixtral runs (``CKPTDOCTOR_TF4_PYTHON``): ``mixtral``, ``bigger``, ``experts3``."""
    if not TF4_PYTHON:
        pytest.skip("CKPTDOCTOR_TF4_PYTHON is not set: no transformers 4.57 to write with")
    return Path(once_per_session(tmp_path_factory, "mixtral457", lambda root: _mixtral_runs(root, TF4_PYTHON)))


def _layout(result: Any) -> list[Finding]:
    return [f for f in result.findings if f.rule == "CKD421"]


def _with_optimizer_of(runs: Path, donor: str, tmp: Path) -> Path:
    """A copy of the clean Mixtral's checkpoint-2 holding ``donor``'s ``optimizer.pt`` (a run of another size)."""
    import shutil

    ck = tmp / f"optimizer-of-{donor}" / "checkpoint-2"
    shutil.copytree(runs / "mixtral" / "checkpoint-2", ck)
    shutil.copy2(runs / donor / "checkpoint-2" / "optimizer.pt", ck / "optimizer.pt")
    return ck.parent


def test_a_5x_mixtral_resume_leaves_router_and_experts_at_init_and_the_gate_counts_what_it_restores(
    mixtral5: Path, tmp_path: Path,
) -> None:
    from ckptdoctor.resume_gate import gate

    run, clean = mixtral5 / "mixtral", mixtral5 / "llama"
    resumed = trainer([{"out": str(tmp_path / "resumed"), "model": "mixtral", "resume": str(run / "checkpoint-2"),
                        "args": {"max_steps": 4}}], tmp_path / "resume")[0]
    assert "error" not in resumed and resumed["steps"] == [3, 4]  # it trains, from random experts
    assert resumed["tensors"] == 21 and len(resumed["at_init"]) == 6
    assert all(".mlp.gate." in n or ".mlp.experts." in n for n in resumed["at_init"])

    planned = gate(run, checkpoint="checkpoint-2")
    found = _layout(planned)
    assert len(found) == 1 and found[0].path == "model.safetensors"
    assert "builds `MixtralForCausalLM` in another key layout" in found[0].message
    assert "restores 15 of 21 tensors" in found[0].message and "keep their initial values" in found[0].message
    # the optimizer load itself went through (it holds the live, fused layout): CKD421 is the one hazard
    assert {f.rule for f in planned.findings} == {"CKD421"}
    assert _layout(gate(clean, checkpoint="checkpoint-2")) == []
    # a 4.x resume builds the per-expert layout it was saved in, and its optimizer has the 5.x parameter count
    older_gate = gate(run, checkpoint="checkpoint-2", transformers_version="4.57")
    older = _layout(older_gate)
    assert len(older) == 1 and "holds state for 21 parameters" in older[0].message and "with 29" in older[0].message
    assert {f.rule for f in older_gate.findings} == {"CKD421"}


def test_a_split_and_a_prefix_change_are_counted_as_the_real_5x_resume_restores(mixtral5: Path, tmp_path: Path) -> None:
    """GTE saves q, k and v as one `attention.qkv_proj` (a WeightConverter with 3 targets: `Chunk`) and the up and
    gate projections as one; Qwen3.5-MoE's conversion holds a `PrefixChange` besides its fused experts. Each count
    is the real resume's: the live tensors left at their initial values are the ones the gate says are not
    restored (GTE's tied `lm_head.decoder.weight` is restored through its embedding: no file key of its own)."""
    from ckptdoctor.resume_gate import gate

    gte, qwen = mixtral5 / "gte", mixtral5 / "qwen3_5_moe"
    resumed_gte, resumed_qwen = trainer(
        [{"out": str(tmp_path / "gte"), "model": "gte", "resume": str(gte / "checkpoint-2"), "args": {"max_steps": 4}},
         {"out": str(tmp_path / "qwen"), "model": "qwen3_5_moe", "resume": str(qwen / "checkpoint-2"),
          "args": {"max_steps": 4}}], tmp_path / "resume")
    assert "error" not in resumed_gte and resumed_gte["steps"] == [3, 4]
    assert resumed_gte["tensors"] == 42 and len(resumed_gte["at_init"]) == 34  # = 41 - 7
    assert {"gte.layers.0.self_attn.q_proj.weight", "gte.layers.0.self_attn.k_proj.weight",
            "gte.layers.0.self_attn.v_proj.weight", "gte.layers.0.mlp.gate_proj.weight"} <= set(resumed_gte["at_init"])
    assert "error" not in resumed_qwen and resumed_qwen["tensors"] == 39 and len(resumed_qwen["at_init"]) == 4

    planned = gate(gte, checkpoint="checkpoint-2")
    found = _layout(planned)
    assert len(found) == 1 and "restores 7 of 41 tensors" in found[0].message
    assert {f.rule for f in planned.findings} == {"CKD421"}
    planned = gate(qwen, checkpoint="checkpoint-2")
    found = _layout(planned)
    assert len(found) == 1 and "restores 35 of 39 tensors" in found[0].message
    assert "`model.layers.0.mlp.experts.down_proj`, `model.layers.0.mlp.experts.gate_up_proj`" in found[0].message


def test_a_conversion_ckptdoctor_does_not_model_is_bounded_or_said_not_checked_never_passed_over(
    mixtral5: Path, tmp_path: Path,
) -> None:
    """Inkling2's conversion holds an `Inkling2IndexOffsetWeightRename` (its own `rename_source_key`), and the saved
    `model.llm.attn_res.attn_queries.0` is a key it renames: that key's fate is not known, but the other 47 are
    all renamed (`model.llm.` -> `model.`), so the gate says what is certain. The real resume restores none."""
    from ckptdoctor.findings import Severity
    from ckptdoctor.resume_gate import gate

    run = mixtral5 / "inkling2"
    resumed = trainer([{"out": str(tmp_path / "resumed"), "model": "inkling2", "resume": str(run / "checkpoint-2"),
                        "args": {"max_steps": 4}}], tmp_path / "resume")[0]
    assert "error" not in resumed and resumed["tensors"] == 48 and len(resumed["at_init"]) == 48
    planned = gate(run, checkpoint="checkpoint-2")
    found = _layout(planned)
    assert len(found) == 1 and found[0].severity is Severity.ERROR and found[0].path == "model.safetensors"
    assert "restores at most 1 of the file's 48 tensors, and at least 47 live tensors" in found[0].message
    assert set(resumed["at_init"]) >= {"lm_head.weight", "model.embed_tokens.weight"}
    assert "`Inkling2IndexOffsetWeightRename` (transformers 5.24.0's conversion of `inkling2_text`) renames 1 other " \
           "saved key by code ckptdoctor does not model" in found[0].message
    # resumed by a release that loads the keys as saved, the optimizer's parameter count is the question: the
    # writer's live count is not known (an unmodelled renaming may merge), so the gate says it did not check
    older = _layout(gate(run, checkpoint="checkpoint-2", transformers_version="4.57"))
    assert len(older) == 1 and older[0].severity is Severity.INFO
    assert "was not checked against the one transformers 4.57 builds" in older[0].message
    assert "would rename 1 saved key by code of its own" in older[0].message and "is not known" in older[0].message


def test_the_key_layout_table_is_generated_from_the_releases() -> None:
    from ckptdoctor.key_layouts import releases as table

    releases = table()
    assert releases["4.51.3"] == {"kind": "none"}  # the vision-language renames came with 4.52
    assert releases["4.52.1"]["classes"]["LlavaForConditionalGeneration"][0] == ["^language_model.model",
                                                                                "model.language_model"]
    for v5 in ("5.0.0", "5.24.0"):
        assert [t["kind"] for t in releases[v5]["types"]["mixtral"]] == ["WeightRenaming", "WeightConverter",
                                                                        "WeightConverter"]
    # a PrefixChange renames by the base WeightTransform.rename_source_key: its regex is recorded as a renaming's
    prefix = releases["5.24.0"]["types"]["qwen3_5_moe_text"][0]
    assert prefix == {"kind": "PrefixChange", "regex": "(?P<g0>^model\\.language_model\\.(.+))",
                      "targets": ["model.\\1"], "as": "WeightRenaming"}
    # a renaming by code of its own: its name, and the regex a key must match for that code to change it
    assert releases["5.24.0"]["types"]["dory"][0] == {
        "kind": "LayerPairCollapse", "unless": "layers\\.(\\d+)\\.(mixer|attn_alpha|mlp_alpha)(?=\\.|$)"}


def _scan_rules(root: Path, deep: bool = False) -> list[tuple[str, str]]:
    return sorted((f.rule, f.path) for f in scan(str(root), deep=deep).findings)


def test_a_clean_5x_mixtral_checkpoint_raises_no_alarm_although_its_optimizer_holds_the_fused_experts(
    mixtral5: Path,
) -> None:
    """Principle 5: the optimizer holds the live model's fused experts (`gate_up_proj` [2, 64, 16]), the weights the
    per-expert saved ones (`w1` [32, 16]): CKD405 compares them in the live layout. The finished run's last
    checkpoint says its schedule is over (CKD401, an info): nothing else, with or without --deep."""
    import torch

    run = mixtral5 / "mixtral"
    opt = torch.load(run / "checkpoint-2" / "optimizer.pt", weights_only=True)  # the test may load: the scan never
    shapes = sorted(tuple(s["exp_avg"].shape) for s in opt["state"].values())
    assert len(shapes) == 21 and shapes.count((2, 64, 16)) == 2 and shapes.count((2, 16, 32)) == 2
    assert _scan_rules(run) == _scan_rules(run, deep=True) == [("CKD401", "checkpoint-4")]
    # Qwen3.5-MoE's conversion also changes a prefix, GTE's splits fused tensors into several, Inkling2's shifts an
    # index by code of its own: their clean checkpoints are as silent
    for other in ("qwen3_5_moe", "gte", "inkling2"):
        assert _scan_rules(mixtral5 / other) == _scan_rules(mixtral5 / other, deep=True) == [("CKD401", "checkpoint-4")]


def test_ckd405_still_fires_on_a_5x_mixtral_with_the_optimizer_of_another_size(mixtral5: Path, tmp_path: Path) -> None:
    bigger = [f for f in scan(str(_with_optimizer_of(mixtral5, "bigger", tmp_path))).findings if f.rule == "CKD405"]
    assert len(bigger) == 1 and bigger[0].path == "checkpoint-2/optimizer.pt"
    assert "21 optimizer states have shapes no trainable tensor has ([2, 32] x2, [2, 32, 64] x2, [2, 128, 32] x2)" \
        in bigger[0].message
    assert "more than the 4 tensors transformers 5.24.0 fuses from 12 saved ones for `MixtralForCausalLM`" \
        in bigger[0].message
    # the same size but a third expert: the routers' shapes still tell, although the fused experts' cannot
    experts = [f for f in scan(str(_with_optimizer_of(mixtral5, "experts3", tmp_path))).findings
               if f.rule == "CKD405"]
    assert len(experts) == 1 and "6 optimizer states have shapes no trainable tensor has" in experts[0].message
    assert "[3, 16] x2" in experts[0].message and "the weights have [2, 16] x2 instead" in experts[0].message


def test_a_clean_457_mixtral_checkpoint_raises_no_alarm_and_ckd405_fires_on_another_size(
    mixtral457: Path, tmp_path: Path,
) -> None:
    """4.57 trains the per-expert layout it saves: CKD405 compares the files as they are, both ways."""
    from ckptdoctor.resume_gate import gate

    run = mixtral457 / "mixtral"
    assert _scan_rules(run) == _scan_rules(run, deep=True) == [("CKD401", "checkpoint-4")]
    same = gate(run, checkpoint="checkpoint-2", transformers_version="4.57")
    assert not same.findings and same.steps_to_train == 2
    bigger = [f for f in scan(str(_with_optimizer_of(mixtral457, "bigger", tmp_path))).findings
              if f.rule == "CKD405"]
    assert len(bigger) == 1 and "29 optimizer states have shapes no trainable tensor has" in bigger[0].message
    assert "fuses" not in bigger[0].message  # no layout of 4.57 applies
    experts = [f for f in scan(str(_with_optimizer_of(mixtral457, "experts3", tmp_path))).findings
               if f.rule == "CKD405"]
    assert len(experts) == 1 and "the optimizer holds 35 parameters but the weights only 29 tensors" \
        in experts[0].message


def test_a_457_mixtral_resumed_by_5x_raises_at_the_optimizer_load_and_the_gate_says_so(
    mixtral457: Path, tmp_path: Path,
) -> None:
    from ckptdoctor.resume_gate import gate

    run = mixtral457 / "mixtral"
    planned = gate(run, checkpoint="checkpoint-2", transformers_version="5.24")
    same = gate(run, checkpoint="checkpoint-2", transformers_version="4.57")
    resumed = trainer([{"out": str(tmp_path / "resumed"), "model": "mixtral", "resume": str(run / "checkpoint-2"),
                        "args": {"max_steps": 4}}], tmp_path / "resume")[0]  # this interpreter's 5.x
    assert resumed["error"] == ["ValueError", "loaded state dict contains a parameter group that doesn't match the "
                                              "size of optimizer's group"]
    assert resumed["steps"] == []
    found = _layout(planned)
    assert len(found) == 1 and planned.steps_to_train is None and planned.failed
    assert "restores 15 of 21 tensors" in found[0].message and "raises ValueError" in found[0].message
    assert "holds state for 29 parameters (as transformers 4.57.6 built" in found[0].message
    assert {f.rule for f in planned.findings} == {"CKD421"}  # not CKD413 nor CKD405: one crash, said once
    assert _layout(same) == [] and same.steps_to_train == 2


# ---- 2. a run started from another run's checkpoint instead of resuming it ----

SIBLING = {"max_steps": 8, "learning_rate": 1e-2}


def _started(root: Path) -> list[Finding]:
    return codes(root, "CKD422")


def _history(ck: Path) -> list[dict[str, Any]]:
    return [e for e in json.loads((ck / "trainer_state.json").read_text())["log_history"] if "loss" in e]


def test_a_run_started_from_a_sibling_checkpoint_restarts_its_schedule_and_the_losses_show_it(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    trainer([{"out": str(root / "run-a"), "args": SIBLING},
             {"out": str(root / "run-b"), "init_from": str(root / "run-a" / "checkpoint-8"), "args": SIBLING},
             {"out": str(root / "run-c"), "args": {**SIBLING, "seed": 1}}], tmp_path / "train")
    a, b = _history(root / "run-a" / "checkpoint-8"), _history(root / "run-b" / "checkpoint-8")
    # the damage: run-b warms up again at the full LR from step 1, with a fresh optimizer, on run-a's weights
    assert b[0]["step"] == 1 and b[0]["learning_rate"] == SIBLING["learning_rate"] > a[-1]["learning_rate"]
    assert b[0]["loss"] < a[0]["loss"] - (a[0]["loss"] - a[-1]["loss"]) / 2
    assert "_name_or_path" not in json.loads((root / "run-b" / "checkpoint-8" / "config.json").read_text())

    found = _started(root)
    assert [f.path for f in found] == ["run-b/checkpoint-8/config.json"]
    assert "sibling run `run-a`" in found[0].message and "likely started from `run-a`'s weights" in found[0].message
    assert _started(root / "run-a") == _started(root / "run-b") == []  # one run alone shows nothing
    # run-c trained from scratch beside them (another seed): it starts where run-a started
    assert not [f for f in found if "run-c" in f.path]


@pytest.mark.skipif(not TF440, reason="CKPTDOCTOR_TF440_LAYER is not set: no transformers 4.40 to write with")
def test_transformers_440_names_the_checkpoint_a_run_was_started_from(tmp_path: Path) -> None:
    a, b = tmp_path / "run-a", tmp_path / "elsewhere" / "run-b"
    trainer([{"out": str(a), "args": SIBLING},
             {"out": str(b), "init_from": str(a / "checkpoint-8"), "args": SIBLING}], tmp_path / "train",
            env=_layered(TF440))
    assert json.loads((b / "checkpoint-8" / "config.json").read_text())["_name_or_path"] == str(a / "checkpoint-8")
    found = _started(b)  # the run alone: the file says where it came from
    assert [f.path for f in found] == ["checkpoint-8/config.json"]
    assert f"`_name_or_path` names `{a / 'checkpoint-8'}`" in found[0].message
    assert _started(a) == []
