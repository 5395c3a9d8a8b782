"""Any JSON a `trainer_state.json` can hold is scanned and reported without a traceback (principle 4).

The Trainer writes plain numbers, but the file is JSON: an integer past float range, NaN, a string or a nested list
where a number belongs must come out as findings, never as an exception from a rule or a renderer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from ckptdoctor.render.report import render_json, render_text
from ckptdoctor.render.sarif import render_github, render_sarif
from ckptdoctor.scanner import scan
from tests.helpers.cli import copy_fixture

FIELDS = ("global_step", "max_steps", "num_train_epochs", "epoch", "train_batch_size", "save_steps", "logging_steps",
          "best_model_checkpoint", "best_metric", "best_global_step")
ENTRY_FIELDS = ("step", "loss", "learning_rate", "epoch", "grad_norm", "train_loss")

_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.just(10**400), st.just(-(10**400)),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), st.just("checkpoint-999"),
)
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                              max_size=3), max_leaves=6)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_fixture("lr-finished", tmp_path_factory.mktemp("hostile-state") / "run")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(top={"num_train_epochs": 10**400, "epoch": -(10**400)}, entry={"learning_rate": 10**400}, where=0)
@example(top={"max_steps": float("nan"), "global_step": 10**400}, entry={"loss": [1]}, where=1)
@given(
    top=st.dictionaries(st.sampled_from(FIELDS), _VALUES, max_size=4),
    entry=st.dictionaries(st.sampled_from(ENTRY_FIELDS), _VALUES, max_size=4),
    where=st.integers(0, 3),
)
def test_any_trainer_state_values_scan_and_render(
    base: Path, tmp_path: Path, top: dict[str, Any], entry: dict[str, Any], where: int
) -> None:
    run = tmp_path / "run"
    if run.exists():
        shutil.rmtree(run)
    shutil.copytree(base, run)
    state = run / "checkpoint-8" / "trainer_state.json"
    doc = json.loads(state.read_text())
    doc.update(top)
    history = doc["log_history"]
    if history:
        history[where % len(history)].update(entry)
    state.write_text(json.dumps(doc, indent=2))  # NaN and Infinity as json.dumps writes them, as the Trainer would
    report = scan(str(run))
    findings = report.findings
    assert not [f for f in findings if "internal error" in f.message], findings  # a rule that raised
    assert render_text(report) and render_json(report) and render_sarif(findings) is not None
    render_github(findings)


def test_a_valid_state_over_the_size_limit_is_unread_not_invalid(tmp_path: Path) -> None:
    """A `trainer_state.json` past `Limits.json_bytes` is valid JSON that `json.load` reads: the scan says it was not
    read (CKD001), never "not valid JSON" (CKD402), and the gate says it cannot predict the steps (CKD412), never that
    train() raises (CKD413). Issue 26 found both claims false."""
    import ckptdoctor
    from ckptdoctor.limits import DEFAULT_LIMITS

    run = copy_fixture("lr-finished", tmp_path / "run")
    state = run / "checkpoint-8" / "trainer_state.json"
    text = state.read_text()
    json.loads(text)
    with open(state, "ab") as f:  # JSON allows any whitespace after the value: still valid, now over the limit
        chunk = b" " * (1 << 20)
        while f.tell() <= DEFAULT_LIMITS.json_bytes:
            f.write(chunk)
    report = scan(str(run))
    at = [(f.rule, f.message) for f in report.findings if f.path == "checkpoint-8/trainer_state.json"]
    assert [r for r, _ in at] == ["CKD001"] and "limit; not read" in at[0][1], at
    result = ckptdoctor.gate(run, max_steps=16)
    rules = {f.rule: f.message for f in result.findings}
    assert "CKD413" not in rules and "CKD402" not in rules, rules
    assert "`trainer_state.json` was not read" in rules["CKD412"] and "not predicted" in rules["CKD412"]
    assert result.start_step is None and result.lr == ()
