"""Scenario builders: each produces one hazard for real, by doing what users do with the reference trainer.

Most scenarios share one story: a run configured for ``RUN_STEPS`` optimizer steps, saving every ``SAVE_STEPS``,
is preempted right after its checkpoint at ``PREEMPT_STEP``; the user then resumes with
``resume_from_checkpoint=True``, which picks ``checkpoint-{PREEMPT_STEP}``. Damage is applied to that latest
checkpoint (unless the scenario's story says otherwise), so resuming shows its effect on steps 9-12 next to the
uninterrupted run. ``python -m ckptdoctor.reference scenario NAME OUT_DIR`` builds one; ``list`` names them.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckptdoctor.reference.train import (
    ADAPTER_SAFE_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SCHEDULER_NAME,
    WEIGHTS_NAME,
    TrainConfig,
    train,
)

RUN_STEPS = 12
SAVE_STEPS = 4
PREEMPT_STEP = 8


class SimulatedKill(Exception):
    """Raised from a save hook: the process 'dies' at that point and leaves the folder as it is."""


@dataclass(frozen=True, slots=True)
class Scenario:
    """A named way to produce one hazard (or a healthy baseline) inside an empty output directory."""

    name: str
    summary: str
    build: Callable[[Path], None]


SCENARIOS: dict[str, Scenario] = {}


def scenario(name: str, summary: str) -> Callable[[Callable[[Path], None]], Callable[[Path], None]]:
    """Register a builder under ``name``."""

    def register(fn: Callable[[Path], None]) -> Callable[[Path], None]:
        SCENARIOS[name] = Scenario(name, summary, fn)
        return fn

    return register


def base_config(out: Path, **changes: Any) -> TrainConfig:
    """The shared run: ``RUN_STEPS`` steps, a checkpoint every ``SAVE_STEPS``."""
    return TrainConfig(output_dir=str(out), max_steps=RUN_STEPS, save_steps=SAVE_STEPS).replace(**changes)


def latest(out: Path) -> Path:
    """The checkpoint the preempted run left last (the one ``resume_from_checkpoint=True`` picks)."""
    return out / f"checkpoint-{PREEMPT_STEP}"


def build(name: str, out_dir: str | os.PathLike[str]) -> Path:
    """Build scenario ``name`` into ``out_dir`` (created; must be empty or absent) and return it."""
    if name not in SCENARIOS:
        raise KeyError(f"unknown scenario {name!r}; known: {', '.join(sorted(SCENARIOS))}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    SCENARIOS[name].build(out)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Healthy baselines


@scenario("clean-full", "Full fine-tune, model.safetensors; preempted after checkpoint-8 of 12 steps.")
def clean_full(out: Path) -> None:
    """Healthy: nothing to report."""
    train(base_config(out), preempt_after_step=PREEMPT_STEP)


@scenario("clean-bin", "Full fine-tune saved as pytorch_model.bin (the T4 save_safetensors=False variant).")
def clean_bin(out: Path) -> None:
    """Healthy: the legacy weights file name."""
    train(base_config(out, weights_format="bin"), preempt_after_step=PREEMPT_STEP)


@scenario("clean-lora", "LoRA through peft (q_proj, v_proj): adapter_model.safetensors + adapter_config.json.")
def clean_lora(out: Path) -> None:
    """Healthy: a PEFT checkpoint."""
    train(base_config(out, use_lora=True), preempt_after_step=PREEMPT_STEP)


@scenario("lora-second-adapter", "LoRA with a second, inactive named adapter saved into the `aux/` subfolder.")
def lora_second_adapter(out: Path) -> None:
    """Healthy: two adapters, the second in a subfolder as PeftModel.save_pretrained writes it."""
    train(base_config(out, use_lora=True, second_adapter="aux"), preempt_after_step=PREEMPT_STEP)


@scenario("sharded", "Full weights split into model-0000i-of-0000n.safetensors + model.safetensors.index.json.")
def sharded(out: Path) -> None:
    """Healthy: sharded weights with a correct index."""
    train(base_config(out, weights_format="sharded"), preempt_after_step=PREEMPT_STEP)


# ---------------------------------------------------------------------------------------------------------------
# Hazards


@scenario("stub-shadow", "LoRA checkpoints that also hold a near-empty pytorch_model.bin written by a callback.")
def stub_shadow(out: Path) -> None:
    """A save callback stores ``torch.save(state_dict)`` of an unpopulated (ZeRO-3-style) model: ``{}``.

    Resume takes the full-weights branch, loads nothing with strict=False, and never loads the adapter.
    """

    def stray_state_dict(path: Path) -> None:
        if path.name == ADAPTER_SAFE_WEIGHTS_NAME:
            torch.save({}, path.parent / WEIGHTS_NAME)

    train(base_config(out, use_lora=True), save_hook=stray_state_dict, preempt_after_step=PREEMPT_STEP)


@scenario("stale-higher", "A second run in the same output_dir leaves the first run's higher checkpoint-12.")
def stale_higher(out: Path) -> None:
    """Run 1 finishes 12 steps; run 2 (10 steps, another learning rate, no resume) is preempted after checkpoint-8.

    Resuming run 2 picks run 1's checkpoint-12 and trains nothing (global_step 12 >= max_steps 10).
    """
    train(base_config(out))
    train(stale_higher_second_run(out), preempt_after_step=PREEMPT_STEP)


def stale_higher_second_run(out: Path) -> TrainConfig:
    """The arguments of the second run in ``stale-higher``."""
    return base_config(out, max_steps=10, learning_rate=2e-2)


@scenario("lr-finished", "A run that finished: its last checkpoint's schedule is done (LR 0.0 in optimizer.pt).")
def lr_finished(out: Path) -> None:
    """Resuming it with more steps trains the first step at LR 0, then jumps into the middle of a new schedule."""
    train(base_config(out, max_steps=PREEMPT_STEP))


@scenario("sharded-missing-shard", "Sharded checkpoint-8 with one shard file gone (an interrupted copy).")
def sharded_missing_shard(out: Path) -> None:
    """Resume fails with FileNotFoundError."""
    sharded(out)
    shard_files(latest(out))[1].unlink()


@scenario("sharded-wrong-index", "Sharded checkpoint-8 whose index points the last shard's tensors at shard 1.")
def sharded_wrong_index(out: Path) -> None:
    """The last shard is never opened, so its tensors silently keep their fresh values on resume."""
    sharded(out)
    folder = latest(out)
    index_path = folder / SAFE_WEIGHTS_INDEX_NAME
    index = json.loads(index_path.read_text(encoding="utf-8"))
    shards = shard_files(folder)
    index["weight_map"] = {k: (shards[0].name if v == shards[-1].name else v) for k, v in index["weight_map"].items()}
    # An index merged by a hand-written script: same format, wrong target.
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


@scenario("sharded-truncated-shard", "Sharded checkpoint-8 with its last shard cut in half (disk full).")
def sharded_truncated_shard(out: Path) -> None:
    """Resume fails inside safetensors."""
    sharded(out)
    last = shard_files(latest(out))[-1]
    os.truncate(last, last.stat().st_size // 2)


@scenario("interrupted-save", "Killed while writing checkpoint-8: no rng_state.pth, no trainer_state.json.")
def interrupted_save(out: Path) -> None:
    """The Trainer writes in place; the process dies right after scheduler.pt of the second save."""

    def kill(path: Path) -> None:
        if path.name == SCHEDULER_NAME and path.parent.name == f"checkpoint-{PREEMPT_STEP}":
            raise SimulatedKill(str(path))

    with contextlib.suppress(SimulatedKill):
        train(base_config(out, atomic_save=False), save_hook=kill)


@scenario("optimizer-mismatch", "LoRA resumed after changing target_modules: Adam state lands on other tensors.")
def optimizer_mismatch(out: Path) -> None:
    """Run on (q_proj, v_proj), preempted; resumed on (k_proj, v_proj): k gets q's Adam moments, q is dropped."""
    train(base_config(out, use_lora=True), preempt_after_step=PREEMPT_STEP)
    train(base_config(out, use_lora=True, lora_target_modules=("k_proj", "v_proj")), resume_from_checkpoint=True)


@scenario("prefixed-keys-compile", "Weights saved from a torch.compile'd model: every key starts `_orig_mod.`.")
def prefixed_keys_compile(out: Path) -> None:
    """Resume loads them non-strictly into the plain model: nothing matches, training restarts from fresh."""
    train(base_config(out, wrapper="compile"), preempt_after_step=PREEMPT_STEP)


@scenario("prefixed-keys-ddp", "Weights saved from a DistributedDataParallel wrapper: every key starts `module.`.")
def prefixed_keys_ddp(out: Path) -> None:
    """Same silent fresh start as the compile case."""
    train(base_config(out, wrapper="ddp"), preempt_after_step=PREEMPT_STEP)


@scenario("fsdp", "FSDP2 sharded state from 2 gloo processes: pytorch_model_fsdp_0/, optimizer_0/, rng_state_R.pth.")
def fsdp(out: Path) -> None:
    """Healthy: one DCP checkpoint (checkpoint-4 of 8 steps), preempted after it."""
    from ckptdoctor.reference.fsdp import train_fsdp

    train_fsdp(fsdp_config(out), preempt_after_step=SAVE_STEPS)


@scenario("fsdp-missing-rank", "FSDP checkpoint whose rank-1 model shard __1_0.distcp is missing.")
def fsdp_missing_rank(out: Path) -> None:
    """Only rank 0's files were copied; resume fails on every rank."""
    fsdp(out)
    (out / f"checkpoint-{SAVE_STEPS}" / "pytorch_model_fsdp_0" / "__1_0.distcp").unlink()


def fsdp_config(out: Path) -> TrainConfig:
    """The FSDP run: 8 steps, a checkpoint every 4."""
    return base_config(out, max_steps=PREEMPT_STEP)


def shard_files(folder: Path) -> list[Path]:
    """The ``model-0000i-of-0000n.safetensors`` files of a checkpoint, in order."""
    return sorted(folder.glob("model-*-of-*.safetensors"))
