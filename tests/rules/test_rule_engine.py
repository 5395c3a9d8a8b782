"""One rule engine for scan and gate rules (``rules.evaluate``): a rule that raises is reported as an internal error
finding and every other rule still runs, in a scan and in a gate alike; the gate then fails (the finding is an
error), since a gate that could not judge must not pass a resume."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

import ckptdoctor
from ckptdoctor.rules import _REGISTRY, Hit, all_rules, get_rule
from tests.helpers.paths import REPO

FIXTURES = REPO / "fixtures"


def _broken(_: Any) -> Iterator[Hit]:
    raise RuntimeError("boom")


def _break(monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    r = get_rule(code)
    assert r is not None
    monkeypatch.setitem(_REGISTRY, code, dataclasses.replace(r, func=_broken))


def test_a_crashing_scan_rule_is_reported_and_the_others_run(monkeypatch: pytest.MonkeyPatch) -> None:
    before = ckptdoctor.scan(FIXTURES / "interrupted-save", no_config=True)
    assert "CKD102" in {f.rule for f in before.findings}
    other = next(r.code for r in all_rules() if not r.gate_only and not r.deep_only and r.code != "CKD102")
    _break(monkeypatch, other)
    after = ckptdoctor.scan(FIXTURES / "interrupted-save", no_config=True)
    crashed = [f for f in after.findings if f.rule == other]
    assert [(f.path, f.severity.value, f.message) for f in crashed] == [
        (".", "error", f"internal error in rule {other}: RuntimeError: boom")
    ]
    assert "CKD102" in {f.rule for f in after.findings}


def test_a_crashing_gate_rule_is_reported_the_others_run_and_the_gate_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ckptdoctor.gate(FIXTURES / "clean-full", config=False).verdict == "pass"
    before = ckptdoctor.gate(FIXTURES / "lr-finished", config=False)
    assert [f.rule for f in before.findings] == ["CKD407"]
    crashing = next(r.code for r in all_rules() if r.gate_only and r.code != "CKD407")
    _break(monkeypatch, crashing)
    clean = ckptdoctor.gate(FIXTURES / "clean-full", config=False)
    assert [(f.rule, f.path, f.severity.value, f.message) for f in clean.findings] == [
        (crashing, ".", "error", f"internal error in rule {crashing}: RuntimeError: boom")
    ]
    assert clean.verdict == "fail" and clean.exit_code == 1
    after = ckptdoctor.gate(FIXTURES / "lr-finished", config=False)
    assert {f.rule for f in after.findings} == {"CKD407", crashing}  # the other gate rules still judged
