"""accelerate's ``Accelerator.save_state`` / ``load_state`` as a stack: the layout of its folders and what
``load_state()`` picks.

``save_state(output_dir)`` (src/accelerate/accelerator.py ``Accelerator.save_state``, src/accelerate/checkpointing.py
``save_accelerator_state``) writes each prepared model (``model.safetensors``, ``model_1.safetensors`` ...), then
each optimizer (``optimizer.bin``, ``optimizer_1.bin``), scheduler (``scheduler.bin``), sampler and dataloader
states, the grad scaler (``scaler.pt``), and last the RNG states of each process (``random_states_<rank>.pkl``),
then each object given to ``register_for_checkpointing`` (``custom_checkpoint_<i>.pkl``). It writes no training
state of the Trainer's kind (no ``trainer_state.json``): a folder without one is no interrupted save.

With ``ProjectConfiguration(automatic_checkpoint_naming=True)``, ``save_state()`` writes into
``project_dir/checkpoints/checkpoint_<save_iteration>`` and ``load_state()`` with no folder lists
``project_dir/checkpoints``, sorts every entry by the first run of digits in its name (``_inner``: an entry with no
digit raises ``IndexError``) and loads the last.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ckptdoctor.model import Run

# `RNG_STATE_NAME` in src/accelerate/utils/constants.py: every process writes its own, last, at every save.
_SIGNATURE_RE = re.compile(r"^random_states_\d+\.pkl$")
# The folder automatic naming writes under `project_dir/checkpoints` (`Accelerator.save_state`).
AUTOMATIC_RE = re.compile(r"^checkpoint_(\d+)$")
AUTOMATIC_PARENT = "checkpoints"
# The Trainer's rotation pattern (`sort_checkpoints` in src/transformers/trainer_utils.py).
_TRAINER_RE = re.compile(r"checkpoint-\d+")
# `_inner` in `Accelerator.load_state`: the digit runs of the last path component; the first is the sort key.
_DIGITS_RE = re.compile(r"[0-9]+")


def signed(names: Iterable[str]) -> bool:
    """Whether a folder holding top-level ``names`` holds the RNG state file ``save_state`` writes at every save."""
    return any(_SIGNATURE_RE.match(n) for n in names)


def is_automatic_layout(name: str, subfolders: Iterable[str]) -> bool:
    """Whether a folder called ``name`` with these ``subfolders`` is automatic naming's ``checkpoints`` folder: some
    ``checkpoint_<i>`` and no Trainer ``checkpoint-<n>`` (where a ``checkpoint_30`` is a renamed Trainer folder)."""
    subfolders = list(subfolders)
    return (
        name == AUTOMATIC_PARENT
        and any(AUTOMATIC_RE.match(d) for d in subfolders)
        and not any(_TRAINER_RE.search(d) for d in subfolders)
    )


def load_state_pick(entries: Iterable[str]) -> str | None:
    """The entry of ``project_dir/checkpoints`` that ``load_state()`` with no folder loads: the last when sorted by
    the first number in each name (a stable sort, so ties keep the listing's order, here the names' order). None
    when there is no entry, or when one has no digit (``load_state()`` raises ``IndexError`` then)."""
    keyed = []
    for e in sorted(entries):
        m = _DIGITS_RE.search(e)
        if m is None:
            return None
        keyed.append((int(m.group()), e))
    if not keyed:
        return None
    keyed.sort(key=lambda k: k[0])
    return keyed[-1][1]


def resume_text(run: Run) -> str:
    """What resuming ``run`` (an accelerate run) loads, in the words of accelerate's own call."""
    names = [ck.path.rsplit("/", 1)[-1] for ck in run.checkpoints]
    if run.path.rsplit("/", 1)[-1] == AUTOMATIC_PARENT and any(AUTOMATIC_RE.match(n) for n in names):
        pick = load_state_pick(names)
        return f"accelerate; `load_state()` loads `{pick}`" if pick else "accelerate; `load_state()` raises"
    return "accelerate `save_state` folders; `load_state(folder)` loads the folder named"
