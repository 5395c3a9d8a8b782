"""The gate of an accelerate run: what ``Accelerator.load_state()`` picks, what it restores, whether it raises.

``ckptdoctor gate RUN`` comes here (``resume_gate.api.run_gate``) when the scanned run is accelerate's, or with
``--stack accelerate``: the prediction is ``stacks.accelerate.load_state``'s, judged by CKD432 (it raises) and the
scan's findings on the save it loads and on the run's own folder (CKD120 a stray entry it cannot use, CKD430 an older
state picked, CKD431 custom checkpoints, any damaged file). ``ckptdoctor.integrations.accelerate`` does the same
for a program's own ``Accelerator``, with what it registered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ckptdoctor.findings import Finding, display_path, within
from ckptdoctor.model import FolderRole, Run, Stack, Tree
from ckptdoctor.resume_gate.accelerate_rules import AccelerateResume, accelerate_gate_findings
from ckptdoctor.resume_gate.plan import Plan
from ckptdoctor.rules import Selection
from ckptdoctor.stacks import accelerate

STACK = "accelerate"
# the scan's finding that CKD432 states for the save load_state() loads (the same missing files)
_RESTATED = frozenset({"CKD121"})


def chosen(stack: str | None, tree: Tree) -> bool:
    """Whether the gate follows accelerate's resume: ``--stack accelerate``, or no ``--stack`` and the scanned
    tree holds accelerate saves and no Trainer checkpoint."""
    return stack == STACK or (stack is None and owns(tree))


def owns(tree: Tree) -> bool:
    """Whether ``tree``'s checkpoints are accelerate's: some run is, and no Trainer ``checkpoint-N`` is there."""
    trainer = any(r.stack is Stack.TRAINER and any(c.role is FolderRole.CHECKPOINT for c in r.checkpoints)
                  for r in tree.runs)
    return not trainer and run_of(tree) is not None


def run_of(tree: Tree) -> Run | None:
    """The accelerate run ``load_state`` resumes: automatic naming's ``checkpoints/`` first, else the first."""
    runs = [r for r in tree.runs if r.stack is Stack.ACCELERATE and r.checkpoints]
    return next((r for r in runs if accelerate.is_automatic(r)), runs[0] if runs else None)


def judge(
    tree: Tree,
    plan: Plan,
    *,
    run: str | None = None,
    scanned: Sequence[Finding] = (),
    selection: Selection | None = None,
    registered: accelerate.Registered | None = None,
) -> dict[str, Any]:
    """Predict ``load_state()`` for the accelerate run in ``tree`` and judge it: CKD432 where it raises, and the
    scan's findings about the save it loads and the run folder itself (not those about other saves). Returns the
    ``GateResult`` fields (``resume_gate.api`` builds it: this module sits below it)."""
    selection = selection or Selection()
    found = run_of(tree)
    load = accelerate.load_state(found, registered)
    run_path = found.path if found is not None else "."
    ctx = AccelerateResume(tree, run_path, load)
    others = [ck.path for ck in (found.checkpoints if found else ()) if ck.path != load.folder]

    def about_this_resume(f: Finding) -> bool:  # the save it loads, or an entry of the run folder (CKD120)
        in_run = (f.path.rsplit("/", 1)[0] if "/" in f.path else ".") == run_path
        here = load.folder is not None and within(f.path, load.folder)
        return (here or in_run) and not any(within(f.path, o) for o in others) and f.rule not in _RESTATED

    # no save at all: CKD432 says what load_state() raises (the scan's CKD002 says the same of any stack)
    kept = [f for f in scanned if about_this_resume(f)] if found is not None else []
    findings = tuple(sorted([*kept, *accelerate_gate_findings(ctx, selection)], key=Finding.sort_key))
    label = run if run is not None else tree.root
    folder = None if load.folder is None else display_path(tree.root, load.folder)
    start, total = load.step, plan.max_steps
    todo = None if start is None or total is None else max(0, total - start)
    return {
        "run": label, "checkpoint": folder, "weights_branch": "accelerate `load_state()`", "start_step": start,
        "max_steps": total, "steps_to_train": todo, "lr": (), "findings": findings,
        "restores_optimizer": any(n.startswith("optimizer") for n in load.reads), "fail_on": plan.fail_on,
        "weights_file": load.reads[0] if load.reads else None, "stack": STACK, "restores": load.reads,
    }
