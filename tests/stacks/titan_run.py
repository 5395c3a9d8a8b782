"""Real torch.distributed.checkpoint saves in torchtitan's layout, written and resumed by two gloo ranks on CPU.

torchtitan itself needs CUDA; its ``CheckpointManager`` (torchtitan 0.3.0,
``torchtitan/components/checkpointer/dcp.py``) is a thin layer over DCP, so this file does what it does with the
same calls: every ``interval`` steps ``dcp.save`` of the flattened model state dict beside the Stateful
``optimizer``, ``lr_scheduler``, ``dataloader`` and ``train_state`` into ``<dump>/checkpoint/step-<N>/``; at the
last step, with the default ``last_save_model_only=True``, the model state alone (``_save_last_step``). A resume
finds the step as ``_find_load_step`` does (the highest ``step-N`` holding ``.metadata``), loads it as ``_load``
does (``model_only`` only for step 0) with ``dcp.load`` and records what happened per run: the step loaded, the
restored ``train_state``, or the exception.

``python tests/stacks/titan_run.py write JOBS.json`` or ``resume JOBS.json RESULTS.json``. Not a test module: the scan
path never imports torch; the tests run this in a subprocess.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import sys
import tempfile
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.stateful import Stateful

WORLD = 2


class Optimizers(Stateful):
    """torchtitan's ``OptimizersContainer``: a flat, FQN-keyed optimizer state dict."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.optim = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        return dict(get_optimizer_state_dict(self.model, self.optim, options=opts))

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        set_optimizer_state_dict(self.model, self.optim, sd, options=opts)


class Schedulers(Stateful):
    """torchtitan's ``LRSchedulersContainer``: only ``last_epoch`` is saved."""

    def __init__(self) -> None:
        self.last_epoch = 0

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.last_epoch = sd["last_epoch"]


class Loader(Stateful):
    """torchtitan's ``ParallelAwareDataloader``: this dp rank's state pickled under ``dp_rank_<r>``, and the dp
    world size, which ``load_state_dict`` asserts equal to the current one."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world, self.consumed = rank, world, 0

    def state_dict(self) -> dict[str, Any]:
        return {f"dp_rank_{self.rank}": pickle.dumps({"consumed": self.consumed}), "world_size": self.world}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if not sd or f"dp_rank_{self.rank}" not in sd:
            return  # torchtitan warns "DataLoader state is empty for dp rank" and goes on
        assert self.world == sd["world_size"], (
            "dp_degree is inconsistent before and after checkpoint, dataloader resharding is not supported yet."
        )
        self.consumed = pickle.loads(sd[f"dp_rank_{self.rank}"])["consumed"]


class TrainState(Stateful):
    """torchtitan's ``Trainer`` as the ``train_state`` Stateful: ``step`` and ``ntokens_seen``."""

    def __init__(self) -> None:
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def _states(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)  # one weight, one bias: the smallest model whose saves hold every kind of item
    return {
        "model": model,
        "optimizer": Optimizers(model),
        "lr_scheduler": Schedulers(),
        "dataloader": Loader(rank, world),
        "train_state": TrainState(),
    }


def _flat(states: dict[str, Any], model_only: bool = False) -> dict[str, Any]:
    """``_flattened_model_states_sd``: the model's keys at the top level, the other states under their names."""
    sd: dict[str, Any] = dict(states["model"].state_dict())
    if not model_only:
        sd.update({k: v for k, v in states.items() if k != "model"})
    return sd


def _write(rank: int, job: dict[str, Any], world: int) -> None:
    # `loader_world`: the data-parallel degree the dataloader records, when it is not the number of ranks
    states = _states(rank, job.get("loader_world", world))
    model, opt = states["model"], states["optimizer"].optim
    folder = os.path.join(job["root"], "checkpoint")
    for step in range(1, job["steps"] + 1):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        states["lr_scheduler"].last_epoch = step
        states["dataloader"].consumed = step * 2
        states["train_state"].step = step
        states["train_state"].ntokens_seen = step * 16
        last = step == job["steps"]
        if not (last or step % job["interval"] == 0):
            continue
        model_only = last and job.get("last_save_model_only", True)
        sd = _flat(states, model_only)
        if model_only:
            sd = {k: v.to(torch.float32) for k, v in sd.items()}
        dcp.save(sd, checkpoint_id=os.path.join(folder, f"step-{step}"))


def _find_load_step(folder: str) -> int:
    """torchtitan's ``_find_load_step``: the highest ``step-N`` holding ``.metadata`` (or an HF index)."""
    if not os.path.isdir(folder):
        return -1
    steps = []
    for name in os.listdir(folder):
        m = re.search(r"step-(\d+)", name)
        if m is None:
            continue
        path = os.path.join(folder, name)
        if os.path.isfile(os.path.join(path, ".metadata")) or os.path.isfile(
            os.path.join(path, "model.safetensors.index.json")
        ):
            steps.append(int(m.group(1)))
    return max(steps) if steps else -1


def _resume(rank: int, job: dict[str, Any], world: int) -> dict[str, Any]:
    states = _states(rank, job.get("world", world))
    folder = os.path.join(job["root"], "checkpoint")
    load_step = job.get("load_step", -1)
    step = _find_load_step(folder) if load_step == -1 else load_step
    out: dict[str, Any] = {"load_step": step}
    if step == -1:
        out["fresh"] = True
        return out
    checkpoint_id = os.path.join(folder, f"step-{step}")
    try:
        if not os.path.isdir(checkpoint_id):
            raise FileNotFoundError(f"--checkpoint.load_step={step} not found at {checkpoint_id}")
        sd = _flat(states, model_only=step == 0)
        dcp.load(sd, checkpoint_id=checkpoint_id)
        keys = states["model"].state_dict().keys()
        states["model"].load_state_dict({k: sd[k] for k in keys})  # what `ModelWrapper.load_state_dict` does
        out["train_state_step"] = states["train_state"].step
        out["last_epoch"] = states["lr_scheduler"].last_epoch
    except BaseException as exc:  # every failure is the result being recorded
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        out["trace"] = traceback.format_exc()[-3000:]
    return out


def _rank(rank: int, mode: str, jobs: list[dict[str, Any]], store: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    warnings.simplefilter("ignore")
    out = []
    for job in jobs:
        if mode == "write":
            _write(rank, job, WORLD)
        else:
            out.append(_resume(rank, job, WORLD))
        dist.barrier()
    if rank == 0 and mode == "resume":
        with open(results, "w") as fh:
            json.dump(out, fh)
    dist.destroy_process_group()


def main(argv: list[str]) -> None:
    """``write JOBS.json`` or ``resume JOBS.json RESULTS.json`` with two gloo ranks."""
    mode, jobs_file = argv[0], argv[1]
    results = argv[2] if len(argv) > 2 else ""
    with open(jobs_file) as fh:
        jobs = json.load(fh)
    store = tempfile.mktemp(prefix="titan-store-")
    mp.spawn(_rank, args=(mode, jobs, store, results), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main(sys.argv[1:])
