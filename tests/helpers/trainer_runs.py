"""Helpers shared by several test files (moved from tests/rules/test_rules_transformers.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckptdoctor.findings import Finding

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


VOCAB = 64


STEPS = 4  # saves at 2 and 4: the last checkpoint ends the linear schedule (LR 0)


class Tokens(torch.utils.data.Dataset):  # type: ignore[misc]
    """Random token sequences; labels are the inputs (the model shifts them)."""

    def __init__(self, n: int = 16, seq: int = 8, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, seq), generator=gen)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def llama_config() -> Any:
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)


def llama() -> Any:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama_config())


def train(out: Path, model: Any, callbacks: list[Any] | None = None, **overrides: Any) -> Path:
    """Run the real Trainer for ``STEPS`` steps, saving every 2, on CPU with nothing reported anywhere."""
    kwargs: dict[str, Any] = {
        "output_dir": str(out), "max_steps": STEPS, "save_steps": 2, "logging_steps": 1,
        "per_device_train_batch_size": 4, "learning_rate": 1e-3, "use_cpu": True, "report_to": "none",
        "disable_tqdm": True, "seed": 0,
    }
    resume = overrides.pop("resume_from_checkpoint", None)
    kwargs.update(overrides)
    eval_set = Tokens(8, seed=1) if kwargs.get("eval_strategy") not in (None, "no") else None
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**kwargs),
                                   train_dataset=Tokens(), eval_dataset=eval_set, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    return out


def describe(fs: list[Finding]) -> str:
    return "\n".join(f"{f.rule} {f.severity.value} {f.path}: {f.message}" for f in fs) or "(no findings)"
