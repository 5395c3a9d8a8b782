"""Settings found the way ruff finds them (issue 18, point 3): the closest settings file from each scanned folder
upward, the user configuration when there is none, the security rule for every file found, ``--show-settings``
and the settings files listed in the JSON report. Each through the installed console script."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

import ckptdoctor
from tests.helpers import console
from tests.helpers.fixing import age
from tests.helpers.paths import REPO

EVIL = b"cos\nsystem\n(S'true'\ntR."  # a pickle that calls os.system when loaded: CKD601 [error]


def cli(*args: str, user: Path | None = None) -> tuple[int, dict | str, str]:
    """Run the installed ``ckptdoctor`` script (this checkout on PYTHONPATH); JSON output parsed."""
    proc = console.run(*args, env={"CKPTDOCTOR_USER_CONFIG": str(user or "/nonexistent/user.toml")})
    assert proc.returncode in (0, 1), proc.stderr
    out: dict | str = json.loads(proc.stdout) if "json" in args else proc.stdout
    return proc.returncode, out, proc.stderr


def rules_in(doc: dict, run: str) -> set[str]:
    return {f["rule"] for f in doc["findings"] if f"/{run}/" in f"/{f['path']}/"}


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository holding ``runs/a`` and ``runs/b``: the same two runs (CKD101 [error] and CKD401 [info] each)."""
    for name in ("a", "b"):
        shutil.copytree(REPO / "fixtures" / "stale-higher", tmp_path / "runs" / name)
    return tmp_path


def test_a_file_in_a_run_applies_to_that_run_when_scanning_the_folder_of_runs(repo: Path) -> None:
    (repo / "runs" / "b" / ".ckptdoctor.toml").write_text('ignore = ["CKD101"]\n')
    code, doc, _ = cli("scan", "--format", "json", str(repo / "runs"))
    assert isinstance(doc, dict)
    assert (rules_in(doc, "a"), rules_in(doc, "b")) == ({"CKD101", "CKD401"}, {"CKD401"})
    assert code == 1  # runs/a still has its error
    b = str(repo / "runs" / "b")
    assert doc["settings"] == [
        {"path": f"{b}/.ckptdoctor.toml", "trusted": False,
         "folders": [b, f"{b}/checkpoint-12", f"{b}/checkpoint-4", f"{b}/checkpoint-8"]}
    ]  # fmt: skip


def test_the_repository_pyproject_above_the_root_applies(repo: Path) -> None:
    (repo / "pyproject.toml").write_text('[project]\nname = "x"\n\n[tool.ckptdoctor]\nignore = ["CKD101"]\n')
    (repo / "runs" / "pyproject.toml").write_text('[project]\nname = "y"\n')  # no [tool.ckptdoctor]: not counted
    code, doc, _ = cli("scan", "--format", "json", str(repo / "runs" / "a"))
    assert isinstance(doc, dict)
    assert (code, {f["rule"] for f in doc["findings"]}) == (0, {"CKD401"})
    assert [s["path"] for s in doc["settings"]] == [str(repo / "pyproject.toml")]


def test_the_closest_file_wins_whole_and_nothing_is_merged(repo: Path) -> None:
    (repo / "pyproject.toml").write_text('[tool.ckptdoctor]\nignore = ["CKD101"]\n')
    (repo / "runs" / "b" / ".ckptdoctor.toml").write_text('ignore = ["CKD401"]\nfail-on = "never"\n')
    code, doc, _ = cli("scan", "--format", "json", str(repo / "runs"))
    assert isinstance(doc, dict)
    assert (rules_in(doc, "a"), rules_in(doc, "b")) == ({"CKD401"}, {"CKD101"})
    assert code == 0  # b's error passes under b's own fail-on; a has only an info
    assert [s["path"] for s in doc["settings"]] == [str(repo / "pyproject.toml"), str(repo / "runs/b/.ckptdoctor.toml")]


def test_the_user_configuration_applies_only_when_no_project_file_is_found(repo: Path, tmp_path: Path) -> None:
    user = tmp_path / "user.toml"
    user.write_text('ignore = ["CKD101"]\nallow-globals = ["argparse.Namespace"]\n')
    code, doc, _ = cli("scan", "--format", "json", str(repo / "runs" / "a"), user=user)
    assert isinstance(doc, dict)
    assert (code, {f["rule"] for f in doc["findings"]}) == (0, {"CKD401"})
    assert doc["settings"][0]["path"] == str(user) and doc["settings"][0]["trusted"] is True
    (repo / "runs" / "a" / ".ckptdoctor.toml").write_text('select = ["CKD1"]\n')
    _, doc, _ = cli("scan", "--format", "json", str(repo / "runs" / "a"), user=user)
    assert isinstance(doc, dict)
    assert {f["rule"] for f in doc["findings"]} == {"CKD101"}  # the project file, not the user's ignore


@pytest.fixture
def evil_repo(repo: Path) -> Path:
    (repo / "runs" / "b" / "checkpoint-12" / "evil.pkl").write_bytes(EVIL)
    return repo


HIDE = 'ignore = ["CKD6", "CKD101", "CKD401"]\nfail-on = "never"\n[severity]\nCKD601 = "info"\n'


@pytest.mark.parametrize("where", ["runs/b/.ckptdoctor.toml", "runs/b/checkpoint-12/.ckptdoctor.toml"])
def test_a_file_at_or_below_the_root_cannot_lower_security(evil_repo: Path, where: str) -> None:
    (evil_repo / where).write_text(HIDE)
    code, doc, err = cli("scan", "--format", "json", str(evil_repo / "runs"))
    assert isinstance(doc, dict)
    security = [(f["rule"], f["severity"]) for f in doc["findings"] if f["rule"].startswith("CKD6")]
    assert security == [("CKD601", "error")]
    assert code == 1 and "may not turn off or lower security rules" in err


def test_a_file_above_the_root_cannot_lower_security_either(evil_repo: Path) -> None:
    """Above the root is not the same as the user's: `scan download/checkpoint-12` puts the downloaded run's own
    file above the root. Only the command line and the user configuration may turn a security rule off."""
    (evil_repo / "runs" / "b" / ".ckptdoctor.toml").write_text(HIDE)
    code, doc, err = cli("scan", "--format", "json", str(evil_repo / "runs" / "b" / "checkpoint-12"))
    assert isinstance(doc, dict)
    assert [f["rule"] for f in doc["findings"]] == ["CKD601"] and code == 1
    assert "may not turn off or lower security rules" in err


def test_the_user_configuration_may_turn_a_security_rule_off(evil_repo: Path, tmp_path: Path) -> None:
    user = tmp_path / "user.toml"
    user.write_text(HIDE)
    code, doc, err = cli("scan", "--format", "json", str(evil_repo / "runs" / "b"), user=user)
    assert isinstance(doc, dict)
    assert (code, doc["findings"], err) == (0, [], "")


def test_show_settings_says_which_file_applies_where_and_checks_nothing(evil_repo: Path) -> None:
    (evil_repo / "pyproject.toml").write_text('[tool.ckptdoctor]\nselect = ["CKD1"]\nfail-on = "warning"\n')
    (evil_repo / "runs" / "b" / ".ckptdoctor.toml").write_text(HIDE)
    runs = evil_repo / "runs"
    quarantined = runs / ".ckptdoctor" / "quarantine" / "t1" / "old-run"  # the fixer's folder: skipped, as a scan does
    quarantined.mkdir(parents=True)
    (quarantined / ".ckptdoctor.toml").write_text('ignore = ["CKD1"]\n')
    code, text, _ = cli("scan", "--show-settings", str(runs))
    assert code == 0 and "Found" not in str(text)
    assert str(text).splitlines() == [
        f"{runs}",
        f"  file: {evil_repo}/pyproject.toml [tool.ckptdoctor]",
        "  select: CKD1",
        "  ignore: none",
        "  severity: the catalog defaults",
        "  fail-on: warning (settings file)",
        "  kept on: CKD601, CKD602, CKD603, CKD604, CKD605",
        f"{runs}/b (and below)",
        f"  file: {runs}/b/.ckptdoctor.toml",
        "  select: every rule",
        "  ignore: CKD6, CKD101, CKD401",
        "  severity: the catalog defaults",
        "  fail-on: never (settings file)",
        "  kept on: CKD601, CKD602, CKD603, CKD604, CKD605",
        "",
        "A project file cannot turn off or lower security rules (kept on); --ignore, --fail-on",
        "and the user configuration can.",
    ]
    code, doc, _ = cli("scan", "--show-settings", "--format", "json", "--fail-on", "info", str(runs))
    assert isinstance(doc, dict) and code == 0 and doc["schema"] == "ckptdoctor.settings/1"
    scopes = doc["roots"][0]["scopes"]
    assert [(s["folder"], s["file"], s["fail_on"], s["fail_on_from"]) for s in scopes] == [
        (str(runs), f"{evil_repo}/pyproject.toml", "info", "--fail-on"),
        (f"{runs}/b", f"{runs}/b/.ckptdoctor.toml", "info", "--fail-on"),
    ]
    for command in (["gate"], ["fix", "--dry-run"]):
        code, doc, _ = cli(*command, "--show-settings", "--format", "json", str(runs / "b"))
        assert isinstance(doc, dict) and code == 0
        assert [s["file"] for s in doc["roots"][0]["scopes"]] == [f"{runs}/b/.ckptdoctor.toml"]


def test_show_settings_writes_where_every_output_goes(evil_repo: Path, tmp_path: Path) -> None:
    runs = evil_repo / "runs"
    _, shown, _ = cli("scan", "--show-settings", str(runs))
    for command in (["scan"], ["fix", "--dry-run"], ["gate"]):
        out = tmp_path / "settings.txt"
        code, text, _ = cli(*command, "--show-settings", "-o", str(out), str(runs / "a"))
        assert (code, text) == (0, "") and out.read_text().startswith(f"{runs / 'a'}\n  file: ")
        code, text, _ = cli(*command, "--show-settings", "-s", str(runs / "a"))
        assert (code, text) == (0, "")
    out = tmp_path / "all.txt"
    assert cli("scan", "--show-settings", "--output-file", str(out), str(runs))[:2] == (0, "")
    assert out.read_text() == shown


def test_fix_applies_the_settings_file_of_each_run_below_the_root(tmp_path: Path) -> None:
    """Two interrupted saves (CKD102, fixed by a quarantine); run b's own file ignores CKD102: b is left alone, and
    the rescan agrees with scan."""
    root = tmp_path / "runs"
    for name in ("a", "b"):
        shutil.copytree(REPO / "fixtures" / "interrupted-save", root / name)
    (root / "b" / ".ckptdoctor.toml").write_text('ignore = ["CKD102"]\n')
    age(root)
    code, doc, _ = cli("fix", "--dry-run", "--format", "json", str(root))
    assert isinstance(doc, dict) and code == 1
    assert [op["path"] for r in doc["roots"] for op in r["operations"]] == ["a/checkpoint-8"]
    code, out, _ = cli("fix", str(root))
    assert code == 0 and "Fixed 1 problem, 0 remain." in str(out)
    assert (root / "b" / "checkpoint-8").is_dir() and not (root / "a" / "checkpoint-8").exists()
    assert cli("scan", str(root))[0] == 0  # scan judges it the same


def test_what_a_fix_leaves_in_a_run_is_judged_under_that_runs_file(repo: Path) -> None:
    """CKD101 [error] has only a manual fix, so it remains; run b's file (below the root) says fail-on "never": the
    fix exits as the scan does, and the command line's --fail-on still applies over it."""
    runs = repo / "runs"
    (runs / "b" / ".ckptdoctor.toml").write_text('fail-on = "never"\n')
    age(repo)
    assert cli("fix", "--dry-run", str(runs))[0] == cli("scan", str(runs))[0] == 1  # run a has no file: it fails
    shutil.rmtree(runs / "a")
    assert cli("fix", "--dry-run", str(runs))[0] == cli("scan", str(runs))[0] == 0
    result = ckptdoctor.fix(runs, dry_run=True)
    assert [f.rule for f in result.remaining] == ["CKD101", "CKD401"] and result.exit_code() == 0
    assert cli("fix", "--dry-run", "--fail-on", "error", str(runs))[0] == 1


def test_the_python_api_resolves_settings_as_the_command_line(evil_repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (evil_repo / "pyproject.toml").write_text('[tool.ckptdoctor]\nignore = ["CKD101"]\n')
    (evil_repo / "runs" / "b" / ".ckptdoctor.toml").write_text(HIDE)
    runs = evil_repo / "runs"
    code, doc, _ = cli("scan", "--format", "json", str(runs))
    assert isinstance(doc, dict)
    monkeypatch.setenv("CKPTDOCTOR_USER_CONFIG", "/nonexistent/user.toml")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = ckptdoctor.scan(str(runs))
    assert report.exit_code() == code
    assert [(f.rule, f.path, f.severity.value) for f in report.findings] == [
        (f["rule"], f["path"], f["severity"]) for f in doc["findings"]
    ]
    assert [(u.path, list(u.folders)) for u in report.settings] == [(s["path"], s["folders"]) for s in doc["settings"]]
    assert any("may not turn off or lower security rules" in str(w.message) for w in caught)


def test_a_user_configuration_typo_is_a_usage_error_even_under_a_project_file(repo: Path, tmp_path: Path) -> None:
    user = tmp_path / "user.toml"
    user.write_text('ignroe = ["CKD101"]\n')
    (repo / "runs" / "a" / ".ckptdoctor.toml").write_text('select = ["CKD1"]\n')
    proc = console.run("scan", str(repo / "runs" / "a"), env={"CKPTDOCTOR_USER_CONFIG": str(user)})
    assert proc.returncode == 2 and "unknown setting(s) ignroe" in proc.stderr


def test_gate_and_its_python_api_read_the_repository_file_above_the_run(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (repo / "pyproject.toml").write_text('[tool.ckptdoctor]\nignore = ["CKD101"]\n')
    run = repo / "runs" / "a"
    _, doc, _ = cli("gate", "--format", "json", str(run))
    assert isinstance(doc, dict)
    rules = {f["rule"] for f in doc["findings"]}
    assert "CKD101" not in rules and rules
    monkeypatch.setenv("CKPTDOCTOR_USER_CONFIG", "/nonexistent/user.toml")
    result = ckptdoctor.gate(str(run))
    assert {f.rule for f in result.findings} == rules


def _fleet(tmp_path: Path, n: int, settings: Callable[[int], str]) -> Path:
    """A folder of ``n`` copies of the stale-higher fixture (``r00`` ...), run ``i`` with the settings file
    ``settings(i)``."""
    runs = tmp_path / "runs"
    for i in range(n):
        shutil.copytree(REPO / "fixtures" / "stale-higher", runs / f"r{i:02}")
        (runs / f"r{i:02}" / ".ckptdoctor.toml").write_text(settings(i))
    return runs


def test_a_fleet_with_a_file_in_every_run_resolves_each_file_once_and_judges_each_run_under_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bucket of runs, each with its own settings file, plus one above them all: each run is judged under the
    closest file (its own), the rules run for each run under its own file and the root's only (never under a
    sibling's: that was a rule pass per run already scanned, quadratic in the runs), and each file is read and
    checked once, so a file that may not lower a security rule is said once, not once per later run."""
    import ckptdoctor.scanner as scanner

    n = 12
    # odd runs ignore the stale-checkpoint error, even ones try (and fail) to hide a security rule
    runs = _fleet(tmp_path, n, lambda i: 'ignore = ["CKD101"]\n' if i % 2 else 'ignore = ["CKD601"]\n')
    (runs / ".ckptdoctor.toml").write_text('ignore = ["CKD401"]\n')  # the root's: governs no run (each has its own)
    judged: list[int] = []  # the runs each rule pass judged
    real = scanner.part_findings

    def counted(part: scanner.Part, selection: object) -> object:
        judged.append(len(part.tree.runs))
        return real(part, selection)  # type: ignore[arg-type]

    monkeypatch.setattr(scanner, "part_findings", counted)
    kept: list[tuple[str, tuple[str, ...]]] = []
    report = ckptdoctor.scan(str(runs), on_kept=lambda source, codes: kept.append((source, codes)))
    by_run: dict[str, set[str]] = {}
    for f in report.findings:
        by_run.setdefault(f.path.split("/")[0], set()).add(f.rule)
    assert by_run == {f"r{i:02}": {"CKD401"} if i % 2 else {"CKD101", "CKD401"} for i in range(n)}
    assert sum(judged) == 2 * n  # each run twice: under the root's file, and under its own
    assert sorted(kept) == [(str(runs / f"r{i:02}" / ".ckptdoctor.toml"), ("CKD601",)) for i in range(0, n, 2)]
    used = {u.path: u.folders for u in report.settings}
    assert used.pop(str(runs / ".ckptdoctor.toml")) == (str(runs),)  # the root's own file: the root alone
    assert len(used) == n and all(len(folders) == 4 for folders in used.values())  # a run and its 3 checkpoints


@pytest.mark.parametrize("how", ["fix", "deep"])
def test_fix_and_deep_run_the_rules_once_per_distinct_file_not_once_per_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """``fix`` and ``--deep`` judge a root whole under each settings file below it: the runs of a fleet that hold the
    same file (a team's template) share one rule pass, and each run is still judged under its own file."""
    import ckptdoctor.scanner as scanner

    n = 6
    # two files among six runs: four ignore the stale-checkpoint error, two ignore CKD401
    runs = _fleet(tmp_path, n, lambda i: 'ignore = ["CKD101"]\n' if i % 3 else 'ignore = ["CKD401"]\n')
    whole: list[int] = []  # the rule passes over the whole root
    real = scanner.part_findings

    def counted(part: scanner.Part, selection: object) -> object:
        if len(part.tree.runs) == n:
            whole.append(1)
        return real(part, selection)  # type: ignore[arg-type]

    monkeypatch.setattr(scanner, "part_findings", counted)
    if how == "fix":
        findings = ckptdoctor.fix(str(runs), dry_run=True).remaining
    else:
        findings = ckptdoctor.scan(str(runs), deep=True).findings
    by_run: dict[str, set[str]] = {}
    for f in findings:
        by_run.setdefault(f.path.split("/")[0], set()).add(f.rule)
    assert {r: rules & {"CKD101", "CKD401"} for r, rules in by_run.items()} == {
        f"r{i:02}": {"CKD401"} if i % 3 else {"CKD101"} for i in range(n)
    }
    # --deep: the root's pass and one per distinct file (was n + 1); fix: one per distinct file before its plan and
    # one after it (was 2n)
    assert len(whole) == (4 if how == "fix" else 3)
