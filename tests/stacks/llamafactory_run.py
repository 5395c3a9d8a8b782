"""Real LLaMA-Factory 0.9.5 fine-tunes for tests/stacks/test_stack_llamafactory.py, run with the layer on the path
(``PYTHONPATH=LAYER DISABLE_VERSION_CHECK=1 python llamafactory_run.py OUT``; docs/stacks.md has the recipe).

Builds a tiny Llama (2 layers, hidden 16) and a word-level tokenizer locally (nothing downloaded) and a 16-example
alpaca-format dataset, then trains two runs of 4 steps, saving every 2, in fp32 on CPU: ``OUT/board`` (LoRA) the way
LLaMA Board starts one (its ``save_cmd`` writes ``training_args.yaml`` into the output folder, then the training
reads that file), and ``OUT/cli`` (full fine-tune) as ``llamafactory-cli train`` does with the same arguments.
Not a test module.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import tokenizers
import torch
import transformers
import yaml
from llamafactory.train.tuner import run_exp
from llamafactory.webui.common import save_cmd


def _inputs(out: str) -> None:
    """The local model, tokenizer and dataset."""
    words = {f"w{i}": i for i in range(61)} | {"<pad>": 61, "</s>": 62, "<unk>": 63}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(f"{out}/model")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                   pad_token_id=61, eos_token_id=62, bos_token_id=62)
    transformers.LlamaForCausalLM(cfg).save_pretrained(f"{out}/model")
    os.makedirs(f"{out}/data", exist_ok=True)
    rows = [{"instruction": " ".join(f"w{(i * 7 + j) % 60}" for j in range(5)), "input": "",
             "output": " ".join(f"w{(i * 3 + j) % 60}" for j in range(4))} for i in range(16)]
    with open(f"{out}/data/tiny.json", "w") as f:
        json.dump(rows, f)
    with open(f"{out}/data/dataset_info.json", "w") as f:
        json.dump({"tiny": {"file_name": "tiny.json"}}, f)


def _args(out: str, name: str, **kw: Any) -> dict[str, Any]:
    return dict(stage="sft", do_train=True, model_name_or_path=f"{out}/model", dataset="tiny",
                dataset_dir=f"{out}/data", template="default", output_dir=f"{out}/{name}", cutoff_len=32,
                per_device_train_batch_size=2, max_steps=4, save_steps=2, logging_steps=1, learning_rate=1e-3,
                report_to="none", plot_loss=True, disable_gradient_checkpointing=True, bf16=False, fp16=False,
                preprocessing_num_workers=1, dataloader_num_workers=0, use_cpu=True, **kw)


def main() -> None:
    out = sys.argv[1]
    _inputs(out)
    with open(save_cmd(_args(out, "board", finetuning_type="lora", lora_target="all", lora_rank=4))) as f:
        run_exp(yaml.safe_load(f))  # LLaMA Board: `llamafactory-cli train <output_dir>/training_args.yaml`
    run_exp(_args(out, "cli", finetuning_type="full"))


if __name__ == "__main__":
    main()
