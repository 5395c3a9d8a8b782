"""Rule modules follow code families: a rule's code tells which module of ``ckptdoctor/rules/`` holds it."""

from __future__ import annotations

from ckptdoctor.findings import Applicability
from ckptdoctor.rules import RULE_MODULES, all_rules
from tests.helpers.paths import REPO

RULES_DIR = REPO / "ckptdoctor" / "rules"
# The module of each code family, by the code's first digit (CKD0xx and CKD1xx are both discovery).
FAMILIES = {
    "0": "ckptdoctor.rules.discovery",
    "1": "ckptdoctor.rules.discovery",
    "2": "ckptdoctor.rules.weights",
    "3": "ckptdoctor.rules.adapters",
    "4": "ckptdoctor.rules.training",
    "5": "ckptdoctor.rules.distributed",
    "6": "ckptdoctor.rules.security",
}
# Modules of ckptdoctor/rules/ that are not a code family: the registry, private helpers and the pickle policy (the
# gate-only rules are registered from ckptdoctor/resume_gate/rules.py, whatever their family).
NOT_FAMILIES = {"__init__"}


def test_every_rule_lives_in_its_family_module() -> None:
    misplaced = [
        f"{r.code} is in {r.func.__module__}, expected {FAMILIES.get(r.code[3])}"
        for r in all_rules()
        if not r.gate_only and r.func.__module__ != FAMILIES.get(r.code[3])
    ]
    assert not misplaced, misplaced


def test_the_rule_modules_are_the_families() -> None:
    """Every family module is loaded by the registry, and no other module of rules/ registers scan rules."""
    families = set(FAMILIES.values())
    assert families <= set(RULE_MODULES)
    modules = {f"ckptdoctor.rules.{p.stem}" for p in RULES_DIR.glob("*.py") if p.stem not in NOT_FAMILIES}
    others = {m for m in modules - families if not m.rsplit(".", 1)[1].startswith("_")}
    assert not others, f"rule modules outside the code families: {sorted(others)}"


def test_fix_safety_is_one_type() -> None:
    """A rule's fix is the plans' own Applicability (SAFE or UNSAFE), or None for a rule without a fix."""
    for r in all_rules():
        assert r.fix is None or r.fix in (Applicability.SAFE, Applicability.UNSAFE), (r.code, r.fix)
        assert isinstance(r.fix, (Applicability, type(None))), (r.code, type(r.fix))
