"""Which training program wrote a folder, and how that program lays out and resumes its runs: one module per stack.

A folder is recognised by the files its program always writes (its signature), never by its name alone:

- ``trainer``: the transformers Trainer (``trainer_state.json``, ``training_args.bin``, ``rng_state.pth`` ...);
  what its resume picks and loads stays in ``ckptdoctor.trainer_view``.
- ``accelerate``: ``Accelerator.save_state`` (``random_states_<rank>.pkl``), by hand into any folder or, with
  ``ProjectConfiguration(automatic_checkpoint_naming=True)``, into ``project_dir/checkpoints/checkpoint_<i>``.
- ``lightning``: PyTorch Lightning's ``.ckpt`` files (a pickled dict holding ``pytorch-lightning_version``); the
  folder holding them (``ModelCheckpoint``'s ``dirpath``) is a run of one checkpoint, the folder.
- ``torchtitan``: ``CheckpointManager``'s ``checkpoint/step-<N>/`` torch.distributed.checkpoint saves; discovery
  makes the folder holding them a run (``torchtitan.is_layout``).
- ``mindnlp``: MindNLP's Trainer (MindSpore ``.ckpt`` weights, ``optimizer.ckpt``, ``scheduler.json``), and
  ``tensorflow``: TensorFlow bundles and Keras ``.h5`` weights, as ``discover.framework_of`` tells them.

``settle`` decides the stack of each checkpoint folder of one run: by its own signature, else by its siblings'
(an interrupted save lacks what its program writes last), else by whether every file in it is one the Trainer
writes before ``trainer_state.json`` (an interrupted Trainer save looks exactly like that), else unknown. Pure
functions of file names: no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from ckptdoctor.model import Checkpoint, FileFacts, FolderRole, Framework, Run, Stack
from ckptdoctor.stacks import accelerate, lightning, torchtitan, trainer

__all__ = ["TRAINER_SAVES", "resume_text", "settle", "signature"]

# The stacks whose `checkpoint-N` folders the transformers Trainer's save order governs: its own, MindNLP's Trainer (a
# port of it: `mindnlp/engine/trainer/base.py` `_save_checkpoint` writes `trainer_state.json` last too) and the
# TensorFlow folders, judged so before stacks were told apart.
TRAINER_SAVES = frozenset({Stack.TRAINER, Stack.MINDNLP, Stack.TENSORFLOW})
_FRAMEWORK_STACKS = {Framework.MINDNLP: Stack.MINDNLP, Framework.TENSORFLOW: Stack.TENSORFLOW}


def resume_text(run: Run) -> str | None:
    """What resuming ``run`` loads, for a run another stack than the Trainer wrote (None for the Trainer's runs:
    ``Run.resume_pick`` says it)."""
    if run.stack is Stack.ACCELERATE:
        return accelerate.resume_text(run)
    if run.stack is Stack.LIGHTNING:
        return lightning.resume_text(run)
    if run.stack is Stack.TORCHTITAN:
        return torchtitan.resume_text(run)
    return None


def signature(files: Sequence[FileFacts], names: Iterable[str]) -> Stack | None:
    """The stack whose own files are among a folder's ``files`` (``names``: their names in the folder, a
    subfolder's files named by the subfolder); None when no stack's are."""
    names = list(names)
    if trainer.signed(names):
        return Stack.TRAINER
    if accelerate.signed(names):
        return Stack.ACCELERATE
    if any(lightning.signed(f) for f in files):
        return Stack.LIGHTNING
    return None


def settle(checkpoints: Sequence[Checkpoint]) -> tuple[list[Checkpoint], Stack]:
    """Each checkpoint of one run with its stack decided, and the run's stack.

    MindNLP and TensorFlow folders are those stacks' (``Checkpoint.framework`` is their signature: MindSpore and
    TensorFlow files); only PyTorch folders are weighed further. The run's stack is the Trainer's when any of its
    folders is, else that of its signed folders, else MindNLP's or TensorFlow's when all its folders are, else the
    Trainer's. A folder with no signature takes its run's stack when the run has signed folders; alone, a `checkpoint-N`
    folder is the Trainer's when it could be a Trainer save cut short and of unknown make otherwise, and any other
    folder (a model folder, the run's own files) stays the Trainer's.
    """
    signed = {ck.path: signature(ck.files, _top_names(ck)) for ck in checkpoints if ck.framework is Framework.PYTORCH}
    found = {s for s in signed.values() if s is not None}
    run_stack = Stack.TRAINER if Stack.TRAINER in found or not found else sorted(found)[0]
    others = {_FRAMEWORK_STACKS[ck.framework] for ck in checkpoints if ck.framework in _FRAMEWORK_STACKS}
    if not signed and len(others) == 1:
        run_stack = others.pop()
    out = []
    for ck in checkpoints:
        if ck.path not in signed:
            stack = _FRAMEWORK_STACKS.get(ck.framework, ck.stack)
        elif (own := signed[ck.path]) is not None:
            stack = own
        else:
            torn = trainer.could_be_torn(ck.relname(f) for f in ck.files if "/" not in ck.relname(f))
            unknown = ck.role is FolderRole.CHECKPOINT and not torn
            stack = run_stack if found else (Stack.UNKNOWN if unknown else Stack.TRAINER)
        out.append(ck if stack is ck.stack else dataclasses.replace(ck, stack=stack))
    return out, run_stack


def _top_names(ck: Checkpoint) -> list[str]:
    """The names of the files directly in ``ck``'s folder, and of its subfolders' first level (a DeepSpeed tag)."""
    return [ck.relname(f).split("/", 1)[0] for f in ck.files]
