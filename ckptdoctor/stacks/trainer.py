"""The transformers Trainer as a stack: the files that sign its checkpoint folders.

Everything else the Trainer does (which folder ``resume_from_checkpoint=True`` picks, which files it loads, in which
order) is in ``ckptdoctor.trainer_view`` and is not repeated here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ckptdoctor.patterns import lazy

# Files only the Trainer writes into a checkpoint (`Trainer._save_checkpoint`, `_save_optimizer_and_scheduler`,
# `_save_rng_state` in src/transformers/trainer.py), its DeepSpeed tag folders, and the sentinel of its JIT
# checkpoints. Not the FSDP names (`pytorch_model_fsdp_0`, `optimizer_0`), `scaler.pt` or DeepSpeed's `latest`:
# accelerate's `save_state` writes those too.
_OWN = frozenset({"trainer_state.json", "training_args.bin", "optimizer.pt", "scheduler.pt",
                  "checkpoint-is-incomplete.txt"})
_OWN_RE = re.compile(r"^(?:rng_state(?:_\d+)?\.pth|global_step\d+)$")
# What `save_model` (weights, config, tokenizer, adapter, model card) writes before the training state: a
# Trainer save interrupted there holds nothing else (`Trainer._save`, `PreTrainedModel.save_pretrained`,
# `PreTrainedTokenizerBase.save_pretrained`, `PeftModel.save_pretrained`).
_EARLY_SUFFIXES = (".safetensors", ".json", ".txt", ".model", ".jinja", ".md")
_EARLY_RE = lazy(r"^(?:pytorch_model(?:-\d+-of-\d+)?\.bin|adapter_model\.bin|optimizer\.bin)$")


def signed(names: Iterable[str]) -> bool:
    """Whether a folder holding top-level ``names`` holds a file only the Trainer writes."""
    return any(n in _OWN or _OWN_RE.match(n) for n in names)


def could_be_torn(names: Iterable[str]) -> bool:
    """Whether a folder holding ``names`` and nothing of any stack's own could be a Trainer save cut short: empty,
    or holding only what ``save_model`` writes first."""
    return all(n.endswith(_EARLY_SUFFIXES) or _EARLY_RE.match(n) for n in names)
