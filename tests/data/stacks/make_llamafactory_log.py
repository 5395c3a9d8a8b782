"""Write tests/data/stacks/llamafactory-0.9.5/trainer_log.jsonl with LLaMA-Factory's own ``LogCallback``.

Run with llamafactory 0.9.5 importable (docs/stacks.md: ``pip install --no-deps --target LAYER llamafactory==0.9.5``,
then ``PYTHONPATH=LAYER DISABLE_VERSION_CHECK=1 python tests/data/stacks/make_llamafactory_log.py OUT_DIR``): a real
transformers Trainer (tiny GPT-2, 4 steps, logging every step) with the callback LLaMA-Factory's ``run_sft`` adds,
which appends one JSON document per log to ``OUT_DIR/trainer_log.jsonl``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import transformers
from llamafactory.train.callbacks import LogCallback


class Tokens(torch.utils.data.Dataset):  # type: ignore[misc]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, Any]:
        ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2,
                                                                 n_positions=32))
    args = transformers.TrainingArguments(output_dir=sys.argv[1], max_steps=4, save_steps=2, logging_steps=1,
                                          per_device_train_batch_size=4, use_cpu=True, report_to="none",
                                          disable_tqdm=True, seed=0)
    transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[LogCallback()]).train()


if __name__ == "__main__":
    main()
