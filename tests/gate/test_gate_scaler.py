"""Proof: a ``scaler.pt`` resumed by a Trainer without a GradScaler crashes in ``_load_scaler``, as the gate says.

An fp16 run saves ``accelerator.scaler.state_dict()`` as ``scaler.pt``; transformers 5.23's ``_load_scaler`` calls
``self.accelerator.scaler.load_state_dict(torch.load(...))`` whenever the file exists, and accelerate 1.15 makes a
GradScaler only for fp16 off CPU. One tiny GPT-2 run (CPU, fp32: no scaler) is trained once; each test adds the
``scaler.pt`` an fp16 run writes to a copy of ``checkpoint-2``, asks the gate, then resumes the real Trainer.
"""

from __future__ import annotations

import json
import shutil
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")
from transformers import TrainingArguments  # noqa: E402

from ckptdoctor.cli import main  # noqa: E402
from ckptdoctor.integrations.transformers import ResumeGateError, check_resume  # noqa: E402
from ckptdoctor.resume_gate import GateInputError, GateResult, gate  # noqa: E402
from tests.helpers.gate_damage import cut, trainer  # noqa: E402

PLAN = 6  # max_steps of the resume: checkpoint-2 has 4 steps left


@pytest.fixture(scope="module")
def scaler_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("scaler") / "out"
    trainer(out).train()
    return out


def with_scaler(src: Path, tmp_path: Path, damage: bool = False) -> Path:
    """A copy of the run whose `checkpoint-2` holds the `scaler.pt` an fp16 run saves (optionally cut in half)."""
    out = tmp_path / "out"
    shutil.copytree(src, out)
    # An enabled GradScaler's state_dict (a CUDA one without CUDA is disabled and saves {}): the keys fp16 writes.
    state = torch.amp.GradScaler("cpu").state_dict()
    assert set(state) == {"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}
    torch.save(state, out / "checkpoint-2" / "scaler.pt")
    if damage:
        cut(out / "checkpoint-2" / "scaler.pt")
    return out


def crashes(result: GateResult) -> list[str]:
    return [f.message for f in result.findings if f.rule == "CKD413"]


def resume(tr: Any, out: Path) -> BaseException | None:
    try:
        tr.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    except Exception as exc:  # the exception is what is compared
        return exc
    return None


def test_the_real_resume_without_a_scaler_raises_and_check_resume_predicts_it(scaler_run: Path, tmp_path: Path) -> None:
    out = with_scaler(scaler_run, tmp_path)
    tr = trainer(out, max_steps=PLAN)
    assert tr.accelerator.scaler is None  # fp32 on CPU: accelerate made no GradScaler
    with pytest.raises(ResumeGateError) as info:
        check_resume(tr, str(out / "checkpoint-2"))
    (msg,) = crashes(info.value.result)
    assert "`scaler.pt`" in msg and "_load_scaler" in msg and "AttributeError" in msg, msg
    assert info.value.result.steps_to_train is None and info.value.result.lr == ()
    raised = resume(tr, out)
    assert isinstance(raised, AttributeError), repr(raised)
    assert str(raised) == "'NoneType' object has no attribute 'load_state_dict'"
    assert traceback.extract_tb(raised.__traceback__)[-1].name == "_load_scaler"


def test_a_resume_with_a_scaler_loads_it(scaler_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The resume an fp16 run on a GPU makes: a GradScaler is there, `scaler.pt` loads, training goes on."""
    out = with_scaler(scaler_run, tmp_path)
    tr = trainer(out, max_steps=PLAN)
    monkeypatch.setattr(tr.accelerator, "scaler", torch.amp.GradScaler("cpu"))
    result = check_resume(tr, str(out / "checkpoint-2"))
    assert crashes(result) == [] and result.steps_to_train == PLAN - 2
    assert resume(tr, out) is None and tr.state.global_step == PLAN


def test_a_damaged_scaler_with_a_scaler_is_torch_loads_error(scaler_run: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    out = with_scaler(scaler_run, tmp_path, damage=True)
    tr = trainer(out, max_steps=PLAN)
    monkeypatch.setattr(tr.accelerator, "scaler", torch.amp.GradScaler("cpu"))
    with pytest.raises(ResumeGateError) as info:
        check_resume(tr, str(out / "checkpoint-2"))
    (msg,) = crashes(info.value.result)
    assert msg == "`scaler.pt` is truncated: train() raises RuntimeError in _load_scaler (torch.load)", msg
    raised = resume(tr, out)
    assert type(raised) is RuntimeError, repr(raised)
    # without a scaler the same file is the AttributeError, raised before torch.load reads it
    (msg,) = crashes(gate(out, checkpoint="checkpoint-2", max_steps=PLAN, grad_scaler=False))
    assert msg.startswith("`scaler.pt` is truncated and the resume has no GradScaler: train() raises AttributeError")
    raised = resume(trainer(out, max_steps=PLAN), out)
    assert isinstance(raised, AttributeError), repr(raised)


def test_unknown_scaler_keeps_a_whole_scaler_pt_quiet(scaler_run: Path, tmp_path: Path) -> None:
    out = with_scaler(scaler_run, tmp_path)
    assert crashes(gate(out, checkpoint="checkpoint-2", max_steps=PLAN)) == []
    assert crashes(gate(out, checkpoint="checkpoint-2", max_steps=PLAN, grad_scaler=True)) == []
    assert len(crashes(gate(out, checkpoint="checkpoint-2", max_steps=PLAN, grad_scaler=False))) == 1
    # no scaler.pt: _load_scaler loads nothing
    assert crashes(gate(scaler_run, checkpoint="checkpoint-2", max_steps=PLAN, grad_scaler=False)) == []


def test_bf16_makes_no_scaler_on_any_device(scaler_run: Path, tmp_path: Path) -> None:
    """fp16 false and bf16 true: transformers asks accelerate for bf16, which never makes a GradScaler."""
    out = with_scaler(scaler_run, tmp_path)
    tr = trainer(out, max_steps=PLAN, bf16=True)
    assert tr.args.mixed_precision == "bf16" and tr.accelerator.scaler is None
    raised = resume(tr, out)
    assert isinstance(raised, AttributeError) and "load_state_dict" in str(raised), repr(raised)


def test_fp16_false_alone_leaves_the_launcher_to_decide(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """With fp16 and bf16 both false the mixed precision is ACCELERATE_MIXED_PRECISION (`accelerate launch
    --mixed_precision fp16` sets it): fp16, so a GradScaler on a GPU. The gate cannot know it from the args."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    args = TrainingArguments(str(tmp_path), report_to=[], use_cpu=True)
    assert args.fp16 is False and args.bf16 is False and args.mixed_precision == "fp16"


def cli(out: Path, tmp_path: Path, **fields: Any) -> Any:
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"max_steps": PLAN, **fields}), encoding="utf-8")
    return CliRunner().invoke(main, ["gate", str(out), "--checkpoint", "checkpoint-2", "--training-args", str(path)])


def test_the_cli_reads_the_scaler_from_fp16_and_bf16(scaler_run: Path, tmp_path: Path) -> None:
    out = with_scaler(scaler_run, tmp_path)
    result = cli(out, tmp_path, fp16=False, bf16=True)
    assert result.exit_code == 1, result.output
    assert "CKD413 [error] `scaler.pt` (saved by an fp16 run) is there and the resume has no GradScaler: train() " \
           "raises AttributeError in _load_scaler" in result.stdout
    for fields in ({"fp16": True}, {"fp16": False, "bf16": False}, {}):  # device- or launcher-dependent: unknown
        result = cli(out, tmp_path, **fields)
        assert result.exit_code == 0 and "CKD413" not in result.stdout, (fields, result.output)
    result = cli(out, tmp_path, fp16="no")
    assert result.exit_code == 2 and "fp16 must be true or false" in result.output


def test_grad_scaler_must_be_a_bool(scaler_run: Path) -> None:
    with pytest.raises(GateInputError, match="grad_scaler must be True or False"):
        gate(scaler_run, max_steps=PLAN, grad_scaler="no")
