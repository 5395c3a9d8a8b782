"""The reference trainer: real Trainer-style checkpoints and resumes for every hazard ckptdoctor detects."""

from __future__ import annotations

from ckptdoctor.reference.train import TrainConfig, TrainResult, get_last_checkpoint, train

__all__ = ["TrainConfig", "TrainResult", "get_last_checkpoint", "train"]
