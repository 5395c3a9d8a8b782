"""A damaged file the resume never opens is that file's finding, not an interrupted save of its checkpoint.

Built from a real transformers Trainer run (tiny GPT-2, CPU, checkpoints at 2, 4, 6, 8). A one-byte
`ema_backup.safetensors` (a callback's side file) in `checkpoint-8`, the folder `resume_from_checkpoint=True`
picks: the scan reports the file (CKD202, a warning, whose fix quarantines that file alone), not the checkpoint
(CKD102); the gate passes and predicts the resume of `checkpoint-8`; the fix keeps `checkpoint-8`, and the real
resume of the fixed folder loads it. A cut file the resume does open still condemns the checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptdoctor import api
from ckptdoctor.cli import main
from ckptdoctor.findings import Severity
from ckptdoctor.fixer import undo
from ckptdoctor.resume_gate import gate

transformers = pytest.importorskip("transformers")
from tests.helpers.e2e import tree_digest  # noqa: E402
from tests.helpers.gate_runs import ALL, assert_predicted, copy_run, train  # noqa: E402

LAST = "checkpoint-8"
SIDE = f"{LAST}/ema_backup.safetensors"


@pytest.fixture(scope="module")
def side_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("side") / "out"
    train(out)
    return out


def with_side_file(side_run: Path, tmp_path: Path, name: str = SIDE, data: bytes = b"x") -> Path:
    out = copy_run(side_run, tmp_path)
    (out / name).write_bytes(data)
    return out


def test_a_cut_side_file_is_the_files_warning_not_an_interrupted_save(side_run: Path, tmp_path: Path) -> None:
    out = with_side_file(side_run, tmp_path)
    report = api.scan(str(out))
    got = {(f.rule, f.path, f.severity) for f in report.findings if f.rule in ("CKD102", "CKD202")}
    assert got == {("CKD202", SIDE, Severity.WARNING)}
    side = next(f for f in report.findings if f.rule == "CKD202")
    assert side.fix is not None and [op.path for op in side.fix.ops] == [SIDE]
    assert report.exit_code() == 0


def test_the_gate_passes_and_predicts_the_picked_checkpoint(side_run: Path, tmp_path: Path) -> None:
    out = with_side_file(side_run, tmp_path)
    result = CliRunner().invoke(main, ["gate", str(out), "--max-steps", "12", "--format", "json"])
    assert result.exit_code == 0, result.output
    assert '"checkpoint": "' + str(out / LAST) in result.output.replace("\\\\", "/")


def test_fix_quarantines_the_side_file_alone_and_the_real_resume_loads_the_checkpoint(
    side_run: Path, tmp_path: Path
) -> None:
    out = with_side_file(side_run, tmp_path)
    dry = CliRunner().invoke(main, ["fix", str(out), "--dry-run", "--force"])
    assert f"would move `{SIDE}`" in dry.output, dry.output
    assert f"would move `{LAST}/`" not in dry.output
    assert "would pick up from" not in dry.output  # the resume point does not move
    before = tree_digest(out)
    result = api.fix(str(out), force=True)
    assert result.exit_code() == 0
    assert not (out / SIDE).exists() and (out / LAST / "model.safetensors").exists()
    cured = tmp_path / "cured"
    shutil.copytree(out, cured)
    pred = gate(str(cured), max_steps=12, lr_steps=ALL)
    assert pred.exit_code == 0
    seen = train(cured, resume=True, max_steps=12)
    assert_predicted(pred, seen)
    assert seen.loaded is not None and Path(seen.loaded).name == LAST
    undo(str(out))
    assert tree_digest(out) == before


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt", "rng_state.pth"])
def test_a_cut_file_the_resume_opens_still_condemns_the_checkpoint(side_run: Path, tmp_path: Path, name: str) -> None:
    out = copy_run(side_run, tmp_path)
    target = out / LAST / name
    target.write_bytes(target.read_bytes()[:100])
    codes = {(f.rule, f.severity) for f in api.scan(str(out)).findings if f.path == LAST}
    assert ("CKD102", Severity.ERROR) in codes


def test_a_cut_training_args_is_a_warning_the_resume_never_reads_it(side_run: Path, tmp_path: Path) -> None:
    out = copy_run(side_run, tmp_path)
    target = out / LAST / "training_args.bin"
    target.write_bytes(target.read_bytes()[:100])
    found = {(f.rule, f.severity) for f in api.scan(str(out)).findings if f.rule in ("CKD102", "CKD203")}
    assert found == {("CKD203", Severity.WARNING)}
