"""Small real checkpoints for CLI and report tests, written with torch and safetensors (not hand-made bytes).

The reference trainer (ckptdoctor.reference) makes checkpoints by training; these builders make one folder quickly
when a test only needs a realistic layout.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file


def trainer_state(step: int, max_steps: int, lr: float = 1e-3, epochs: float = 1.0, **extra: Any) -> dict[str, Any]:
    """A trainer_state.json body with transformers 5.x's fields and a linear-decay log_history."""
    history = [
        {"epoch": epochs * s / max_steps, "grad_norm": 1.0, "learning_rate": lr * (max_steps - s + 1) / max_steps,
         "loss": 3.0 - 0.01 * s, "step": s}
        for s in range(1, step + 1)
    ]
    state: dict[str, Any] = {
        "best_global_step": None, "best_metric": None, "best_model_checkpoint": None,
        "epoch": epochs * step / max_steps, "eval_steps": 500, "global_step": step,
        "is_hyper_param_search": False, "is_local_process_zero": True, "is_world_process_zero": True,
        "log_history": history, "logging_steps": 1, "max_steps": max_steps, "num_input_tokens_seen": 0,
        "num_train_epochs": epochs, "save_steps": 2, "stateful_callbacks": {"TrainerControl": {"args": {
            "should_epoch_stop": False, "should_evaluate": False, "should_log": False, "should_save": True,
            "should_training_stop": step >= max_steps}, "attributes": {}}}, "total_flos": 0.0,
        "train_batch_size": 2, "trial_name": None, "trial_params": None,
    }
    state.update(extra)
    return state


def make_checkpoint(folder: Path, step: int = 4, max_steps: int = 8, lr: float = 1e-3) -> Path:
    """A full fine-tune checkpoint as the Trainer writes it: weights, optimizer, scheduler, RNG, state."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, (max_steps - s) / max_steps))
    for _ in range(step):
        loss = model(torch.randint(0, 16, (4,))).sum()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    torch.save(sched.state_dict(), folder / "scheduler.pt")
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()},
               folder / "rng_state.pth")
    (folder / "config.json").write_text(json.dumps({"vocab_size": 16, "hidden_size": 8}))
    (folder / "trainer_state.json").write_text(json.dumps(trainer_state(step, max_steps, lr), indent=2) + "\n")
    os.chmod(folder / "model.safetensors", 0o644)
    return folder


def make_run(root: Path, steps: tuple[int, ...] = (2, 4), max_steps: int = 8) -> Path:
    """An output_dir with one checkpoint-N per step."""
    for s in steps:
        make_checkpoint(root / f"checkpoint-{s}", s, max_steps)
    return root


def comparable_report(report: Any) -> dict[str, Any]:
    """A scan's JSON report without what legitimately differs between a local and a remote root (roots, time)."""
    from ckptdoctor.render.report import render_json

    doc: dict[str, Any] = json.loads(render_json(report))
    doc.pop("roots")
    doc["summary"].pop("seconds")
    for run in doc["runs"]:
        run.pop("root")
    for f in doc["findings"]:
        f.pop("root", None)
    return doc
