"""Train or resume a tiny real Trainer under DeepSpeed (ZeRO on the CPU accelerator, one rank over gloo), in a fresh
process, for tests/gate/test_gate_deepspeed.py and for bench/make_allowlist.py (its DeepSpeed Trainer stacks record
what the saved files pickle).

Run as a script, never imported by the suite: ``python tests/gate/deepspeed_trainer.py JOB.json RESULT.json`` with
DeepSpeed's layer first on ``PYTHONPATH`` (``CKPTDOCTOR_DEEPSPEED_LAYER``). The jobs run one after the other in this
process (the accelerate state is reset between them; DeepSpeed's process group stays up), which saves DeepSpeed's
start-up per job. A job is a dict:

- ``out``: output_dir; ``args``: TrainingArguments overrides; ``resume``: null, true or a checkpoint path;
- ``stage``: the ZeRO stage (2 unless given); ``ds``: entries merged into the DeepSpeed config (``"optimizer"``,
  ``"scheduler"``, ``"zero_optimization"`` given whole).

The result lists the optimizer LR each step began with (``[global_step, lr]``), the class of the Trainer's
scheduler, and the exception ``train()`` raised (type and message).

DeepSpeed's CPU accelerator JIT-compiles its shared-memory collective (``deepspeed/comm/torch.py``
``build_shm_op``) when the backend starts: minutes of C++ on a busy machine, and a build killed half-way leaves a
lock in the torch extensions folder that every later start waits on for ever. That op serves only the inference
all-reduce; training's collectives go through ``torch.distributed`` (gloo here), so it is not built.
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate.state import AcceleratorState
from transformers import Trainer, TrainerCallback, TrainingArguments

# see the module docstring; `import deepspeed.comm.torch as m` would bind torch itself (deepspeed.comm's `torch`)
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """16 fixed random sequences of 8 tokens out of 64: 4 optimizer steps per epoch at batch size 4."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recorder(TrainerCallback):  # type: ignore[misc]
    def __init__(self, seen: dict[str, Any]) -> None:
        self.seen = seen

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seen["lrs"].append([state.global_step, kwargs["optimizer"].param_groups[0]["lr"]])
        self.seen["scheduler"] = type(kwargs["lr_scheduler"]).__name__


def run(job: dict[str, Any]) -> dict[str, Any]:
    AcceleratorState._reset_state(reset_partial_state=True)  # each job builds its own DeepSpeed plugin
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=32))
    ds: dict[str, Any] = {
        "zero_optimization": {"stage": job.get("stage", 2)}, "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
        "zero_force_ds_cpu_optimizer": False,  # torch's AdamW: DeepSpeed's CPU Adam is a C++ build
    }
    ds.update(job.get("ds", {}))
    kwargs: dict[str, Any] = {
        "output_dir": job["out"], "max_steps": 4, "save_steps": 2, "logging_steps": 1,
        "per_device_train_batch_size": 4, "learning_rate": 1e-3, "warmup_steps": 2, "use_cpu": True,
        "report_to": "none", "disable_tqdm": True, "seed": 0, "deepspeed": ds,
    }
    kwargs.update(job.get("args", {}))
    seen: dict[str, Any] = {"lrs": [], "scheduler": None}
    trainer = Trainer(model=model, args=TrainingArguments(**kwargs), train_dataset=Tokens(),
                      callbacks=[Recorder(seen)])
    try:
        trainer.train(resume_from_checkpoint=job.get("resume"))
    except Exception as exc:  # the crash is the result
        seen["error"] = [type(exc).__name__, str(exc)[:2000]]
    return seen


def main() -> None:
    faulthandler.dump_traceback_later(600, exit=True)  # a hang (a rendezvous, a build lock) fails with its stack
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_PORT", "29500")
    jobs = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps([run(job) for job in jobs]))


if __name__ == "__main__":
    main()
