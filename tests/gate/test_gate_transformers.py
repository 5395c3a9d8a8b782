"""Proof: the gate's prediction equals what the real transformers Trainer then does when it resumes.

Every test trains a tiny GPT-2 (2 layers, 8 dims, CPU, no downloads) into an output_dir, asks the gate about a
planned resume, then resumes the real Trainer with the same plan and compares: the checkpoint it loaded, the step
it started from, how many optimizer steps it took, and the LR of every step (1e-9 relative).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.gate_runs import ALL, Observed, assert_predicted, codes, copy_run, make_trainer, train

transformers = pytest.importorskip("transformers")

from ckptdoctor.integrations.transformers import ResumeGateError, check_resume, gate_callback  # noqa: E402
from ckptdoctor.resume_gate import gate  # noqa: E402


@pytest.fixture(scope="module")
def linear_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """2 epochs x 4 steps, linear decay from 1e-3, checkpoints at steps 2, 4, 6, 8 (8 ends the schedule)."""
    out = tmp_path_factory.mktemp("linear") / "out"
    train(out)
    yield out


@pytest.fixture(scope="module")
def cosine_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Cosine with warm-up given as a ratio (0.375 of 8 -> 3 steps), checkpoints at 2, 4, 6, 8."""
    out = tmp_path_factory.mktemp("cosine") / "out"
    train(out, lr_scheduler_type="cosine", warmup_steps=0.375)
    yield out


def test_finished_schedule_resumed_with_more_epochs(linear_run: Path, tmp_path: Path) -> None:
    out = copy_run(linear_run, tmp_path)
    pred = gate(out, num_train_epochs=3, lr_steps=ALL)
    assert (pred.start_step, pred.max_steps, pred.steps_to_train) == (8, 12, 4)
    assert pred.lr[0] == 0.0  # restored from optimizer.pt, then base * (12 - s) / 12 of the *new* schedule
    assert {"CKD410", "CKD411"} <= codes(pred) and pred.verdict == "pass"
    assert_predicted(pred, train(out, resume=True, num_train_epochs=3))


def test_finished_schedule_resumed_with_same_epochs_trains_nothing(linear_run: Path, tmp_path: Path) -> None:
    out = copy_run(linear_run, tmp_path)
    pred = gate(out)
    assert pred.steps_to_train == 0 and pred.lr == () and pred.verdict == "fail"
    assert "CKD407" in codes(pred)
    assert_predicted(pred, train(out, resume=True))


def test_changed_learning_rate_is_ignored(linear_run: Path, tmp_path: Path) -> None:
    out = copy_run(linear_run, tmp_path)
    pred = gate(out, checkpoint="checkpoint-4", learning_rate=5e-3, lr_steps=ALL)
    assert pred.base_lr == 1e-3 and "CKD409" in codes(pred) and pred.verdict == "fail"
    assert_predicted(pred, train(out, resume=str(out / "checkpoint-4"), learning_rate=5e-3))


def test_same_arguments_continue_the_uninterrupted_schedule(linear_run: Path, tmp_path: Path) -> None:
    import json

    out = copy_run(linear_run, tmp_path)
    pred = gate(out, checkpoint=str(out / "checkpoint-4"), lr_steps=ALL)
    history = json.loads((linear_run / "checkpoint-8" / "trainer_state.json").read_text())["log_history"]
    logged = [e["learning_rate"] for e in history if "learning_rate" in e and e["step"] > 4]
    assert list(pred.lr) == logged and pred.verdict == "pass" and not codes(pred) - {"CKD404"}
    assert_predicted(pred, train(out, resume=str(out / "checkpoint-4")))


def test_stale_higher_checkpoint_from_an_earlier_run(linear_run: Path, tmp_path: Path) -> None:
    out = copy_run(linear_run, tmp_path)
    for folder, _, files in os.walk(out):  # the first run happened an hour ago
        for name in [*files, "."]:
            p = os.path.join(folder, name)
            st = os.stat(p)
            os.utime(p, (st.st_atime - 3600, st.st_mtime - 3600))
    train(out, num_train_epochs=1, learning_rate=2e-3)  # a second, shorter run in the same output_dir
    pred = gate(out, num_train_epochs=1, learning_rate=2e-3)
    assert pred.checkpoint is not None and pred.checkpoint.endswith("checkpoint-8")
    assert {"CKD101", "CKD407"} <= codes(pred) and pred.steps_to_train == 0
    assert_predicted(pred, train(out, resume=True, num_train_epochs=1, learning_rate=2e-3))


def test_missing_scheduler_restarts_the_schedule(linear_run: Path, tmp_path: Path) -> None:
    out = copy_run(linear_run, tmp_path)
    (out / "checkpoint-8" / "scheduler.pt").unlink()
    pred = gate(out, num_train_epochs=3, learning_rate=2e-3, lr_steps=ALL)
    assert not pred.restores_optimizer and "CKD408" in codes(pred)
    assert pred.lr[0] == 2e-3  # fresh optimizer at the planned LR, schedule from its step 0
    assert_predicted(pred, train(out, resume=True, num_train_epochs=3, learning_rate=2e-3))


def test_cosine_warmup_ratio_resumed_with_more_epochs(cosine_run: Path, tmp_path: Path) -> None:
    out = copy_run(cosine_run, tmp_path)
    pred = gate(out, checkpoint="checkpoint-2", num_train_epochs=3, lr_steps=ALL)
    assert pred.warmup_steps == 5  # ceil(0.375 x 12): the ratio applies to the new max_steps
    assert_predicted(pred, train(out, resume=str(out / "checkpoint-2"), num_train_epochs=3,
                                 lr_scheduler_type="cosine", warmup_steps=0.375))


def test_cosine_finished_resumed_with_more_epochs(cosine_run: Path, tmp_path: Path) -> None:
    out = copy_run(cosine_run, tmp_path)
    pred = gate(out, num_train_epochs=4, lr_steps=ALL)
    assert_predicted(pred, train(out, resume=True, num_train_epochs=4, lr_scheduler_type="cosine",
                                 warmup_steps=0.375))


@pytest.mark.parametrize(
    ("schedule", "kwargs"),
    [
        ("polynomial", {"power": 2.0}),  # its lambda divides by the *new* learning_rate
        ("cosine_with_restarts", {"num_cycles": 2}),
        ("constant_with_warmup", {}),
        ("inverse_sqrt", {}),
        ("constant", {}),
    ],
)
def test_other_schedules_with_new_max_steps_and_lr(
    schedule: str, kwargs: dict[str, Any], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    common = {"lr_scheduler_type": schedule, "lr_scheduler_kwargs": kwargs, "warmup_steps": 2, "save_steps": 3}
    train(out, max_steps=6, **common)
    pred = gate(out, checkpoint="checkpoint-3", max_steps=10, learning_rate=2e-3, lr_steps=ALL)
    assert pred.steps_to_train == 7 and pred.settings is not None and pred.settings.steps_per_epoch == 4
    assert_predicted(pred, train(out, resume=str(out / "checkpoint-3"), max_steps=10, learning_rate=2e-3, **common))


def test_finished_max_steps_run_not_a_multiple_of_the_epoch_trains_one_more_step(tmp_path: Path) -> None:
    """max_steps 6 with 4 steps per epoch: the loop still has updates left, so it takes one step past the end."""
    out = tmp_path / "out"
    train(out, max_steps=6, save_steps=3)
    pred = gate(out, lr_steps=ALL)
    assert (pred.start_step, pred.steps_to_train) == (6, 1) and pred.lr == (0.0,)
    assert_predicted(pred, train(out, resume=True, max_steps=6, save_steps=3))


def test_check_resume_raises_before_train(linear_run: Path, tmp_path: Path) -> None:
    out = copy_run(linear_run, tmp_path)
    trainer = make_trainer(out, Observed())
    with pytest.raises(ResumeGateError) as info:
        check_resume(trainer, resume_from_checkpoint=True)
    assert "CKD407" in str(info.value) and info.value.result.steps_to_train == 0
    more = make_trainer(out, Observed(), num_train_epochs=3)
    assert check_resume(more, resume_from_checkpoint=True).steps_to_train == 4


def test_gate_callback_stops_train_before_the_first_step(linear_run: Path, tmp_path: Path) -> None:
    out = copy_run(linear_run, tmp_path)
    seen = Observed()
    trainer = make_trainer(out, seen, callbacks=[gate_callback(str(out / "checkpoint-4"))], learning_rate=5e-3)
    with pytest.raises(ResumeGateError, match="CKD409"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    assert seen.lrs == []  # no optimizer step ran
    callback = gate_callback(True)
    ok = make_trainer(out, Observed(), callbacks=[callback], num_train_epochs=3)
    ok.train(resume_from_checkpoint=True)
    assert callback.result is not None and callback.result.steps_to_train == 4
