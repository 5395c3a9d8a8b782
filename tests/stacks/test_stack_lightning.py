"""Proof: a PyTorch Lightning 2.6 checkpoint that ``Trainer.fit(ckpt_path=...)`` cannot load is reported (CKD416),
and a clean Lightning run raises no alarm.

Lightning 2.6 resumes with ``torch.load(weights_only=None)``, so torch's default ``weights_only=True``, which refuses
an ``argparse.Namespace`` that ``save_hyperparameters()`` stored in ``hyper_parameters``. The real runs and resumes
happen in the Lightning interpreter named by ``CKPTDOCTOR_LIGHTNING_PYTHON`` (tests/stacks/lightning_run.py, as a
subprocess: the main interpreter never imports Lightning; .ci/run builds a ``pip install --target`` layer and sets
it). The files under tests/data/lightning-2.6.6 were written by the same script (``namespace`` and ``plain``
jobs, roots ``/tmp/lightning-2.6.6/<job>``) and prove the rule without Lightning installed.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ckptdoctor.findings import Finding
from ckptdoctor.scanner import scan
from tests.helpers.paths import TESTS

LIGHTNING_PYTHON = os.environ.get("CKPTDOCTOR_LIGHTNING_PYTHON", "")
SCRIPT = Path(__file__).with_name("lightning_run.py")
# Not under tests/data/stacks: the security tests hold every file there free of CKD6xx findings, and whether the
# `Namespace` in `namespace/` may be unpickled is the security family's question, not this one's.
DATA = TESTS / "data" / "lightning-2.6.6"
needs_lightning = pytest.mark.skipif(
    not LIGHTNING_PYTHON, reason="CKPTDOCTOR_LIGHTNING_PYTHON is not set: no Lightning 2.6 interpreter to train and "
    "resume with (.ci/run builds one and sets it)")


def _findings(root: Path) -> list[Finding]:
    """Every finding but the security family's (CKD6xx: whether a Namespace may be unpickled is that family's)."""
    return [f for f in scan(str(root)).findings if not f.rule.startswith("CKD6")]


def _lightning(jobs: list[dict[str, Any]], tmp: Path) -> list[dict[str, Any]]:
    """Run ``jobs`` in the Lightning interpreter (tests/stacks/lightning_run.py) and return their results."""
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    proc = subprocess.run([LIGHTNING_PYTHON, str(SCRIPT), str(tmp / "jobs.json"), str(tmp / "results.json")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results: list[dict[str, Any]] = json.loads((tmp / "results.json").read_text())
    return results


def _expected(root: Path) -> list[tuple[str, str, str]]:
    return [(f.rule, f.path, f.message) for f in _findings(root)]


REFUSED = ("`Trainer.fit(ckpt_path=...)` raises `UnpicklingError`: Lightning loads it with "
           "`torch.load(weights_only=True)`, which refuses `argparse.Namespace` (in `hyper_parameters`)")


def test_committed_namespace_checkpoints_are_refused() -> None:
    assert _expected(DATA / "namespace") == [
        ("CKD416", "checkpoints/epoch=0-step=2.ckpt", REFUSED),
        ("CKD416", "checkpoints/last.ckpt", REFUSED),
    ]


def test_committed_plain_run_is_clean() -> None:
    assert scan(str(DATA / "plain")).findings == ()


@needs_lightning
def test_real_resume_refuses_what_ckd416_names(tmp_path: Path) -> None:
    jobs = [{"root": str(tmp_path / "namespace"), "namespace": True}, {"root": str(tmp_path / "plain")}]
    ns, plain = _lightning(jobs, tmp_path)
    assert ns["raised"] == "UnpicklingError" and "argparse.Namespace" in ns["message"]
    assert plain["raised"] is None
    assert plain["loaded"] == str(tmp_path / "plain" / "checkpoints" / "last.ckpt")
    assert [(r, p) for r, p, _ in _expected(tmp_path / "namespace")] == [
        ("CKD416", "checkpoints/epoch=0-step=2.ckpt"), ("CKD416", "checkpoints/last.ckpt")]
    assert scan(str(tmp_path / "plain")).findings == ()
    # the run's header names the file `fit(ckpt_path="last")` loaded in the real resume
    from ckptdoctor.render.report import render_text

    text = render_text(scan(str(tmp_path / "plain")), color=False)
    assert f'`fit(ckpt_path="last")` loads `{Path(plain["loaded"]).name}`' in text


def test_lightning_folder_is_a_run_of_its_stack() -> None:
    """ModelCheckpoint's folder is a Lightning run (recognised by the `.ckpt` content, not its name), and its
    header says what ``fit(ckpt_path="last")`` loads."""
    from ckptdoctor.model import Stack
    from ckptdoctor.render.report import render_text

    report = scan(str(DATA / "plain"))
    (tree,) = report.trees
    assert [(r.path, r.stack, r.resume_pick) for r in tree.runs] == [("checkpoints", Stack.LIGHTNING, None)]
    assert [ck.stack for ck in tree.runs[0].checkpoints] == [Stack.LIGHTNING]
    assert 'Lightning; `fit(ckpt_path="last")` loads `last.ckpt`' in render_text(report, color=False)


def test_last_pick_follows_lightning(tmp_path: Path) -> None:
    """``fit(ckpt_path="last")`` takes the most recently modified of `last.ckpt`, `last-v1.ckpt` ... (the stem
    matches ``^last(-(\\d+))?``), never a top-k file; none: it trains from scratch."""
    from ckptdoctor.model import FileFacts, FileKind
    from ckptdoctor.stacks.lightning import last_pick

    def f(name: str, mtime: float) -> FileFacts:
        return FileFacts(f"checkpoints/{name}", 10, mtime, FileKind.TORCH_ZIP)

    files = [f("last.ckpt", 1.0), f("last-v1.ckpt", 3.0), f("epoch=3-step=8.ckpt", 9.0)]
    assert last_pick(files) == files[1]
    assert last_pick([f("epoch=3-step=8.ckpt", 9.0)]) is None
