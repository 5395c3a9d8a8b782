"""The Python ways into the gate behave as a training script needs: ``check_resume`` and ``gate_callback`` against a
real transformers Trainer (paths resolved as ``train()`` resolves them, fresh runs let through, warnings logged),
and ``gate()`` / ``--training-args`` rejecting planned values of the wrong type.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from click.testing import CliRunner  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

from ckptdoctor.cli import main  # noqa: E402
from ckptdoctor.integrations.transformers import ResumeGateError, check_resume, gate_callback  # noqa: E402
from ckptdoctor.resume_gate import GateInputError, gate, plan_from_training_args  # noqa: E402
from tests.helpers.gate_runs import ALL, Observed, assert_predicted, copy_run, make_trainer, train  # noqa: E402

SECURITY_NOTE = "may not turn off or lower security rules"


@pytest.fixture(scope="module")
def api_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """2 epochs x 4 steps, linear decay from 1e-3, checkpoints at steps 2, 4, 6, 8."""
    out = tmp_path_factory.mktemp("api") / "out"
    train(out)
    yield out


# ---------------------------------------------------------------------------------------------------------------
# check_resume resolves resume_from_checkpoint as train() does


def test_a_relative_checkpoint_is_taken_from_the_working_directory(
    api_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = copy_run(api_run, tmp_path)
    monkeypatch.chdir(tmp_path)  # outside output_dir: "checkpoint-6" is not there for train()
    trainer = make_trainer(out, Observed(), num_train_epochs=3)
    with pytest.raises(ResumeGateError) as info:
        check_resume(trainer, resume_from_checkpoint="checkpoint-6")
    assert [f.rule for f in info.value.result.findings] == ["CKD413"]
    assert "names no folder" in str(info.value)
    with pytest.raises(ValueError, match="Can't find a valid checkpoint at checkpoint-6"):
        trainer.train(resume_from_checkpoint="checkpoint-6")

    # the same name from inside output_dir, and a path from outside it, are what train() loads
    assert check_resume(trainer, resume_from_checkpoint="out/checkpoint-6").start_step == 6
    monkeypatch.chdir(out)
    seen = Observed()
    trainer = make_trainer(out, seen, num_train_epochs=3)
    pred = check_resume(trainer, resume_from_checkpoint="checkpoint-6", lr_steps=ALL)
    trainer.train(resume_from_checkpoint="checkpoint-6")
    assert seen.loaded == "checkpoint-6"
    assert_predicted(pred, seen)


def test_the_cli_still_finds_a_checkpoint_inside_run_dir(api_run: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    out = copy_run(api_run, tmp_path)
    monkeypatch.chdir(tmp_path)
    assert gate(out, checkpoint="checkpoint-6", num_train_epochs=3).start_step == 6  # the CLI's convenience
    missing = gate(out, checkpoint="checkpoint-6", checkpoint_in_run=False, num_train_epochs=3)
    assert missing.checkpoint is None and [f.rule for f in missing.findings] == ["CKD413"]


# ---------------------------------------------------------------------------------------------------------------
# gate_callback: after train() has loaded the checkpoint; fresh runs pass


def test_the_callback_lets_a_fresh_run_train(tmp_path: Path) -> None:
    callback = gate_callback()
    seen = Observed()
    trainer = make_trainer(tmp_path / "fresh", seen, max_steps=2, save_steps=10)
    trainer.add_callback(callback)
    trainer.train()
    assert callback.result is None and len(seen.lrs) == 2


def test_a_damaged_checkpoint_raises_in_train_before_the_callback(api_run: Path, tmp_path: Path) -> None:
    """transformers loads the weights before on_train_begin: the callback never sees them; check_resume does."""
    out = copy_run(api_run, tmp_path)
    weights = out / "checkpoint-8" / "model.safetensors"
    with open(weights, "r+b") as fh:
        fh.truncate(weights.stat().st_size // 2)
    with pytest.raises(ResumeGateError, match="CKD413"):
        check_resume(make_trainer(out, Observed(), num_train_epochs=3), resume_from_checkpoint=True)
    callback = gate_callback(True)
    trainer = make_trainer(out, Observed(), callbacks=[callback], num_train_epochs=3)
    with pytest.raises(Exception) as info:
        trainer.train(resume_from_checkpoint=True)
    assert type(info.value).__name__ == "SafetensorError" and not isinstance(info.value, ResumeGateError)
    assert callback.result is None  # on_train_begin never ran


# ---------------------------------------------------------------------------------------------------------------
# Warnings of a passing gate are logged


def test_warnings_of_a_passing_gate_are_logged(api_run: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    out = copy_run(api_run, tmp_path)
    with caplog.at_level(logging.WARNING, logger="ckptdoctor"):
        result = check_resume(make_trainer(out, Observed(), num_train_epochs=3), resume_from_checkpoint=True)
    assert result.verdict == "pass"
    logged = [r for r in caplog.records if r.name == "ckptdoctor"]
    assert [r.levelno for r in logged] == [logging.WARNING, logging.WARNING]
    assert "CKD410 [warning]" in logged[0].getMessage() and "CKD411 [warning]" in logged[1].getMessage()

    caplog.clear()
    callback = gate_callback(True)
    with caplog.at_level(logging.WARNING, logger="ckptdoctor"):
        make_trainer(out, Observed(), callbacks=[callback], num_train_epochs=3).train(resume_from_checkpoint=True)
    assert callback.result is not None and callback.result.steps_to_train == 4
    rules = [r.getMessage().split(": ")[1].split(" ")[0] for r in caplog.records if r.name == "ckptdoctor"]
    assert rules == ["CKD410", "CKD411"]


# ---------------------------------------------------------------------------------------------------------------
# Planned values of the wrong type are usage errors; the checkpoint's own are skipped


@pytest.mark.parametrize(
    ("args", "key"),
    [
        ({"num_train_epochs": "three", "max_steps": "x"}, "num_train_epochs"),
        ({"max_steps": "x"}, "max_steps"),
        ({"max_steps": 2.5}, "max_steps"),
        ({"learning_rate": float("nan")}, "learning_rate"),
        ({"warmup_ratio": float("inf")}, "warmup_ratio"),
        ({"warmup_steps": True}, "warmup_steps"),
        ({"lr_scheduler_type": 3}, "lr_scheduler_type"),
        ({"lr_scheduler_kwargs": "not json"}, "lr_scheduler_kwargs"),
        ({"lr_scheduler_kwargs": [1]}, "lr_scheduler_kwargs"),
        ({"ignore_data_skip": "yes"}, "ignore_data_skip"),
    ],
)
def test_planned_training_args_of_the_wrong_type_are_usage_errors(
    api_run: Path, tmp_path: Path, args: dict[str, object], key: str
) -> None:
    with pytest.raises(GateInputError, match=f"training_args {key} must be"):
        gate(api_run, training_args=args)
    if not any(isinstance(v, float) for v in args.values()):  # the checkpoint's own non-finite ones stay: CKD413
        assert plan_from_training_args(args).get(key) is None  # lenient: as the checkpoint's own are read
    path = tmp_path / "ta.json"
    path.write_text(json.dumps(args))  # NaN and Infinity too: json.load reads them
    result = CliRunner().invoke(main, ["gate", str(api_run), "--training-args", str(path)])
    assert result.exit_code == 2, result.output
    assert f"--training-args {path}: training_args {key} must be" in result.stderr


def test_valid_planned_training_args_still_plan(api_run: Path, tmp_path: Path) -> None:
    args = TrainingArguments(output_dir=str(tmp_path), num_train_epochs=3, learning_rate=1e-3, report_to=[],
                             per_device_train_batch_size=4)  # the run's: a new one would change the epoch
    path = tmp_path / "ta.json"
    path.write_text(args.to_json_string())
    result = CliRunner().invoke(main, ["gate", str(api_run), "--training-args", str(path), "--format", "json"])
    doc = json.loads(result.stdout)
    assert doc["max_steps"] == 12 and doc["resolved"]["sources"]["num_train_epochs"] == "planned"
    nulls = {"num_train_epochs": 3, "max_steps": None, "lr_scheduler_kwargs": ""}  # null or empty: not planned
    assert gate(api_run, training_args=nulls).max_steps == 12


def test_the_checkpoints_own_training_args_of_the_wrong_type_are_skipped(api_run: Path, tmp_path: Path) -> None:
    out = copy_run(api_run, tmp_path)
    args = torch.load(out / "checkpoint-8" / "training_args.bin", weights_only=False)
    args.num_train_epochs = "three"  # whatever a pickle holds: not the user's plan, so not a usage error
    torch.save(args, out / "checkpoint-8" / "training_args.bin")
    result = gate(out)
    assert result.settings is not None and result.settings.sources["num_train_epochs"] == "trainer_state.json"


# ---------------------------------------------------------------------------------------------------------------
# A settings file that tries to turn off security rules: a Python warning from the API, the CLI note on the CLI


def test_the_python_api_warns_where_the_cli_prints_its_note(
    api_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = copy_run(api_run, tmp_path)
    (out / ".ckptdoctor.toml").write_text('ignore = ["CKD6"]\n')
    with pytest.warns(UserWarning, match=SECURITY_NOTE) as caught:
        gate(out, num_train_epochs=3)
    assert "ignore=[...]" in str(caught[0].message) and "--ignore" not in str(caught[0].message)
    assert caught[0].filename == __file__  # attributed to the caller, not to ckptdoctor
    with pytest.warns(UserWarning, match=SECURITY_NOTE) as caught:
        check_resume(make_trainer(out, Observed(), num_train_epochs=3), resume_from_checkpoint=True)
    assert caught[0].filename == __file__
    assert SECURITY_NOTE not in capsys.readouterr().err

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the CLI does not warn: it prints scan's note
        result = CliRunner().invoke(main, ["gate", str(out), "--num-train-epochs", "3"])
    assert result.exit_code == 0, result.output
    assert "use --ignore on the command line to turn one off." in result.stderr
