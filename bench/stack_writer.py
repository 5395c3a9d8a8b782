"""Write the files one stack of the allowlist matrix produces; run by that stack's interpreter (never imported here).

Usage: ``python bench/stack_writer.py OUT FAMILY`` with FAMILY ``transformers`` (TrainingArguments variants, a
2-step Trainer run, peft adapters through the Trainer saved as ``.bin``) or ``numpy`` (what a Trainer run and
``np.save`` write under the numpy installed: RNG state, arrays, scalars, object arrays). Prints one JSON line: the
versions, what was written, and what failed with the library's own error (a failure is recorded, never guessed
around). bench/make_allowlist.py runs it under every layer or venv of the matrix and reads the files back with
ckptdoctor's static readers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import random
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

warnings.simplefilter("ignore")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from torch import nn  # noqa: E402

OUT = sys.argv[1]
FAMILY = sys.argv[2] if len(sys.argv) > 2 else "transformers"
os.makedirs(OUT, exist_ok=True)
done: list[str] = []
failed: dict[str, str] = {}


def versions(*names: str) -> dict[str, str]:
    """Each package's ``__version__``, or "not installed"."""
    out = {}
    for n in names:
        try:
            out[n] = importlib.import_module(n).__version__
        except Exception:
            out[n] = "not installed"
    return out


def attempt(name: str, fn: Callable[[], Any]) -> None:
    """Run one case; a library that refuses it is recorded with its own message."""
    try:
        fn()
        done.append(name)
    except Exception as exc:  # the library's refusal is the fact recorded
        failed[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def args_kw(**kw: Any) -> Any:
    """TrainingArguments with ``logging_dir`` set where it exists (4.x's default holds the host name), on CPU, no
    reporting.
    ``eval_strategy`` is spelled ``evaluation_strategy`` before 4.41."""
    import transformers

    cls = kw.pop("cls", transformers.TrainingArguments)
    if "logging_dir" in {f.name for f in dataclasses.fields(cls)}:  # transformers 5 dropped it
        kw.setdefault("logging_dir", os.path.join(OUT, "logs"))
    kw.setdefault("report_to", "none")
    kw.setdefault("use_cpu", True)
    try:
        return cls(**kw)
    except TypeError:
        if "eval_strategy" not in kw:
            raise
        kw["evaluation_strategy"] = kw.pop("eval_strategy")
        return cls(**kw)


@contextlib.contextmanager
def own_environment() -> Iterator[None]:
    """TrainingArguments(fsdp=, bf16= ...) set ACCELERATE_* variables that a later case would obey: undo them."""
    env = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(env)


def save_args(name: str, **kw: Any) -> None:
    """``torch.save(args, "training_args.bin")`` as ``Trainer._save`` does."""
    with own_environment():
        a = args_kw(output_dir=os.path.join(OUT, "o", name), **kw)
        torch.save(a, os.path.join(OUT, f"training_args-{name}.bin"))


class Regression(nn.Module):
    """A one-layer regressor the Trainer can train (returns its loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": ((self.lin(x).squeeze(-1) - labels) ** 2).mean()}


def run_trainer(name: str, model: nn.Module, data: list[dict[str, torch.Tensor]], **kw: Any) -> None:
    """A 2-step ``Trainer.train()`` saving checkpoint-1 and checkpoint-2 under OUT/name."""
    from transformers import Trainer

    kw.setdefault("max_steps", 2)
    with own_environment():
        args = args_kw(output_dir=os.path.join(OUT, name), save_steps=1, per_device_train_batch_size=4,
                       logging_steps=1, **kw)  # fmt: skip
        Trainer(model=model, args=args, train_dataset=data).train()


def regression_data() -> list[dict[str, torch.Tensor]]:
    return [{"x": torch.randn(4), "labels": torch.tensor(0.5)} for _ in range(8)]


def tiny_gpt2() -> nn.Module:
    """A 1-layer GPT-2 built from a config (nothing downloaded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32)
    return GPT2LMHeadModel(cfg)


def peft_run(name: str, make_config: Callable[[], Any]) -> None:
    """A peft model trained by the Trainer for one step (``.bin`` checkpoints where ``save_safetensors`` exists;
    transformers 5 always writes safetensors), then ``save_pretrained(safe_serialization=False)``."""
    import transformers
    from peft import get_peft_model

    model = get_peft_model(tiny_gpt2(), make_config())
    ids = [torch.randint(0, 64, (8,)) for _ in range(4)]
    data = [{"input_ids": t, "labels": t} for t in ids]
    kw = {"save_safetensors": False}
    if "save_safetensors" not in {f.name for f in dataclasses.fields(transformers.TrainingArguments)}:
        kw = {}
    run_trainer(f"peft-{name}", model, data, max_steps=1, **kw)
    model.save_pretrained(os.path.join(OUT, f"peft-{name}", "adapter-bin"), safe_serialization=False)


def transformers_family() -> None:
    import transformers

    torch.manual_seed(0)
    attempt("trainer", lambda: run_trainer("trainer", Regression(), regression_data()))
    attempt("trainer-bin", lambda: run_trainer("trainer-bin", Regression(), regression_data(),
                                               save_safetensors=False))  # fmt: skip
    attempt("trainer-bf16", lambda: run_trainer("trainer-bf16", Regression(), regression_data(), bf16=True))
    attempt("peft", peft_family)
    attempt("default", lambda: save_args("default"))
    attempt("variant", lambda: save_args("variant", eval_strategy="steps", save_strategy="epoch",
                                         lr_scheduler_type="cosine", optim="adafactor", hub_strategy="checkpoint",
                                         debug="underflow_overflow"))  # fmt: skip
    attempt("seq2seq", lambda: save_args("seq2seq", cls=transformers.Seq2SeqTrainingArguments,
                                         predict_with_generate=True))  # fmt: skip
    # a Seq2Seq variant holding a GenerationConfig object (pickled inside training_args.bin), beams and sortish sampler
    attempt("seq2seq-generation", lambda: save_args(
        "seq2seq-generation", cls=transformers.Seq2SeqTrainingArguments, predict_with_generate=True,
        generation_max_length=64, generation_num_beams=4, sortish_sampler=True,
        generation_config=transformers.GenerationConfig(max_new_tokens=8, num_beams=2)))  # fmt: skip
    attempt("fsdp", lambda: save_args("fsdp", fsdp="full_shard auto_wrap",
                                      fsdp_config={"transformer_layer_cls_to_wrap": ["GPT2Block"]}))  # fmt: skip
    attempt("fsdp-offload", lambda: save_args("fsdp-offload", fsdp="shard_grad_op offload"))
    attempt("bf16", lambda: save_args("bf16", bf16=True))
    attempt("fp16", lambda: save_args("fp16", fp16=True))
    attempt("torch-compile", lambda: save_args("torch-compile", torch_compile=True))


def peft_family() -> None:
    """LoRA, DoRA, modules_to_save, IA3 and prompt tuning adapters written by the Trainer."""
    import peft

    target = ["c_attn"]
    attempt("peft-lora", lambda: peft_run("lora", lambda: peft.LoraConfig(r=2, target_modules=target,
                                                                          task_type="CAUSAL_LM")))  # fmt: skip
    attempt("peft-dora", lambda: peft_run("dora", lambda: peft.LoraConfig(r=2, target_modules=target, use_dora=True,
                                                                          task_type="CAUSAL_LM")))  # fmt: skip
    attempt("peft-modules_to_save", lambda: peft_run("mts", lambda: peft.LoraConfig(
        r=2, target_modules=target, modules_to_save=["ln_f"], task_type="CAUSAL_LM")))  # fmt: skip
    attempt("peft-ia3", lambda: peft_run("ia3", lambda: peft.IA3Config(
        target_modules=["c_attn", "c_fc"], feedforward_modules=["c_fc"], task_type="CAUSAL_LM")))  # fmt: skip
    attempt("peft-prompt_tuning", lambda: peft_run("prompt", lambda: peft.PromptTuningConfig(
        num_virtual_tokens=4, task_type="CAUSAL_LM")))  # fmt: skip


def numpy_family() -> None:
    import numpy as np

    np.random.seed(0)
    # Trainer._save_rng_state on one CPU process: python, numpy and torch generators.
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()},
               os.path.join(OUT, "rng_state.pth"))  # fmt: skip
    torch.save({"a": np.arange(3), "b": np.float32(1.5), "c": np.zeros((2, 2), dtype=np.float16), "d": np.int64(7),
                "e": np.bool_(True), "f": np.array(["x", "yz"]), "g": np.dtype("float64")},
               os.path.join(OUT, "np.pt"))  # fmt: skip
    objects = np.empty(3, dtype=object)
    objects[:] = [1, "two", np.arange(2)]
    np.save(os.path.join(OUT, "objects.npy"), objects, allow_pickle=True)
    np.savez(os.path.join(OUT, "arrays.npz"), a=np.arange(4), o=objects)
    done.extend(["rng_state", "arrays", "object-arrays"])
    try:
        importlib.import_module("transformers")
    except Exception as exc:
        failed["trainer"] = f"{type(exc).__name__}: {exc}"[:200]
        return
    attempt("trainer", lambda: run_trainer("trainer", Regression(), regression_data()))


if FAMILY == "numpy":
    numpy_family()
    names = ("numpy", "torch", "transformers", "accelerate")
else:
    transformers_family()
    names = ("transformers", "accelerate", "peft", "tokenizers", "huggingface_hub", "numpy", "torch")
print(json.dumps({"versions": versions(*names), "configs": done, "failed": failed}))
