"""`ckptdoctor gate` reads RUN_DIR's settings file as `ckptdoctor scan` reads it: select, ignore and severity apply
to the scan findings and to the gate rules, its fail-on is the default, and it cannot hide a security finding.

Every run is a real checkpoint (torch + safetensors, tests/helpers/builders.py); each test changes one thing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

from ckptdoctor.cli import main
from ckptdoctor.resume_gate import GateInputError, gate
from tests.helpers.builders import make_run
from tests.helpers.payloads import _reducer

WRONG_LR = ("--learning-rate", "1e-2")  # the checkpoint's base LR is 1e-3: CKD409 [error], nothing else


def cli(*args: str) -> Result:
    result = CliRunner().invoke(main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result


def gate_json(*args: str) -> tuple[int, dict[str, Any], set[str]]:
    result = cli("gate", *args, "--format", "json")
    doc: dict[str, Any] = json.loads(result.stdout)
    return result.exit_code, doc, {f["rule"] for f in doc["findings"]}


def outcome(*args: str) -> tuple[int, set[str]]:
    """The exit code and the rules reported of `ckptdoctor gate ARGS --format json`."""
    code, _, rules = gate_json(*args)
    return code, rules


@pytest.fixture(scope="module")
def settings_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An output_dir with checkpoint-4 of an 8-step linear run: the gate passes with the run's own arguments."""
    return make_run(tmp_path_factory.mktemp("settings") / "out", steps=(4,))


@pytest.fixture
def settings_copy(settings_run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(settings_run, out)
    return out


def settings(settings_copy: Path, text: str, name: str = ".ckptdoctor.toml") -> None:
    (settings_copy / name).write_text(text)


def test_without_settings_the_gate_fails_on_the_planned_lr(settings_copy: Path) -> None:
    code, doc, rules = gate_json(str(settings_copy), *WRONG_LR)
    assert (code, doc["verdict"], rules) == (1, "fail", {"CKD409"})


@pytest.mark.parametrize("name", [".ckptdoctor.toml", "pyproject.toml"])
def test_an_ignored_gate_rule_disappears(settings_copy: Path, name: str) -> None:
    table = "" if name == ".ckptdoctor.toml" else "[tool.ckptdoctor]\n"
    settings(settings_copy, table + 'ignore = ["CKD409"]\n', name)
    code, doc, rules = gate_json(str(settings_copy), *WRONG_LR)
    assert (code, doc["verdict"], rules) == (0, "pass", set())
    text = cli("gate", str(settings_copy), *WRONG_LR)
    assert text.exit_code == 0 and "CKD409" not in text.stdout and "Verdict: pass" in text.stdout
    assert gate(settings_copy, learning_rate=1e-2).verdict == "pass"


def test_an_ignored_scan_rule_disappears_from_gate_as_from_scan(settings_copy: Path) -> None:
    # CKD211 corrupt-json [error], a scan finding; json.load takes a repeated key, so the resume does not crash
    (settings_copy / "checkpoint-4" / "config.json").write_text('{"n_embd": 8, "n_embd": 8}')
    assert outcome(str(settings_copy)) == (1, {"CKD211"})
    settings(settings_copy, 'ignore = ["CKD211"]\n')
    assert cli("scan", str(settings_copy)).exit_code == 0
    assert outcome(str(settings_copy)) == (0, set())


def test_select_narrows_the_scan_findings_and_the_gate_rules_still_run(settings_copy: Path) -> None:
    """A select list written for `scan` must not turn the gate's own judgement off: it narrows the scan findings."""
    (settings_copy / "checkpoint-4" / "config.json").write_text('{"n_embd": 8, "n_embd": 8}')  # CKD211, not a crash
    os.remove(settings_copy / "checkpoint-4" / "rng_state.pth")  # CKD404 [info], outside the selection below
    settings(settings_copy, 'select = ["CKD2"]\n')  # scan's weight rules only
    assert outcome(str(settings_copy), *WRONG_LR) == (1, {"CKD211", "CKD409"})
    settings(settings_copy, 'select = ["CKD41", "CKD409"]\n')  # gate rules only: the scan findings go
    assert outcome(str(settings_copy), *WRONG_LR) == (1, {"CKD409"})
    assert outcome(str(settings_copy), *WRONG_LR, "--no-config", "--select", "CKD2") == (1, {"CKD211", "CKD409"})
    settings(settings_copy, 'select = ["CKD2"]\nignore = ["CKD409"]\n')  # ignoring a gate rule does turn it off
    assert outcome(str(settings_copy), *WRONG_LR) == (1, {"CKD211"})


def test_a_severity_override_changes_the_verdict(settings_copy: Path) -> None:
    settings(settings_copy, '[severity]\nCKD409 = "warning"\n')
    code, doc, _ = gate_json(str(settings_copy), *WRONG_LR)
    assert code == 0 and doc["verdict"] == "pass"
    assert [f["severity"] for f in doc["findings"]] == ["warning"]
    os.remove(settings_copy / "checkpoint-4" / "rng_state.pth")  # CKD404 rng-state-missing [info], a scan finding
    settings(settings_copy, '[severity]\nCKD404 = "error"\n')
    code, doc, rules = gate_json(str(settings_copy))
    assert (code, doc["verdict"], rules) == (1, "fail", {"CKD404"})


def test_fail_on_from_the_file_applies_and_the_command_line_overrides_it(settings_copy: Path) -> None:
    settings(settings_copy, 'fail-on = "warning"\n[severity]\nCKD409 = "warning"\n')
    text = cli("gate", str(settings_copy), *WRONG_LR)
    assert text.exit_code == 1 and "Verdict: fail (0 errors, 1 warning, 0 infos; fail-on warning from the settings " \
        "file)" in text.stdout
    assert gate_json(str(settings_copy), *WRONG_LR, "--fail-on", "error")[0] == 0
    result = gate(settings_copy, learning_rate=1e-2)
    assert (result.verdict, result.fail_on, result.exit_code) == ("fail", "warning", 1)
    assert gate(settings_copy, learning_rate=1e-2, fail_on="error").verdict == "pass"


def test_no_config_restores_the_defaults(settings_copy: Path) -> None:
    settings(settings_copy, 'ignore = ["CKD409"]\nfail-on = "never"\n')
    assert gate_json(str(settings_copy), *WRONG_LR)[0] == 0
    code, doc, rules = gate_json(str(settings_copy), *WRONG_LR, "--no-config")
    assert (code, doc["verdict"], rules) == (1, "fail", {"CKD409"})
    assert "--fail-on error" in cli("gate", str(settings_copy), *WRONG_LR, "--no-config").stdout
    assert gate(settings_copy, learning_rate=1e-2, config=False).verdict == "fail"


def test_command_line_select_and_ignore_add_to_the_file(settings_copy: Path) -> None:
    os.remove(settings_copy / "checkpoint-4" / "rng_state.pth")
    settings(settings_copy, '[severity]\nCKD404 = "error"\n')
    assert outcome(str(settings_copy), *WRONG_LR) == (1, {"CKD404", "CKD409"})
    assert outcome(str(settings_copy), *WRONG_LR, "--ignore", "CKD404") == (1, {"CKD409"})
    assert outcome(str(settings_copy), *WRONG_LR, "--ignore", "CKD404,CKD409") == (0, set())
    # no scan finding; gate rules run
    assert outcome(str(settings_copy), *WRONG_LR, "--select", "CKD41") == (1, {"CKD409"})
    result = gate(settings_copy, learning_rate=1e-2, select=["CKD4"], ignore="CKD409")
    assert {f.rule for f in result.findings} == {"CKD404"}


def test_the_file_at_run_dir_counts_not_one_inside_a_checkpoint(settings_copy: Path) -> None:
    settings(settings_copy / "checkpoint-4", 'ignore = ["CKD409"]\n')  # what scan of RUN_DIR ignores too
    assert outcome(str(settings_copy), *WRONG_LR) == (1, {"CKD409"})


@pytest.fixture
def evil_run(settings_copy: Path) -> Path:
    """The run with a `training_args.bin` whose unpickling would call `os.system` (CKD601 [error]), and a
    settings file that came with it asking to hide that."""
    torch.save(_reducer(os.system, ("true",)), settings_copy / "checkpoint-4" / "training_args.bin")
    settings(settings_copy, 'ignore = ["CKD6"]\nfail-on = "never"\n[severity]\nCKD601 = "info"\n')
    return settings_copy


def test_a_settings_file_cannot_hide_a_security_finding(evil_run: Path) -> None:
    result = cli("gate", str(evil_run), "--format", "json")
    doc = json.loads(result.stdout)
    assert result.exit_code == 1 and doc["verdict"] == "fail"
    assert [(f["rule"], f["severity"]) for f in doc["findings"]] == [("CKD601", "error")]
    assert "may not turn off or lower security rules" in result.stderr
    assert 'security errors fail the scan even with fail-on = "never"' in result.stderr
    assert cli("scan", str(evil_run)).exit_code == 1  # the gate agrees with scan
    py = gate(evil_run)
    assert py.verdict == "fail" and py.fail_on == "never" and py.exit_code == 1


def test_the_command_line_can_still_turn_a_security_rule_off(evil_run: Path) -> None:
    assert outcome(str(evil_run), "--ignore", "CKD601") == (0, set())
    code, doc, rules = gate_json(str(evil_run), "--fail-on", "never")
    assert (code, doc["verdict"], rules) == (0, "pass", {"CKD601"})
    assert gate(evil_run, fail_on="never").verdict == "pass"


def test_the_user_configuration_is_trusted_as_the_command_line_is(settings_copy: Path, tmp_path: Path) -> None:
    """The user configuration never travels with a checkpoint: its `fail-on = "never"` passes a security error in
    the gate exactly as it does in a scan (a run folder's own file cannot, above)."""
    torch.save(_reducer(os.system, ("true",)), settings_copy / "checkpoint-4" / "training_args.bin")
    user = tmp_path / "user.toml"
    user.write_text('fail-on = "never"\n')
    env = {"CKPTDOCTOR_USER_CONFIG": str(user)}
    runner = CliRunner()
    scanned = runner.invoke(main, ["scan", str(settings_copy)], env=env)
    gated = runner.invoke(main, ["gate", str(settings_copy), "--format", "json"], env=env)
    assert (scanned.exit_code, gated.exit_code) == (0, 0), (scanned.output, gated.output)
    doc = json.loads(gated.stdout)
    assert doc["verdict"] == "pass" and [f["rule"] for f in doc["findings"]] == ["CKD601"]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("fail-on = \n", "Invalid value"),  # not TOML
        ("select = 5\n", "`select` must be a list"),
        ('ignore = ["CKD999"]\n', "no rule code starts with 'CKD999'"),
        ('[severity]\nCKD9 = "error"\n', "severity CKD9: not a rule code"),
        ('fail-on = "sometimes"\n', "`fail-on` must be"),
        ("colour = true\n", "unknown setting(s) colour"),
    ],
)
def test_a_bad_settings_file_exits_2_with_one_line(settings_copy: Path, text: str, says: str) -> None:
    settings(settings_copy, text)
    result = cli("gate", str(settings_copy))
    assert result.exit_code == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and says in lines[0] and "Traceback" not in lines[0]
    assert cli("gate", str(settings_copy), "--no-config").exit_code == 0
    with pytest.raises(GateInputError, match=r"\.ckptdoctor\.toml"):
        gate(settings_copy)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--select", "CKD209"], "`ckptdoctor scan --deep` runs it, the gate never does"),  # nonfinite-weights
        (["--select", "CKD212,CKD303"], "--select CKD212"),
        (["--select", "CKD9"], "no rule code starts with 'CKD9'"),
        (["--ignore", "bogus"], "--ignore BOGUS"),
    ],
)
def test_selecting_what_the_gate_cannot_run_exits_2(settings_copy: Path, args: list[str], says: str) -> None:
    result = cli("gate", str(settings_copy), *args)
    assert result.exit_code == 2 and says in result.stderr
    codes = args[1:]
    with pytest.raises(GateInputError, match=re.escape(says)):
        gate(settings_copy, select=codes) if args[0] == "--select" else gate(settings_copy, ignore=codes)


def test_a_deep_prefix_that_also_names_scan_rules_is_allowed(settings_copy: Path) -> None:
    assert cli("gate", str(settings_copy), "--select", "CKD2").exit_code == 0  # CKD201-208 run; CKD209 needs --deep


def test_no_checkpoint_finding_follows_the_settings_file(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    assert gate(tmp_path).verdict == "fail"  # CKD413: no checkpoint-N
    settings(tmp_path, '[severity]\nCKD413 = "warning"\n')
    result = gate(tmp_path)
    assert result.verdict == "pass" and [f.severity.value for f in result.findings] == ["warning"]
