"""The rule catalog says every severity a finding can be reported at: the default, and when it changes.

A script that maps rule to severity from `ckptdoctor rules --format json` must not be surprised by a finding. The
engine enforces it for every scan and gate (a hit at an undeclared severity is an internal error), so every test
that scans drives the check; here it is driven over the shipped fixtures and the suite's real checkpoints.
"""

from __future__ import annotations

import inspect
import json
import subprocess

import pytest

import ckptdoctor
from ckptdoctor.findings import Severity
from ckptdoctor.rules import Hit, all_rules, declared, get_rule, rule, rules_markdown
from tests.helpers import console
from tests.helpers.paths import REPO

REAL = [REPO / "fixtures", *sorted((REPO / "tests" / "data").iterdir())]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return console.run(*args)


def test_the_json_catalog_declares_ckd102_escalating_to_error_as_the_fixture_reports_it() -> None:
    doc = json.loads(_cli("rules", "--format", "json").stdout)
    assert doc["schema"] == "ckptdoctor.rules/1" and doc["version"] == ckptdoctor.__version__
    catalog = {r["code"]: r for r in doc["rules"]}
    ckd102 = catalog["CKD102"]
    assert ckd102["severity"] == "warning"
    assert [w["severity"] for w in ckd102["severity_when"]] == ["error"]
    report = json.loads(_cli("scan", "--format", "json", str(REPO / "fixtures" / "interrupted-save")).stdout)
    reported = {(f["rule"], f["severity"]) for f in report["findings"]}
    assert ("CKD102", "error") in reported
    for code, sev in reported:  # every reported severity is one the catalog declares
        entry = catalog[code]
        assert sev in {entry["severity"], *(w["severity"] for w in entry["severity_when"])}, (code, sev)


def test_text_catalog_and_explain_say_when_the_severity_changes() -> None:
    table = _cli("rules").stdout
    assert "warning (error when it is the checkpoint the resume picks" in table
    explained = _cli("explain", "CKD102").stdout
    assert "Reported as error when it is the checkpoint the resume picks" in explained
    assert "| CKD102 | `incomplete-checkpoint` | warning (error when" in rules_markdown()


@pytest.mark.parametrize("deep", [False, True], ids=["scan", "deep"])
def test_no_finding_on_real_checkpoints_has_a_severity_its_catalog_entry_does_not_declare(deep: bool) -> None:
    if deep:
        pytest.importorskip("numpy")
    report = ckptdoctor.scan(REAL, no_config=True, deep=deep)
    assert report.findings
    for f in report.findings:
        r = get_rule(f.rule)
        assert r is not None and f.severity in r.severities, f
        assert "internal error" not in f.message, f


def test_the_gate_reports_only_declared_severities() -> None:
    for run in sorted(p for p in (REPO / "fixtures").iterdir() if p.is_dir()):
        result = ckptdoctor.gate(run, world_size=3, max_steps=4)
        for f in result.findings:
            r = get_rule(f.rule)
            assert r is not None and f.severity in r.severities, f


def test_every_rule_that_chooses_a_severity_declares_it() -> None:
    """A rule whose body names a severity (a literal ``Severity.X``, the discovery rules' ``_severity`` or the
    corrupt-file rules' ``_corrupt_hits``) declares the others in its catalog entry, and only those rules do."""
    choosing = set()
    for r in all_rules():
        body = inspect.getsource(r.func).split('"""', 2)[-1]  # after the docstring: not the decorator
        if "Severity." in body or "_severity(" in body or "_corrupt_hits(" in body:
            choosing.add(r.code)
    varying = {r.code for r in all_rules() if r.severity_when}
    assert choosing == varying == {
        "CKD001", "CKD102", "CKD121", "CKD202", "CKD203", "CKD205", "CKD211", "CKD214", "CKD421", "CKD431", "CKD504",
        "CKD510", "CKD512", "CKD604"
    }
    for r in all_rules():
        assert r.severity not in {sev for sev, _ in r.severity_when}, r.code
        assert all(when and not when.endswith(".") for _, when in r.severity_when), r.code


def test_a_hit_at_an_undeclared_severity_is_a_rule_bug() -> None:
    r = get_rule("CKD104")
    assert r is not None and r.severities == {Severity.WARNING}
    with pytest.raises(ValueError, match="CKD104 reported at error"):
        declared(r, [Hit("checkpoint-8", "x", Severity.ERROR)])
    assert declared(r, [Hit("checkpoint-8", "x")]) == [Hit("checkpoint-8", "x")]
    with pytest.raises(ValueError, match="repeats a severity"):
        rule("CKD999", "x", Severity.ERROR, severity_when=((Severity.ERROR, "always"),))
