"""SARIF 2.1.0 and GitHub annotation rendering of findings, for scan's and gate's findings alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptdoctor.findings import Applicability, Finding, FixPlan, Severity
from ckptdoctor.gate import gate
from ckptdoctor.render import sarif
from ckptdoctor.scanner import scan
from tests.builders import make_run

LEVELS = ("none", "note", "warning", "error")


def _text(v: object) -> bool:
    return isinstance(v, dict) and isinstance(v.get("text"), str)


def _validate(doc: dict) -> None:  # type: ignore[type-arg]
    """The parts of the SARIF 2.1.0 schema (OASIS sarif-schema-2.1.0.json) that code-scanning upload relies on."""
    assert doc["version"] == "2.1.0" and doc["$schema"].startswith("https://")
    assert isinstance(doc["runs"], list)
    for run in doc["runs"]:
        driver = run["tool"]["driver"]
        assert isinstance(driver["name"], str)
        rules = driver["rules"]
        for rule in rules:
            assert isinstance(rule["id"], str)
            for key in ("shortDescription", "fullDescription", "help"):
                assert key not in rule or _text(rule[key]), key
            assert rule.get("defaultConfiguration", {}).get("level", "none") in LEVELS
        for res in run["results"]:
            assert isinstance(res["ruleId"], str) and rules[res["ruleIndex"]]["id"] == res["ruleId"]
            assert res["level"] in LEVELS and _text(res["message"])
            assert res["locations"]
            for loc in res["locations"]:
                phys = loc["physicalLocation"]
                assert isinstance(phys["artifactLocation"]["uri"], str) and phys["artifactLocation"]["uri"]
                assert isinstance(phys["region"]["startLine"], int) and phys["region"]["startLine"] >= 1
            assert all(isinstance(v, str) for v in res["partialFingerprints"].values())


@pytest.fixture(scope="module")
def broken_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = make_run(tmp_path_factory.mktemp("sarif") / "out", steps=(2, 4))
    (out / "checkpoint-4" / "scheduler.pt").unlink()  # CKD403
    (out / "checkpoint-2" / "trainer_state.json").unlink()  # CKD102
    return out


def test_scan_findings_render_as_valid_sarif(broken_run: Path) -> None:
    report = scan(str(broken_run))
    assert report.findings
    doc = json.loads(sarif.render_sarif(report.findings))
    _validate(doc)
    results = doc["runs"][0]["results"]
    assert {r["ruleId"] for r in results} >= {"CKD102", "CKD403"}
    assert all(r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"].startswith("file://")
               for r in results)  # the scan root was absolute
    fixed = [r for r in results if r["ruleId"] == "CKD102"]
    assert fixed and fixed[0]["properties"]["applicability"] == "safe"


def test_gate_findings_render_with_their_rule_documents(broken_run: Path) -> None:
    result = gate(broken_run, learning_rate=5e-3)
    doc = sarif.to_sarif(result.findings)
    _validate(doc)
    rules = {r["id"]: r for r in doc["runs"][0]["tool"]["driver"]["rules"]}
    assert "CKD408" in rules and "## Why is this bad?" in rules["CKD408"]["help"]["markdown"]
    assert rules["CKD408"]["properties"]["tags"] == ["checkpoint", "gate"]


def test_relative_paths_and_stable_fingerprints() -> None:
    f = Finding("CKD101", "stale-checkpoint-selected", Severity.ERROR, "checkpoint 12", "msg one", root="runs/a")
    g = Finding("CKD101", "stale-checkpoint-selected", Severity.ERROR, "checkpoint 12", "other text", root="runs/a")
    a, b = sarif.to_sarif([f]), sarif.to_sarif([g])
    _validate(a)
    loc = a["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"]
    assert loc == {"uri": "runs/a/checkpoint%2012", "uriBaseId": "%SRCROOT%"}
    fp = a["runs"][0]["results"][0]["partialFingerprints"]
    assert fp == b["runs"][0]["results"][0]["partialFingerprints"]  # the message does not change the identity
    assert sarif.to_sarif([])["runs"][0]["results"] == []


def test_github_annotations_are_escaped() -> None:
    plan = FixPlan("Quarantine it", Applicability.SAFE)
    f = Finding("CKD102", "incomplete-checkpoint", Severity.WARNING, "ck,1:x", "50% done\nline two", plan, root=".")
    i = Finding("CKD404", "rng-state-missing", Severity.INFO, ".", "no rng", root="out")
    text = sarif.render_github([f, i], notice="resume: ok")
    lines = text.splitlines()
    assert lines == [
        "::notice title=ckptdoctor::resume: ok",
        "::warning file=ck%2C1%3Ax,title=CKD102 incomplete-checkpoint::50%25 done%0Aline two",
        "::notice file=out,title=CKD404 rng-state-missing::no rng",
    ]
