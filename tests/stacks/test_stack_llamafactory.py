"""Proof: the folders real LLaMA-Factory 0.9.5 fine-tunes write raise no alarm (issue 23, section 1), in a scan and
in the gate.

The runs happen in a subprocess with the LLaMA-Factory layer on the path (``CKPTDOCTOR_LLAMAFACTORY_LAYER``: a
``pip install --no-deps --target`` layer built as docs/stacks.md says; tests/stacks/llamafactory_run.py): a LoRA run
started the way LLaMA Board starts one (its own ``training_args.yaml``, sorted keys, first line ``cutoff_len: 32``)
and a full fine-tune, each with ``trainer_log.jsonl``, ``training_loss.png`` and ``chat_template.jinja`` beside its
checkpoints. Both end their schedule (``max_steps`` reached), so CKD401's info is expected.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptdoctor.findings import Severity
from ckptdoctor.scanner import scan

LAYER = os.environ.get("CKPTDOCTOR_LLAMAFACTORY_LAYER", "")
SCRIPT = Path(__file__).with_name("llamafactory_run.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both real runs, trained once."""
    if not LAYER:
        pytest.skip("CKPTDOCTOR_LLAMAFACTORY_LAYER is not set: no LLaMA-Factory 0.9.5 layer to train with")
    out = tmp_path_factory.mktemp("llamafactory")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([LAYER, *filter(None, [os.environ.get("PYTHONPATH")])]),
           "DISABLE_VERSION_CHECK": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), str(out)], env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.mark.parametrize("name", ["board", "cli"])
def test_llamafactory_runs_raise_no_alarm(runs: Path, name: str) -> None:
    run = runs / name
    held = {p.name for p in run.iterdir()}
    assert {"trainer_log.jsonl", "training_loss.png", "chat_template.jinja", "checkpoint-2", "checkpoint-4"} <= held
    if name == "board":
        assert (run / "training_args.yaml").read_text().startswith("cutoff_len: 32\n")
    found = [(f.rule, f.severity, f.path) for f in scan(str(run)).findings]
    assert found == [("CKD401", Severity.INFO, "checkpoint-4")]


def test_llamafactory_gate_passes(runs: Path) -> None:
    from ckptdoctor.resume_gate.api import gate

    for name in ("board", "cli"):
        result = gate(runs / name)
        assert not result.failed and result.checkpoint.endswith("checkpoint-4")
