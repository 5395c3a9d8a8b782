"""Shared helpers for the reference-trainer tests: uninterrupted baselines, resuming a copy, comparing losses."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from ckptdoctor.reference.scenarios import build
from ckptdoctor.reference.train import TrainConfig, TrainResult, train

TOL = 1e-6  # "the same losses": what a resume from a healthy checkpoint must achieve
DEPARTS = 1e-4  # "departs": a real difference, far above float noise

_BASELINES: dict[str, dict[int, float]] = {}


def uninterrupted_losses(cfg: TrainConfig) -> dict[int, float]:
    """Losses of the same run trained start to finish in a scratch folder (cached per configuration)."""
    key = repr(cfg.replace(output_dir=""))
    if key not in _BASELINES:
        with tempfile.TemporaryDirectory() as scratch:
            _BASELINES[key] = train(cfg.replace(output_dir=scratch)).losses
    return _BASELINES[key]


def max_difference(expected: dict[int, float], got: dict[int, float]) -> float:
    """Largest per-step loss difference over the steps ``got`` trained (which must be a non-empty subset)."""
    assert got, "the resume trained no steps"
    assert set(got) <= set(expected), (sorted(got), sorted(expected))
    return max(abs(expected[step] - got[step]) for step in got)


def build_scenario(name: str, tmp_path: Path) -> Path:
    """Build a scenario into ``tmp_path/name``."""
    return build(name, tmp_path / name)


def resume_copy(out: Path, dest: Path, cfg: TrainConfig, resume: bool | str = True) -> TrainResult:
    """Copy an output_dir and resume in the copy, so one scenario can be resumed several ways."""
    shutil.copytree(out, dest)
    target: bool | str = resume if resume is True else str(dest / str(resume))
    return train(cfg.replace(output_dir=str(dest)), resume_from_checkpoint=target)
