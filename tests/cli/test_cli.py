"""The command line: exit codes, the JSON contract, text output, configuration, and the light import path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptdoctor.cli import main
from tests.helpers.builders import make_run
from tests.helpers.paths import REPO


def run(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env=env)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("healthy") / "out")


def _check_schema(doc: dict) -> None:
    assert doc["schema"] == "ckptdoctor.report/1"
    assert isinstance(doc["version"], str)
    assert all(isinstance(r, str) for r in doc["roots"])
    for run_ in doc["runs"]:
        assert isinstance(run_["path"], str)
        assert run_["resume_pick"] is None or isinstance(run_["resume_pick"], str)
        for ck in run_["checkpoints"]:
            assert set(ck) >= {"path", "step", "global_step", "max_steps", "kinds", "files", "bytes", "tensors",
                               "learning_rate"}
            assert isinstance(ck["kinds"], list)
            assert isinstance(ck["files"], int) and isinstance(ck["bytes"], int)
            for key in ("step", "global_step", "max_steps", "tensors"):
                assert ck[key] is None or isinstance(ck[key], int)
            assert ck["learning_rate"] is None or isinstance(ck["learning_rate"], float)
    for f in doc["findings"]:
        assert set(f) >= {"rule", "name", "severity", "path", "message", "fix"}
        assert f["severity"] in ("error", "warning", "info")
        assert "\\" not in f["path"]
        assert f["fix"] is None or f["fix"]["applicability"] in ("safe", "unsafe", "manual")
    s = doc["summary"]
    assert set(s) >= {"error", "warning", "info", "files", "seconds"}


def test_healthy_run_is_clean_and_json_is_the_contract(healthy: Path) -> None:
    code, out = run("scan", "--format", "json", str(healthy))
    doc = json.loads(out)  # nothing but the document on stdout
    _check_schema(doc)
    assert code == 0, doc["findings"]
    assert doc["findings"] == []
    (r,) = doc["runs"]
    assert r["resume_pick"] == "checkpoint-4"
    ck4 = next(c for c in r["checkpoints"] if c["path"] == "checkpoint-4")
    assert ck4["step"] == 4 and ck4["global_step"] == 4 and ck4["max_steps"] == 8
    assert "full" in ck4["kinds"] and ck4["tensors"] == 3
    assert ck4["learning_rate"] == pytest.approx(1e-3 * 4 / 8)


def test_text_output_has_table_and_summary_without_color(healthy: Path) -> None:
    code, out = run("scan", str(healthy), env={"NO_COLOR": "1"})
    assert code == 0
    assert "checkpoint-4" in out and "resume picks" in out
    assert out.strip().splitlines()[-1].startswith("No problems found in")
    assert "\x1b[" not in out


def test_missing_root_is_a_usage_error(tmp_path: Path) -> None:
    code, _ = run("scan", str(tmp_path / "nope"))
    assert code == 2


def test_corrupt_file_is_a_finding_not_a_crash(tmp_path: Path) -> None:
    root = make_run(tmp_path / "out", steps=(2,))
    st = root / "checkpoint-2" / "model.safetensors"
    st.write_bytes(st.read_bytes()[:-10])
    code, out = run("scan", "--format", "json", str(root))
    doc = json.loads(out)
    assert code == 1
    assert any(f["rule"] == "CKD202" and f["path"] == "checkpoint-2/model.safetensors" for f in doc["findings"])
    code, _ = run("scan", "--fail-on", "never", str(root))
    assert code == 0
    code, out = run("scan", "--format", "json", "--ignore", "CKD2,CKD102", str(root))
    assert not [f for f in json.loads(out)["findings"] if f["rule"].startswith("CKD2")]


def test_unknown_rule_code_is_a_usage_error(healthy: Path) -> None:
    code, out = run("scan", "--select", "XYZ", str(healthy))
    assert code == 2 and "XYZ" in out


def test_config_file_selects_rules(tmp_path: Path) -> None:
    root = make_run(tmp_path / "out", steps=(2,))
    (root / "checkpoint-2" / "model.safetensors").write_bytes(b"")
    (root / ".ckptdoctor.toml").write_text('ignore = ["CKD202", "CKD102"]\n')
    code, out = run("scan", "--format", "json", str(root))
    assert code == 0, out
    code, _ = run("scan", "--no-config", str(root))
    assert code == 1
    (root / ".ckptdoctor.toml").write_text('ignore = 3\n')
    code, out = run("scan", str(root))
    assert code == 2 and "ignore" in out


def test_pyproject_table_and_severity_override(tmp_path: Path) -> None:
    root = make_run(tmp_path / "out", steps=(2,))
    (root / "checkpoint-2" / "model.safetensors").write_bytes(b"")
    (root / "pyproject.toml").write_text(
        '[tool.ckptdoctor]\n[tool.ckptdoctor.severity]\nCKD202 = "info"\nCKD102 = "info"\n'
    )
    code, out = run("scan", "--format", "json", str(root))
    sev = {f["rule"]: f["severity"] for f in json.loads(out)["findings"]}
    assert sev.get("CKD202") == "info" and code == 0


def test_scan_path_never_imports_torch_peft_numpy(healthy: Path) -> None:
    code = (
        "import sys, runpy\n"
        "from ckptdoctor.cli import main\n"
        "try:\n"
        f"    main(['scan', '--format', 'json', {str(healthy)!r}])\n"
        "except SystemExit:\n"
        "    pass\n"
        "bad = [m for m in ('torch', 'peft', 'numpy', 'safetensors', 'transformers') if m in sys.modules]\n"
        "print('IMPORTED', bad, file=sys.stderr)\n"
        "sys.exit(3 if bad else 0)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr


def test_python_dash_m_and_version() -> None:
    p = subprocess.run([sys.executable, "-m", "ckptdoctor", "--version"], capture_output=True, text=True)
    assert p.returncode == 0 and "ckptdoctor" in p.stdout


def test_version_builds_no_command() -> None:
    # `--version` is answered before any command's module (options, rendering, the library) is imported
    code = (
        "import sys\n"
        "from ckptdoctor.cli import main\n"
        "try:\n"
        "    main(['--version'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('ckptdoctor.')), file=sys.stderr)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "ckptdoctor, version" in p.stdout, p.stderr
    # (ckptdoctor.version is the package face's one import: a single assignment)
    expected = "['ckptdoctor.cli', 'ckptdoctor.cli.options', 'ckptdoctor.errors', 'ckptdoctor.version']"
    assert p.stderr.strip() == expected, p.stderr


def test_inspect_safetensors_and_pickle(healthy: Path) -> None:
    code, out = run("inspect", "--format", "json", str(healthy / "checkpoint-4" / "model.safetensors"))
    doc = json.loads(out)
    assert code == 0 and doc["kind"] == "safetensors" and len(doc["tensors"]) == 3
    code, out = run("inspect", "--format", "json", str(healthy / "checkpoint-4" / "scheduler.pt"))
    doc = json.loads(out)
    assert doc["kind"] == "torch-zip" and doc["value"]["last_epoch"] == 4
    code, out = run("inspect", str(healthy / "checkpoint-4" / "optimizer.pt"))
    assert "param_groups" in out


def test_inspect_marks_what_the_scan_would_flag_in_a_pickle(tmp_path: Path) -> None:
    """A file looked at on its own must not read as harmless: each global carries the scan's verdict."""
    import torch

    from tests.helpers.payloads import _reducer

    torch.save({"a": _reducer(os.system, ("true",)), "w": torch.zeros(2)}, tmp_path / "evil.pt")
    code, out = run("inspect", "--format", "json", str(tmp_path / "evil.pt"))
    doc = json.loads(out)
    assert code == 0 and doc["verdicts"]["posix.system"] == "dangerous"
    assert doc["verdicts"]["torch._utils._rebuild_tensor_v2"] == "allowed"
    code, out = run("inspect", str(tmp_path / "evil.pt"))
    assert "posix.system [dangerous: CKD601]" in out and "_rebuild_tensor_v2 [" not in out


def test_inspect_gives_each_global_the_scans_verdict_not_its_names(tmp_path: Path) -> None:
    """``inspect`` judges the stream as the scan does: an allowlisted class called with arguments (not a reviewed
    call), and a class proved by its source whose module a resuming process has not imported, are CKD601 there and
    here; a reviewed call (an enum's value lookup) and a named class of a loaded module are allowed in both."""
    from ckptdoctor import scan

    cases = {
        # TrainingArguments is an exact allowlist entry, but only a NEWOBJ of no arguments + BUILD is its rebuild
        "called": (b"\x80\x02ctransformers.training_args\nTrainingArguments\nX\x01\x00\x00\x00o\x85R.",
                   "transformers.training_args.TrainingArguments", "denied"),
        # CALLED_ENUMS: a value lookup, reviewed harmless for any argument
        "enum": (b"\x80\x02ctransformers.trainer_utils\nIntervalStrategy\nX\x05\x00\x00\x00steps\x85R.",
                 "transformers.trainer_utils.IntervalStrategy", "allowed"),
        # a numpy test module: naming the class imports it
        "unloaded": (b"\x80\x02cnumpy.lib.tests.test_shape_base\nTestApplyOverAxes\n0N.",
                     "numpy.lib.tests.test_shape_base.TestApplyOverAxes", "denied"),
        # a class of torch, proved by its source, in a module every resume path has imported
        "named": (b"\x80\x02ctorch.optim.adamw\nAdamW\n0N.", "torch.optim.adamw.AdamW", "allowed"),
    }
    for label, (data, dotted, word) in cases.items():
        (tmp_path / label).mkdir()
        (tmp_path / label / "optimizer.pt").write_bytes(data)
        flagged = [f for f in scan(str(tmp_path / label), no_config=True).findings if f.rule == "CKD601"]
        assert bool(flagged) == (word == "denied"), (label, flagged)
        code, out = run("inspect", "--format", "json", str(tmp_path / label / "optimizer.pt"))
        doc = json.loads(out)
        assert code == 0 and doc["verdicts"][dotted] == word, (label, doc["verdicts"])
        if word == "denied":
            assert doc["why"][dotted] in flagged[0].message, (doc["why"], flagged[0].message)
            code, out = run("inspect", str(tmp_path / label / "optimizer.pt"))
            assert f"{dotted} [not proved harmless as used: CKD601]" in out
    assert "would import `numpy.lib.tests.test_shape_base`" in json.loads(
        run("inspect", "--format", "json", str(tmp_path / "unloaded" / "optimizer.pt"))[1]
    )["why"]["numpy.lib.tests.test_shape_base.TestApplyOverAxes"]


def test_rules_and_explain() -> None:
    code, out = run("rules", "--format", "json")
    assert code == 0 and any(r["code"] == "CKD201" for r in json.loads(out)["rules"])
    code, out = run("explain", "CKD201")
    assert code == 0 and "## Why is this bad?" in out
    code, _ = run("explain", "nope")
    assert code == 2


def test_readme_rule_table_and_test_command_are_current() -> None:
    from ckptdoctor.rules import rules_markdown

    readme = (REPO / "README.md").read_text()
    start, end = "<!-- rules:start -->\n", "<!-- rules:end -->"
    table = readme.split(start, 1)[1].split(end, 1)[0].strip()
    assert table == rules_markdown(), "README rule table is stale: paste `ckptdoctor rules --format markdown`"
    ci = (REPO / ".ci" / "run").read_text()
    command = ci.strip().splitlines()[-1]
    assert command in readme, "README must show the exact test command .ci/run runs"


def test_report_paths_use_forward_slashes(healthy: Path) -> None:
    _, out = run("scan", "--format", "json", str(healthy))
    for r in json.loads(out)["runs"]:
        for ck in r["checkpoints"]:
            assert os.sep == "/" or "\\" not in ck["path"]


def test_scan_sarif_and_github_formats(tmp_path: Path) -> None:
    root = make_run(tmp_path / "out", steps=(2,))
    (root / "checkpoint-2" / "model.safetensors").write_bytes(b"\x00" * 4)
    code, out = run("scan", "--format", "sarif", str(root))
    log = json.loads(out)
    assert code == 1 and log["version"] == "2.1.0"
    rules = {r["ruleId"] for r in log["runs"][0]["results"]}
    assert "CKD202" in rules
    code, out = run("scan", "--format", "github", str(root))
    assert code == 1
    assert any(line.startswith("::error file=") and "CKD202" in line for line in out.splitlines())


def _malicious_checkpoint(root: Path) -> Path:
    """A run whose pytorch_model.bin is a raw pickle that would call os.system when loaded (never loaded here)."""
    run = make_run(root)
    evil = b"cposix\nsystem\n(S'echo owned'\ntR."  # protocol 0: GLOBAL posix system, MARK, STRING, TUPLE, REDUCE
    (run / "checkpoint-4" / "pytorch_model.bin").write_bytes(evil)
    return run


@pytest.mark.parametrize(
    "settings",
    [
        'ignore = ["CKD6"]\n',
        'ignore = ["CKD"]\n',
        'select = ["CKD2"]\n',
        '[severity]\nCKD601 = "info"\n',
    ],
)
def test_a_settings_file_in_the_scanned_folder_cannot_silence_security_rules(tmp_path: Path, settings: str) -> None:
    run = _malicious_checkpoint(tmp_path / "run")
    (run / ".ckptdoctor.toml").write_text(settings)
    result = CliRunner().invoke(main, ["scan", "--format", "json", str(run)])
    found = {(f["rule"], f["severity"]) for f in json.loads(result.stdout)["findings"]}
    assert ("CKD601", "error") in found
    assert result.exit_code == 1
    assert "may not turn off or lower security rules (CKD601" in result.stderr


def test_the_command_line_can_still_turn_a_security_rule_off(tmp_path: Path) -> None:
    run = _malicious_checkpoint(tmp_path / "run")
    (run / ".ckptdoctor.toml").write_text('ignore = ["CKD6"]\n')
    result = CliRunner().invoke(main, ["scan", "--format", "json", "--ignore", "CKD601", str(run)])
    rules = {f["rule"] for f in json.loads(result.stdout)["findings"]}
    assert "CKD601" not in rules


def test_fail_on_never_in_a_settings_file_does_not_pass_a_malicious_pickle(tmp_path: Path) -> None:
    run = _malicious_checkpoint(tmp_path / "run")
    (run / ".ckptdoctor.toml").write_text('fail-on = "never"\n')
    result = CliRunner().invoke(main, ["scan", str(run)])
    assert result.exit_code == 1 and "security errors fail the scan" in result.stderr
    assert CliRunner().invoke(main, ["scan", "--fail-on", "never", str(run)]).exit_code == 0
    (run / "checkpoint-4" / "pytorch_model.bin").unlink()  # without it only ordinary findings: never means never
    assert CliRunner().invoke(main, ["scan", str(run)]).exit_code == 0


def test_the_console_entry_ends_fast_and_says_everything(tmp_path: Path) -> None:
    """`python -m ckptdoctor` (cli.run) ends read-only commands with os._exit once output is flushed: the whole
    report still arrives, with the same exit code as in-process; a command that writes exits normally."""
    fixtures = REPO / "fixtures" / "stub-shadow"
    p = subprocess.run(
        [sys.executable, "-m", "ckptdoctor", "scan", "--format", "json", str(fixtures)], capture_output=True, text=True
    )
    inproc = CliRunner().invoke(main, ["scan", "--format", "json", str(fixtures)])
    assert p.returncode == inproc.exit_code == 1
    assert json.loads(p.stdout)["findings"] == json.loads(inproc.stdout)["findings"]
    # A report of every fixture (tens of KB through the pipe) is whole.
    every = fixtures.parent
    big = subprocess.run(
        [sys.executable, "-m", "ckptdoctor", "scan", "--format", "json", str(every)], capture_output=True, text=True
    )
    whole = CliRunner().invoke(main, ["scan", "--format", "json", str(every)])
    assert json.loads(big.stdout)["findings"] == json.loads(whole.stdout)["findings"]
    run = make_run(tmp_path / "run")
    done = subprocess.run(
        [sys.executable, "-m", "ckptdoctor", "scan", "--deep", "--checksums", "write", str(run)],
        capture_output=True,
        text=True,
    )
    assert done.returncode in (0, 1), done.stderr
    assert (run / ".ckptdoctor" / "manifest.json").is_file()


def test_an_fsdp_checkpoint_lists_its_optimizer_folder() -> None:
    """FSDP keeps the optimizer in `optimizer_0/`: the resume restores it, so the kinds say so (as gate does)."""
    fixtures = REPO / "fixtures"
    code, out = run("scan", "--format", "json", "--fail-on", "never", str(fixtures / "fsdp"))
    assert code == 0
    kinds = [ck["kinds"] for r in json.loads(out)["runs"] for ck in r["checkpoints"]]
    assert kinds and all("fsdp" in k and "optimizer" in k for k in kinds), kinds
