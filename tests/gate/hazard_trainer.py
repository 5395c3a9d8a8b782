"""Train or resume a tiny real Trainer in a fresh process, for the tests of the resume hazards users report most.

Run as a script, never imported by the suite: ``python tests/gate/hazard_trainer.py JOB.json RESULT.json`` (by
tests/gate/test_resume_hazards.py, with the suite's own interpreter or ``CKPTDOCTOR_TF4_PYTHON``'s). A job is a dict:

- ``out``: output_dir; ``args``: TrainingArguments overrides; ``resume``: null, true or a checkpoint path;
- ``model``: ``"llama"`` (tied embeddings), ``"gpt2"`` or ``"mixtral"`` (2 layers of 2 experts, hidden size 16;
  ``config``: other ``MixtralConfig`` values, e.g. another model size), ``"qwen3_5_moe"`` (transformers 5 only) or
  ``"gte"`` (a masked LM, transformers 5 only: its saved layout fuses q, k and v, and the up and gate projections)
  or ``"inkling2"`` (transformers 5 only: its conversion holds a transform that renames by code of its own);
  ``untie_config``: set
  ``config.tie_word_embeddings = False`` on the tied model before training (the weights stay tied in memory);
  ``from_config``: build the model from that folder's ``config.json`` instead (what a user does who resumes from the
  checkpoint's config);
- ``init_from``: start from that checkpoint's weights (``from_pretrained``) as a new run, as a script does that
  passes a checkpoint as the model instead of resuming it;
- ``early_stopping``: patience of an ``EarlyStoppingCallback`` (with evaluation every ``eval_steps``);
- ``numpy_lr``: a ``LambdaLR`` whose lambda returns numpy floats (numpy scalars then reach the optimizer's and the
  scheduler's state);
- ``touch``: folders whose modification time is set to now before training (a copy that did not keep times).

The result says what ``train()`` did: the global_step at ``on_train_begin`` and the model's tensors that are still
at their initial values then (``at_init``: what the resume's weights load did not restore), the optimizer steps it
ran, the exception it raised (type and message), the checkpoint folders left after it, and, for
``from_pretrained``, whether the loaded head equals the saved input embedding.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from transformers import Trainer, TrainerCallback, TrainingArguments


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """16 fixed random sequences of 8 tokens out of 64: 4 optimizer steps per epoch at batch size 4."""

    def __init__(self, n: int = 16, seed: int = 0) -> None:
        self.ids = torch.randint(0, 64, (n, 8), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recorder(TrainerCallback):  # type: ignore[misc]
    def __init__(self, seen: dict[str, Any]) -> None:
        self.seen = seen

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seen["start"] = state.global_step
        model, init = kwargs.get("model"), self.seen.pop("init", None)
        if model is not None and init is not None and state.global_step > 0:  # a resume: what its load left alone
            sd = model.state_dict()
            self.seen["at_init"] = sorted(n for n, t in sd.items() if n in init and torch.equal(t, init[n]))
            self.seen["tensors"] = len(sd)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.seen["steps"].append(state.global_step)


def build_model(job: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    if job.get("init_from"):
        return transformers.AutoModelForCausalLM.from_pretrained(job["init_from"])
    if job.get("from_config"):
        cfg = transformers.AutoConfig.from_pretrained(job["from_config"])
        return transformers.AutoModelForCausalLM.from_config(cfg)
    if job.get("model") == "mixtral":
        sizes = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
                 "num_attention_heads": 2, "num_key_value_heads": 2, "num_local_experts": 2, "num_experts_per_tok": 1,
                 "max_position_embeddings": 32}
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**sizes, **job.get("config", {})}))
    if job.get("model") == "qwen3_5_moe":  # transformers 5 only: its conversion changes a prefix besides the experts
        return transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, head_dim=8, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
            shared_expert_intermediate_size=16, max_position_embeddings=32))
    if job.get("model") == "gte":  # transformers 5 only: saved with fused qkv (a Chunk into 3 live tensors)
        return transformers.GteForMaskedLM(transformers.GteConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=32))
    if job.get("model") == "inkling2":  # transformers 5 only: its conversion shifts an index by code of its own
        return transformers.Inkling2ForCausalLM(transformers.Inkling2TextConfig(
            vocab_size=64, unpadded_vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=8,
            sliding_window_size=8, d_rel=4, rel_extent=8, max_position_embeddings=32, moe_intermediate_size=16,
            n_routed_experts=2, num_experts_per_tok=1, n_layers_per_attn_res_block=1, eos_token_id=0))
    if job.get("model", "llama") == "gpt2":
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32, bos_token_id=0, eos_token_id=0))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True))
    if job.get("untie_config"):
        model.config.tie_word_embeddings = False  # the weights stay tied: the module is shared in memory
    return model


def run(job: dict[str, Any]) -> dict[str, Any]:
    seen: dict[str, Any] = {"start": None, "steps": []}
    out = Path(job["out"])
    for folder in job.get("touch", ()):
        now = time.time()
        os.utime(folder, (now, now))
    kwargs: dict[str, Any] = {
        "output_dir": str(out), "max_steps": 8, "save_steps": 2, "logging_steps": 1,
        "per_device_train_batch_size": 4, "learning_rate": 1e-3, "use_cpu": True, "report_to": "none",
        "disable_tqdm": True, "seed": 0,
    }
    if int(transformers.__version__.split(".")[0]) < 5:
        kwargs["logging_dir"] = str(out / "logs")  # 4.x's default names the host, and 5.x has no such argument
    kwargs.update(job.get("args", {}))
    callbacks: list[Any] = [Recorder(seen)]
    eval_set = None
    if job.get("early_stopping") is not None:
        callbacks.append(transformers.EarlyStoppingCallback(early_stopping_patience=job["early_stopping"],
                                                            early_stopping_threshold=1e9))
        eval_set = Tokens(8, seed=1)
    model = build_model(job)
    seen["init"] = {n: t.detach().clone() for n, t in model.state_dict().items()}
    trainer = Trainer(model=model, args=TrainingArguments(**kwargs), train_dataset=Tokens(), eval_dataset=eval_set,
                      callbacks=callbacks)
    if job.get("numpy_lr"):
        trainer.create_optimizer()
        total = kwargs["max_steps"]
        trainer.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            trainer.optimizer, lambda s: np.float64(max(0.0, (total - s) / total)))
    result: dict[str, Any] = {}
    try:
        trainer.train(resume_from_checkpoint=job.get("resume"))
    except Exception as exc:  # the crash is the result
        result["error"] = [type(exc).__name__, str(exc)[:2000]]
    seen.pop("init", None)
    result.update(seen)
    result["folders"] = sorted(p.name for p in out.glob("checkpoint-*"))
    if job.get("check_head"):
        loaded = transformers.AutoModelForCausalLM.from_pretrained(job["check_head"])
        result["head_is_embedding"] = bool(torch.equal(loaded.get_output_embeddings().weight,
                                                       loaded.get_input_embeddings().weight))
    return result


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps([run(job) for job in jobs]))


if __name__ == "__main__":
    main()
