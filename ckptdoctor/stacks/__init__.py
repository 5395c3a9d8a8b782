"""Which training program wrote a folder, and how that program lays out and resumes its runs: one module per stack.

A folder is recognised by the files its program always writes (its signature), never by its name alone:

- ``trainer``: the transformers Trainer (``trainer_state.json``, ``training_args.bin``, ``rng_state.pth`` ...);
  what its resume picks and loads stays in ``ckptdoctor.trainer_view``.
- ``accelerate``: ``Accelerator.save_state`` (``random_states_<rank>.pkl``), by hand into any folder or, with
  ``ProjectConfiguration(automatic_checkpoint_naming=True)``, into ``project_dir/checkpoints/checkpoint_<i>``.
- ``lightning``: PyTorch Lightning's ``.ckpt`` files (a pickled dict holding ``pytorch-lightning_version``).

``settle`` decides the stack of each checkpoint folder of one run: by its own signature, else by its siblings'
(an interrupted save lacks what its program writes last), else by whether every file in it is one the Trainer
writes before ``trainer_state.json`` (an interrupted Trainer save looks exactly like that), else unknown. Pure
functions of file names: no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from ckptdoctor.model import Checkpoint, Framework, Run, Stack
from ckptdoctor.stacks import accelerate, trainer

__all__ = ["resume_text", "settle", "signature"]


def resume_text(run: Run) -> str | None:
    """What resuming ``run`` loads, for a run another stack than the Trainer wrote (None for the Trainer's runs:
    ``Run.resume_pick`` says it)."""
    if run.stack is Stack.ACCELERATE:
        return accelerate.resume_text(run)
    return None


def signature(names: Iterable[str]) -> Stack | None:
    """The stack whose own files are among a folder's top-level file ``names``; None when no stack's are."""
    names = list(names)
    if trainer.signed(names):
        return Stack.TRAINER
    if accelerate.signed(names):
        return Stack.ACCELERATE
    return None


def settle(checkpoints: Sequence[Checkpoint]) -> tuple[list[Checkpoint], Stack]:
    """Each checkpoint of one run with its stack decided, and the run's stack.

    Only PyTorch folders are weighed (MindNLP and TensorFlow folders keep the Trainer's stack, as before). The run's
    stack is the Trainer's when any of its folders is, else that of its signed folders, else the Trainer's.
    """
    signed = {ck.path: signature(_top_names(ck)) for ck in checkpoints if ck.framework is Framework.PYTORCH}
    found = {s for s in signed.values() if s is not None}
    run_stack = Stack.TRAINER if Stack.TRAINER in found or not found else sorted(found)[0]
    out = []
    for ck in checkpoints:
        if ck.path not in signed:
            out.append(ck)
            continue
        stack = signed[ck.path]
        if stack is None:
            torn = trainer.could_be_torn(ck.relname(f) for f in ck.files if "/" not in ck.relname(f))
            stack = run_stack if found else (Stack.TRAINER if torn else Stack.UNKNOWN)
        out.append(ck if stack is ck.stack else dataclasses.replace(ck, stack=stack))
    return out, run_stack


def _top_names(ck: Checkpoint) -> list[str]:
    """The names of the files directly in ``ck``'s folder, and of its subfolders' first level (a DeepSpeed tag)."""
    return [ck.relname(f).split("/", 1)[0] for f in ck.files]
