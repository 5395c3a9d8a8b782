"""The Python API (``import ckptdoctor``): it reads each root's settings file as the command line does, gives the
command's findings and exit code, and importing it loads neither click nor tabulate."""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptdoctor
from ckptdoctor.cli import main
from ckptdoctor.errors import UsageError
from tests.helpers.paths import REPO

FIXTURES = REPO / "fixtures"
# A settings file's select or ignore that leaves security rules out warns (UserWarning): expected in these tests.
pytestmark = pytest.mark.filterwarnings("ignore:ckptdoctor.*may not turn off:UserWarning")
# A pickle whose loading would call os.system: CKD601, a security error.
EVIL = b"cposix\nsystem\n(S'true'\ntR."


def cli(*args: str) -> tuple[int, list[tuple[str, str, str]], str]:
    """The command's exit code, its findings as (rule, severity, path) and its stderr."""
    result = CliRunner().invoke(main, [*args, "--format", "json"])
    doc = json.loads(result.stdout)
    found = doc["findings"] if "findings" in doc else doc["remaining"]
    return result.exit_code, [(f["rule"], f["severity"], f["path"]) for f in found], result.stderr


def found(findings: tuple[ckptdoctor.Finding, ...]) -> list[tuple[str, str, str]]:
    return [(f.rule, f.severity.value, f.path) for f in findings]


@pytest.fixture
def stubbed(tmp_path: Path) -> Path:
    shutil.copytree(FIXTURES / "stub-shadow", tmp_path / "stub-shadow")
    return tmp_path / "stub-shadow"


@pytest.fixture
def evil(tmp_path: Path) -> Path:
    """A clean run with a malicious training_args.bin and a settings file that came with it asking to hide that."""
    root = tmp_path / "hostile"
    shutil.copytree(FIXTURES / "clean-full", root)
    (root / "checkpoint-8" / "training_args.bin").write_bytes(EVIL)
    (root / ".ckptdoctor.toml").write_text('ignore = ["CKD6"]\nfail-on = "never"\n')
    return root


@pytest.mark.parametrize(
    "settings",
    [
        "",
        'fail-on = "never"\n',
        'ignore = ["CKD201"]\n',
        '[severity]\nCKD201 = "warning"\n',
        'fail-on = "warning"\n[severity]\nCKD201 = "warning"\n',
        'select = ["CKD1"]\n',
    ],
)
def test_scan_reads_the_settings_file_as_the_command_line_does(stubbed: Path, settings: str) -> None:
    if settings:
        (stubbed / ".ckptdoctor.toml").write_text(settings)
    report = ckptdoctor.scan(stubbed)
    code, cli_found, _ = cli("scan", str(stubbed))
    assert found(report.findings) == cli_found
    assert report.exit_code() == code
    assert ckptdoctor.scan(stubbed, no_config=True).exit_code() == cli("scan", "--no-config", str(stubbed))[0] == 1


def test_options_override_the_settings_file_as_on_the_command_line(stubbed: Path) -> None:
    (stubbed / ".ckptdoctor.toml").write_text('fail-on = "never"\n')
    report = ckptdoctor.scan(stubbed, fail_on="error", ignore="CKD1")
    code, cli_found, _ = cli("scan", "--fail-on", "error", "--ignore", "CKD1", str(stubbed))
    assert (found(report.findings), report.exit_code()) == (cli_found, code) and code == 1
    assert report.exit_code("never") == 0  # an explicit fail-on judges the findings alone


def test_each_root_is_judged_by_its_own_settings_file(stubbed: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(stubbed, other)
    (stubbed / ".ckptdoctor.toml").write_text('fail-on = "never"\n')
    report = ckptdoctor.scan([stubbed, other])
    code, cli_found, _ = cli("scan", str(stubbed), str(other))
    assert found(report.findings) == cli_found and report.exit_code() == code == 1
    only_quiet = ckptdoctor.scan([stubbed])
    assert only_quiet.findings and only_quiet.exit_code() == cli("scan", str(stubbed))[0] == 0


def test_a_settings_file_cannot_hide_a_security_error(evil: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = ckptdoctor.scan(evil)
    code, cli_found, err = cli("scan", str(evil))
    assert ("CKD601", "error", "checkpoint-8/training_args.bin") in cli_found
    assert found(report.findings) == cli_found and report.exit_code() == code == 1
    assert 'security errors fail the scan even with fail-on = "never"' in err
    assert "may not turn off or lower security rules" in err and "--ignore" in err
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "ignore=[...]" in said[0] and "--ignore" not in said[0]
    assert caught[0].filename == __file__  # the warning points at the caller, not into ckptdoctor
    heard: list[tuple[str, tuple[str, ...]]] = []
    ckptdoctor.scan(evil, on_kept=lambda source, codes: heard.append((source, tuple(codes))))
    assert heard and heard[0][0].endswith(".ckptdoctor.toml") and "CKD601" in heard[0][1]
    assert ckptdoctor.scan(evil, ignore=["CKD601"]).exit_code() == cli("scan", "--ignore", "CKD601",
                                                                            str(evil))[0]


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({"select": ["CKD999"]}, "--select CKD999: no rule code starts with 'CKD999'"),
        ({"select": [""]}, "--select was given no rule code"),
        ({"select": ["CKD407"]}, "`ckptdoctor gate` runs CKD407"),
        ({"fail_on": "sometimes"}, "fail_on must be one of"),
        ({"checksums": "write"}, "--checksums write needs --deep"),
    ],
)
def test_what_the_command_line_exits_2_for_is_a_usage_error(
    stubbed: Path, kwargs: dict[str, object], says: str
) -> None:
    with pytest.raises(UsageError, match=re.escape(says)):
        ckptdoctor.scan(stubbed, **kwargs)  # type: ignore[arg-type]


def test_a_bad_settings_file_is_a_usage_error_as_on_the_command_line(stubbed: Path) -> None:
    (stubbed / ".ckptdoctor.toml").write_text('select = ["CKD9"]\n')
    with pytest.raises(UsageError, match="select CKD9: no rule code starts with"):
        ckptdoctor.scan(stubbed)
    result = CliRunner().invoke(main, ["scan", str(stubbed)])
    assert result.exit_code == 2 and "select CKD9: no rule code starts with" in result.stderr


def test_fix_gives_the_command_line_exit_code(stubbed: Path, tmp_path: Path) -> None:
    twin = tmp_path / "twin"
    shutil.copytree(stubbed, twin)
    dry = ckptdoctor.fix(stubbed, dry_run=True)
    code, cli_found, _ = cli("fix", "--dry-run", str(twin))
    assert dry.exit_code() == code == 1 and found(dry.remaining) == cli_found
    result = ckptdoctor.fix(stubbed, force=True)
    code, cli_found, _ = cli("fix", "--force", str(twin))
    assert result.exit_code() == code and found(result.remaining) == cli_found
    txid = result.txids[0]
    assert txid is not None
    journal, restored = ckptdoctor.undo(str(stubbed), txid)
    assert journal.txid == txid and restored >= 1


def test_fix_keeps_a_security_error_failing_under_a_settings_files_never(evil: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dry = ckptdoctor.fix(evil, dry_run=True)
    code, _, err = cli("fix", "--dry-run", str(evil))
    assert dry.exit_code() == code == 1 and 'security errors fail the scan even with fail-on = "never"' in err


def test_the_api_names() -> None:
    assert set(ckptdoctor.__all__) == {"scan", "scan_many", "iter_scan", "gate", "fix", "undo", "Finding", "Severity",
                                       "Report", "GateResult", "Selection", "ScanStream", "ScannedPart",
                                       "__version__"}
    importlib.import_module("ckptdoctor.resume_gate")  # the package must not replace the function `ckptdoctor.gate`

    assert callable(ckptdoctor.gate) and ckptdoctor.gate.__module__ == "ckptdoctor.resume_gate.api"
    for name in ckptdoctor.__all__:
        assert getattr(ckptdoctor, name) is not None and name in dir(ckptdoctor)
    with pytest.raises(AttributeError):
        ckptdoctor.nothing  # noqa: B018


def test_importing_the_api_loads_neither_click_nor_tabulate() -> None:
    code = (
        "import sys, ckptdoctor; ckptdoctor.scan, ckptdoctor.gate, ckptdoctor.fix, ckptdoctor.undo, ckptdoctor.Report; "
        "print(sorted(m for m in sys.modules if m.startswith(('ckptdoctor', 'click', 'tabulate'))))"
    )
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    loaded = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    # importlib.import_module (how the API's names are imported) is not timed: sys.modules tells what was imported
    assert "ckptdoctor.api" in proc.stdout and "ckptdoctor.settings" in loaded
    assert "'click" not in proc.stdout and "'tabulate" not in proc.stdout
    heavy = sorted(m for m in loaded if m.split(".")[0] in ("click", "tabulate", "torch", "numpy"))
    assert not heavy, heavy
