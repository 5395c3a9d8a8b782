"""Helpers shared by several test files (moved from tests/gate/test_gate_transformers.py)."""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from ckptdoctor.resume_gate import GateResult  # noqa: E402

ALL = 1000  # lr_steps: predict every step, so the whole sequence is compared


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """16 fixed random sequences: 4 optimizer steps per epoch at batch size 4."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 32, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


@dataclass
class Observed:
    """What the Trainer did: the checkpoint it loaded, its first step, and the LR each optimizer step used."""

    loaded: str | None = None
    start: int | None = None
    lrs: list[float] = field(default_factory=list)


class Recorder(TrainerCallback):
    def __init__(self, seen: Observed) -> None:
        self.seen = seen

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seen.start = state.global_step

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seen.lrs.append(kwargs["optimizer"].param_groups[0]["lr"])


class RecordingTrainer(Trainer):
    """The stock Trainer, noting which checkpoint `_load_from_checkpoint` was given."""

    seen: Observed

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        self.seen.loaded = resume_from_checkpoint
        super()._load_from_checkpoint(resume_from_checkpoint, model)


def make_trainer(out: Path, seen: Observed, callbacks: list[Any] | None = None, **overrides: Any) -> RecordingTrainer:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=2, n_head=2))
    kwargs: dict[str, Any] = {
        "output_dir": str(out), "per_device_train_batch_size": 4, "num_train_epochs": 2, "learning_rate": 1e-3,
        "save_strategy": "steps", "save_steps": 2, "logging_steps": 1, "report_to": [], "use_cpu": True,
        "disable_tqdm": True, "seed": 0, "dataloader_num_workers": 0,
    }
    eval_dataset = overrides.pop("eval_dataset", None)
    kwargs.update(overrides)
    trainer = RecordingTrainer(model=model, args=TrainingArguments(**kwargs), train_dataset=Tokens(),
                               eval_dataset=eval_dataset, callbacks=[Recorder(seen), *(callbacks or [])])
    trainer.seen = seen
    return trainer


def train(out: Path, resume: bool | str | None = None, **overrides: Any) -> Observed:
    seen = Observed()
    make_trainer(out, seen, **overrides).train(resume_from_checkpoint=resume)
    return seen


def copy_run(src: Path, tmp_path: Path) -> Path:
    dest = tmp_path / "out"
    shutil.copytree(src, dest)  # copy2 keeps the mtimes discovery compares
    return dest


def assert_predicted(pred: GateResult, seen: Observed) -> None:
    assert pred.checkpoint is not None and seen.loaded is not None
    assert os.path.realpath(pred.checkpoint) == os.path.realpath(seen.loaded)
    assert pred.start_step == seen.start
    assert pred.steps_to_train == len(seen.lrs)
    assert len(pred.lr) == min(len(seen.lrs), ALL)
    for i, (want, got) in enumerate(zip(seen.lrs, pred.lr, strict=False)):
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=0.0), (i, pred.lr, seen.lrs)


def codes(pred: GateResult) -> set[str]:
    return {f.rule for f in pred.findings}
