"""Proof: the gate names the crash a damaged checkpoint causes, as the real transformers Trainer then raises it.

One tiny GPT-2 run (4 steps, checkpoints at 2 and 4) is trained once; each test damages a copy of `checkpoint-2`
the way a preempted copy or a full disk does (a file cut in half, emptied, deleted), asks the gate about resuming
it with `max_steps=6`, then resumes the real Trainer and checks that it raises the exception the gate named, in the
loader it named. Also: the gate no longer says "restored" for an optimizer it cannot load, and its JSON says null,
not 0, for what it did not predict.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from tests.helpers.gate_damage import cut, tiny_model, trainer

transformers = pytest.importorskip("transformers")

from ckptdoctor.cli import main  # noqa: E402
from ckptdoctor.render.gate import render_text, summary  # noqa: E402
from ckptdoctor.resume_gate import GateResult, gate  # noqa: E402

PLAN = 6  # max_steps of the resume: checkpoint-2 has 4 steps left


def resume_raises(out: Path) -> BaseException | None:
    """What the real ``trainer.train(resume_from_checkpoint=checkpoint-2)`` raises (None: it trains)."""
    try:
        trainer(out, max_steps=PLAN).train(resume_from_checkpoint=str(out / "checkpoint-2"))
    except Exception as exc:  # the exception is what is compared
        return exc
    return None


@pytest.fixture(scope="module")
def damaged_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("damage") / "out"
    trainer(out).train()
    shutil.rmtree(out / "checkpoint-4")  # resume_from_checkpoint=True and the gate both pick checkpoint-2
    return out


@pytest.fixture(scope="module")
def sharded(damaged_out: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run whose checkpoint-2 holds its weights in two safetensors shards and an index."""
    out = tmp_path_factory.mktemp("sharded") / "out"
    shutil.copytree(damaged_out, out)
    ck = out / "checkpoint-2"
    tiny_model().save_pretrained(out / "shards", max_shard_size="5KB")  # the weights' values do not matter here
    os.remove(ck / "model.safetensors")
    for f in (out / "shards").iterdir():
        if f.name.startswith("model"):
            shutil.move(str(f), ck / f.name)
    shutil.rmtree(out / "shards")
    assert len(list(ck.glob("model-*.safetensors"))) == 2
    return out


def empty(path: Path) -> None:
    path.write_bytes(b"")


def shards(ck: Path) -> list[Path]:
    return sorted(ck.glob("model-*.safetensors"))


def scaler_state(ck: Path) -> None:
    """A `scaler.pt` as an fp16 run saves it (GradScaler.state_dict()), cut in half."""
    torch.save(torch.amp.GradScaler("cpu").state_dict(), ck / "scaler.pt")
    cut(ck / "scaler.pt")


# name: (fixture, damage to checkpoint-2, the file the gate names, the exception, the loader)
CASES: dict[str, tuple[str, Callable[[Path], None], str, str, str]] = {
    "optimizer-cut": ("damaged_out", lambda ck: cut(ck / "optimizer.pt"), "optimizer.pt", "OSError",
                      "_load_optimizer_and_scheduler"),
    "optimizer-cut-small": ("damaged_out", lambda ck: cut(ck / "optimizer.pt", 0.05), "optimizer.pt", "RuntimeError",
                            "_load_optimizer_and_scheduler"),
    "optimizer-empty": ("damaged_out", lambda ck: empty(ck / "optimizer.pt"), "optimizer.pt", "EOFError",
                        "_load_optimizer_and_scheduler"),
    "optimizer-bin-only": ("damaged_out", lambda ck: os.rename(ck / "optimizer.pt", ck / "optimizer.bin"),
                           "optimizer.pt", "FileNotFoundError", "_load_optimizer_and_scheduler"),
    "scheduler-cut": ("damaged_out", lambda ck: cut(ck / "scheduler.pt"), "scheduler.pt", "RuntimeError",
                      "_load_optimizer_and_scheduler"),
    "rng-cut": ("damaged_out", lambda ck: cut(ck / "rng_state.pth"), "rng_state.pth", "OSError", "_load_rng_state"),
    "scaler-cut": ("damaged_out", scaler_state, "scaler.pt", "AttributeError", "_load_scaler"),
    "weights-cut": ("damaged_out", lambda ck: cut(ck / "model.safetensors"), "model.safetensors", "SafetensorError",
                    "_load_from_checkpoint"),
    "config-cut": ("damaged_out", lambda ck: cut(ck / "config.json"), "config.json", "JSONDecodeError",
                   "_load_from_checkpoint"),
    "trainer-state-cut": ("damaged_out", lambda ck: cut(ck / "trainer_state.json"), "trainer_state.json",
                          "JSONDecodeError", "TrainerState.load_from_json"),
    "shard-cut": ("sharded", lambda ck: cut(shards(ck)[0]), "model-00001-of-00002.safetensors", "SafetensorError",
                  "load_sharded_checkpoint"),
    "shard-missing": ("sharded", lambda ck: os.remove(shards(ck)[1]), "model-00002-of-00002.safetensors",
                      "FileNotFoundError", "load_sharded_checkpoint"),
    "index-cut": ("sharded", lambda ck: cut(ck / "model.safetensors.index.json"), "model.safetensors.index.json",
                  "JSONDecodeError", "load_sharded_checkpoint"),
}


def damaged(src: Path, tmp_path: Path, damage: Callable[[Path], None]) -> Path:
    out = tmp_path / "out"
    shutil.copytree(src, out)
    damage(out / "checkpoint-2")
    return out


def crash_of(result: GateResult) -> str:
    (msg,) = [f.message for f in result.findings if f.rule == "CKD413"]
    return msg


@pytest.mark.parametrize("case", list(CASES))
def test_the_gate_names_the_crash_the_real_resume_has(case: str, request: pytest.FixtureRequest,
                                                      tmp_path: Path) -> None:
    fixture, damage, name, exc_name, loader = CASES[case]
    out = damaged(request.getfixturevalue(fixture), tmp_path, damage)
    result = gate(out, max_steps=PLAN)
    msg = crash_of(result)
    assert f"`{name}`" in msg and exc_name in msg and loader in msg, msg
    assert result.verdict == "fail" and result.lr == () and not result.restores_optimizer
    assert result.max_steps is None and result.steps_to_train is None  # nothing predicted past the crash
    text = render_text(result)
    assert "restored from the checkpoint" not in text and "not predicted" in text
    assert "raises before its first step" in summary(result)
    raised = resume_raises(out)
    assert raised is not None and type(raised).__name__ == exc_name, repr(raised)


def test_an_optimizer_the_resume_skips_is_not_a_crash(damaged_out: Path, tmp_path: Path) -> None:
    """Without `scheduler.pt` neither file is loaded: a cut `optimizer.pt` is skipped, the schedule restarts."""
    def skipped(ck: Path) -> None:
        cut(ck / "optimizer.pt")
        os.remove(ck / "scheduler.pt")

    out = damaged(damaged_out, tmp_path, skipped)
    result = gate(out, max_steps=PLAN)
    assert "CKD413" not in {f.rule for f in result.findings} and "CKD408" in {f.rule for f in result.findings}
    assert (result.start_step, result.max_steps, result.steps_to_train) == (2, PLAN, 4)
    assert "NOT restored (fresh)" in render_text(result)
    assert resume_raises(out) is None


def test_the_cli_reports_a_cut_optimizer_as_a_crash(damaged_out: Path, tmp_path: Path) -> None:
    """The review's case: `gate dmg/truncopt --max-steps 8` said "restored" and predicted an LR of 0."""
    out = damaged(damaged_out, tmp_path, lambda ck: cut(ck / "optimizer.pt"))
    result = CliRunner().invoke(main, ["gate", str(out), "--max-steps", "8"])
    assert result.exit_code == 1
    assert "restored" not in result.stdout and "CKD410" not in result.stdout
    assert "CKD413 [error] `optimizer.pt` is truncated: train() raises OSError" in result.stdout
    doc = json.loads(CliRunner().invoke(main, ["gate", str(out), "--max-steps", "8", "--format", "json"]).stdout)
    assert (doc["start_step"], doc["max_steps"], doc["steps_to_train"], doc["lr"]) == (2, None, None, [])
    assert doc["resolved"]["restores_optimizer_and_scheduler"] is False
    assert doc["resolved"]["max_steps_argument"] == 8 and doc["resolved"]["epochs_trained"] is None


def test_json_says_null_for_an_empty_run_dir(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["gate", str(tmp_path), "--format", "json"])
    doc = json.loads(result.stdout)
    assert result.exit_code == 1 and doc["checkpoint"] is None and doc["resolved"] is None
    assert (doc["start_step"], doc["max_steps"], doc["steps_to_train"], doc["lr"]) == (None, None, None, [])
    text = CliRunner().invoke(main, ["gate", str(tmp_path)]).stdout
    assert "none found" in text and "global_step" not in text


def test_json_says_null_for_an_unreadable_trainer_state(damaged_out: Path, tmp_path: Path) -> None:
    out = damaged(damaged_out, tmp_path, lambda ck: cut(ck / "trainer_state.json"))
    result = CliRunner().invoke(main, ["gate", str(out), "--max-steps", "4", "--format", "json"])
    doc = json.loads(result.stdout)
    assert (doc["start_step"], doc["max_steps"], doc["steps_to_train"], doc["lr"]) == (None, None, None, [])
    assert doc["resolved"]["max_steps_argument"] == 4
    assert all(doc["resolved"][k] is None for k in ("epochs_trained", "loop_epochs", "warmup_steps"))
    # `checkpoint` is the path resume_from_checkpoint takes (RUN_DIR joined); finding paths are relative to `root`
    assert doc["checkpoint"] == os.path.join(str(out), "checkpoint-2")
    assert {(f["path"], f["root"]) for f in doc["findings"] if f["rule"] == "CKD413"} == {("checkpoint-2", str(out))}
    text = CliRunner().invoke(main, ["gate", str(out), "--max-steps", "4"]).stdout
    assert "steps            unknown: not predicted" in text and "max_steps 0" not in text
