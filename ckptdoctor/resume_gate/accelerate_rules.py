"""The gate's rule for accelerate's resume: ``Accelerator.load_state()`` as predicted by ``stacks.accelerate``.

On the rules' row, loaded by the registry (``rules.RULE_MODULES``); only the accelerate gate
(``ckptdoctor.resume_gate.accelerate``) hands it an ``AccelerateResume``: in the Trainer's gate it finds nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from ckptdoctor.findings import Finding, Severity
from ckptdoctor.model import Tree, frozen
from ckptdoctor.rules import Hit, Selection, evaluate, get_rule, rule
from ckptdoctor.stacks.accelerate import LoadState

LOAD_STATE_RULE = "CKD432"


@frozen
class AccelerateResume:
    """What the accelerate gate judges: the scanned tree, the run folder, and the predicted ``load_state()``."""

    tree: Tree
    run: str  # the run's path in the tree ("." for the root)
    load: LoadState


@rule(LOAD_STATE_RULE, "accelerate-load-state-will-fail", Severity.ERROR, gate_only=True)
def accelerate_load_state_will_fail(ctx: Any) -> Iterator[Hit]:
    """The planned `Accelerator.load_state()` raises: no save to load, an entry it cannot sort, a file it opens
    missing or cut short, or custom checkpoints that do not match the registered objects.

    ## What it does
    Follows `Accelerator.load_state` for the save it picks (automatic naming: the highest `checkpoint_<i>` in
    `project_dir/checkpoints`; otherwise the folder given) and names the exception it raises: `FileNotFoundError`
    for a missing `checkpoints/` folder or a missing `model`/`optimizer`/`scheduler`/`scaler` file, `IndexError` for
    an empty `checkpoints/` or an entry without a digit, a `torch.load` error for a file cut short, `RuntimeError`
    when the `custom_checkpoint_<i>.pkl` files are not as many as the objects the program registered (given to the
    gate by `ckptdoctor.integrations.accelerate.check_load_state`, which reads them from the `Accelerator`).

    ## Why is this bad?
    The job fails after it got its allocation, with the model already overwritten by the first files loaded.

    ## Example
    `checkpoints/checkpoint_3/` from a preempted save holds `model.safetensors` only: `FileNotFoundError:
    .../optimizer.bin`.

    ## Fix safety
    No fix here; `ckptdoctor fix` quarantines an interrupted save (CKD121) or a stray entry of `checkpoints/` (CKD120).

    ## References
    `src/accelerate/accelerator.py` `Accelerator.load_state`; `src/accelerate/checkpointing.py`
    `load_accelerator_state`, `load_custom_state`.
    """
    if not isinstance(ctx, AccelerateResume):
        return
    where = ctx.load.folder or ctx.run
    for why in ctx.load.raises:
        yield Hit(where, why)


def accelerate_gate_findings(ctx: AccelerateResume, selection: Selection) -> list[Finding]:
    """The accelerate gate rule's findings on ``ctx`` under ``selection`` (ignoring it by code turns it off)."""
    r = get_rule(LOAD_STATE_RULE)
    # as the Trainer's gate rules: a select list narrows the scan findings only, an ignore turns the rule off
    unselected = replace(selection, select=())
    if r is None or not unselected.enabled(replace(r, gate_only=False)):
        return []
    return evaluate([r], ctx, ctx.tree, selection)
