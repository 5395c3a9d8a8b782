"""`ckptdoctor gate` of a run in object storage (S3 through moto on loopback) predicts what it predicts locally,
and that prediction is what the real Trainer's resume does (tests/test_gate_transformers.py proves it locally)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")
pytest.importorskip("transformers")

from ckptdoctor.cli import main
from ckptdoctor.resume import gate
from tests.test_gate_transformers import ALL, assert_predicted, train
from tests.test_remote import _RequestLog, _upload, server  # noqa: F401  (the moto server fixture)

pytestmark = pytest.mark.slow


def test_gate_of_an_s3_run_matches_the_local_gate_and_the_resume(
    server: tuple[str, _RequestLog], tmp_path: Path  # noqa: F811
) -> None:
    out = tmp_path / "out"
    train(out)
    url = _upload(out, "gate-run")
    remote = gate(url, num_train_epochs=3, lr_steps=ALL)
    local = gate(out, num_train_epochs=3, lr_steps=ALL)
    assert remote.checkpoint == url.rstrip("/") + "/checkpoint-8" or remote.checkpoint == url + "checkpoint-8"
    fields = ("weights_branch", "start_step", "max_steps", "steps_to_train", "lr", "verdict", "base_lr")
    assert {k: getattr(remote, k) for k in fields} == {k: getattr(local, k) for k in fields}
    assert [(f.rule, f.message) for f in remote.findings] == [(f.rule, f.message) for f in local.findings]
    cli = CliRunner().invoke(main, ["gate", url, "--checkpoint", "checkpoint-4", "--format", "json"])
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.stdout)["start_step"] == 4
    missing = CliRunner().invoke(main, ["gate", url.rstrip("/") + "-nothing/"])
    assert missing.exit_code == 2
    assert_predicted(local, train(out, resume=True, num_train_epochs=3))
