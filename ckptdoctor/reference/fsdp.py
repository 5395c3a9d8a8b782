"""FSDP2-style training on 2 CPU processes over gloo, saving sharded state with ``torch.distributed.checkpoint``.

The checkpoint holds what accelerate writes for ``SHARDED_STATE_DICT`` under the Trainer
(``src/accelerate/utils/fsdp_utils.py`` ``save_fsdp_model``, ``save_fsdp_optimizer``):
``pytorch_model_fsdp_0/`` and ``optimizer_0/`` (``.metadata`` + ``__R_0.distcp`` per rank), ``rng_state_R.pth``
per rank, ``scheduler.pt`` and ``trainer_state.json``, and no config, weights file or training_args.bin.
Resume reads the same files back; a missing rank file fails it on every rank.
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ckptdoctor.reference.train import (
    PREFIX_CHECKPOINT_DIR,
    SCHEDULER_NAME,
    TRAINER_STATE_NAME,
    TinyCausalLM,
    TrainConfig,
    TrainerState,
    create_optimizer,
    create_scheduler,
    epoch_batches,
    load_rng_state,
    make_corpus,
    next_token_loss,
    replace_dir,
    rng_state,
    rotate_checkpoints,
    set_seed,
    total_steps,
    trainer_control_state,
    updates_per_epoch,
)

FSDP_MODEL_DIR = "pytorch_model_fsdp_0"
FSDP_OPTIMIZER_DIR = "optimizer_0"
JOIN_TIMEOUT_S = 180.0  # a hung collective must fail the caller, never block a test run forever


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def train_fsdp(cfg: TrainConfig, resume_from_checkpoint: str | os.PathLike[str] | None = None,
               world_size: int = 2, preempt_after_step: int | None = None) -> dict[int, float]:
    """Train (or resume from a DCP checkpoint) on ``world_size`` gloo processes; returns rank 0's losses by step.

    ``preempt_after_step`` ends the run right after that step and its save, like ``train``'s.

    Raises ``RuntimeError`` naming the failing rank and its traceback when any process fails.
    """
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    port = _free_port()
    resume = None if resume_from_checkpoint is None else str(resume_from_checkpoint)
    procs = [ctx.Process(target=_worker, args=(rank, world_size, port, cfg, resume, preempt_after_step, results))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    reports: dict[int, tuple[str, Any]] = {}
    try:
        while len(reports) < world_size:
            kind, rank, payload = results.get(timeout=JOIN_TIMEOUT_S)
            reports[rank] = (kind, payload)
            if kind == "error":
                break  # the other ranks may be stuck in a collective; they are terminated below
    except queue.Empty:
        pass
    finally:
        for proc in procs:
            proc.join(timeout=5 if reports.get(0, ("",))[0] == "ok" else 1)
            if proc.is_alive():
                proc.terminate()
                proc.join()
    for rank in range(world_size):
        kind, payload = reports.get(rank, ("error", "no report (timed out or died)"))
        if kind == "error":
            raise RuntimeError(f"FSDP rank {rank} failed:\n{payload}")
    return dict(reports[0][1])


def _worker(rank: int, world_size: int, port: int, cfg: TrainConfig, resume: str | None, preempt: int | None,
            results: Any) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        losses = _train_rank(rank, world_size, cfg, resume, preempt)
        results.put(("ok", rank, losses))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train_rank(rank: int, world_size: int, cfg: TrainConfig, resume: str | None,
                preempt: int | None) -> dict[int, float]:
    set_seed(cfg.seed)
    model = TinyCausalLM(cfg)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # The for-loop AdamW: the fused CPU kernel does not take DTensor parameters.
    optimizer = create_optimizer(model, cfg.replace(optim="adamw_torch"))
    max_steps, num_train_epochs = total_steps(cfg)
    scheduler = create_scheduler(optimizer, cfg, max_steps)
    per_epoch = updates_per_epoch(cfg)
    state = TrainerState(max_steps=max_steps, num_train_epochs=num_train_epochs, logging_steps=cfg.logging_steps,
                         save_steps=cfg.save_steps, train_batch_size=cfg.per_device_train_batch_size)
    folder = Path(resume) if resume else None
    if folder is not None:
        state = TrainerState.load(folder / TRAINER_STATE_NAME)
        state.max_steps, state.num_train_epochs = max_steps, num_train_epochs
        model_sd = get_model_state_dict(model)
        dcp_load({"model": model_sd}, checkpoint_id=folder / FSDP_MODEL_DIR)
        set_model_state_dict(model, model_sd)
        optim_sd = get_optimizer_state_dict(model, optimizer)
        dcp_load({"optimizer": optim_sd}, checkpoint_id=folder / FSDP_OPTIMIZER_DIR)
        set_optimizer_state_dict(model, optimizer, optim_sd)
        scheduler.load_state_dict(torch.load(folder / SCHEDULER_NAME, weights_only=True))
    epochs_trained, start_update = divmod(state.global_step, per_epoch)

    corpus = make_corpus(cfg)
    losses: dict[int, float] = {}
    model.train()
    for epoch in range(epochs_trained, num_train_epochs):
        if state.global_step >= max_steps:
            break
        if folder is not None and epoch == epochs_trained:
            load_rng_state(folder, world_size, rank)
        batches = epoch_batches(corpus, cfg, epoch)
        ga = cfg.gradient_accumulation_steps
        for update in range(start_update if epoch == epochs_trained else 0, per_epoch):
            micro = batches[update * ga : (update + 1) * ga]
            step_loss = torch.zeros(())
            for batch in micro:
                # Each rank takes its slice of the global batch, as a distributed sampler would.
                loss = next_token_loss(model, batch[rank::world_size]) / len(micro)
                loss.backward()  # type: ignore[no-untyped-call]
                step_loss += loss.detach()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)

            state.global_step += 1
            state.epoch = epoch + (update + 1) / per_epoch
            losses[state.global_step] = float(step_loss)
            if state.global_step % state.logging_steps == 0:
                norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
                state.log_history.append({"epoch": state.epoch, "grad_norm": float(norm), "learning_rate": lr,
                                          "loss": float(step_loss), "step": state.global_step})
            if state.global_step % state.save_steps == 0 or state.global_step >= max_steps:
                _save(rank, model, optimizer, scheduler, state, cfg)
            if state.global_step >= max_steps or state.global_step == preempt:
                break
        if state.global_step == preempt:
            break
    return losses


def _save(rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
          state: TrainerState, cfg: TrainConfig) -> None:
    """Every rank writes its DCP shards and RNG file into a temp folder; rank 0 adds the rest and renames it."""
    output_dir = Path(cfg.output_dir)
    final = output_dir / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    folder = output_dir / f"tmp-{final.name}" if cfg.atomic_save else final
    dcp_save({"model": get_model_state_dict(model)}, storage_writer=FileSystemWriter(folder / FSDP_MODEL_DIR))
    dcp_save({"optimizer": get_optimizer_state_dict(model, optimizer)},
             storage_writer=FileSystemWriter(folder / FSDP_OPTIMIZER_DIR))
    if rank == 0:
        torch.save(scheduler.state_dict(), folder / SCHEDULER_NAME)
    torch.save(rng_state(), folder / f"rng_state_{rank}.pth")
    dist.barrier()
    if rank == 0:
        state.stateful_callbacks = trainer_control_state(training_stops=state.global_step >= state.max_steps)
        (folder / TRAINER_STATE_NAME).write_text(state.to_json(), encoding="utf-8")
        if cfg.atomic_save:
            replace_dir(folder, final)
        rotate_checkpoints(output_dir, cfg.save_total_limit, state.best_model_checkpoint)
    dist.barrier()
