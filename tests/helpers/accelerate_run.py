"""One accelerate 1.15 training program, run in this process as a fresh one: a tiny model, AdamW, a LambdaLR,
``Accelerator(cpu=True)``, ``save_state``/``load_state`` (issue 23, sections 3 to 5).

Each call builds a new ``Accelerator`` after resetting accelerate's process-wide state, as a new process would
start, so one test can run a program, resume it with another, and see what ``load_state()`` restored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import ProjectConfiguration


class Counter:
    """A custom object for ``register_for_checkpointing``: anything with ``state_dict``/``load_state_dict``."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


class Program:
    """A fresh training program: its accelerator, prepared model, optimizer and scheduler."""

    def __init__(self, project: Path | None = None, total_limit: int | None = 3, custom: int = 0) -> None:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        config = None if project is None else ProjectConfiguration(
            project_dir=str(project), automatic_checkpoint_naming=True, total_limit=total_limit)
        self.acc = Accelerator(cpu=True, project_config=config)
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        self.model, self.opt, self.sched = self.acc.prepare(model, opt, sched)
        self.custom = [Counter() for _ in range(custom)]
        if custom:
            self.acc.register_for_checkpointing(*self.custom)

    @property
    def step(self) -> int:
        """The scheduler's ``last_epoch``: the optimizer steps this state has trained."""
        sched: Any = getattr(self.sched, "scheduler", self.sched)
        return int(sched.last_epoch)

    def train(self, steps: int, save: bool = True, folder: Path | None = None) -> None:
        """``steps`` optimizer steps, each followed by ``save_state()`` (into ``folder``/checkpoint-<step> by hand)."""
        for _ in range(steps):
            self.acc.backward(self.model(torch.randn(3, 4)).sum())
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad()
            if save:
                self.acc.save_state(None if folder is None else str(folder / f"checkpoint-{self.step}"))

    def resume(self, folder: Path | None = None) -> int:
        """``load_state(folder)`` (``load_state()`` with automatic naming when None); the step it restored."""
        self.acc.load_state(None if folder is None else str(folder))
        return self.step


def four_saves(root: Path) -> Path:
    """A project of four steps, a save after each, ``total_limit=3``, one registered object: ``checkpoints/``
    holds ``checkpoint_1`` to ``checkpoint_3`` (the scheduler at steps 2 to 4)."""
    Program(root, custom=1).train(4)
    return root


def copy_project(src: Path, tmp_path: Path) -> Path:
    """A copy of the project ``src`` to change one thing in."""
    import shutil

    root = tmp_path / "project"
    shutil.copytree(src, root)
    return root
