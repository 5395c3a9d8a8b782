"""What a demanding user of ruff expects from the scan command line: a root named twice is scanned once, an empty
root fails unless allowed, rules can be named as `explain` names them, and an empty --select is a mistake."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import ckptdoctor
from tests.helpers.cli import copy_fixture, invoke


@pytest.fixture(scope="module")
def stub_roots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return copy_fixture("stub-shadow", tmp_path_factory.mktemp("roots") / "stub-shadow")


def test_a_root_named_twice_is_scanned_once(stub_roots: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(stub_roots.parent)
    once = json.loads(invoke("scan", "--format", "json", "stub-shadow")[1])
    code, out, _ = invoke("scan", "--format", "json", "stub-shadow", "./stub-shadow/", str(stub_roots))
    twice = json.loads(out)
    assert code == 1
    assert twice["summary"]["files"] == once["summary"]["files"]
    assert [f["rule"] for f in twice["findings"]] == [f["rule"] for f in once["findings"]]


def test_an_empty_root_is_an_error_finding_unless_allowed(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    code, out, _ = invoke("scan", "--format", "json", str(tmp_path / "empty"))
    doc = json.loads(out)
    assert code == 1 and doc["summary"]["files"] == 0
    assert [(f["rule"], f["severity"], f["path"]) for f in doc["findings"]] == [("CKD002", "error", ".")]
    code, out, _ = invoke("scan", "--format", "json", "--allow-empty", str(tmp_path / "empty"))
    assert code == 0 and json.loads(out)["findings"] == []


def test_rules_can_be_selected_and_ignored_by_name(stub_roots: Path) -> None:
    by_code = invoke("scan", "--format", "json", "--select", "CKD201", str(stub_roots))
    by_name = invoke("scan", "--format", "json", "--select", "stub-weights-shadow-adapter", str(stub_roots))
    assert by_code[0] == by_name[0] == 1 and json.loads(by_code[1])["findings"] == json.loads(by_name[1])["findings"]
    assert invoke("scan", "--ignore", "Stub-Weights-Shadow-Adapter", str(stub_roots))[0] == 0


def test_a_settings_file_may_name_rules_too(tmp_path: Path) -> None:
    root = copy_fixture("stub-shadow", tmp_path / "run")
    (root / ".ckptdoctor.toml").write_text('ignore = ["stub-weights-shadow-adapter"]\n')
    assert invoke("scan", str(root))[0] == 0


@pytest.mark.parametrize("option", ["--select", "--ignore"])
@pytest.mark.parametrize("value", ["", " , "])
def test_an_empty_selection_is_a_usage_error(stub_roots: Path, option: str, value: str) -> None:
    code, out, err = invoke("scan", option, value, str(stub_roots))
    assert code == 2 and out == "" and f"{option} was given no rule code" in err


def test_rules_json_says_which_rules_only_the_gate_runs() -> None:
    rules = {r["code"]: r for r in json.loads(invoke("rules", "--format", "json")[1])["rules"]}
    assert rules["CKD407"]["gate_only"] is True and rules["CKD201"]["gate_only"] is False


# Roots no command can use, and what each must say it is (issue 26: `gate /dev/null` printed a traceback and exited 1;
# a self-looping link was said not to exist). Every command refuses them at one check, scanner.check_roots.
UNUSABLE = {
    "device": ("/dev/null", "not a folder or a regular file"),
    "fifo": ("fifo", "not a folder or a regular file"),
    "self-loop": ("loop", "a symbolic link loop"),
    "link-cycle": ("a", "a symbolic link loop"),
    "dangling": ("dangling", "a symbolic link to `gone`, which does not exist"),
    "missing": ("typo", "does not exist"),
}


@pytest.fixture
def unusable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "loop").symlink_to("loop")
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    (tmp_path / "dangling").symlink_to("gone")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("command", ["scan", "fix", "undo", "inspect", "gate"])
@pytest.mark.parametrize("kind", sorted(UNUSABLE))
def test_every_command_refuses_an_unusable_root_the_same_way(unusable: Path, command: str, kind: str) -> None:
    root, says = UNUSABLE[kind]
    code, out, err = invoke(command, root)  # a traceback (gate on /dev/null raised ValueError) fails here
    assert code == 2 and out == "", (code, out, err)
    line = err.strip().splitlines()[-1]
    assert line.startswith("Error: Invalid value for ") and f"{root}: {says}" in line, err


def test_the_api_refuses_them_as_the_command_line_does(unusable: Path) -> None:
    with pytest.raises(ValueError, match="not a folder or a regular file"):
        ckptdoctor.gate("/dev/null")
    with pytest.raises(OSError, match="a symbolic link loop"):
        ckptdoctor.scan("loop")
    with pytest.raises(FileNotFoundError, match="which does not exist"):
        ckptdoctor.gate("dangling")
