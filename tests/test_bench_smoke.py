"""The benchmark generator (bench/synth.py) on a tiny model: its files are real enough for the real libraries and
for ckptdoctor, which finds the run healthy; the S3 fleet bench (bench/fleet_s3.py) at 2 runs of 2 checkpoints. No
timings are asserted here: bench/RESULTS.md holds those."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors import safe_open

from ckptdoctor.scanner import scan

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_generator_writers_match_the_libraries(tmp_path: Path) -> None:
    _load("synth").verify(tmp_path)  # byte-compares with save_file and torch.save, loads a sparse archive


def test_generated_run_is_sparse_real_and_healthy(tmp_path: Path) -> None:
    synth = _load("synth")
    args = argparse.Namespace(
        model="tiny", checkpoints=3, runs=1, save_steps=50, logging_steps=10, max_shard_gb=0.0002, weights_only=False
    )
    synth.generate(tmp_path / "run", args)
    ck = tmp_path / "run" / "checkpoint-150"
    shards = sorted(ck.glob("model-*.safetensors"))
    assert len(shards) > 1 and (ck / "model.safetensors.index.json").exists()
    with safe_open(str(shards[0]), "pt") as f:
        assert f.metadata() == {"format": "pt"} and f.keys()
    opt = torch.load(ck / "optimizer.pt", mmap=True, weights_only=True)
    assert opt["state"][0]["exp_avg"].shape == (1000, 64) and float(opt["state"][0]["step"]) == 150.0
    state = json.loads((ck / "trainer_state.json").read_text())
    assert state["global_step"] == 150 and len(state["log_history"]) == 15 + 3
    report = scan(str(tmp_path / "run"))
    assert [f.rule for f in report.findings if f.severity.value != "info"] == []
    assert report.trees[0].files_seen == 3 * 11
    # The data regions are zeros (holes): --deep sees every weight matrix as all zeros, and nothing else.
    deep = scan(str(ck), deep=True)
    assert {f.rule for f in deep.findings if f.severity.value != "info"} == {"CKD212"}


def test_probe_measures_a_workload(tmp_path: Path) -> None:
    import os
    import subprocess

    out = tmp_path / "probe.json"
    env = {**os.environ, "PROBE_OUT": str(out)}
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "probe.py"), "call", "baselines:plain_read", str(ROOT / "bench")],
        env=env,
        check=True,
    )
    r = json.loads(out.read_text())
    assert r["exit"] == 0 and r["rchar_workload"] > 0 and r["maxrss_mb"] > 0


def test_fleet_s3_bench_builds_counts_and_scans(tmp_path: Path) -> None:
    """bench/fleet_s3.py at 2 x 2: the bucket builder, the server-side request counter and the serial mode."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from ckptdoctor.sources.fsspec import WHOLE_FILE

    fleet = _load("fleet_s3")
    torch.save({"output_dir": "out"}, tmp_path / "training_args.bin")  # a TrainingArguments would import transformers
    with fleet.moto_server() as server:
        files = fleet.build_run(tmp_path / "run", 2, training_args=(tmp_path / "training_args.bin").read_bytes())
        assert fleet.fill(server, 2, files) == 2 * len(files) == 2 * 2 * 11
        results = list(fleet.measure(server, ROOT, ["serial"], tmp_path))
    (serial,) = results
    assert serial.exit_code == 0, serial
    assert serial.summary["files"] == 2 * len(files) and serial.summary["error"] == serial.summary["warning"] == 0
    # A 7B checkpoint's shards and optimizer are fetched piecemeal, not whole: so are the bench's.
    sizes = {name.rsplit("/", 1)[-1]: len(data) for name, data in files.items()}
    piecemeal = [n for n in sizes if n.endswith(".safetensors") or n == "optimizer.pt"]
    assert len(piecemeal) == 4 and all(sizes[n] > WHOLE_FILE for n in piecemeal)
    assert all(serial.counts.by_name[n] > 4 for n in piecemeal)  # more than one request per object (4 of each)
    # Every object was fetched; the counts add up.
    assert set(serial.counts.by_name) == set(sizes)
    assert serial.counts.requests["list"] >= 1 and serial.counts.requests["other"] == 0
    assert serial.counts.total() == sum(serial.counts.requests.values()) >= 1 + 2 * len(files)
    assert serial.peak_rss_mb["scan"] > 0 and serial.row(2, 2)["requests_per_checkpoint"] > 11
