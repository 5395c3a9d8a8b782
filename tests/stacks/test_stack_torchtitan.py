"""torchtitan's checkpoint folders, written by real ``torch.distributed.checkpoint.save`` calls on two gloo ranks in
torchtitan 0.3.0's layout (``tests/stacks/titan_run.py``), resumed the way ``CheckpointManager.load`` resumes, and
scanned.

Each hazard is proved twice: the resume (``_find_load_step`` + ``dcp.load``) does what the finding says, and the
scan reports it at the folder at fault; the clean runs raise no error or warning.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.paths import REPO

pytest.importorskip("torch")

from ckptdoctor.findings import Finding, Severity
from ckptdoctor.model import Stack
from ckptdoctor.scanner import scan

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).with_name("titan_run.py")

# (name, how it is written: steps, interval, last_save_model_only, the dataloader world size it records)
WRITES: dict[str, dict[str, Any]] = {
    "full": {"steps": 6, "interval": 2, "last_save_model_only": False},
    "model-only": {"steps": 6, "interval": 2},  # torchtitan's default: the final step holds the model alone
    "loader-world-4": {"steps": 4, "interval": 2, "last_save_model_only": False, "loader_world": 4},
}


def _run(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, str(SCRIPT), *args], check=True, env=env, timeout=600)


def _damage(root: Path) -> dict[str, Path]:
    """Copies of the written runs, each with one thing changed as it happens in real runs."""
    out: dict[str, Path] = {name: root / name for name in WRITES}
    steps = lambda name: root / name / "checkpoint"  # noqa: E731
    # preempted while saving step-6: the ranks wrote their data, the coordinator never wrote `.metadata`
    shutil.copytree(root / "full", root / "torn-newest")
    (steps("torn-newest") / "step-6" / ".metadata").unlink()
    out["torn-newest"] = root / "torn-newest"
    # rank 1's node-local file never copied; another copy with it cut short
    shutil.copytree(root / "full", root / "lost-rank")
    (steps("lost-rank") / "step-6" / "__1_0.distcp").unlink()
    out["lost-rank"] = root / "lost-rank"
    shutil.copytree(root / "full", root / "cut-rank")
    cut = steps("cut-rank") / "step-6" / "__1_0.distcp"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    out["cut-rank"] = root / "cut-rank"
    # step-4's folder renamed into place as the newest
    shutil.copytree(root / "full", root / "renamed")
    shutil.rmtree(steps("renamed") / "step-6")
    (steps("renamed") / "step-4").rename(steps("renamed") / "step-8")
    out["renamed"] = root / "renamed"
    return out


@pytest.fixture(scope="module")
def titan(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Path], dict[str, dict[str, Any]]]:
    """The runs (by name) and what resuming each did (``titan_run.py resume``), with the default world size 2 and,
    for ``model-only@4``, ``full@dp4``, ``full@7``, the planned data-parallel degree or step given."""
    root = tmp_path_factory.mktemp("titan")
    jobs = [{"root": str(root / name), **spec} for name, spec in WRITES.items()]
    (root / "write.json").write_text(json.dumps(jobs))
    _run("write", str(root / "write.json"))
    runs = _damage(root)
    resumes = {name: {"root": str(path)} for name, path in runs.items()}
    resumes["model-only@4"] = {"root": str(runs["model-only"]), "load_step": 4}
    resumes["full@dp4"] = {"root": str(runs["full"]), "world": 4}
    resumes["full@7"] = {"root": str(runs["full"]), "load_step": 7}
    (root / "resume.json").write_text(json.dumps(list(resumes.values())))
    _run("resume", str(root / "resume.json"), str(root / "results.json"))
    results = json.loads((root / "results.json").read_text())
    return runs, dict(zip(resumes, results, strict=True))


def _findings(path: Path) -> list[Finding]:
    return list(scan(str(path)).findings)


def _codes(findings: list[Finding], at_least: Severity = Severity.INFO) -> set[tuple[str, str]]:
    return {(f.rule, f.path) for f in findings if f.severity.rank >= at_least.rank}


def test_clean_runs_are_torchtitan_runs_without_alarm(titan: Any) -> None:
    runs, resumed = titan
    assert resumed["full"] == {"load_step": 6, "train_state_step": 6, "last_epoch": 6}
    for name in ("full", "loader-world-4"):
        report = scan(str(runs[name]))
        (run,) = report.trees[0].runs
        assert run.stack is Stack.TORCHTITAN and run.path == "checkpoint"
        assert [ck.step for ck in run.checkpoints] == [2, 4, 6][: len(run.checkpoints)]
        assert {ck.stack for ck in run.checkpoints} == {Stack.TORCHTITAN}
        assert not [f for f in report.findings if f.severity.rank >= Severity.WARNING.rank and name == "full"]
    # the checkpoint folder itself, and one step folder given directly
    assert not _findings(runs["full"] / "checkpoint")
    assert not _findings(runs["full"] / "checkpoint" / "step-4")
    assert scan(str(runs["full"] / "checkpoint" / "step-4")).trees[0].runs[0].stack is Stack.TORCHTITAN


def test_json_report_names_the_stack(titan: Any) -> None:
    from ckptdoctor.render.report import to_json

    runs, _ = titan
    doc = to_json(scan(str(runs["full"])))
    (run,) = doc["runs"]
    assert run["stack"] == "torchtitan"
    assert [c["stack"] for c in run["checkpoints"]] == ["torchtitan"] * 3
    assert run["checkpoints"][0]["kinds"] == ["dcp", "optimizer", "scheduler", "dataloader", "train-state"]


def test_step_without_metadata_falls_back_silently(titan: Any) -> None:
    runs, resumed = titan
    assert resumed["torn-newest"]["load_step"] == 4 and "error" not in resumed["torn-newest"]
    found = _findings(runs["torn-newest"])
    (hit,) = [f for f in found if f.rule == "CKD510"]
    assert hit.path == "checkpoint/step-6" and hit.severity is Severity.ERROR
    assert "`_find_load_step` skips it and `load()` resumes from `step-4`, 2 steps earlier" in hit.message
    assert _codes(found, Severity.WARNING) == {("CKD510", "checkpoint/step-6")}


def test_missing_or_cut_rank_file_from_the_run_folder(titan: Any) -> None:
    runs, resumed = titan
    for name in ("lost-rank", "cut-rank"):
        assert "error" in resumed[name], resumed[name]
        found = _findings(runs[name])
        assert ("CKD501", "checkpoint/step-6/__1_0.distcp") in _codes(found, Severity.ERROR), found


def test_model_only_final_step(titan: Any) -> None:
    runs, resumed = titan
    err = resumed["model-only"]["error"]
    assert "Missing key in checkpoint state_dict" in err
    assert resumed["model-only@4"]["train_state_step"] == 4  # the previous full save resumes
    found = _findings(runs["model-only"])
    (hit,) = [f for f in found if f.rule == "CKD511"]
    assert hit.path == "checkpoint/step-6" and hit.severity is Severity.INFO
    assert "`optimizer`, `lr_scheduler`, `dataloader`, `train_state`" in hit.message
    assert not _codes(found, Severity.WARNING)  # a finished run's default final save is no scan alarm


def test_train_state_step_against_the_folder(titan: Any) -> None:
    runs, resumed = titan
    assert resumed["renamed"]["load_step"] == 8 and resumed["renamed"]["train_state_step"] == 4
    found = _findings(runs["renamed"])
    (hit,) = [f for f in found if f.rule == "CKD512"]
    assert hit.path == "checkpoint/step-8" and hit.severity is Severity.ERROR
    assert "`train_state.step` is 4 but the folder is `step-8`" in hit.message


def test_dataloader_ranks_against_the_world_size(titan: Any) -> None:
    runs, resumed = titan
    assert "dp_degree is inconsistent" in resumed["full@dp4"]["error"]
    found = _findings(runs["loader-world-4"])
    hits = [f for f in found if f.rule == "CKD513"]
    assert {f.path for f in hits} == {"checkpoint/step-2", "checkpoint/step-4"}
    assert "missing dp rank(s) 2, 3" in hits[0].message


# ---------------------------------------------------------------------------------------------------------------
# `ckptdoctor gate` follows `CheckpointManager.load()`: each verdict next to what the resume above did


def _gate(path: Path, **planned: Any) -> Any:
    from ckptdoctor.resume_gate.api import gate

    return gate(path, config=False, **planned)


def test_gate_predicts_the_step_load_takes(titan: Any) -> None:
    runs, resumed = titan
    r = _gate(runs["full"], max_steps=10, world_size=2)
    assert not r.failed, r.findings
    assert r.checkpoint.endswith("checkpoint/step-6") and r.weights_branch == "dcp"
    assert r.start_step == resumed["full"]["train_state_step"] == 6 and r.steps_to_train == 4
    assert r.to_json()["weights_file"] == "dcp.load: model, optimizer, lr_scheduler, dataloader, train_state"


def test_gate_fails_where_load_raises(titan: Any) -> None:
    runs, resumed = titan
    cases = {  # the run, the plan, what the real resume did
        "model-only": (runs["model-only"], {}, "Missing key in checkpoint state_dict"),
        "full@dp4": (runs["full"], {"world_size": 4}, "dp_degree is inconsistent"),
        "full@7": (runs["full"], {"load_step": 7}, "--checkpoint.load_step=7 not found"),
        "cut-rank": (runs["cut-rank"], {}, ""),
    }
    for name, (path, planned, raised) in cases.items():
        assert raised in resumed[name]["error"], (name, resumed[name])
        r = _gate(path, **planned)
        assert r.failed, name
        if name != "cut-rank":
            assert any(f.rule == "CKD514" for f in r.findings), (name, r.findings)
        else:  # the scan's CKD501 about the folder loaded is kept
            assert any(f.rule == "CKD501" for f in r.findings), r.findings
    # the previous full save, named: what the real resume loaded
    r = _gate(runs["model-only"], load_step=4)
    assert not r.failed and r.start_step == resumed["model-only@4"]["train_state_step"] == 4


def test_gate_fails_where_load_falls_back(titan: Any) -> None:
    runs, resumed = titan
    r = _gate(runs["torn-newest"])
    assert r.checkpoint.endswith("checkpoint/step-4") and resumed["torn-newest"]["load_step"] == 4
    (hit,) = [f for f in r.findings if f.rule == "CKD514"]
    assert hit.path == "checkpoint/step-6" and "falls back to `step-4`" in hit.message


def test_stack_option_and_the_trainer_gate(titan: Any, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from ckptdoctor.cli import main

    runs, _ = titan
    out = CliRunner().invoke(main, ["gate", str(runs["full"]), "--max-steps", "10", "--load-step", "4"])
    assert out.exit_code == 0, out.output
    assert "train_state.step 4 -> training.steps 10: trains 6" in out.output
    # `--stack trainer` follows the Trainer's resume, which finds no checkpoint-N there
    out = CliRunner().invoke(main, ["gate", str(runs["full"]), "--stack", "trainer"])
    assert out.exit_code == 1 and "CKD413" in out.output
    # `--stack torchtitan` on a folder torchtitan never wrote: load() starts from scratch
    out = CliRunner().invoke(main, ["gate", str(tmp_path), "--stack", "torchtitan"])
    assert out.exit_code == 1 and "CKD514" in out.output
    out = CliRunner().invoke(main, ["gate", str(tmp_path), "--stack", "torchtitan", "--allow-empty"])
    assert out.exit_code == 0, out.output
