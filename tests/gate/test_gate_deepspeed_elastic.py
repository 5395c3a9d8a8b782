"""Proof: a real DeepSpeed checkpoint whose elastic ZeRO state leaves the first resumed LR at the restarted
schedule's step 0, and the gate predicts every LR of its real resume (issue 24, item 8).

The checkpoint is kept in tests/data/deepspeed-0.19.8-zero2-elastic (its README says how it was written and what
its real resume did): it needs DeepSpeed's own Adam, a C++ build too slow for the suite, so no layer is needed here.
tests/gate/test_gate_deepspeed.py builds the other DeepSpeed cases with the real library.
"""

from __future__ import annotations

import math

from ckptdoctor.resume_gate import GateResult, gate
from tests.helpers.paths import REPO


def rules(result: GateResult) -> set[str]:
    return {f.rule for f in result.findings}


ELASTIC = REPO / "tests" / "data" / "deepspeed-0.19.8-zero2-elastic"
ELASTIC_RESUMED = (0.0, 0.0005, 0.0003333333333333333, 0.00016666666666666666)  # the real resume's steps 5-8
ELASTIC_UNINTERRUPTED = 0.0006666666666666666  # the uninterrupted run's step 5


def test_an_elastic_zero_state_restarts_the_first_lr_and_ckd423_says_so() -> None:
    """DeepSpeed restores an elastic state's per-parameter tensors and step, not its param groups: the first resumed
    step runs at the fresh schedule's step-0 LR (0: warm-up), then the restored schedule takes over."""
    pred = gate(ELASTIC, lr_steps=100)
    assert pred.checkpoint is not None and pred.start_step == 4 and pred.steps_to_train == 4
    assert all(math.isclose(p, s, rel_tol=1e-9, abs_tol=1e-12) for p, s in zip(pred.lr, ELASTIC_RESUMED,
                                                                                strict=True)), pred.lr
    found = [f for f in pred.findings if f.rule == "CKD423"]
    assert len(found) == 1 and f"not at {ELASTIC_UNINTERRUPTED:.4g}" in found[0].message
    assert rules(pred) == {"CKD410", "CKD423"} and pred.verdict == "pass"
