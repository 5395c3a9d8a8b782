"""MindNLP (MindSpore) and TensorFlow/Keras checkpoints: discovery, the rules with their stack's semantics, the
gate's MindNLP branch, and one test per damage a user would produce, each built from the real samples."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckptdoctor.cli import main
from ckptdoctor.discover import discover
from ckptdoctor.model import Framework
from ckptdoctor.resume_gate import gate
from tests.helpers.paths import TESTS

DATA = TESTS / "data"
MINDNLP = DATA / "mindnlp"  # checkpoint-6 of a save_safetensors=False run (mindspore_model.ckpt)
MINDNLP_RUN = DATA / "mindnlp-run"  # checkpoint-2 of a save_safetensors=True run
TF = DATA / "tf"  # tf-trainer: TFTrainer's checkpoint/ folder + tf_model.h5; keras-weights: save_weights


def _scan(path: Path) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(main, ["scan", str(path), "--format", "json", "--no-config"])
    return result.exit_code, json.loads(result.output)


def _hits(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(f["rule"], f["path"]) for f in doc["findings"] if f["severity"] != "info"}


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    for p in dst.rglob("*"):
        p.chmod(0o644 if p.is_file() else 0o755)
    return dst


@pytest.mark.parametrize("root", [MINDNLP, MINDNLP_RUN, TF, TF / "tf-trainer", TF / "keras-weights"])
def test_real_samples_scan_clean(root: Path) -> None:
    code, doc = _scan(root)
    assert code == 0 and _hits(doc) == set(), doc["findings"]
    # no "not a torch file", no "no weights", no unsafe-pickle alarm on the MindSpore tensor rebuilders
    assert not {f["rule"] for f in doc["findings"]} & {"CKD106", "CKD203", "CKD601", "CKD602", "CKD404"}


def test_discovery_names_the_framework_and_json_shows_it() -> None:
    tree = discover(str(DATA))
    by_path = {ck.path: ck.framework for run in tree.runs for ck in run.checkpoints}
    assert by_path["mindnlp-run/checkpoint-2"] is Framework.MINDNLP
    assert by_path["mindnlp/checkpoint-6"] is Framework.MINDNLP
    assert by_path["tf/tf-trainer/checkpoint"] is Framework.TENSORFLOW
    assert by_path["tf/tf-trainer"] is Framework.TENSORFLOW
    assert by_path["tf/keras-weights"] is Framework.TENSORFLOW
    # each is its own stack, recognised from the same files (MindSpore / TensorFlow), in the model and in JSON
    stacks = {ck.path: ck.stack.value for run in tree.runs for ck in run.checkpoints}
    assert stacks["mindnlp-run/checkpoint-2"] == stacks["mindnlp/checkpoint-6"] == "mindnlp"
    assert stacks["tf/tf-trainer/checkpoint"] == stacks["tf/keras-weights"] == "tensorflow"
    assert {r.path: r.stack.value for r in tree.runs}["mindnlp"] == "mindnlp"
    _, doc = _scan(TF / "tf-trainer")
    assert {run["stack"] for run in doc["runs"]} == {"tensorflow"}
    rows = {c["path"]: c for run in doc["runs"] for c in run["checkpoints"]}
    assert rows["."]["framework"] == "tensorflow" and "hdf5" in rows["."]["kinds"]
    assert rows["."]["framework"] == "tensorflow" and rows["."]["files"] == 1
    _, doc = _scan(MINDNLP_RUN)
    (ck,) = [c for run in doc["runs"] for c in run["checkpoints"]]
    assert ck["framework"] == "mindnlp" and ck["kinds"][:1] == ["full"] and ck["tensors"] == 29
    assert {"optimizer", "scheduler"} <= set(ck["kinds"])
    text = CliRunner().invoke(main, ["scan", str(MINDNLP_RUN), "--no-config"]).output
    assert "(MindNLP; resume_from_checkpoint=True picks" in text


def test_mindnlp_gate_restores_and_predicts_the_real_lrs() -> None:
    r = gate(MINDNLP_RUN)
    assert (r.weights_branch, r.start_step, r.max_steps, r.steps_to_train) == ("full", 2, 6, 4)
    assert r.restores_optimizer and r.verdict == "pass", r.findings
    assert r.warmup_steps == 2 and r.base_lr == pytest.approx(1e-3)
    # The LR of optimizer step k is what the run logged after step k-1 (the scheduler steps after the optimizer).
    later = json.loads((DATA / "mindnlp-run-checkpoint-6-trainer_state.json").read_text())
    logged = {e["step"]: e["learning_rate"] for e in later["log_history"] if "learning_rate" in e}
    assert list(r.lr) == pytest.approx([logged[k - 1] for k in range(3, 7)], rel=1e-9)


def test_deleted_scheduler_json(tmp_path: Path) -> None:
    run = _copy(MINDNLP_RUN, tmp_path)
    (run / "checkpoint-2" / "scheduler.json").unlink()
    _, doc = _scan(run)
    assert ("CKD403", "checkpoint-2") in _hits(doc)
    r = gate(run)
    assert not r.restores_optimizer
    assert any(f.rule == "CKD408" and "no `scheduler.json`" in f.message for f in r.findings)


def test_truncated_mindspore_ckpt(tmp_path: Path) -> None:
    run = _copy(MINDNLP, tmp_path)
    with open(run / "checkpoint-6" / "mindspore_model.ckpt", "r+b") as f:
        f.truncate(5000)
    code, doc = _scan(run)
    # CKD102 too: a file cut short in the newest checkpoint is what an interrupted save leaves, as for torch files
    assert code == 1 and _hits(doc) == {("CKD215", "checkpoint-6/mindspore_model.ckpt"), ("CKD102", "checkpoint-6")}
    r = gate(run, max_steps=8)
    assert any(f.rule == "CKD413" and "mindspore_model.ckpt" in f.message for f in r.findings)


def _damaged_tf(tmp_path: Path, name: str, size: int | None) -> dict[str, Any]:
    root = _copy(TF / "tf-trainer", tmp_path)
    target = root / name
    if size is None:
        target.unlink()
    else:
        with open(target, "r+b") as f:
            f.truncate(size)
    code, doc = _scan(root)
    assert code == 1
    return doc


def test_truncated_tf_index(tmp_path: Path) -> None:
    doc = _damaged_tf(tmp_path, "checkpoint/ckpt-3.index", 500)
    assert _hits(doc) == {("CKD215", "checkpoint/ckpt-3.index")}


def test_truncated_tf_data_shard(tmp_path: Path) -> None:
    doc = _damaged_tf(tmp_path, "checkpoint/ckpt-3.data-00000-of-00001", 100)
    assert _hits(doc) == {("CKD215", "checkpoint/ckpt-3.data-00000-of-00001")}


def test_missing_tf_data_shard(tmp_path: Path) -> None:
    doc = _damaged_tf(tmp_path, "checkpoint/ckpt-2.data-00000-of-00001", None)
    assert _hits(doc) == {("CKD204", "checkpoint/ckpt-2.index")}


def test_truncated_h5(tmp_path: Path) -> None:
    doc = _damaged_tf(tmp_path, "tf_model.h5", 1000)
    assert _hits(doc) == {("CKD215", "tf_model.h5")}


def test_dangling_checkpoint_state(tmp_path: Path) -> None:
    root = _copy(TF / "tf-trainer", tmp_path)
    for p in (root / "checkpoint").glob("ckpt-3.*"):
        p.unlink()
    code, doc = _scan(root)
    assert code == 1 and _hits(doc) == {("CKD107", "checkpoint/checkpoint")}
    (msg,) = [f["message"] for f in doc["findings"] if f["rule"] == "CKD107"]
    assert "model_checkpoint_path" in msg and "ckpt-3" in msg


def test_unsupported_format_is_an_info_never_silence(tmp_path: Path) -> None:
    (tmp_path / "flax_model.msgpack").write_bytes(b"\x81\xa6params\x80")
    (tmp_path / "model.keras").write_bytes(b"PK\x03\x04" + b"\x00" * 60)
    code, doc = _scan(tmp_path)
    infos = {(f["rule"], f["path"]) for f in doc["findings"]}
    assert code == 0 and infos == {("CKD216", "flax_model.msgpack"), ("CKD216", "model.keras")}


def test_inspect_describes_the_framework_files() -> None:
    def inspect(path: Path) -> dict[str, Any]:
        result = CliRunner().invoke(main, ["inspect", str(path), "--format", "json"])
        assert result.exit_code == 0, result.output
        doc: dict[str, Any] = json.loads(result.output)
        return doc

    ms = inspect(MINDNLP / "checkpoint-6" / "mindspore_model.ckpt")
    assert ms["kind"] == "mindspore-ckpt" and len(ms["tensors"]) == 29 and not ms["problems"]
    idx = inspect(TF / "tf-trainer" / "checkpoint" / "ckpt-3.index")
    assert idx["kind"] == "tf-index" and idx["shards"] == 1 and idx["tensors"]
    state = inspect(TF / "tf-trainer" / "checkpoint" / "checkpoint")
    assert state["value"]["model_checkpoint_path"] == "ckpt-3"
    h5 = inspect(TF / "tf-trainer" / "tf_model.h5")
    assert h5["kind"] == "hdf5" and h5["value"]["eof_address"] == h5["bytes"]
