"""The pre-resume gate: predict what ``trainer.train(resume_from_checkpoint=...)`` will do, and judge it first.

``plan``: what the resume is planned with, and every argument it will use. ``predict``: the pure arithmetic of
transformers' resume path, a frozen ``Prediction`` (no findings, no text). ``rules``: the gate rules (CKD407-415,
CKD504), registered like every other rule and run over a ``ResumeContext``. ``api``: ``gate()`` and its
``GateResult``. ``render/gate.py`` renders a result and ``cli/gate.py`` is the ``ckptdoctor gate`` command: they
import this package, never the reverse.

The names below are loaded on first use: the rule registry imports ``ckptdoctor.resume_gate.rules`` on every scan, which
must not pull in the API (and through it the scanner). ``predict()`` is not among them: it would hide the module.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptdoctor.resume_gate.api import GateResult, gate, judge, rule_selection
    from ckptdoctor.resume_gate.plan import GateInputError, Plan, plan_from_training_args
    from ckptdoctor.resume_gate.predict import Prediction, StepPlan, resume_steps
    from ckptdoctor.resume_gate.resolve import ResolvedArgs, steps_per_epoch_of

_EXPORTS = {
    "GateResult": "api",
    "gate": "api",
    "judge": "api",
    "rule_selection": "api",
    "GateInputError": "plan",
    "Plan": "plan",
    "ResolvedArgs": "resolve",
    "plan_from_training_args": "plan",
    "steps_per_epoch_of": "resolve",
    "Prediction": "predict",
    "StepPlan": "predict",
    "resume_steps": "predict",
}

__all__ = [
    "GateInputError",
    "GateResult",
    "Plan",
    "Prediction",
    "ResolvedArgs",
    "StepPlan",
    "gate",
    "judge",
    "plan_from_training_args",
    "resume_steps",
    "rule_selection",
    "steps_per_epoch_of",
]


def __getattr__(name: str) -> Any:
    """Load an exported name from its module on first use."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
