"""The README and docs/ stay true: every shown `$ ckptdoctor ...` session is rerun, the JSON schema sketch matches
real output, and every --help of the commands in cli/ teaches (help on each option, examples)."""

from __future__ import annotations

import ipaddress
import json
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

from ckptdoctor.cli import main
from tests.helpers.console import HANG_GUARD, environ
from tests.helpers.docs import _age, _normalize

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# `$ ckptdoctor ...` sessions on a run the reference trainer makes, not a shipped fixture: name -> TrainConfig kwargs
TRAINED_RUNS = {
    "runs/my-run": {"num_samples": 16, "per_device_train_batch_size": 4, "num_train_epochs": 2, "learning_rate": 1e-3},
}


def _sessions() -> list[tuple[str, str, str]]:
    """(doc name, command, expected output) of every fenced block that starts with `$ ckptdoctor`."""
    out = []
    for doc in DOCS:
        for block in re.findall(r"```[a-z]*\n(.*?)```", doc.read_text(encoding="utf-8"), re.S):
            first, _, rest = block.partition("\n")
            if first.startswith("$ ckptdoctor "):
                out.append((doc.name, first[2:], rest))
    return out


def test_docs_show_sessions() -> None:
    assert len(_sessions()) >= 4, "the README's and docs/gate.md's example sessions were not found"


@pytest.mark.parametrize(("doc", "command", "expected"), _sessions(), ids=lambda v: str(v)[:60])
def test_shown_session_is_real(doc: str, command: str, expected: str, tmp_path: Path) -> None:
    """Rerun the command in a folder holding copies of what it names; the output must be the one shown."""
    args = command.split()[1:]
    for arg in args:
        name = arg.rstrip("/")
        if name.startswith("docs/examples/"):  # an example tree whose settings files sit above the folder named
            top = "/".join(name.split("/")[:3])
            shutil.copytree(REPO / top, tmp_path / top, copy_function=shutil.copy2, dirs_exist_ok=True)
        elif name.startswith("fixtures/"):
            shutil.copytree(REPO / name, tmp_path / name, copy_function=shutil.copy2)
            _age(tmp_path / name)
        elif name in TRAINED_RUNS:
            from ckptdoctor.reference.train import TrainConfig, train

            train(TrainConfig(output_dir=str(tmp_path / name), **TRAINED_RUNS[name]))  # type: ignore[arg-type]
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor", *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=environ())
    assert proc.returncode in (0, 1), proc.stderr
    assert _normalize(proc.stdout) == _normalize(expected), f"{doc}: `{command}` prints something else now"


def test_readme_json_schema_names_every_key(tmp_path: Path) -> None:
    """The README's sketch of `--format json` names exactly the keys a real report has, at each level."""
    user = tmp_path / "config.toml"
    user.write_text('fail-on = "error"\n')  # a settings file the report lists, changing nothing
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    sketch = readme.split("## JSON report", 1)[1].split("```", 2)[1]
    documented = set(re.findall(r'"([a-z_]+)":', sketch))
    run = shutil.copytree(REPO / "fixtures" / "stub-shadow", tmp_path / "stub-shadow")
    # a pickle global outside the known packages, let through by --allow-global: the report lists it
    (run / "checkpoint-8" / "extra.pkl").write_bytes(pickle.dumps(ipaddress.IPv4Address("10.0.0.1"), protocol=2))
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor", "scan", "--format", "json", "--allow-global",
                           "ipaddress.IPv4Address", str(run)], cwd=REPO, capture_output=True, text=True,
                          timeout=HANG_GUARD, env=environ({"CKPTDOCTOR_USER_CONFIG": str(user)}))  # fmt: skip
    doc = json.loads(proc.stdout)
    assert doc["settings"], "the user configuration was not listed"
    assert doc["allowed_globals"], "the allowance was not listed"
    real = set(doc) | set(doc["summary"])
    for allowed in doc["allowed_globals"]:
        real |= set(allowed)
    for used in doc["settings"]:
        real |= set(used)
    for run_ in doc["runs"]:
        real |= set(run_)
        for ck in run_["checkpoints"]:
            real |= set(ck)
    for finding in doc["findings"]:
        real |= set(finding) | set(finding["fix"] or {})
    assert documented == real


def _commands() -> list[tuple[str, click.Command]]:
    ctx = click.Context(main)
    names = ["scan", "inspect", "rules", "explain", "gate"]  # fix and undo are documented in ckptdoctor/cli/fix.py
    out = [(n, main.get_command(ctx, n)) for n in names]
    return [(n, c) for n, c in out if c is not None]


@pytest.mark.parametrize(("name", "command"), _commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_help_teaches(name: str, command: click.Command) -> None:
    """Each option says what it does, each command shows examples, and the command list is not cut short."""
    for param in command.params:
        if isinstance(param, click.Option) and param.name != "help":
            assert param.help, f"`ckptdoctor {name} {param.opts[0]}` has no help"
    assert command.epilog and "Examples:" in command.epilog, f"`ckptdoctor {name} --help` shows no examples"
    for line in command.epilog.splitlines():
        if line.strip().startswith("ckptdoctor "):
            assert line.split()[1] == name or name in ("rules", "explain"), line
    short = command.get_short_help_str(limit=80)
    assert not short.endswith("..."), f"`ckptdoctor --help` cuts `{name}` short: {short}"


def test_main_help_lists_every_command_with_examples() -> None:
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor", "--help"], capture_output=True, text=True, timeout=60,
                          env=environ())
    assert proc.returncode == 0 and "Examples:" in proc.stdout
    for name in ("scan", "fix", "undo", "gate", "inspect", "rules", "explain"):
        assert re.search(rf"^  {name} ", proc.stdout, re.M), name


def test_readme_counts_of_the_fixture_scan() -> None:
    """The set-up section tells what `ckptdoctor scan fixtures/` reports; it must stay what it reports."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    m = re.search(r"It reports (\d+) errors, (\d+) warnings and (\d+) infos and exits 1", readme)
    assert m, "the README no longer says what `ckptdoctor scan fixtures/` reports"
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor", "scan", "--format", "json", "fixtures/"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env=environ())
    summary = json.loads(proc.stdout)["summary"]
    assert proc.returncode == 1
    assert [summary["error"], summary["warning"], summary["info"]] == [int(g) for g in m.groups()]
