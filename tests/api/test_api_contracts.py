"""Contracts a user review found broken: the Python ``scan()``/``fix()`` APIs fail closed like the command line, a
settings file cannot pass a malicious pickle through ``fix``, ``[severity]`` takes names and prefixes (never
lowering a security rule), settings files linked out of the folder are refused, TERM=dumb, the documented txid.

Every tree is a copy of a shipped fixture (real checkpoints written by the reference trainer); hostile pickles are
the byte strings of ``tests.payloads``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from ckptdoctor.cli import options as cli
from ckptdoctor.findings import Severity
from ckptdoctor.fixer import FixRefused, fix
from ckptdoctor.fixer.journal import new_txid
from ckptdoctor.rules import Selection
from ckptdoctor.scanner import scan
from tests.helpers.cli import copy_fixture, invoke
from tests.helpers.fixing import age, stubs_and_hostile_pickle

NEVER_NOTE = 'security errors fail the scan even with fail-on = "never" in a settings file'


def _hostile_run(tmp_path: Path, settings: str | None = 'fail-on = "never"\n') -> Path:
    """stub-shadow (two stubs the fix quarantines) with a pickle calling posix.system (CKD601) and a settings file."""
    root = stubs_and_hostile_pickle(tmp_path)
    if settings is not None:
        (root / ".ckptdoctor.toml").write_text(settings)
    return age(root)


def _rules(findings: Any) -> dict[str, str]:
    return {f.rule: f.severity.value for f in findings}


# ---------------------------------------------------------------------------------------------------------------
# 1. fix under a settings file's fail-on = "never"


@pytest.mark.parametrize("args", [(), ("--dry-run",), ("--format", "json"), ("--dry-run", "--format", "json")])
def test_fix_does_not_let_a_settings_file_pass_a_malicious_pickle(tmp_path: Path, args: tuple[str, ...]) -> None:
    root = _hostile_run(tmp_path)
    code, out, err = invoke("fix", *args, str(root))
    assert code == 1 and NEVER_NOTE in err
    if "json" in args:
        assert [f["rule"] for f in json.loads(out)["remaining"]] == ["CKD601"]
    assert invoke("scan", str(root))[0] == 1  # fix and scan agree


def test_fail_on_never_on_the_command_line_still_overrides_for_fix(tmp_path: Path) -> None:
    root = _hostile_run(tmp_path)
    code, _, err = invoke("fix", "--fail-on", "never", str(root))  # fixes the stubs; CKD601 stays, by request
    assert code == 0 and NEVER_NOTE not in err
    # Nothing left to change: the dry run's exit is the remaining findings' alone.
    assert invoke("fix", "--dry-run", "--fail-on", "never", str(root))[0] == 0
    code, _, err = invoke("fix", "--dry-run", str(root))
    assert code == 1 and NEVER_NOTE in err


def test_fail_on_never_still_means_never_without_a_security_error(tmp_path: Path) -> None:
    root = copy_fixture("stub-shadow", tmp_path / "run")
    (root / ".ckptdoctor.toml").write_text('fail-on = "never"\n')
    code, _, err = invoke("fix", age(root).as_posix())
    assert code == 0 and NEVER_NOTE not in err


# ---------------------------------------------------------------------------------------------------------------
# 2. scan() fails closed


def test_scan_refuses_a_missing_root(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        scan(str(tmp_path / "nonexist"))
    with pytest.raises(FileNotFoundError):
        scan([copy_fixture("clean-full", tmp_path / "ok"), tmp_path / "nonexist"])  # one bad root of several
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    with pytest.raises(FileNotFoundError):
        scan(tmp_path / "dangling")


def test_scan_refuses_a_fifo_root_without_opening_it(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a folder or a regular file"):
        scan(fifo)  # opening it would block forever


def test_scan_takes_str_pathlike_and_sequences(tmp_path: Path) -> None:
    root = copy_fixture("stub-shadow", tmp_path / "run")
    by_str = scan(str(root))
    assert _rules(scan(root).findings) == _rules(by_str.findings) == {"CKD201": "error"}
    assert [t.root for t in scan([root, str(root / "checkpoint-4")]).trees] == [str(root), str(root / "checkpoint-4")]
    assert scan(root).exit_code() == 1
    with pytest.raises(ValueError, match="no root"):
        scan([])
    with pytest.raises(TypeError, match="bytes"):
        scan([os.fsencode(root)])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("selection", "named"),
    [
        (Selection(select=("CKD999",)), "CKD999"),
        (Selection(select=("unsafe-pickle-glob",)), "unsafe-pickle-glob"),
        (Selection(ignore=("CKD2O1",)), "CKD2O1"),
        (Selection(select=("",)), "''"),
        (Selection(severity={"CKD9": Severity.INFO}), "CKD9"),
    ],
)
def test_scan_refuses_a_selection_that_names_no_rule(tmp_path: Path, selection: Selection, named: str) -> None:
    root = _hostile_run(tmp_path, settings=None)
    with pytest.raises(ValueError, match=re.escape(named)):
        scan(root, selection=selection)


def test_scan_selection_takes_rule_names_and_severity_prefixes(tmp_path: Path) -> None:
    root = _hostile_run(tmp_path, settings=None)
    assert _rules(scan(root, selection=Selection(select=("unsafe-pickle-global",))).findings) == {"CKD601": "error"}
    assert _rules(scan(root, selection=Selection(ignore=("stub-weights-shadow-adapter",))).findings) == {
        "CKD601": "error"
    }
    # The API is the caller's own choice, as the command line is: a prefix reaches every rule it matches.
    lowered = scan(root, selection=Selection(severity={"CKD6": "info", "CKD2": Severity.WARNING}))  # type: ignore[dict-item]
    assert _rules(lowered.findings) == {"CKD601": "info", "CKD201": "warning"}


def test_scan_reads_no_settings_file(tmp_path: Path) -> None:
    root = _hostile_run(tmp_path, settings='ignore = ["CKD2"]\n')
    assert set(_rules(scan(root).findings)) == {"CKD201", "CKD601"}


# ---------------------------------------------------------------------------------------------------------------
# 3. fix() from Python


def test_fix_api_says_a_missing_root_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(FixRefused, match="does not exist"):
        fix(str(tmp_path / "nonexist"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(FixRefused, match="is not a folder"):
        fix(tmp_path / "file")


def test_fix_api_checks_its_selection_before_writing(tmp_path: Path) -> None:
    root = _hostile_run(tmp_path, settings=None)
    with pytest.raises(ValueError, match="CKD999"):
        fix(root, selection=Selection(select=("CKD999",)))
    assert not (root / ".ckptdoctor").exists()
    result = fix(root, selection=Selection(select=("stub-weights-shadow-adapter",)), dry_run=True)
    assert sum(len(p.planned) for p in result.plans) == 2


# ---------------------------------------------------------------------------------------------------------------
# 4. [severity] keys: names and prefixes; security rules stay; settings files linked out of the folder


def _scan_json(root: Path) -> tuple[int, dict[str, str], str]:
    code, out, err = invoke("scan", "--format", "json", str(root))
    doc = json.loads(out) if out else {"findings": []}
    return code, {f["rule"]: f["severity"] for f in doc["findings"]}, err


@pytest.mark.parametrize(
    ("severity", "expected"),
    [
        ('stub-weights-shadow-adapter = "warning"', {"CKD201": "warning"}),
        ('CKD2 = "info"', {"CKD201": "info"}),
        ('ckd = "info"\nCKD201 = "warning"', {"CKD201": "warning"}),  # the more specific key wins
        ('CKD201 = "info"\nCKD2 = "warning"', {"CKD201": "info"}),  # whatever the order
    ],
)
def test_a_severity_key_may_be_a_name_or_a_prefix(tmp_path: Path, severity: str, expected: dict[str, str]) -> None:
    root = copy_fixture("stub-shadow", tmp_path / "run")
    (root / ".ckptdoctor.toml").write_text(f"[severity]\n{severity}\n")
    code, rules, _ = _scan_json(root)
    assert rules == expected and code == (1 if "error" in expected.values() else 0)


@pytest.mark.parametrize("key", ["CKD", "CKD6", "CKD60", "unsafe-pickle-global"])
def test_a_severity_prefix_cannot_lower_a_security_rule(tmp_path: Path, key: str) -> None:
    root = _hostile_run(tmp_path, settings=f'[severity]\n{key} = "info"\n')
    code, rules, err = _scan_json(root)
    assert code == 1 and rules["CKD601"] == "error"
    assert "may not turn off or lower security rules (CKD601" in err
    if key == "CKD":
        assert rules["CKD201"] == "info"  # the rest of the prefix applies


@pytest.mark.parametrize(
    ("severity", "says"),
    [
        ('CKD9 = "info"', "severity CKD9: not a rule code, prefix or name"),
        ('no-such-rule = "info"', "severity no-such-rule: not a rule code, prefix or name"),
        ('CKD601 = "error"\nunsafe-pickle-global = "error"', "names the same rules"),
    ],
)
def test_a_severity_key_that_names_no_rule_is_a_usage_error(tmp_path: Path, severity: str, says: str) -> None:
    root = copy_fixture("stub-shadow", tmp_path / "run")
    (root / ".ckptdoctor.toml").write_text(f"[severity]\n{severity}\n")
    code, out, err = invoke("scan", str(root))
    assert code == 2 and out == "" and says in err


@pytest.mark.parametrize("name", [".ckptdoctor.toml", "pyproject.toml"])
def test_a_settings_file_linked_outside_the_folder_is_refused(tmp_path: Path, name: str) -> None:
    root = copy_fixture("stub-shadow", tmp_path / "run")
    secret = tmp_path / "secret.toml"
    secret.write_text('token = "s3cr3t"\n[tool.ckptdoctor]\nignore = ["CKD2"]\n')
    os.symlink(secret, root / name)
    code, out, err = invoke("scan", str(root))
    assert code == 2 and out == "" and "s3cr3t" not in err
    assert f"{root / name}: a symbolic link to a file outside" in err
    os.unlink(root / name)
    os.symlink("/etc/passwd", root / name)
    code, _, err = invoke("fix", "--dry-run", str(root))
    assert code == 2 and "symbolic link" in err and "root:" not in err
    assert invoke("scan", "--no-config", str(root))[0] == 1  # --no-config does not read it at all


def test_a_settings_file_linked_inside_the_folder_is_read(tmp_path: Path) -> None:
    root = copy_fixture("stub-shadow", tmp_path / "run")
    (root / "settings").mkdir()
    (root / "settings" / "ckptdoctor.toml").write_text('ignore = ["CKD2"]\n')
    os.symlink(Path("settings") / "ckptdoctor.toml", root / ".ckptdoctor.toml")
    assert _scan_json(root)[:2] == (0, {})


# ---------------------------------------------------------------------------------------------------------------
# 5-7. colour, the documented txid, the dry run's would_fix


class _Terminal:
    """A stream that says it is a terminal (what `_use_color` asks of sys.stdout)."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("env", "color"), [({"TERM": "xterm-256color"}, True), ({"TERM": "dumb"}, False), ({"NO_COLOR": "1"}, False)]
)
def test_colour_only_on_a_terminal_that_shows_it(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], color: bool
) -> None:
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.delenv("TERM", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli.use_color(_Terminal()) is color


def test_the_undo_help_shows_a_real_txid(tmp_path: Path) -> None:
    code, out, _ = invoke("undo", "--help")
    shown = re.search(r"--txid (\S+)", out.split("Examples:")[1])
    assert code == 0 and shown is not None
    shape = re.compile(r"\d{8}T\d{6}Z-[0-9a-f]{6}")
    assert shape.fullmatch(new_txid()) and shape.fullmatch(shown.group(1))
    root = copy_fixture("stub-shadow", tmp_path / "run")
    invoke("fix", str(age(root)))
    (txid,) = (p.stem for p in (root / ".ckptdoctor" / "journal").glob("*.json"))
    assert shape.fullmatch(txid)


def test_the_dry_run_json_says_how_many_problems_it_would_fix(tmp_path: Path) -> None:
    root = _hostile_run(tmp_path, settings=None)
    _, text, _ = invoke("fix", "--dry-run", str(root))
    assert "Would fix 2 problems with 2 operations" in text
    _, out, _ = invoke("fix", "--dry-run", "--format", "json", str(root))
    dry = json.loads(out)["summary"]
    assert dry == {"operations": 2, "fixed": 0, "would_fix": 2, "remain": 1}
    _, out, _ = invoke("fix", "--format", "json", str(root))
    real = json.loads(out)["summary"]
    assert real == {"operations": 2, "fixed": 2, "would_fix": None, "remain": 1}
