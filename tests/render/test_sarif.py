"""SARIF 2.1.0 and GitHub annotation rendering of findings, for scan's and gate's findings alike."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from ckptdoctor.findings import Applicability, Finding, FixPlan, Severity
from ckptdoctor.render import sarif
from ckptdoctor.resume_gate import gate
from ckptdoctor.scanner import scan
from tests.helpers.builders import make_run
from tests.helpers.paths import REPO

# The definitions of the OASIS SARIF 2.1.0 schema a ckptdoctor log uses (see its "$comment")
SCHEMA = json.loads((REPO / "tests" / "data" / "sarif-2.1.0-subset.json").read_text(encoding="utf-8"))
_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "integer": (int,), "number": (int, float),
    "boolean": (bool,),
}


def _is(value: object, kind: str) -> bool:
    return isinstance(value, _TYPES[kind]) and (kind == "boolean" or not isinstance(value, bool))


def schema_errors(value: Any, schema: Any, where: str = "$") -> list[str]:
    """Where ``value`` breaks ``schema``: the JSON Schema keywords the SARIF subset uses (draft-07 meaning)."""
    if schema is True:
        return []
    if schema is False:
        return [f"{where}: no such property in SARIF 2.1.0"]
    if "$ref" in schema:
        return schema_errors(value, SCHEMA["definitions"][schema["$ref"].rsplit("/", 1)[-1]], where)
    kind = schema.get("type")
    if kind is not None and not _is(value, kind):
        return [f"{where}: not {kind}"]
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} not one of {schema['enum']}")
    if "anyOf" in schema and all(schema_errors(value, s, where) for s in schema["anyOf"]):
        errors.append(f"{where}: matches none of {schema['anyOf']}")
    if isinstance(value, dict):
        errors += [f"{where}: {key} is required" for key in schema.get("required", ()) if key not in value]
        props, extra = schema.get("properties", {}), schema.get("additionalProperties", True)
        for key, item in value.items():
            errors += schema_errors(item, props.get(key, extra), f"{where}.{key}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{where}: fewer than {schema['minItems']} items")
        if schema.get("uniqueItems") and len({json.dumps(v, sort_keys=True) for v in value}) != len(value):
            errors.append(f"{where}: items repeat")
        for i, item in enumerate(value):
            errors += schema_errors(item, schema.get("items", True), f"{where}[{i}]")
    if _is(value, "number") and not schema.get("minimum", value) <= value <= schema.get("maximum", value):
        errors.append(f"{where}: {value} out of bounds")
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{where}: does not match {schema['pattern']}")
        if schema.get("format") in ("uri", "uri-reference") and (not value or re.search(r"[\s\\]", value)):
            errors.append(f"{where}: not a URI reference")
        if schema.get("format") == "uri" and not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", value):
            errors.append(f"{where}: not an absolute URI")
    return errors


def _validate(doc: dict) -> None:  # type: ignore[type-arg]
    """Valid under the SARIF 2.1.0 schema (the subset), plus what GitHub code scanning needs beyond it: a rule
    index that names the result's rule, and a ``startLine`` wherever a result is anchored to a file."""
    assert schema_errors(doc, SCHEMA) == []
    for run in doc["runs"]:
        rules = run["tool"]["driver"]["rules"]
        for res in run["results"]:
            assert rules[res["ruleIndex"]]["id"] == res["ruleId"]
            assert res["locations"]
            for loc in res["locations"]:
                phys = loc["physicalLocation"]
                assert "region" not in phys or phys["region"]["startLine"] == 1


def test_the_schema_check_rejects_what_the_standard_rejects() -> None:
    f = Finding("CKD102", "incomplete-checkpoint", Severity.ERROR, "ck/a.json", "m", file="ck/a.json")
    good = sarif.to_sarif([f])
    assert schema_errors(good, SCHEMA) == []
    loc = good["runs"][0]["results"][0]["locations"][0]["physicalLocation"]
    for broken, why in (
        ({**loc, "region": {"startLine": 0}}, "out of bounds"),
        ({**loc, "regoin": {"startLine": 1}}, "no such property"),
        ({"region": {"startLine": 1}}, "matches none"),
        ({**loc, "artifactLocation": {"uri": "a b"}}, "not a URI"),
    ):
        doc = json.loads(json.dumps(good))
        doc["runs"][0]["results"][0]["locations"][0]["physicalLocation"] = broken
        assert any(why in e for e in schema_errors(doc, SCHEMA)), broken
    doc = json.loads(json.dumps(good))
    doc["runs"][0]["results"][0]["level"] = "fatal"
    assert schema_errors(doc, SCHEMA)


@pytest.mark.parametrize("golden", ["scan.sarif", "gate.sarif"])
def test_the_shipped_outputs_are_valid_sarif_anchored_to_files(golden: str) -> None:
    """The golden outputs (`scan fixtures/`, `gate fixtures/stale-higher`): valid, and each result with a region
    names a file that exists; a result about a folder as a whole has no region."""
    doc = json.loads((REPO / "tests" / "data" / "output_golden" / golden).read_text(encoding="utf-8"))
    _validate(doc)
    for res in doc["runs"][0]["results"]:
        phys = res["locations"][0]["physicalLocation"]
        path = REPO / phys["artifactLocation"]["uri"]
        assert ("region" in phys) == path.is_file(), (res["ruleId"], str(path))


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


def test_a_folder_finding_points_at_the_file_at_fault(tmp_path: Path) -> None:
    """A cut `trainer_state.json` makes its checkpoint an interrupted save (CKD102, a folder finding): the SARIF
    result points at that file, with a region; a missing one leaves nothing to point at: the folder, no region."""
    out = make_run(tmp_path / "out", steps=(2, 4))
    state = out / "checkpoint-4" / "trainer_state.json"
    state.write_bytes(state.read_bytes()[:40])
    (out / "checkpoint-2" / "trainer_state.json").unlink()
    doc = sarif.to_sarif(scan(str(out)).findings)
    _validate(doc)
    where = {
        r["ruleId"] + " " + r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"].rsplit("/out/", 1)[1]:
        "region" in r["locations"][0]["physicalLocation"]
        for r in doc["runs"][0]["results"] if r["ruleId"] == "CKD102"
    }
    assert where == {"CKD102 checkpoint-4/trainer_state.json": True, "CKD102 checkpoint-2": False}
