"""Proof: a stale `pytorch_model.bin` beside a newer `model.safetensors` (same names and shapes, other values) is
what `--deep` tells apart, and the real resume loads `model.safetensors`.

One tiny Llama run (8 steps, saves at 4 and 8; `model.safetensors` only) is trained once. A test plants in a copy of
`checkpoint-8` the `pytorch_model.bin` a `torch.save(state_dict)` writes, of step 4's weights (stale) or of step 8's
(current): the plain scan sees two alike forms either way; `--deep` reports the stale one only.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from ckptdoctor.scanner import scan  # noqa: E402
from tests.helpers.trainer_runs import Tokens, llama  # noqa: E402

pytestmark = pytest.mark.slow


def trainer(out: Path, callbacks: list[Any] | None = None) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=8, save_steps=4, logging_steps=4, per_device_train_batch_size=4,
        learning_rate=1e-2, use_cpu=True, report_to="none", disable_tqdm=True, seed=0,
    )
    return transformers.Trainer(model=llama(), args=args, train_dataset=Tokens(), callbacks=callbacks)


@pytest.fixture(scope="module")
def stale_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("stale") / "out"
    trainer(out).train()
    return out


def planted(stale_run: Path, tmp_path: Path, step: int) -> Path:
    """A copy of the run whose `checkpoint-8` also holds a `pytorch_model.bin` of step ``step``'s weights."""
    out = tmp_path / "out"
    shutil.copytree(stale_run, out)
    weights = load_file(str(out / f"checkpoint-{step}" / "model.safetensors"))
    torch.save(weights, out / "checkpoint-8" / "pytorch_model.bin")
    return out


def ckd206(out: Path, deep: bool) -> list[str]:
    return [f.message for f in scan(str(out), deep=deep).findings if f.rule == "CKD206"]


class Snapshot(transformers.TrainerCallback):  # type: ignore[misc]
    """The model's parameters at ``on_train_begin``: after ``_load_from_checkpoint``, before any step."""

    def __init__(self) -> None:
        self.params: dict[str, Any] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.params = {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_stale_bin_differs_in_value_and_the_resume_loads_the_safetensors(stale_run: Path, tmp_path: Path) -> None:
    out = planted(stale_run, tmp_path, 4)
    ck = out / "checkpoint-8"
    assert ckd206(out, deep=False) == []  # same names, dtypes and shapes: no tensor bytes read, nothing to say
    (msg,) = ckd206(out, deep=True)
    assert "same tensor names, dtypes and shapes but different values" in msg, msg
    assert "a resume loads `model.safetensors` and ignores `pytorch_model.bin`" in msg, msg
    current, stale = load_file(str(ck / "model.safetensors")), torch.load(ck / "pytorch_model.bin")
    differ = sum(not torch.equal(current[k], stale[k]) for k in current)
    assert f"({differ:,} of {len(current):,} tensors compared differ" in msg, msg
    snap = Snapshot()
    trainer(out, [snap]).train(resume_from_checkpoint=str(ck))  # at max_steps: loads, trains no step
    assert all(torch.equal(snap.params[k], v) for k, v in current.items())
    assert not all(torch.equal(snap.params[k], v) for k, v in stale.items())


def test_a_bin_equal_to_the_safetensors_is_silent(stale_run: Path, tmp_path: Path) -> None:
    out = planted(stale_run, tmp_path, 8)
    assert ckd206(out, deep=False) == [] and ckd206(out, deep=True) == []
    # values are digested only where forms compete: checkpoint-4's single form costs nothing more
    digests = {d.path: {t.digest is not None for t in d.tensors} for d in scan(str(out), deep=True).trees[0].data}
    assert digests["checkpoint-8/model.safetensors"] == digests["checkpoint-8/pytorch_model.bin"] == {True}
    assert digests["checkpoint-4/model.safetensors"] == {False}
