"""`ckptdoctor gate` on real checkpoints (torch-written): the step arithmetic, the findings, the CLI contract, and
the pre-commit hook and GitHub Actions example from docs/gate.md run for real."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from ckptdoctor.cli import main
from ckptdoctor.resume_gate import GateInputError, gate, resume_steps, steps_per_epoch_of
from ckptdoctor.rules import all_rules
from ckptdoctor.trainer_view import TrainerStateView
from tests.helpers.builders import make_checkpoint
from tests.helpers.paths import REPO

BIN = Path(sys.executable).parent


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def codes(result: Any) -> set[str]:
    return {f.rule for f in result.findings}


# ---------------------------------------------------------------------------------------------------------------
# Arithmetic


@pytest.mark.parametrize(
    ("g", "upe", "max_steps", "epochs", "skip", "want"),
    [
        (8, 4, -1, 2.0, False, (8, 2, 2, 0)),  # finished, same epochs
        (8, 4, -1, 3.0, False, (12, 3, 2, 4)),  # more epochs
        (6, 4, 6, 0.0, False, (6, 2, 1, 1)),  # finished max_steps run: one step past the end
        (4, 4, 6, 0.0, False, (6, 2, 1, 2)),
        (12, 4, -1, 2.0, False, (8, 2, 3, 0)),  # stale: past the end
        (3, 4, 10, 0.0, False, (10, 3, 0, 7)),
        (3, 4, 10, 0.0, True, (10, 3, 0, 7)),  # data skip does not change the count here (max_steps stops it)
        (5, 4, -1, 2.0, True, (8, 2, 1, 3)),  # ignore_data_skip: the epoch restarts, max_steps still stops it
        (6, 4, -1, 1.5, False, (6, 2, 1, 1)),  # fractional epochs: ceil(1.5 x 4) = 6, loop of 2 epochs
    ],
)
def test_resume_steps(g: int, upe: int, max_steps: int, epochs: float, skip: bool, want: tuple[int, ...]) -> None:
    s = resume_steps(g, upe, max_steps, epochs, skip)
    assert (s.max_steps, s.num_train_epochs, s.epochs_trained, s.steps_to_train) == want


def _state(**kw: Any) -> TrainerStateView:
    base: dict[str, Any] = {"global_step": None, "max_steps": None, "num_train_epochs": None, "epoch": None,
                            "log_history": (), "best_model_checkpoint": None, "best_metric": None,
                            "train_batch_size": None, "save_steps": None, "logging_steps": None, "raw": {},
                            "by_step": {}}
    base.update(kw)
    return TrainerStateView(**base)


@pytest.mark.parametrize(
    ("kw", "want"),
    [
        ({"global_step": 6, "epoch": 1.5, "max_steps": 12, "num_train_epochs": 3}, 4),
        ({"global_step": 1, "epoch": 1 / 3, "max_steps": 9, "num_train_epochs": 3}, 3),
        ({"global_step": 2, "epoch": 0.8, "max_steps": 9, "num_train_epochs": 3}, 3),  # GA remainder: from max/epochs
        ({"global_step": 2, "epoch": 0.8, "max_steps": 10, "num_train_epochs": 3}, None),
        ({"global_step": 0, "epoch": 0.0}, None),
    ],
)
def test_steps_per_epoch_of(kw: dict[str, Any], want: int | None) -> None:
    assert steps_per_epoch_of(_state(**kw)) == want


# ---------------------------------------------------------------------------------------------------------------
# Findings on real checkpoints


def test_midway_resume_continues_and_passes(midway: Path) -> None:
    r = gate(midway)
    assert r.checkpoint == os.path.join(str(midway), "checkpoint-4")
    assert (r.weights_branch, r.start_step, r.max_steps, r.steps_to_train) == ("full", 4, 8, 4)
    assert r.restores_optimizer and r.verdict == "pass"
    assert r.lr == pytest.approx([1e-3 * 4 / 8, 1e-3 * 3 / 8, 1e-3 * 2 / 8, 1e-3 * 1 / 8], rel=1e-12)
    assert r.settings is not None and r.settings.sources["learning_rate"] == "scheduler.pt"


def test_no_checkpoint_at_all(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    r = gate(tmp_path)
    assert r.checkpoint is None and codes(r) == {"CKD413"} and r.verdict == "fail"


def test_torn_checkpoint_would_crash(midway: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(midway, out)
    (out / "checkpoint-4" / "trainer_state.json").unlink()
    r = gate(out)
    assert {"CKD102", "CKD413"} <= codes(r) and r.steps_to_train is None and r.lr == ()
    assert any("FileNotFoundError" in f.message for f in r.findings)


def test_checkpoint_without_weights_would_crash(midway: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(midway, out)
    (out / "checkpoint-4" / "model.safetensors").unlink()
    r = gate(out)
    assert r.weights_branch == "none" and "CKD413" in codes(r)


def test_world_size_from_rank_files(tmp_path: Path) -> None:
    ck = make_checkpoint(tmp_path / "out" / "checkpoint-4")
    os.rename(ck / "rng_state.pth", ck / "rng_state_0.pth")
    shutil.copy(ck / "rng_state_0.pth", ck / "rng_state_1.pth")
    assert "CKD504" not in codes(gate(tmp_path / "out", world_size=2))
    r = gate(tmp_path / "out", world_size=4)
    (f,) = [f for f in r.findings if f.rule == "CKD504"]
    assert f.severity.value == "warning" and "saved by 2 ranks" in f.message


def test_metric_driven_schedule_is_unpredictable(midway: Path) -> None:
    r = gate(midway, lr_scheduler_type="reduce_lr_on_plateau")
    # only the first resumed LR is known: the one optimizer.pt stores
    assert "CKD412" in codes(r) and len(r.lr) == 1 and r.steps_to_train == 4


def test_impossible_schedule_would_crash(midway: Path) -> None:
    r = gate(midway, lr_scheduler_type="polynomial", learning_rate=1e-8)  # lr_end 1e-7 must be below it
    assert "CKD413" in codes(r) and r.verdict == "fail"


def test_missing_optimizer_restarts_schedule(midway: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(midway, out)
    (out / "checkpoint-4" / "optimizer.pt").unlink()
    r = gate(out, learning_rate=2e-3, warmup_steps=2)
    assert "CKD408" in codes(r) and "CKD410" in codes(r) and not r.restores_optimizer
    assert r.lr == pytest.approx([0.0, 1e-3, 2e-3, 2e-3 * 5 / 6])


def test_training_args_file_and_explicit_override(midway: Path, tmp_path: Path) -> None:
    args = {"num_train_epochs": 2, "max_steps": -1, "learning_rate": 1e-3, "warmup_ratio": 0.0}
    r = gate(midway, training_args=args)
    assert r.max_steps == 16 and r.steps_to_train == 12
    r = gate(midway, training_args={**args, "max_steps": 6}, num_train_epochs=3)
    assert r.max_steps == 24  # explicit epochs make it an epoch-based run, whatever the file says


def test_unknown_steps_per_epoch_is_a_usage_error(tmp_path: Path) -> None:
    ck = make_checkpoint(tmp_path / "out" / "checkpoint-3", step=3, max_steps=10)
    state = json.loads((ck / "trainer_state.json").read_text())
    state.update(epoch=0.7, num_train_epochs=3)
    (ck / "trainer_state.json").write_text(json.dumps(state))
    with pytest.raises(GateInputError):
        gate(tmp_path / "out")
    code, out = run("gate", str(tmp_path / "out"))
    assert code == 2 and "--steps-per-epoch" in out
    assert gate(tmp_path / "out", steps_per_epoch=5).steps_to_train == 7


def test_gate_rules_are_documented_and_never_run_by_scan(midway: Path) -> None:
    gate_rules = {r.code for r in all_rules() if r.gate_only}
    assert gate_rules == {"CKD407", "CKD408", "CKD409", "CKD410", "CKD411", "CKD412", "CKD413", "CKD414", "CKD415",
                          "CKD417", "CKD418", "CKD419", "CKD420", "CKD421", "CKD423",
                          "CKD432",  # accelerate's load_state() (ckptdoctor.resume_gate.accelerate)
                          "CKD445", "CKD446", "CKD449",  # Lightning (ckptdoctor.resume_gate.lightning)
                          "CKD504", "CKD514"}
    _, out = run("scan", "--format", "json", str(midway))
    assert not {f["rule"] for f in json.loads(out)["findings"]} & gate_rules


# ---------------------------------------------------------------------------------------------------------------
# Command line


def test_cli_json_contract_and_exit_codes(midway: Path) -> None:
    code, out = run("gate", str(midway), "--format", "json", "--lr-steps", "2")
    doc = json.loads(out)
    assert code == 0
    assert set(doc) >= {"schema", "run", "checkpoint", "weights_branch", "start_step", "max_steps", "steps_to_train",
                        "lr", "verdict", "findings"}
    assert doc["schema"] == "ckptdoctor.gate/1" and doc["verdict"] == "pass" and len(doc["lr"]) == 2
    assert doc["weights_branch"] in ("full", "adapter", "sharded", "fsdp", "deepspeed", "none")
    done = ["--steps-per-epoch", "2", "--num-train-epochs", "2"]  # step 4 of 2 x 2: nothing left
    code, out = run("gate", str(midway), *done, "--format", "json")
    assert code == 1 and json.loads(out)["verdict"] == "fail" and json.loads(out)["steps_to_train"] == 0
    assert run("gate", str(midway), *done, "--fail-on", "never")[0] == 0
    # a max_steps below global_step still trains one step when the epoch has updates left, as the Trainer does
    code, out = run("gate", str(midway), "--max-steps", "3", "--format", "json")
    assert code == 0 and json.loads(out)["steps_to_train"] == 1
    code, out = run("gate", str(midway), "--learning-rate", "1e-2")
    assert code == 1 and "CKD409" in out and "Verdict: fail" in out


@pytest.mark.parametrize(
    "args",
    [
        ["--num-train-epochs", "2", "--max-steps", "4"],
        ["--warmup-steps", "2", "--warmup-ratio", "0.1"],
        ["--lr-scheduler-kwargs", "[1]"],
        ["--checkpoint", "no-such-folder"],
        ["--lr-scheduler-type", "bogus"],
    ],
)
def test_cli_usage_errors_exit_2(midway: Path, args: list[str]) -> None:
    assert run("gate", str(midway), *args)[0] == 2


def test_cli_checkpoint_option_and_github_format(midway: Path) -> None:
    code, out = run("gate", str(midway), "--checkpoint", "checkpoint-2", "--steps-per-epoch", "1",
                    "--num-train-epochs", "2", "--format", "github")
    lines = out.strip().splitlines()
    assert code == 1 and lines[0].startswith("::notice title=ckptdoctor::resume loads ")
    assert any(line.startswith("::error file=") and "CKD407" in line for line in lines)


def test_gate_is_importable_without_torch() -> None:
    code = "import sys, ckptdoctor.cli.gate, ckptdoctor.render.sarif, ckptdoctor.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


# ---------------------------------------------------------------------------------------------------------------
# The pre-commit hook and the GitHub Actions example in the README, exercised


def _example(marker: str) -> Any:
    text = (REPO / "README.md").read_text()
    m = re.search(rf"<!-- {marker} -->\s*```yaml\n(.*?)```", text, re.S)
    assert m, marker
    return yaml.safe_load(m.group(1))


def _shell(cmd: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **env, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(["bash", "-c", cmd], cwd=cwd, env=full, capture_output=True, text=True, timeout=120)


def test_pre_commit_hooks_run_as_documented(midway: Path, tmp_path: Path) -> None:
    hooks = {h["id"]: h for h in yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())}
    assert set(hooks) == {"ckptdoctor-scan", "ckptdoctor-gate"}
    allowed = {"id", "name", "entry", "language", "description", "pass_filenames", "always_run", "require_serial",
               "minimum_pre_commit_version", "files", "types", "args", "stages"}
    for h in hooks.values():
        assert {"id", "name", "entry", "language"} <= set(h) <= allowed and h["language"] == "python"
    config = _example("pre-commit-example")
    (repo,) = config["repos"]
    # Pin what exists: a release tag of this repository, or the commit-SHA placeholder the text explains.
    tags = subprocess.run(["git", "tag", "--list"], cwd=REPO, capture_output=True, text=True).stdout.split()
    assert repo["rev"] == "<COMMIT_SHA>" or repo["rev"] in tags, repo["rev"]
    shutil.copytree(midway, tmp_path / "runs" / "my-run")
    for use in repo["hooks"]:
        hook = hooks[use["id"]]
        cmd = " ".join([hook["entry"], *(f"'{a}'" for a in use["args"])])  # pre-commit: entry + args
        proc = _shell(cmd, tmp_path, {})
        assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = _shell(f"{hooks['ckptdoctor-gate']['entry']} runs/my-run --num-train-epochs 2 --steps-per-epoch 2",
                  tmp_path, {})
    assert proc.returncode == 1 and "CKD407" in proc.stdout


def test_github_actions_example_runs(midway: Path, tmp_path: Path) -> None:
    workflow = _example("github-actions-example")
    job = workflow["jobs"]["gate"]
    shutil.copytree(midway, tmp_path / "runs" / "my-run")
    (install,) = [s["run"] for s in job["steps"] if "pip install" in s.get("run", "")]
    assert install.endswith('@${CKPTDOCTOR_SHA}"') and job["env"]["CKPTDOCTOR_SHA"] == "<COMMIT_SHA>"  # no tag exists
    ours = [s for s in job["steps"] if "ckptdoctor" in s.get("run", "") and "pip install" not in s["run"]]
    assert len(ours) == 2
    for step in ours:
        proc = _shell(step["run"], tmp_path, {k: str(v) for k, v in job["env"].items()})
        assert proc.returncode == 0, proc.stdout + proc.stderr  # 2 more epochs from step 4 of 8: a clean resume
    sarif = json.loads((tmp_path / "gate.sarif").read_text())
    assert sarif["version"] == "2.1.0"
    uploads = [s for s in job["steps"] if s.get("uses", "").startswith("github/codeql-action/upload-sarif")]
    assert uploads and uploads[0]["with"]["sarif_file"] == "gate.sarif"
    # the same step fails the job when the plan is wrong, with annotations on stdout
    bad = _shell(ours[1]["run"].replace("--num-train-epochs 3", "--num-train-epochs 2 --steps-per-epoch 2"), tmp_path,
                 {"RUN_DIR": "runs/my-run"})
    assert bad.returncode == 1 and "::error file=runs/my-run/checkpoint-4" in bad.stdout


# ---------------------------------------------------------------------------------------------------------------
# The reference trainer (ckptdoctor.reference) resumes the way the gate predicts too


@pytest.mark.parametrize(("schedule", "warmup"), [("linear", 0), ("cosine", 0.25), ("constant_with_warmup", 3)])
def test_reference_trainer_resume_matches_prediction(schedule: str, warmup: float, tmp_path: Path) -> None:
    from ckptdoctor.reference.train import TrainConfig, train

    cfg = TrainConfig(output_dir=str(tmp_path / "out"), num_samples=16, per_device_train_batch_size=4,
                      num_train_epochs=2, save_steps=2, learning_rate=1e-3, lr_scheduler_type=schedule,
                      warmup_steps=warmup)
    train(cfg)
    for resume, epochs in ((True, 3), (str(tmp_path / "out" / "checkpoint-2"), 2)):
        pred = gate(cfg.output_dir, checkpoint=None if resume is True else resume, num_train_epochs=epochs,
                    lr_steps=100)
        got = train(cfg.replace(num_train_epochs=epochs), resume_from_checkpoint=resume)
        assert got.resumed_from is not None and pred.checkpoint is not None
        assert os.path.realpath(got.resumed_from) == os.path.realpath(pred.checkpoint)
        steps = sorted(got.learning_rates)
        assert pred.start_step == steps[0] - 1 and pred.steps_to_train == len(steps)
        assert list(pred.lr) == pytest.approx([got.learning_rates[s] for s in steps], rel=1e-9, abs=0)


def test_training_args_as_yaml_and_json(midway: Path, tmp_path: Path) -> None:
    """A launcher's YAML (PyYAML reads `2e-3` as a string, HfArgumentParser as a number) plans as its JSON does."""
    (tmp_path / "args.yaml").write_text("num_train_epochs: 3\nlearning_rate: 2e-3\nlr_scheduler_type: linear\n")
    (tmp_path / "args.json").write_text(json.dumps({"num_train_epochs": 3, "learning_rate": 2e-3}))
    docs = []
    for name in ("args.yaml", "args.json"):
        code, out = run("gate", str(midway), "--training-args", str(tmp_path / name), "--format", "json")
        docs.append(json.loads(out))
        assert docs[-1]["resolved"]["learning_rate"] == 2e-3 and docs[-1]["resolved"]["num_train_epochs"] == 3
    assert docs[0]["lr"] == docs[1]["lr"] and docs[0]["max_steps"] == docs[1]["max_steps"]
    (tmp_path / "bad.bin").write_bytes(b"\x80\x04 not a pickle")
    (tmp_path / "bad.txt").write_text("num_train_epochs: [unclosed")
    for name in ("bad.bin", "bad.txt"):
        code, out = run("gate", str(midway), "--training-args", str(tmp_path / name))
        assert code == 2 and f"--training-args {tmp_path / name}: " in out and "Traceback" not in out


def test_derived_steps_per_epoch_range_holds_every_dataset_length() -> None:
    """The dataset lengths _samples_for gives back for a run's steps per epoch always hold the real length."""
    from ckptdoctor.resume_gate.resolve import _samples_for, updates_per_epoch

    for n in range(1, 90, 7):
        for batch, world, accum, drop in ((4, 1, 1, False), (8, 2, 3, False), (3, 3, 2, True), (5, 1, 4, True)):
            if drop and n < batch * world:
                continue  # no full batch on every rank: the Trainer's loop would not run
            upe = updates_per_epoch(n, batch, world, accum, drop)
            low, high = _samples_for(upe, batch, world, accum, drop)
            assert low <= n <= high
            assert {updates_per_epoch(m, batch, world, accum, drop) for m in (low, high)} == {upe}

