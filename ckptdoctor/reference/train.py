"""A minimal trainer that writes and resumes checkpoints exactly like the Hugging Face Trainer (transformers 5.23).

Read it top to bottom: configuration, seeding and data, the tiny model, the optimizer and the schedules, the
checkpoint writer, the resume path, and the training loop. Everything runs on CPU in well under a second per
checkpoint. The on-disk layout and the resume decisions follow transformers (``src/transformers/trainer.py``
``Trainer._save_checkpoint``, ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``, ``_load_rng_state``,
``trainer_utils.get_last_checkpoint`` and ``rotate_checkpoints``); this module is their readable twin, so every
hazard ckptdoctor detects can be produced for real and every fix can be proved by resuming after it.

This package needs the ``train`` extra (torch, safetensors, peft, numpy). The scan path never imports it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import random
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ckptdoctor import schedules

logger = logging.getLogger(__name__)

# File names the Trainer uses (transformers ``utils/constants`` and ``trainer.py``).
CONFIG_NAME = "config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
WEIGHTS_NAME = "pytorch_model.bin"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
ADAPTER_SAFE_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_WEIGHTS_NAME = "adapter_model.bin"
ADAPTER_CONFIG_NAME = "adapter_config.json"
TRAINING_ARGS_NAME = "training_args.bin"
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
TRAINER_STATE_NAME = "trainer_state.json"
PREFIX_CHECKPOINT_DIR = "checkpoint"
_RE_CHECKPOINT = re.compile(r"^" + PREFIX_CHECKPOINT_DIR + r"\-(\d+)$")

SCHEDULER_TYPES = schedules.SUPPORTED
WEIGHTS_FORMATS = ("safetensors", "bin", "sharded")
WRAPPERS = ("none", "compile", "ddp")


# ---------------------------------------------------------------------------------------------------------------
# Configuration. ``torch.save``d as ``training_args.bin``, the way the Trainer saves its TrainingArguments.


@dataclass
class TrainConfig:
    """Everything a run needs; the reference trainer's ``TrainingArguments``."""

    output_dir: str = "out"  # where checkpoint-N/ folders go
    seed: int = 1234  # seeds python, numpy and torch before the model is built (Trainer: set_seed(args.seed))
    data_seed: int = 7  # seeds the synthetic corpus and the per-epoch shuffling, independent of the global RNG
    # data
    vocab_size: int = 32  # tokens 0..vocab_size-1
    seq_len: int = 8  # tokens per training example (the model sees seq_len, predicts the next seq_len)
    num_samples: int = 32  # examples in the synthetic corpus
    # model (a few thousand parameters)
    hidden_size: int = 16
    num_hidden_layers: int = 1
    num_attention_heads: int = 2
    intermediate_size: int = 32
    dropout: float = 0.1  # > 0 so that a resume must restore the RNG to reproduce the uninterrupted run
    # optimisation (Trainer defaults where they make sense at this size)
    optim: str = "adamw_torch_fused"  # the Trainer's default on torch >= 2.8; "adamw_torch" for the for-loop AdamW
    learning_rate: float = 5e-2
    weight_decay: float = 0.01  # applied to group 0 only (no bias, no LayerNorm), as Trainer.create_optimizer does
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0  # clip_grad_norm_ before every optimizer step
    per_device_train_batch_size: int = 4
    gradient_accumulation_steps: int = 1
    num_train_epochs: int = 1  # used when max_steps <= 0
    max_steps: int = -1  # > 0 overrides num_train_epochs, as in the Trainer
    lr_scheduler_type: str = "linear"  # linear, cosine, constant, constant_with_warmup, polynomial ... (LambdaLR)
    warmup_steps: float = 0  # >= 1: steps; < 1: a ratio of max_steps (T5 merged warmup_ratio into this field)
    # logging and saving
    logging_steps: int = 1
    save_steps: int = 4  # save every save_steps optimizer steps, and at the last step
    save_total_limit: int | None = None  # keep at most this many checkpoint-N folders (rotation by mtime/number)
    atomic_save: bool = True  # write into tmp-checkpoint-N then rename; False = write in place like T5 does
    weights_format: str = "safetensors"  # one of WEIGHTS_FORMATS (ignored with LoRA)
    max_shard_size: int = 4096  # bytes per shard when weights_format == "sharded"
    # LoRA through peft
    use_lora: bool = False
    lora_r: int = 2
    lora_alpha: int = 4
    lora_dropout: float = 0.05
    lora_target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    second_adapter: str | None = None  # name of an extra, inactive adapter saved into a subfolder of that name
    # how the user wrapped the model when saving (the prefix lands in the saved keys)
    wrapper: str = "none"  # one of WRAPPERS: "compile" -> `_orig_mod.`, "ddp" -> `module.`

    def __post_init__(self) -> None:
        if self.lr_scheduler_type not in SCHEDULER_TYPES:
            raise ValueError(f"lr_scheduler_type must be one of {SCHEDULER_TYPES}, not {self.lr_scheduler_type!r}")
        if self.weights_format not in WEIGHTS_FORMATS:
            raise ValueError(f"weights_format must be one of {WEIGHTS_FORMATS}, not {self.weights_format!r}")
        if self.wrapper not in WRAPPERS:
            raise ValueError(f"wrapper must be one of {WRAPPERS}, not {self.wrapper!r}")
        self.lora_target_modules = tuple(self.lora_target_modules)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


# ---------------------------------------------------------------------------------------------------------------
# Seeding and synthetic data


def set_seed(seed: int) -> None:
    """Seed python, numpy and torch the way ``transformers.set_seed`` does."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def make_corpus(cfg: TrainConfig) -> torch.Tensor:
    """Token sequences ``[num_samples, seq_len + 1]`` following a noisy affine rule, so the loss can fall."""
    gen = torch.Generator().manual_seed(cfg.data_seed)
    seqs = torch.empty(cfg.num_samples, cfg.seq_len + 1, dtype=torch.long)
    seqs[:, 0] = torch.randint(0, cfg.vocab_size, (cfg.num_samples,), generator=gen)
    for t in range(cfg.seq_len):
        noise = (torch.rand(cfg.num_samples, generator=gen) < 0.1).long()
        seqs[:, t + 1] = (3 * seqs[:, t] + 1 + noise) % cfg.vocab_size
    return seqs


def epoch_batches(corpus: torch.Tensor, cfg: TrainConfig, epoch: int) -> list[torch.Tensor]:
    """The epoch's micro-batches, shuffled by a generator seeded per epoch (like accelerate's SeedableRandomSampler).

    The order never touches the global RNG, so skipping batches on resume cannot shift dropout.
    """
    gen = torch.Generator().manual_seed(cfg.data_seed * 1000 + epoch)
    order = torch.randperm(corpus.shape[0], generator=gen)
    bs = cfg.per_device_train_batch_size
    return [corpus[order[i : i + bs]] for i in range(0, len(order), bs)]


def updates_per_epoch(cfg: TrainConfig) -> int:
    """Optimizer steps in one epoch: ``max(ceil(len(dataloader) / GA), 1)`` as in the Trainer."""
    num_batches = math.ceil(cfg.num_samples / cfg.per_device_train_batch_size)
    return max(math.ceil(num_batches / cfg.gradient_accumulation_steps), 1)


def total_steps(cfg: TrainConfig) -> tuple[int, int]:
    """``(max_steps, num_train_epochs)`` as ``Trainer.set_initial_training_values`` derives them."""
    per_epoch = updates_per_epoch(cfg)
    if cfg.max_steps > 0:
        return cfg.max_steps, math.ceil(cfg.max_steps / per_epoch)
    return cfg.num_train_epochs * per_epoch, cfg.num_train_epochs


# ---------------------------------------------------------------------------------------------------------------
# The model: embeddings, one pre-norm decoder block (causal attention + MLP), an untied lm_head.
# Parameter names follow Llama-style Hugging Face models so the keys look like the real thing.


class Attention(nn.Module):
    """Multi-head causal self-attention with separate q/k/v/o projections (LoRA targets)."""

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, h)
        self.k_proj = nn.Linear(h, h)
        self.v_proj = nn.Linear(h, h)
        self.o_proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.num_heads, c // self.num_heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
                                           is_causal=True)
        out: torch.Tensor = self.o_proj(y.transpose(1, 2).reshape(b, t, c))
        return out


class MLP(nn.Module):
    """Two-layer GELU feed-forward block."""

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.gelu(self.up_proj(x)))
        return out


class DecoderLayer(nn.Module):
    """Pre-norm transformer block with dropout on both residual branches."""

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.self_attn(self.input_layernorm(x)))
        out: torch.Tensor = x + self.dropout(self.mlp(self.post_attention_layernorm(x)))
        return out


class Decoder(nn.Module):
    """Token and position embeddings, the layers, a final norm."""

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_positions = nn.Embedding(cfg.seq_len, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1])
        x = self.embed_tokens(input_ids) + self.embed_positions(positions)
        for layer in self.layers:
            x = layer(x)
        out: torch.Tensor = self.norm(x)
        return out


class TinyCausalLM(nn.Module):
    """A causal language model of a few thousand parameters; ``forward`` returns logits."""

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.lm_head(self.model(input_ids))
        return logits


def model_config(cfg: TrainConfig) -> dict[str, Any]:
    """The ``config.json`` contents: the sizes that determine every tensor shape."""
    return {
        "architectures": ["TinyCausalLM"],
        "dropout": cfg.dropout,
        "dtype": "float32",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "max_position_embeddings": cfg.seq_len,
        "model_type": "tiny-causal-lm",
        "num_attention_heads": cfg.num_attention_heads,
        "num_hidden_layers": cfg.num_hidden_layers,
        "tie_word_embeddings": False,
        "vocab_size": cfg.vocab_size,
    }


def build_model(cfg: TrainConfig) -> nn.Module:
    """The base model, wrapped in a peft ``PeftModel`` when ``use_lora`` (plus the optional second adapter)."""
    model: nn.Module = TinyCausalLM(cfg)
    if not cfg.use_lora:
        return model
    from peft import LoraConfig, get_peft_model

    def lora() -> Any:
        return LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=list(cfg.lora_target_modules))

    peft_model: Any = get_peft_model(model, lora())
    if cfg.second_adapter:
        # Added but never activated: only the first active adapter trains, as with the Trainer (H24).
        peft_model.add_adapter(cfg.second_adapter, lora())
    return cast(nn.Module, peft_model)


def wrap_model(model: nn.Module, cfg: TrainConfig) -> nn.Module:
    """Wrap the model the way a user's script did; the wrapper's ``state_dict`` keys carry its prefix."""
    if cfg.wrapper == "compile":
        # The eager backend traces with dynamo but generates no code: fast on CPU, same numerics.
        return cast(nn.Module, torch.compile(model, backend="eager"))
    if cfg.wrapper == "ddp":
        import torch.distributed as dist

        if not dist.is_initialized():
            # A one-process gloo group needs no port: the store lives in memory.
            store = dist.HashStore()  # type: ignore[attr-defined]
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        return nn.parallel.DistributedDataParallel(model)
    return model


def _dist_initialized() -> bool:
    return bool(torch.distributed.is_available() and torch.distributed.is_initialized())


def next_token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting token t+1 from tokens up to t."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


# ---------------------------------------------------------------------------------------------------------------
# Optimizer and learning-rate schedules (the shapes of transformers.optimization, written out)


def no_decay_parameter_names(model: nn.Module) -> set[str]:
    """Biases and LayerNorm parameters get no weight decay (Trainer >= 4.53 rule, simplified to this model)."""
    names = set()
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if isinstance(module, nn.LayerNorm) or param_name == "bias" or "norm" in module_name.split(".")[-1]:
                names.add(full)
    return names


def create_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over two groups, decay then no-decay, trainable parameters only (both groups even when empty)."""
    no_decay = no_decay_parameter_names(model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in params if n not in no_decay], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in params if n in no_decay], "weight_decay": 0.0},
    ]
    kwargs: dict[str, Any] = {"lr": cfg.learning_rate, "betas": (cfg.adam_beta1, cfg.adam_beta2),
                              "eps": cfg.adam_epsilon}
    if cfg.optim == "adamw_torch_fused":
        kwargs["fused"] = True
    elif cfg.optim != "adamw_torch":
        raise ValueError(f"unknown optim {cfg.optim!r}")
    return torch.optim.AdamW(groups, **kwargs)


def create_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, num_training_steps: int) -> Any:
    """A ``LambdaLR`` for the *current* max_steps, as ``transformers.get_scheduler`` builds it.

    The lambdas come from ``ckptdoctor.schedules`` (the scan path's torch-free copy of transformers' arithmetic),
    so the trainer and the scanner's LR predictions cannot drift apart. ``get_scheduler`` passes a plain function
    for "constant" (scheduler.pt then stores ``None`` for it) and a ``functools.partial`` otherwise (``{}``).
    """
    warmup = schedules.warmup_steps_for(cfg.warmup_steps, num_training_steps)
    schedule = schedules.build(cfg.lr_scheduler_type, num_warmup_steps=warmup, num_training_steps=num_training_steps,
                               lr_init=cfg.learning_rate)
    lam = functools.partial(schedule.func, **schedule.params) if schedule.params else schedule.func
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lam)


# ---------------------------------------------------------------------------------------------------------------
# Trainer state (trainer_state.json, every TrainerState field of transformers 5.23)


@dataclass
class TrainerState:
    """The fields of ``transformers.TrainerState`` (5.23), serialised the same way."""

    epoch: float = 0
    global_step: int = 0
    max_steps: int = 0
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int | None = None
    num_train_epochs: int = 0
    num_input_tokens_seen: int = 0
    total_flos: float = 0
    log_history: list[dict[str, float]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    stateful_callbacks: dict[str, Any] | None = None

    def to_json(self) -> str:
        """``json.dumps(asdict(state), indent=2, sort_keys=True) + "\\n"`` as ``TrainerState.save_to_json``."""
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def load(cls, path: Path) -> TrainerState:
        """``TrainerState(**json)``: a missing file raises FileNotFoundError, unknown keys raise TypeError."""
        return cls(**json.loads(path.read_text(encoding="utf-8")))


def trainer_control_state(*, training_stops: bool) -> dict[str, Any]:
    """The ``TrainerControl`` snapshot the Trainer stores in ``stateful_callbacks`` at save time."""
    return {"TrainerControl": {"args": {"should_epoch_stop": False, "should_evaluate": False, "should_log": False,
                                        "should_save": True, "should_training_stop": training_stops},
                               "attributes": {}}}


# ---------------------------------------------------------------------------------------------------------------
# Writing a checkpoint


SaveHook = Callable[[Path], None]
"""Called with each file's path right after it is written; a scenario raises from it to simulate a kill."""


def _contiguous(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().contiguous().clone() for k, v in state_dict.items()}


def split_into_shards(state_dict: dict[str, torch.Tensor], max_shard_size: int) -> list[dict[str, torch.Tensor]]:
    """Greedy split in key order: start a new shard when the next tensor would overflow the current one."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def write_weights(folder: Path, model: nn.Module, cfg: TrainConfig, hook: SaveHook) -> None:
    """Weights as ``save_pretrained`` writes them: config first, then one file, a .bin, shards+index, or adapters."""
    if cfg.use_lora:
        # PeftModel.save_pretrained: adapter_model.safetensors + adapter_config.json (+ README.md) at the root for
        # "default", each other adapter in a subfolder of its name.
        model.save_pretrained(str(folder))  # type: ignore[operator]
        hook(folder / ADAPTER_SAFE_WEIGHTS_NAME)
        return
    (folder / CONFIG_NAME).write_text(json.dumps(model_config(cfg), indent=2, sort_keys=True) + "\n",
                                      encoding="utf-8")
    hook(folder / CONFIG_NAME)
    state_dict = _contiguous(model.state_dict())
    if cfg.weights_format == "safetensors":
        save_file(state_dict, str(folder / SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
        hook(folder / SAFE_WEIGHTS_NAME)
    elif cfg.weights_format == "bin":
        torch.save(state_dict, folder / WEIGHTS_NAME)
        hook(folder / WEIGHTS_NAME)
    else:
        shards = split_into_shards(state_dict, cfg.max_shard_size)
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, start=1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / name), metadata={"format": "pt"})
            hook(folder / name)
            weight_map.update(dict.fromkeys(shard, name))
        index = {"metadata": {"total_parameters": sum(t.numel() for t in state_dict.values()),
                              "total_size": sum(t.numel() * t.element_size() for t in state_dict.values())},
                 "weight_map": weight_map}
        (folder / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n",
                                                      encoding="utf-8")
        hook(folder / SAFE_WEIGHTS_INDEX_NAME)


def rng_state() -> dict[str, Any]:
    """What ``Trainer._save_rng_state`` stores on a CPU-only machine."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, state: TrainerState,
                    cfg: TrainConfig, hook: SaveHook) -> Path:
    """Write ``checkpoint-{global_step}`` in the Trainer's order, trainer_state.json last; then rotate."""
    output_dir = Path(cfg.output_dir)
    final = output_dir / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    folder = output_dir / f"tmp-{final.name}" if cfg.atomic_save else final
    if cfg.atomic_save and folder.exists():
        shutil.rmtree(folder)  # leftover of an earlier crash
    folder.mkdir(parents=True, exist_ok=True)

    write_weights(folder, model, cfg, hook)
    torch.save(cfg, folder / TRAINING_ARGS_NAME)
    hook(folder / TRAINING_ARGS_NAME)
    torch.save(optimizer.state_dict(), folder / OPTIMIZER_NAME)
    hook(folder / OPTIMIZER_NAME)
    torch.save(scheduler.state_dict(), folder / SCHEDULER_NAME)
    hook(folder / SCHEDULER_NAME)
    torch.save(rng_state(), folder / "rng_state.pth")
    hook(folder / "rng_state.pth")
    state.stateful_callbacks = trainer_control_state(training_stops=state.global_step >= state.max_steps)
    (folder / TRAINER_STATE_NAME).write_text(state.to_json(), encoding="utf-8")
    hook(folder / TRAINER_STATE_NAME)

    if cfg.atomic_save:
        replace_dir(folder, final)
    rotate_checkpoints(output_dir, cfg.save_total_limit, state.best_model_checkpoint)
    return final


def replace_dir(src: Path, dst: Path) -> None:
    """Move a finished folder into place; an existing folder of that name (a re-run) is replaced whole."""
    if dst.exists():
        old = dst.with_name(f"tmp-old-{dst.name}")
        os.rename(dst, old)
        os.rename(src, dst)
        shutil.rmtree(old)
    else:
        os.rename(src, dst)


def sorted_checkpoints(output_dir: Path) -> list[Path]:
    """``trainer_utils.sort_checkpoints(use_mtime=True)``: by mtime, by number when all are within a second."""
    found = []
    for path in output_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*"):
        match = re.match(rf".*{PREFIX_CHECKPOINT_DIR}-([0-9]+)", path.name)
        if path.is_dir() and match:
            found.append((path.stat().st_mtime, int(match.group(1)), path))
    mtimes = [m for m, _, _ in found]
    by_number = not found or max(mtimes) - min(mtimes) < 1.0
    found.sort(key=lambda item: (item[1] if by_number else item[0], item[1]))
    return [path for _, _, path in found]


def rotate_checkpoints(output_dir: Path, limit: int | None, best_model_checkpoint: str | None) -> None:
    """Delete the oldest checkpoints beyond ``limit``, sparing the newest and the best (string comparison)."""
    if limit is None or limit <= 0:
        return
    checkpoints = sorted_checkpoints(output_dir)
    protected = {str(checkpoints[-1])} if checkpoints else set()
    if best_model_checkpoint is not None:
        protected.add(str(Path(best_model_checkpoint)))
    excess = len(checkpoints) - max(limit, len(protected))
    for path in checkpoints:
        if excess <= 0:
            break
        if str(path) not in protected:
            logger.info("Deleting older checkpoint [%s] due to save_total_limit", path)
            shutil.rmtree(path, ignore_errors=True)
            excess -= 1


# ---------------------------------------------------------------------------------------------------------------
# Resuming


def get_last_checkpoint(folder: str | os.PathLike[str]) -> Path | None:
    """``trainer_utils.get_last_checkpoint``: the highest ``checkpoint-N`` directory; no content check at all."""
    best: tuple[int, str] | None = None
    for name in os.listdir(folder):
        match = _RE_CHECKPOINT.search(name)
        if match and os.path.isdir(os.path.join(folder, name)) and (best is None or int(match.group(1)) > best[0]):
            best = (int(match.group(1)), name)
    return None if best is None else Path(folder) / best[1]


@dataclass
class LoadReport:
    """What the weights load did; the Trainer only logs these, it never fails on them."""

    branch: str  # "full", "adapter" or "sharded"
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)


def load_from_checkpoint(folder: Path, model: nn.Module, cfg: TrainConfig) -> LoadReport:
    """``Trainer._load_from_checkpoint``: full weights (strict=False) beat adapters, which beat a sharded index."""
    is_fsdp_ckpt = any("pytorch_model_fsdp" in p.name for p in folder.iterdir() if p.is_dir()) or (
        folder / "pytorch_model_fsdp.bin").is_file()
    adapter_subdirs = [p for p in sorted(folder.iterdir()) if p.is_dir() and (
        (p / ADAPTER_WEIGHTS_NAME).is_file() or (p / ADAPTER_SAFE_WEIGHTS_NAME).is_file())]
    if is_fsdp_ckpt:
        raise ValueError(f"Checkpoint found at {folder} is only supported when using PyTorch FSDP")
    names = (ADAPTER_WEIGHTS_NAME, ADAPTER_SAFE_WEIGHTS_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME,
             SAFE_WEIGHTS_INDEX_NAME)
    if not any((folder / n).is_file() for n in names) and not adapter_subdirs:
        raise ValueError(f"Can't find a valid checkpoint at {folder}")
    if (folder / CONFIG_NAME).is_file():
        json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))  # only parsed; a corrupt one aborts (H20)

    if (folder / WEIGHTS_NAME).is_file() or (folder / SAFE_WEIGHTS_NAME).is_file():
        if (folder / SAFE_WEIGHTS_NAME).is_file():
            state_dict = load_file(str(folder / SAFE_WEIGHTS_NAME), device="cpu")
        else:
            state_dict = torch.load(folder / WEIGHTS_NAME, map_location="cpu", weights_only=True)
        result = model.load_state_dict(state_dict, False)
        report = LoadReport("full", list(result.missing_keys), list(result.unexpected_keys))
    elif cfg.use_lora:
        active = model.active_adapters[0]  # type: ignore[index]
        if adapter_subdirs:
            # T5: the root adapter as "default", then each subfolder under its own name; only the active trains.
            if (folder / ADAPTER_SAFE_WEIGHTS_NAME).is_file() or (folder / ADAPTER_WEIGHTS_NAME).is_file():
                model.load_adapter(str(folder), "default", is_trainable=active == "default")  # type: ignore[operator]
            for sub in adapter_subdirs:
                model.load_adapter(str(sub), sub.name, is_trainable=active == sub.name)  # type: ignore[operator]
            model.set_adapter(active)  # type: ignore[operator]
        else:
            model.load_adapter(str(folder), active, is_trainable=True)  # type: ignore[operator]
        return LoadReport("adapter")  # the Trainer discards load_adapter's missing/unexpected keys
    else:
        report = load_sharded_checkpoint(model, folder)
    if report.missing_keys:
        logger.warning("There were missing keys in the checkpoint model loaded: %s.", report.missing_keys)
    if report.unexpected_keys:
        logger.warning("There were unexpected keys in the checkpoint model loaded: %s.", report.unexpected_keys)
    return report


def load_sharded_checkpoint(model: nn.Module, folder: Path) -> LoadReport:
    """``trainer_utils.load_sharded_checkpoint``: keys judged from the index only, each listed shard non-strict."""
    if (folder / SAFE_WEIGHTS_INDEX_NAME).is_file():
        index = json.loads((folder / SAFE_WEIGHTS_INDEX_NAME).read_text(encoding="utf-8"))

        def loader(path: Path) -> dict[str, torch.Tensor]:
            return load_file(str(path))
    elif (folder / WEIGHTS_INDEX_NAME).is_file():
        index = json.loads((folder / WEIGHTS_INDEX_NAME).read_text(encoding="utf-8"))

        def loader(path: Path) -> dict[str, torch.Tensor]:
            return torch.load(path, map_location="cpu", weights_only=True)  # type: ignore[no-any-return]
    else:
        raise ValueError(f"Can't find a checkpoint index ({WEIGHTS_INDEX_NAME} or {SAFE_WEIGHTS_INDEX_NAME}) "
                         f"in {folder}.")
    listed = index["weight_map"]
    model_keys = model.state_dict().keys()
    report = LoadReport("sharded", [k for k in model_keys if k not in listed],
                        [k for k in listed if k not in model_keys])
    for shard in sorted(set(listed.values())):
        model.load_state_dict(loader(folder / shard), strict=False)
    return report


def load_optimizer_and_scheduler(folder: Path, optimizer: torch.optim.Optimizer, scheduler: Any) -> bool:
    """Both or neither, silently: ``Trainer._load_optimizer_and_scheduler`` outside DeepSpeed/FSDP."""
    has_optimizer = (folder / OPTIMIZER_NAME).is_file() or (folder / "optimizer.bin").is_file() or any(
        p.is_dir() and "optimizer" in p.name for p in folder.iterdir())
    if not (has_optimizer and (folder / SCHEDULER_NAME).is_file()):
        return False
    optimizer.load_state_dict(torch.load(folder / OPTIMIZER_NAME, map_location="cpu", weights_only=True))
    scheduler.load_state_dict(torch.load(folder / SCHEDULER_NAME, weights_only=True))
    return True


def load_rng_state(folder: Path, world_size: int = 1, rank: int = 0) -> bool:
    """``Trainer._load_rng_state``: a missing file is an info line; numpy globals allow-listed like safe_globals()."""
    path = folder / ("rng_state.pth" if world_size <= 1 else f"rng_state_{rank}.pth")
    if not path.is_file():
        logger.info("Didn't find an RNG file at %s, if you are resuming a training that wasn't launched in a "
                    "distributed fashion, reproducibility is not guaranteed.", path)
        return False
    # numpy >= 2 pickles `numpy._core.multiarray._reconstruct`, numpy 1 `numpy.core...` (transformers' safe_globals).
    core = np._core if hasattr(np, "_core") else np.core
    allowed = [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(allowed):
        checkpoint_rng_state = torch.load(path, weights_only=True)
    random.setstate(checkpoint_rng_state["python"])
    np.random.set_state(checkpoint_rng_state["numpy"])
    torch.random.set_rng_state(checkpoint_rng_state["cpu"])
    return True


# ---------------------------------------------------------------------------------------------------------------
# The training loop


@dataclass
class TrainResult:
    """What one ``train`` call did; losses and learning rates are keyed by global step (1-based)."""

    losses: dict[int, float]
    learning_rates: dict[int, float]
    global_step: int
    resumed_from: Path | None
    load_report: LoadReport | None
    optimizer_restored: bool
    rng_restored: bool
    model: nn.Module
    checkpoints: list[Path]


@contextlib.contextmanager
def _single_thread() -> Iterator[None]:
    """One intra-op thread makes CPU reductions deterministic; the caller's setting is restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _no_hook(_: Path) -> None:
    return None


def train(cfg: TrainConfig, resume_from_checkpoint: bool | str | os.PathLike[str] | None = None,
          save_hook: SaveHook | None = None, preempt_after_step: int | None = None) -> TrainResult:
    """Train (or resume) with the Trainer's semantics; checkpoints land in ``cfg.output_dir``.

    ``save_hook`` sees every file as soon as it is written (raise from it to die mid-save);
    ``preempt_after_step`` ends the run right after that step and its save, as a killed or preempted job would.
    """
    with _single_thread():
        return _train(cfg, resume_from_checkpoint, save_hook or _no_hook, preempt_after_step)


def _train(cfg: TrainConfig, resume: bool | str | os.PathLike[str] | None, hook: SaveHook,
           preempt_after_step: int | None) -> TrainResult:
    # Which checkpoint (Trainer.train): True means the highest-numbered checkpoint-N folder.
    folder: Path | None = None
    if resume is True:
        folder = get_last_checkpoint(cfg.output_dir) if os.path.isdir(cfg.output_dir) else None
        if folder is None:
            raise ValueError(f"No valid checkpoint found in output directory ({cfg.output_dir})")
    elif resume not in (None, False):
        folder = Path(resume)  # type: ignore[arg-type]

    set_seed(cfg.seed)
    model = build_model(cfg)
    load_report = load_from_checkpoint(folder, model, cfg) if folder is not None else None

    max_steps, num_train_epochs = total_steps(cfg)
    per_epoch = updates_per_epoch(cfg)
    state = TrainerState(max_steps=max_steps, num_train_epochs=num_train_epochs, logging_steps=cfg.logging_steps,
                         save_steps=cfg.save_steps, train_batch_size=cfg.per_device_train_batch_size)
    epochs_trained = start_update = 0
    if folder is not None:
        # Loaded unconditionally: a torn checkpoint without trainer_state.json fails here (FileNotFoundError).
        state = TrainerState.load(folder / TRAINER_STATE_NAME)
        epochs_trained = state.global_step // per_epoch
        start_update = state.global_step % per_epoch
        # init_training_references: max_steps and epochs come from this run; logging/save steps stay (H10).
        state.max_steps, state.num_train_epochs = max_steps, num_train_epochs

    owns_group = cfg.wrapper == "ddp" and not _dist_initialized()
    wrapped = wrap_model(model, cfg)
    optimizer = create_optimizer(model, cfg)
    scheduler = create_scheduler(optimizer, cfg, max_steps)  # built for the *current* max_steps, then state-loaded
    optimizer_restored = load_optimizer_and_scheduler(folder, optimizer, scheduler) if folder is not None else False

    corpus = make_corpus(cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    flops_per_token = 6 * sum(p.numel() for n, p in model.named_parameters() if "embed" not in n)
    losses: dict[int, float] = {}
    lrs: dict[int, float] = {}
    saved: list[Path] = []
    rng_restored = False
    pending_log: list[float] = []
    wrapped.train()

    for epoch in range(epochs_trained, num_train_epochs):
        # The Trainer checks should_training_stop only after a step: resuming a checkpoint at or past max_steps in
        # the middle of an epoch still trains one step (transformers 5.23 `_inner_training_loop` / `_run_epoch`).
        if epoch != epochs_trained and state.global_step >= max_steps:
            break
        batches = epoch_batches(corpus, cfg, epoch)
        first = start_update if epoch == epochs_trained else 0
        if folder is not None and epoch == epochs_trained:
            rng_restored = load_rng_state(folder)  # after the skipped batches, as the Trainer does
        for update in range(first, per_epoch):
            ga = cfg.gradient_accumulation_steps
            micro = batches[update * ga : (update + 1) * ga]
            step_loss = 0.0
            for batch in micro:
                loss = next_token_loss(wrapped, batch) / len(micro)
                loss.backward()  # type: ignore[no-untyped-call]
                step_loss += loss.item()
            grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.max_grad_norm)
            lr = optimizer.param_groups[0]["lr"]  # the LR this step uses (first resumed step: from optimizer.pt)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

            state.global_step += 1
            state.epoch = epoch + (update + 1) / per_epoch
            state.total_flos += float(flops_per_token * sum(b.numel() for b in micro))
            losses[state.global_step] = step_loss
            lrs[state.global_step] = lr
            pending_log.append(step_loss)
            if state.global_step % state.logging_steps == 0:
                state.log_history.append({"epoch": state.epoch, "grad_norm": float(grad_norm),
                                          "learning_rate": lr, "loss": sum(pending_log) / len(pending_log),
                                          "step": state.global_step})
                pending_log.clear()
            if state.global_step % state.save_steps == 0 or state.global_step >= max_steps:
                saved.append(save_checkpoint(wrapped, optimizer, scheduler, state, cfg, hook))
            if state.global_step >= max_steps or state.global_step == preempt_after_step:
                break
        if state.global_step == preempt_after_step:
            break

    if owns_group:
        torch.distributed.destroy_process_group()
    return TrainResult(losses, lrs, state.global_step, folder, load_report, optimizer_restored, rng_restored,
                       model, saved)
