"""Proof: under transformers 4.x the gate follows 4.x's resume path, and matches what a real 4.57 Trainer does.

transformers 4.57 differs from 5.x where the gate mirrors it (src/transformers/trainer.py, optimization.py):
``_load_from_checkpoint`` reads ``model.safetensors`` only when the resuming ``save_safetensors`` is True (else
``pytorch_model.bin``, FileNotFoundError when there is none), ``train()`` resumes at the checkpoint's
``train_batch_size`` whatever the planned batch size, and ``get_scheduler`` passes ``inverse_sqrt`` no kwargs. The
real resumes run in the 4.x interpreter named by ``CKPTDOCTOR_TF4_PYTHON`` (tests/gate/tf4_trainer.py, as a subprocess:
this interpreter holds transformers 5.x); the gate runs here, told the version with ``transformers_version``.
Which version the gate follows by default (planned, installed, the checkpoint's) is tested without it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckptdoctor.cli import main
from ckptdoctor.resume_gate import GateResult, gate
from ckptdoctor.resume_gate import resolve as resolve_module
from tests.helpers.paths import REPO
from tests.helpers.session import once_per_session

TF4_PYTHON = os.environ.get("CKPTDOCTOR_TF4_PYTHON", "")
SCRIPT = Path(__file__).with_name("tf4_trainer.py")
FIXTURES = REPO / "fixtures"
ALL = 1000  # lr_steps: predict every step, so the whole sequence is compared
# The reason says how to run them (README, "Set up"): the README's test command alone skips them.
SKIP_REASON = ("CKPTDOCTOR_TF4_PYTHON is not set: no transformers 4.57 interpreter to resume with. Run them with "
               "`.ci/tf4-layer && CKPTDOCTOR_TF4_PYTHON=$PWD/.ci-tf4-python python -m pytest "
               "tests/gate/test_gate_tf4.py` (.ci/run does)")
needs_tf4 = pytest.mark.skipif(not TF4_PYTHON, reason=SKIP_REASON)


def test_the_readme_says_how_to_run_them_beside_its_test_command() -> None:
    """Issue 26: the README's test command skipped these in silence; only .ci/run knew how to build the layer."""
    repo = REPO
    ci = (repo / ".ci" / "run").read_text()
    setup = (repo / "README.md").read_text().split("## Set up", 1)[1].split("\n## ", 1)[0]
    after = setup.split(ci.strip().splitlines()[-1], 1)[1]  # what follows the test command
    recipe = ".ci/tf4-layer && CKPTDOCTOR_TF4_PYTHON=$PWD/.ci-tf4-python python -m pytest"
    assert "tests/gate/test_gate_tf4.py" in after and recipe in after
    assert recipe in SKIP_REASON
    assert '.ci/tf4-layer "$PWD/.ci-venv/bin/python"' in ci and os.access(repo / ".ci" / "tf4-layer", os.X_OK)


def tf4(jobs: list[dict[str, Any]], tmp: Path) -> list[dict[str, Any]]:
    """Run ``jobs`` in the transformers 4.x interpreter (tests/gate/tf4_trainer.py) and return their results."""
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    # check_resume imports ckptdoctor in that interpreter: this checkout's, first on its path
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([TF4_PYTHON, str(SCRIPT), str(tmp / "jobs.json"), str(tmp / "results.json")],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr[-4000:]
    results: list[dict[str, Any]] = json.loads((tmp / "results.json").read_text())
    return results


# The runs the 4.57 Trainer writes (16 samples at batch 4: 4 steps per epoch, 2 epochs, checkpoints at 2, 4, 6, 8)
RUNS: dict[str, dict[str, Any]] = {
    "full": {},
    "lora-bin": {"lora": True, "args": {"save_safetensors": False}},
    "cosine-ratio": {"args": {"lr_scheduler_type": "cosine", "warmup_ratio": 0.25}},
    "inverse-sqrt": {"args": {"lr_scheduler_type": "inverse_sqrt", "warmup_steps": 2,
                              "lr_scheduler_kwargs": {"timescale": 3}}},
}
# Each resume: the run it copies, the job's arguments and the gate's planned arguments for the same resume
RESUMES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "full": ("full", {"args": {"num_train_epochs": 3}, "check_resume": True}, {"num_train_epochs": 3}),
    "lora-bin": ("lora-bin", {"lora": True, "args": {"save_safetensors": False, "num_train_epochs": 3},
                              "check_resume": True}, {"num_train_epochs": 3, "save_safetensors": False}),
    "warmup-ratio": ("cosine-ratio", {"args": {"lr_scheduler_type": "cosine", "warmup_ratio": 0.25,
                                                "num_train_epochs": 3}},
                     {"training_args": {"lr_scheduler_type": "cosine", "warmup_ratio": 0.25, "num_train_epochs": 3}}),
    "no-safetensors": ("full", {"args": {"save_safetensors": False}, "check_resume": True},
                       {"save_safetensors": False}),
    "batch-8": ("full", {"args": {"per_device_train_batch_size": 8}, "check_resume": True, "gate_callback": True},
                {"per_device_train_batch_size": 8}),
    "inverse-sqrt": ("inverse-sqrt", {"args": {"lr_scheduler_type": "inverse_sqrt", "warmup_steps": 2,
                                                "lr_scheduler_kwargs": {"timescale": 3}, "num_train_epochs": 3}},
                     {"num_train_epochs": 3}),
    # the LoRA run's checkpoint-4 given a model.safetensors holding the adapter under the PeftModel's names and a
    # stub pytorch_model.bin (``_shadow_adapter``): which one the load reads depends on save_safetensors
    "lora-shadow-bin": ("lora-bin", {"lora": True, "args": {"save_safetensors": False, "num_train_epochs": 3},
                                     "check_resume": True}, {"num_train_epochs": 3, "save_safetensors": False}),
    "lora-shadow-safe": ("lora-bin", {"lora": True, "args": {"save_safetensors": True, "num_train_epochs": 3}},
                         {"num_train_epochs": 3, "save_safetensors": True}),
}


def _shadow_adapter(checkpoint: Path) -> None:
    """Beside the adapter: ``model.safetensors`` with every adapter tensor under its PeftModel name (what
    ``torch.save(peft_model.state_dict())`` names them; it restores all of them) and a stub ``pytorch_model.bin``
    (``torch.save({})``; it restores none)."""
    import torch
    from safetensors.torch import save_file

    from ckptdoctor.trainer_view import model_key

    saved = torch.load(checkpoint / "adapter_model.bin", weights_only=True)
    save_file({model_key(k, "default", "lora_"): v.contiguous() for k, v in saved.items()},
              str(checkpoint / "model.safetensors"))
    torch.save({}, checkpoint / "pytorch_model.bin")


PREPARE = {"lora-shadow-bin": _shadow_adapter, "lora-shadow-safe": _shadow_adapter}


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Train each run once with the 4.x Trainer, then resume a copy of it from checkpoint-4 per case (two
    subprocesses in all): each case's output folder as it was before its resume, and what the resume did.

    Done once per test session (``once_per_session``), however many pytest-xdist workers ask."""
    found = once_per_session(tmp_path_factory, "tf4-resumes", _train_and_resume)
    return {case: (Path(folder), seen) for case, (folder, seen) in found.items()}


def _train_and_resume(base: Path) -> dict[str, tuple[str, dict[str, Any]]]:
    trained = tf4([{"out": str(base / name), **job} for name, job in RUNS.items()], base)
    assert all(r["raised"] is None for r in trained), trained
    cases: dict[str, str] = {}
    jobs = []
    for case, (run, job, _) in RESUMES.items():
        before, out = base / "before" / case, base / "resumed" / case
        shutil.copytree(base / run, before)
        shutil.copytree(base / run, out)
        if case in PREPARE:
            PREPARE[case](before / "checkpoint-4")
            PREPARE[case](out / "checkpoint-4")
        cases[case] = str(before)
        jobs.append({"out": str(out), "resume": str(out / "checkpoint-4"), **job})
    (base / "resumes").mkdir()
    results = tf4(jobs, base / "resumes")
    return {case: (cases[case], result) for case, result in zip(RESUMES, results, strict=True)}


def ask(folder: Path, case: str, seen: dict[str, Any], **override: Any) -> GateResult:
    """The gate's prediction of ``case``'s resume, under the 4.x version that ran it unless ``override`` says."""
    planned = dict(RESUMES[case][2])
    training_args = planned.pop("training_args", None)
    planned = {"transformers_version": seen["version"], **planned, **override}
    return gate(folder, checkpoint="checkpoint-4", lr_steps=ALL, training_args=training_args, **planned)


def assert_same(pred: GateResult, seen: dict[str, Any]) -> None:
    """The gate's start step, step count, every LR, the weights file and the verdict are what the resume did."""
    assert seen["raised"] is None, seen["raised"]
    assert pred.start_step == seen["start"]
    assert pred.steps_to_train == len(seen["lrs"]) and len(pred.lr) == len(seen["lrs"])
    for i, (want, got) in enumerate(zip(seen["lrs"], pred.lr, strict=True)):
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=0.0), (i, pred.lr, seen["lrs"])
    assert seen["weights_files"] == [pred.weights_file]
    assert pred.verdict == "pass" and "CKD413" not in {f.rule for f in pred.findings}


@pytest.mark.slow
@needs_tf4
@pytest.mark.parametrize("case", ["full", "lora-bin", "warmup-ratio"])
def test_the_gate_predicts_a_real_4x_resume(case: str, resumed: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    """A full run, a LoRA run saved with save_safetensors=False (adapter_model.bin), a warmup_ratio run resumed
    for a third epoch (the ratio of the new max_steps: 3 warm-up steps where the run had 2)."""
    folder, seen = resumed[case]
    assert seen["version"].startswith("4.")
    pred = ask(folder, case, seen)
    assert pred.settings is not None and pred.settings.transformers_version == seen["version"]
    assert pred.settings.sources["transformers_version"] == "planned"
    assert_same(pred, seen)
    if case == "warmup-ratio":
        assert pred.warmup_steps == 3
    if "check_resume" in seen:  # the same prediction from inside the 4.x training script, its version unplanned
        cr = seen["check_resume"]
        assert (cr["start"], cr["steps_to_train"], cr["lrs"], cr["verdict"], cr["weights_file"]) == (
            pred.start_step, pred.steps_to_train, list(pred.lr), "pass", pred.weights_file)
        assert cr["version"] == [seen["version"], "planned"]


@pytest.mark.slow
@needs_tf4
def test_save_safetensors_false_reads_pytorch_model_bin(resumed: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    """4.x with save_safetensors=False reads pytorch_model.bin, and the folder holds only model.safetensors."""
    folder, seen = resumed["no-safetensors"]
    assert seen["raised"]["type"] == "FileNotFoundError" and seen["weights_files"] == ["pytorch_model.bin"]
    pred = ask(folder, "no-safetensors", seen)
    (crash,) = [f for f in pred.findings if f.rule == "CKD413"]
    assert "FileNotFoundError" in crash.message and "pytorch_model.bin" in crash.message
    assert pred.verdict == "fail" and pred.steps_to_train is None and pred.weights_file == "pytorch_model.bin"
    cr = seen["check_resume"]  # check_resume reads save_safetensors and the version from the Trainer
    assert cr["verdict"] == "fail" and "CKD413" in cr["rules"] and cr["weights_file"] == "pytorch_model.bin"
    five = ask(folder, "no-safetensors", seen, transformers_version="5.23")  # 5.x has no such argument
    assert five.verdict == "pass" and five.weights_file == "model.safetensors"


@pytest.mark.slow
@needs_tf4
def test_the_adapter_count_uses_the_file_4x_reads(resumed: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    """A LoRA checkpoint with a model.safetensors that restores the whole adapter and a stub pytorch_model.bin:
    4.57 with save_safetensors=False reads the stub and restarts the adapter (0 of its tensors change), and the
    gate, check_resume included, counts that file (CKD201 fails the resume); with save_safetensors=True it reads
    model.safetensors and restores every tensor, and the gate passes."""
    folder, seen = resumed["lora-shadow-bin"]
    assert seen["weights_files"] == ["pytorch_model.bin"] and seen["adapter_restored"][0] == 0
    pred = ask(folder, "lora-shadow-bin", seen)
    assert pred.weights_file == "pytorch_model.bin" and pred.adapter_tensors == tuple(seen["adapter_restored"])
    (shadow,) = [f for f in pred.findings if f.rule == "CKD201"]
    assert "pytorch_model.bin" in shadow.path and pred.verdict == "fail"
    cr = seen["check_resume"]
    assert cr["weights_file"] == "pytorch_model.bin" and cr["adapter_tensors"] == seen["adapter_restored"]
    assert cr["verdict"] == "fail" and "CKD201" in cr["rules"]
    # the scan assumes model.safetensors first and is silent; --select CKD4 does not drop the gate's CKD201
    narrowed = ask(folder, "lora-shadow-bin", seen, select=["CKD4"])
    assert "CKD201" in {f.rule for f in narrowed.findings} and narrowed.verdict == "fail"
    ignored = ask(folder, "lora-shadow-bin", seen, ignore=["CKD201"])
    assert "CKD201" not in {f.rule for f in ignored.findings}
    text = CliRunner().invoke(main, ["gate", str(folder), "--checkpoint", "checkpoint-4", "--num-train-epochs", "3",
                                     "--transformers-version", seen["version"], "--no-save-safetensors"])
    total = seen["adapter_restored"][1]
    assert f"(weights: full, pytorch_model.bin: restores 0 of {total} adapter tensors)" in text.output
    assert text.exit_code == 1
    folder, seen = resumed["lora-shadow-safe"]
    assert seen["weights_files"] == ["model.safetensors"] and seen["adapter_restored"] == [total, total]
    pred = ask(folder, "lora-shadow-safe", seen)
    assert pred.weights_file == "model.safetensors" and pred.adapter_tensors == (total, total)
    assert_same(pred, seen)


@pytest.mark.slow
@needs_tf4
def test_a_planned_batch_size_is_not_used_by_4x(resumed: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    """4.x resumes at the checkpoint's train_batch_size: batch 8 planned, the run's 4 steps per epoch kept."""
    folder, seen = resumed["batch-8"]
    pred = ask(folder, "batch-8", seen)
    assert_same(pred, seen)
    assert pred.settings is not None and pred.settings.steps_per_epoch == 4 and len(seen["lrs"]) == 4
    (ignored,) = [f for f in pred.findings if f.rule == "CKD415"]
    assert "per_device_train_batch_size 8 (planned) is not used" in ignored.message
    cr = seen["check_resume"]  # check_resume builds the dataloader at the checkpoint's batch size, as train() will
    assert (cr["start"], cr["steps_to_train"], cr["lrs"], cr["verdict"]) == (4, 4, seen["lrs"], "pass")
    assert "CKD415" in cr["rules"]
    cb = seen["gate_callback"]  # the callback judges with the dataloader train() built: the checkpoint's batch 4
    assert (cb["start"], cb["steps_to_train"], cb["lrs"], cb["verdict"], cb["steps_per_epoch"]) == (
        4, 4, seen["lrs"], "pass", 4)
    assert "CKD415" in cb["rules"]
    five = ask(folder, "batch-8", seen, transformers_version="5.23")  # 5.x: 2 steps per epoch, the run is done
    assert five.settings is not None and five.settings.steps_per_epoch == 2 and five.steps_to_train == 0
    assert "CKD415" not in {f.rule for f in five.findings}


@pytest.mark.slow
@needs_tf4
def test_inverse_sqrt_ignores_its_timescale_in_4x(resumed: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    """4.x's get_scheduler builds inverse_sqrt without lr_scheduler_kwargs: timescale is the warm-up (2), not 3."""
    folder, seen = resumed["inverse-sqrt"]
    assert_same(ask(folder, "inverse-sqrt", seen), seen)
    five = ask(folder, "inverse-sqrt", seen, transformers_version="5.23")
    assert not all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(five.lr[1:], seen["lrs"][1:], strict=True))


# ---------------------------------------------------------------------------------------------------------------
# Which version the gate follows (no 4.x interpreter needed)


@pytest.fixture
def lr_finished_4x(tmp_path: Path) -> Path:
    """fixtures/lr-finished, its config.json saying transformers 4.57.6 wrote it."""
    out = tmp_path / "lr-finished"
    shutil.copytree(FIXTURES / "lr-finished", out)
    config = out / "checkpoint-8" / "config.json"
    doc = json.loads(config.read_text())
    config.write_text(json.dumps({**doc, "transformers_version": "4.57.6"}))
    return out


def test_the_version_is_planned_else_installed_else_the_checkpoints(
    lr_finished_4x: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(resolve_module, "installed_transformers", lambda: "4.46.3")
    s = gate(lr_finished_4x, max_steps=16, transformers_version="5.23").settings
    assert s is not None and (s.transformers_version, s.sources["transformers_version"]) == ("5.23", "planned")
    s = gate(lr_finished_4x, max_steps=16).settings
    assert s is not None and (s.transformers_version, s.sources["transformers_version"]) == ("4.46.3", "installed")
    monkeypatch.setattr(resolve_module, "installed_transformers", lambda: None)
    s = gate(lr_finished_4x, max_steps=16).settings
    assert s is not None and (s.transformers_version, s.sources["transformers_version"]) == ("4.57.6", "config.json")
    s = gate(FIXTURES / "lr-finished", max_steps=16).settings  # a config.json without transformers_version
    assert s is not None and (s.transformers_version, s.sources["transformers_version"]) == ("5", "default")


def test_installed_version_is_read_from_metadata_without_importing_transformers() -> None:
    code = ("import sys; from ckptdoctor.resume_gate.resolve import installed_transformers as v; "
            "from importlib import metadata; assert v() == metadata.version('transformers'); "
            "assert 'transformers' not in sys.modules; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "ok", proc.stderr


def test_text_and_json_say_the_version_and_its_source(lr_finished_4x: Path) -> None:
    args = ["gate", str(lr_finished_4x), "--max-steps", "16", "--transformers-version", "4.57", "--no-save-safetensors"]
    text = CliRunner().invoke(main, args)
    assert "  transformers     4.57 (planned)" in text.output and "(weights: full, pytorch_model.bin)" in text.output
    assert text.exit_code == 1 and "FileNotFoundError" in text.output  # the fixture has no pytorch_model.bin
    doc = json.loads(CliRunner().invoke(main, [*args[:6], "--format", "json"]).stdout)
    assert doc["resolved"]["transformers_version"] == "4.57" and doc["weights_file"] == "model.safetensors"
    assert doc["resolved"]["sources"]["transformers_version"] == "planned"
    bad = CliRunner().invoke(main, [*args[:4], "--transformers-version", "latest"])
    assert bad.exit_code == 2 and "transformers_version must be a version" in bad.output


def test_4x_schedules_and_sharded_index(tmp_path: Path) -> None:
    """4.x's get_scheduler drops inverse_sqrt's kwargs and knows no greedy; load_sharded_checkpoint(prefer_safe=
    args.save_safetensors) reads the .bin index when save_safetensors is False and both indexes are there."""
    from ckptdoctor import schedules

    four = schedules.build("inverse_sqrt", num_warmup_steps=2, num_training_steps=8, lr_init=1.0,
                           kwargs={"timescale": 3}, major=4)
    five = schedules.build("inverse_sqrt", num_warmup_steps=2, num_training_steps=8, lr_init=1.0,
                           kwargs={"timescale": 3})
    assert (four.params["timescale"], five.params["timescale"]) == (2, 3)  # 4.x: the warm-up steps
    assert four.lr(1.0, 5) == 1 / math.sqrt(5 / 2) and five.lr(1.0, 5) == 1 / math.sqrt((5 + 1) / 3)
    with pytest.raises(schedules.ScheduleError, match="no greedy"):
        schedules.build("greedy", num_warmup_steps=0, num_training_steps=8, lr_init=1.0, major=4)
    ck = tmp_path / "run" / "checkpoint-2"
    ck.mkdir(parents=True)
    for name, shard in (("model.safetensors.index.json", "model-00001-of-00001.safetensors"),
                        ("pytorch_model.bin.index.json", "pytorch_model-00001-of-00001.bin")):
        (ck / name).write_text(json.dumps({"metadata": {}, "weight_map": {"w": shard}}))
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": 2, "epoch": 1.0, "max_steps": 4,
                                                       "num_train_epochs": 2, "train_batch_size": 4}))
    assert gate(tmp_path / "run", transformers_version="4.57", save_safetensors=False).weights_file == (
        "pytorch_model.bin.index.json")
    assert gate(tmp_path / "run", transformers_version="4.57").weights_file == "model.safetensors.index.json"
    assert gate(tmp_path / "run", transformers_version="5.23", save_safetensors=False).weights_file == (
        "model.safetensors.index.json")


def test_a_fractional_warmup_steps_is_not_a_ratio_under_4x(lr_finished_4x: Path) -> None:
    """4.x's TrainingArguments take an integer warmup_steps only (a fraction raises ValueError before train()
    starts: CKD413); its ratio is warmup_ratio. 5.x reads warmup_steps below 1 as that ratio."""
    four = gate(lr_finished_4x, max_steps=16, warmup_steps=0.25, transformers_version="4.57")
    (crash,) = [f for f in four.findings if f.rule == "CKD413"]
    assert "warmup_steps 0.25 (planned) is not an integer" in crash.message and "ValueError" in crash.message
    assert four.verdict == "fail" and four.steps_to_train is None
    ratio = gate(lr_finished_4x, max_steps=16, warmup_ratio=0.25, transformers_version="4.57")
    five = gate(lr_finished_4x, max_steps=16, warmup_steps=0.25, transformers_version="5.23")
    assert ratio.warmup_steps == five.warmup_steps == 4 and "CKD413" not in {f.rule for f in ratio.findings}
    # an integer warmup_steps wins over warmup_ratio in 4.x, and a planned one replaces the file's ratio
    assert gate(lr_finished_4x, max_steps=16, warmup_steps=2, warmup_ratio=0.25,
                transformers_version="4.57").warmup_steps == 2
    assert gate(lr_finished_4x, max_steps=16, training_args={"warmup_ratio": 0.25}, warmup_steps=3,
                transformers_version="4.57").warmup_steps == 3


@needs_tf4
def test_4x_training_arguments_refuse_a_fractional_warmup_steps(tmp_path: Path) -> None:
    code = ("from transformers import TrainingArguments as T\n"
            "try:\n    T(output_dir='o', warmup_steps=0.25, report_to=[])\nexcept ValueError as e:\n    print(e)\n")
    proc = subprocess.run([TF4_PYTHON, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert "warmup_steps must be of type int and must be 0 or a positive integer." in proc.stdout, proc.stderr
