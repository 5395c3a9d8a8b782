"""Helpers shared by several test files (moved from tests/gate/test_gate_damage.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from tests.helpers.gate_runs import Tokens  # noqa: E402


def tiny_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=2, n_head=2))


def trainer(out: Path, **overrides: Any) -> Trainer:
    kwargs: dict[str, Any] = {
        "output_dir": str(out), "per_device_train_batch_size": 4, "max_steps": 4, "learning_rate": 1e-3,
        "save_strategy": "steps", "save_steps": 2, "logging_steps": 1, "report_to": [], "use_cpu": True,
        "disable_tqdm": True, "seed": 0, "dataloader_num_workers": 0,
    }
    kwargs.update(overrides)
    return Trainer(model=tiny_model(), args=TrainingArguments(**kwargs), train_dataset=Tokens())


def cut(path: Path, keep: float = 0.5) -> None:
    with open(path, "r+b") as fh:
        fh.truncate(int(path.stat().st_size * keep))
