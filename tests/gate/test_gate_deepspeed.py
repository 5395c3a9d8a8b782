"""Proof: the gate predicts the LR a real DeepSpeed resume uses (issue 24, item 8), and the crashes it meets.

Real Trainers under DeepSpeed 0.19.8 (ZeRO-2 on its CPU accelerator, one rank over gloo) train and resume in one
subprocess (tests/gate/deepspeed_trainer.py) with the layer ``CKPTDOCTOR_DEEPSPEED_LAYER`` names first on its path
(``DS_BUILD_OPS=0 pip install --no-deps --no-build-isolation --target LAYER deepspeed==0.19.8 hjson ninja py-cpuinfo
pydantic pydantic-core annotated-types typing-inspection einops msgpack``); without it these tests skip. Each run:
16 samples at batch 4, max_steps 4, a save every 2 steps, a linear schedule with 2 warm-up steps; each resume
starts from checkpoint-2 with max_steps 6 (a longer schedule, so the restored state and the new one both show).

Who holds the schedule decides what the resume restores (``src/transformers/integrations/deepspeed.py``
``deepspeed_optim_sched``, ``Trainer._load_optimizer_and_scheduler``): a DeepSpeed config without "optimizer" or
"scheduler" leaves it to the Trainer (``scheduler.pt``); with an "optimizer" the engine holds the Trainer's
LambdaLR (``global_stepN/mp_rank_00_model_states.pt`` ``lr_scheduler``, no ``scheduler.pt``); with a "scheduler" the
engine runs DeepSpeed's own. The first resumed step runs at the LR the ZeRO partition's param groups restore.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptdoctor.findings import Severity
from ckptdoctor.resume_gate import GateResult, gate
from ckptdoctor.scanner import scan

LAYER = os.environ.get("CKPTDOCTOR_DEEPSPEED_LAYER", "")
SCRIPT = Path(__file__).with_name("deepspeed_trainer.py")
needs_deepspeed = pytest.mark.skipif(not LAYER, reason="CKPTDOCTOR_DEEPSPEED_LAYER is not set: no DeepSpeed 0.19.8 "
                                     "layer to train and resume with")
pytestmark = [pytest.mark.slow, needs_deepspeed]

TORCH_ADAM = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto", "eps": "auto",
                                          "torch_adam": True}}  # DeepSpeed's own Adam is a C++ build
WARMUP_DECAY = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                    "warmup_num_steps": "auto", "total_num_steps": "auto"}}
# Each run's DeepSpeed config entries (merged over ZeRO-2), and how its copy is changed before the resume
RUNS: dict[str, dict[str, Any]] = {
    "trainer": {},  # the Trainer holds the schedule: scheduler.pt
    "engine": {"optimizer": TORCH_ADAM},  # DeepSpeed's optimizer: the engine holds the Trainer's LambdaLR
    "ds-scheduler": {"scheduler": WARMUP_DECAY},  # DeepSpeed's own schedule
    "elastic": {"zero_optimization": {"stage": 2, "elastic_checkpoint": True}},
}
DELETE = {"no-scheduler": ("trainer", "scheduler.pt")}  # a cleanup that removed the Trainer's scheduler.pt
RESUME_STEPS = 6


def _free_port() -> int:
    with socket.socket() as s:  # the rendezvous port: other suites may hold the default one
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _train(jobs: list[dict[str, Any]], folder: Path) -> list[dict[str, Any]]:
    """Run ``jobs`` in one DeepSpeed process (tests/gate/deepspeed_trainer.py) and return what each did."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "jobs.json").write_text(json.dumps(jobs))
    path = os.pathsep.join(p for p in (LAYER, os.environ.get("PYTHONPATH")) if p)
    # a folder of its own for torch extensions: nothing here builds one, and none is left locked by another run
    env = {**os.environ, "PYTHONPATH": path, "MASTER_PORT": str(_free_port()),
           "TORCH_EXTENSIONS_DIR": str(folder / "torch_extensions")}
    proc = subprocess.run([sys.executable, str(SCRIPT), str(folder / "jobs.json"), str(folder / "results.json")],
                          capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not (folder / "torch_extensions").exists()  # no C++ op was built: the runs take seconds
    results: list[dict[str, Any]] = json.loads((folder / "results.json").read_text())
    return results


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Each case's run folder as saved (the gate reads it) and what the real resume from its checkpoint-2 did.

    Built once per test session: pytest-xdist workers share the session's temporary root, and the first worker to
    take the lock runs the Trainers while the others wait for its results."""
    import fcntl

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    done = shared / "deepspeed-runs.json"
    with open(shared / "deepspeed-runs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            done.write_text(json.dumps(_build(shared / "deepspeed-runs")))
        found = json.loads(done.read_text())
    return {case: (Path(folder), seen) for case, (folder, seen) in found.items()}


def _build(base: Path) -> dict[str, tuple[str, dict[str, Any]]]:
    trained = [{"out": str(base / name), "ds": ds} for name, ds in RUNS.items()]
    resumes = {name: (base / name, ds) for name, ds in RUNS.items()}
    prepare = []
    for case, (run, name) in DELETE.items():
        resumes[case] = (base / case, RUNS[run])
        prepare.append((run, case, name))
    jobs = list(trained)
    results = {}
    for name, seen in zip(RUNS, _train(jobs, base / "train"), strict=True):
        assert "error" not in seen, (name, seen)
        results[name] = seen
    resumes["to-zero3"] = (base / "trainer", {"zero_optimization": {"stage": 3}})  # the ZeRO-2 save under ZeRO-3
    for run, case, name in prepare:
        shutil.copytree(base / run, base / case)
        (base / case / "checkpoint-2" / name).unlink()
    # each resume writes into a folder of its own: the gate reads the run as it was saved
    jobs = [{"out": str(base / "resumed" / case), "ds": ds, "resume": str(folder / "checkpoint-2"),
             "args": {"max_steps": RESUME_STEPS}} for case, (folder, ds) in resumes.items()]
    return {case: (str(folder), seen) for (case, (folder, _)), seen
            in zip(resumes.items(), _train(jobs, base / "resume"), strict=True)}


def predicted(folder: Path, **kw: Any) -> GateResult:
    """The gate's prediction for the resume the fixture ran: checkpoint-2, max_steps 6, every LR."""
    return gate(folder, checkpoint="checkpoint-2", training_args={"max_steps": RESUME_STEPS}, lr_steps=100, **kw)


def rules(result: GateResult) -> set[str]:
    return {f.rule for f in result.findings}


def _same_lrs(pred: tuple[float, ...], seen: list[list[float]]) -> bool:
    return len(pred) == len(seen) and all(math.isclose(p, s[1], rel_tol=1e-9, abs_tol=0.0)
                                          for p, s in zip(pred, seen, strict=True))


@pytest.mark.parametrize("case", ["trainer", "engine"])
def test_the_gate_predicts_every_lr_of_a_real_deepspeed_resume(
    case: str, runs: dict[str, tuple[Path, dict[str, Any]]]
) -> None:
    """The Trainer's schedule, held by the Trainer (scheduler.pt) or by the engine (its model states): the first
    step runs at the LR the ZeRO partition restores, the later ones follow the restored schedule stretched to the
    new max_steps; nothing raises and the gate says nothing about it."""
    folder, seen = runs[case]
    assert "error" not in seen and [s[0] for s in seen["lrs"]] == [2, 3, 4, 5]
    assert seen["scheduler"] == ("LambdaLR" if case == "trainer" else "DeepSpeedSchedulerWrapper")
    assert (folder / "checkpoint-2" / "scheduler.pt").exists() == (case == "trainer")
    pred = predicted(folder)
    assert pred.weights_branch == "deepspeed" and pred.steps_to_train == 4
    assert _same_lrs(pred.lr, seen["lrs"]), (pred.lr, seen["lrs"])
    assert pred.lr[0] == 0.001 and math.isclose(pred.lr[1], 0.00075)  # restored; then base x (6 - 3) / (6 - 2)
    # the longer schedule decays more slowly than the run's own (0.0005 at step 4): CKD411 says so, as it does for
    # a resume without DeepSpeed. The engine steps its schedule before the Trainer logs the LR, so that run logged
    # step 3's LR (0.001) at step 2, which the longer schedule never exceeds. With the run's own max_steps, the gate
    # has nothing to say.
    found = [f for f in pred.findings if f.rule == "CKD411"]
    if case == "trainer":
        assert rules(pred) == {"CKD411"} and "the run's max_steps was 4, the resume's is 6" in found[0].message
    else:
        assert rules(pred) == set()
    own = gate(folder, checkpoint="checkpoint-2")
    assert own.lr == (0.001, 0.0005) and rules(own) == set() and own.verdict == "pass"


def test_a_deepspeed_scheduler_is_reported_unpredicted_past_the_restored_first_lr(
    runs: dict[str, tuple[Path, dict[str, Any]]]
) -> None:
    folder, seen = runs["ds-scheduler"]
    assert "error" not in seen and seen["scheduler"] == "DeepSpeedSchedulerWrapper"
    pred = predicted(folder)
    assert pred.ds_scheduler == "WarmupDecayLR" and len(pred.lr) == 1
    assert math.isclose(pred.lr[0], seen["lrs"][0][1], rel_tol=1e-9)
    found = [f for f in pred.findings if f.rule == "CKD412"]
    assert len(found) == 1 and "`WarmupDecayLR`" in found[0].message and "not predicted" in found[0].message
    assert rules(pred) == {"CKD412"} and pred.verdict == "pass"


def test_an_elastic_zero_state_of_a_torch_optimizer_crashes_the_resume_and_the_gate_says_so(
    runs: dict[str, tuple[Path, dict[str, Any]]]
) -> None:
    """DeepSpeed saves `base_optimizer_state_step` only for optimizers that keep `step` in their param groups;
    torch's keep it per parameter, and the elastic load asserts it is there."""
    folder, seen = runs["elastic"]
    assert seen["lrs"] == [] and seen["error"][0] == "AssertionError"
    pred = predicted(folder)
    found = [f for f in pred.findings if f.rule == "CKD413"]
    assert len(found) == 1 and "elastic ZeRO optimizer state" in found[0].message
    assert "AssertionError" in found[0].message and pred.steps_to_train is None and pred.verdict == "fail"


def test_a_missing_scheduler_pt_the_trainer_loads_crashes_the_resume(
    runs: dict[str, tuple[Path, dict[str, Any]]]
) -> None:
    """CKD403 no longer skips DeepSpeed: where the run's config leaves the schedule to the Trainer, a checkpoint
    without `scheduler.pt` makes the resume raise FileNotFoundError; the gate predicts it (CKD413)."""
    folder, seen = runs["no-scheduler"]
    assert seen["error"][0] == "FileNotFoundError" and "scheduler.pt" in seen["error"][1]
    pred = predicted(folder)
    assert "CKD413" in rules(pred) and pred.verdict == "fail"
    hits = [f for f in scan(folder).findings if f.rule == "CKD403"]
    assert [f.path for f in hits] == ["checkpoint-2"] and "FileNotFoundError" in hits[0].message


def test_no_clean_deepspeed_checkpoint_raises_ckd403(runs: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    """Every checkpoint the runs saved, with or without scheduler.pt as its config decides."""
    for case in RUNS:
        assert [f for f in scan(runs[case][0]).findings if f.rule == "CKD403"] == [], case


def test_a_real_deepspeed_run_raises_no_alarm(runs: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    """Clean real output: no security finding (each ``training_args.bin`` pickles the DeepSpeed plugin's
    ``HfDeepSpeedConfig``, an exact allowlist entry), no warning and no error, whoever holds the schedule."""
    for case in ("trainer", "engine", "ds-scheduler"):
        found = [f"{f.rule} {f.path}: {f.message}" for f in scan(runs[case][0]).findings
                 if f.severity is not Severity.INFO or f.rule.startswith("CKD6")]  # fmt: skip
        assert found == [], case


def test_a_zero2_save_resumed_under_zero3_crashes_and_the_planned_config_says_so(
    runs: dict[str, tuple[Path, dict[str, Any]]]
) -> None:
    """ZeRO-3 reads per-rank model states (`zero_pp_rank_0_mp_rank_00_model_states.pt`) a stage 2 save lacks. The
    gate knows the resuming stage from a planned `deepspeed` config (`--training-args`); the run's own is stage 2."""
    folder, seen = runs["to-zero3"]
    assert seen["lrs"] == [] and seen["error"][0] == "AssertionError"
    planned = {"max_steps": RESUME_STEPS, "deepspeed": {"zero_optimization": {"stage": 3}}}
    pred = gate(folder, checkpoint="checkpoint-2", training_args=planned)
    found = [f for f in pred.findings if f.rule == "CKD413"]
    assert len(found) == 1 and "saved under ZeRO stage 2, and the resume runs ZeRO-3" in found[0].message
    assert "CKD413" not in rules(predicted(folder))  # as the run was: stage 2

