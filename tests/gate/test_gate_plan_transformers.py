"""Proof: the gate takes the plan as launchers hold it, and matches what the real Trainer then does.

A launcher's `training_args.bin`, a new batch size or gradient accumulation (the Trainer recomputes the steps per
epoch from the new dataloader), `cosine_with_restarts` resumed unchanged (its restart is no jump) and
`reduce_lr_on_plateau` (only the first LR is known). Each trains the tiny GPT-2 of test_gate_transformers, asks
the gate, resumes the real Trainer with the same plan and compares every step count, LR and verdict.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
from click.testing import CliRunner  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

from ckptdoctor.cli import main  # noqa: E402
from ckptdoctor.integrations.transformers import check_resume  # noqa: E402
from ckptdoctor.resume_gate import gate  # noqa: E402
from tests.helpers.gate_runs import ALL, Observed, assert_predicted, codes, copy_run, make_trainer, train  # noqa: E402

pytestmark = pytest.mark.slow


class Eval(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """4 sequences to evaluate on (reduce_lr_on_plateau needs an eval strategy)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 32, (8,), generator=torch.Generator().manual_seed(100 + i))
        return {"input_ids": ids, "labels": ids}


@pytest.fixture(scope="module")
def batch4_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """16 samples at batch 4: 4 steps per epoch, 2 epochs, linear from 1e-3, checkpoints at 2, 4, 6, 8."""
    out = tmp_path_factory.mktemp("batch4") / "out"
    train(out)
    yield out


def test_launchers_training_args_bin_with_a_doubled_batch(batch4_run: Path, tmp_path: Path) -> None:
    """The launcher's training_args.bin plans batch 8 and 3 epochs: 2 steps per epoch (13 to 16 samples)."""
    out = copy_run(batch4_run, tmp_path)
    plan = TrainingArguments(output_dir=str(out), per_device_train_batch_size=8, num_train_epochs=3,
                             learning_rate=1e-3, report_to=[], use_cpu=True)
    torch.save(plan, tmp_path / "training_args.bin")  # what Trainer._save writes
    cli = CliRunner().invoke(main, ["gate", str(out), "--checkpoint", "checkpoint-4", "--training-args",
                                    str(tmp_path / "training_args.bin"), "--lr-steps", str(ALL), "--format", "json"])
    assert cli.exit_code == 0, cli.output
    doc = json.loads(cli.stdout)
    assert doc["resolved"]["steps_per_epoch"] == 2 and doc["resolved"]["sources"]["steps_per_epoch"] == "derived"
    pred = gate(out, checkpoint="checkpoint-4", per_device_train_batch_size=8, num_train_epochs=3, lr_steps=ALL)
    assert (pred.start_step, pred.max_steps, pred.steps_to_train) == (4, 6, 2) and list(pred.lr) == doc["lr"]
    assert_predicted(pred, train(out, resume=str(out / "checkpoint-4"), per_device_train_batch_size=8,
                                 num_train_epochs=3))


def test_gradient_accumulation_changes_the_steps_per_epoch(batch4_run: Path, tmp_path: Path) -> None:
    out = copy_run(batch4_run, tmp_path)
    cli = CliRunner().invoke(main, ["gate", str(out), "--checkpoint", "checkpoint-2", "--gradient-accumulation-steps",
                                    "2", "--lr-steps", str(ALL), "--format", "json"])
    doc = json.loads(cli.stdout)
    assert doc["resolved"]["steps_per_epoch"] == 2 and doc["max_steps"] == 4, cli.output
    pred = gate(out, checkpoint="checkpoint-2", gradient_accumulation_steps=2, lr_steps=ALL)
    assert_predicted(pred, train(out, resume=str(out / "checkpoint-2"), gradient_accumulation_steps=2))


def test_halved_batch_is_unknown_to_the_gate_and_exact_in_check_resume(batch4_run: Path, tmp_path: Path) -> None:
    """4 steps per epoch at batch 4 is 13 to 16 samples: 7 or 8 steps at batch 2. The gate says so (CKD414), and
    check_resume, which holds the Trainer's dataloader, predicts the resume exactly."""
    out = copy_run(batch4_run, tmp_path)
    pred = gate(out, checkpoint="checkpoint-4", per_device_train_batch_size=2)
    (finding,) = [f for f in pred.findings if f.rule == "CKD414"]
    assert "per_device_train_batch_size 4 -> 2" in finding.message and "13 to 16 samples" in finding.message
    assert "7 to 8 steps per epoch" in finding.message and pred.steps_to_train is None and pred.lr == ()
    cli = CliRunner().invoke(main, ["gate", str(out), "--checkpoint", "checkpoint-4",
                                    "--per-device-train-batch-size", "2"])
    assert cli.exit_code == 0 and "CKD414" in cli.output and "not predicted" in cli.output
    trainer = make_trainer(out, Observed(), per_device_train_batch_size=2)
    checked = check_resume(trainer, str(out / "checkpoint-4"), lr_steps=ALL)
    assert checked.settings is not None and checked.settings.steps_per_epoch == 8 and checked.max_steps == 16
    assert_predicted(checked, train(out, resume=str(out / "checkpoint-4"), per_device_train_batch_size=2))


def test_cosine_with_restarts_resumed_unchanged_is_no_jump(tmp_path: Path) -> None:
    """Two cycles over 8 steps restart at step 5: the uninterrupted run rises there too, so CKD411 stays silent."""
    out = tmp_path / "out"
    common: dict[str, Any] = {"lr_scheduler_type": "cosine_with_restarts", "lr_scheduler_kwargs": {"num_cycles": 2},
                              "max_steps": 8, "save_steps": 3}
    train(out, **common)
    pred = gate(out, checkpoint="checkpoint-3", lr_steps=ALL)
    assert max(pred.lr) > 1.25 * pred.lr[0] and "CKD411" not in codes(pred) and pred.verdict == "pass"
    assert_predicted(pred, train(out, resume=str(out / "checkpoint-3"), **common))
    longer = gate(out, checkpoint="checkpoint-3", max_steps=16, lr_steps=ALL)  # a new schedule: a real jump
    assert "CKD411" in codes(longer)


def test_reduce_lr_on_plateau_first_lr_is_the_stored_one(tmp_path: Path) -> None:
    out = tmp_path / "out"
    common: dict[str, Any] = {"lr_scheduler_type": "reduce_lr_on_plateau", "eval_strategy": "steps",
                              "eval_steps": 1, "lr_scheduler_kwargs": {"patience": 0, "factor": 0.5}}
    seen = Observed()
    make_trainer(out, seen, eval_dataset=Eval(), **common).train()
    pred = gate(out, checkpoint="checkpoint-4", num_train_epochs=3, lr_steps=ALL)
    (finding,) = [f for f in pred.findings if f.rule == "CKD412"]
    assert "cannot be predicted" in finding.message and "stored in `optimizer.pt`" in finding.message
    resumed = Observed()
    again = make_trainer(out, resumed, num_train_epochs=3, eval_dataset=Eval(), **common)
    again.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert pred.steps_to_train == len(resumed.lrs) and pred.start_step == resumed.start == 4
    assert len(pred.lr) == 1 and math.isclose(pred.lr[0], resumed.lrs[0], rel_tol=1e-9, abs_tol=0.0)
    assert pred.lr[0] in seen.lrs  # the LR the run itself reached by step 4


def test_auto_find_batch_size_resumes_at_the_checkpoints_batch(batch4_run: Path, tmp_path: Path) -> None:
    """transformers 5.x's train() with auto_find_batch_size restores the checkpoint's train_batch_size (4), and
    find_executable_batch_size starts _inner_training_loop at it: a planned batch 8 is not used, the run's 4 steps
    per epoch stay (CKD415). The gate, given auto_find_batch_size, and check_resume predict it exactly."""
    out = copy_run(batch4_run, tmp_path)
    plan: dict[str, Any] = {"per_device_train_batch_size": 8, "auto_find_batch_size": True, "num_train_epochs": 3}
    pred = gate(out, checkpoint="checkpoint-4", lr_steps=ALL, **plan)
    assert pred.settings is not None and pred.settings.steps_per_epoch == 4 and pred.max_steps == 12
    (ignored,) = [f for f in pred.findings if f.rule == "CKD415"]
    assert "with auto_find_batch_size resumes at the checkpoint's train_batch_size 4" in ignored.message
    without = gate(out, checkpoint="checkpoint-4", per_device_train_batch_size=8, num_train_epochs=3)
    assert without.settings is not None and without.settings.steps_per_epoch == 2  # the new batch, recomputed
    cli = CliRunner().invoke(main, ["gate", str(out), "--checkpoint", "checkpoint-4", "--num-train-epochs", "3",
                                    "--per-device-train-batch-size", "8", "--auto-find-batch-size", "--format", "json"])
    assert json.loads(cli.stdout)["lr"] == list(pred.lr[:5]), cli.output
    checked = check_resume(make_trainer(out, Observed(), **plan), str(out / "checkpoint-4"), lr_steps=ALL)
    assert (checked.max_steps, checked.lr) == (pred.max_steps, pred.lr)
    seen = train(out, resume=str(out / "checkpoint-4"), **plan)
    assert_predicted(pred, seen)
    assert len(seen.lrs) == 8
