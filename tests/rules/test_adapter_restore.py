"""Proof: what a full-weights file beside a LoRA adapter restores on a real resume, and that ckptdoctor counts it.

The Trainer's resume loads `model.safetensors` (else `pytorch_model.bin`) into the PeftModel with
`load_state_dict(state_dict, False)` and skips the adapter loader. One tiny LoRA run (4 steps, saves at 2 and 4)
is trained once; at each save a callback also writes the full-weights files real code writes beside an adapter.
Each test plants one of them in a copy of `checkpoint-2`, asks CKD201 and `check_resume` (the gate), resumes the
real Trainer, and counts the adapter tensors whose value at `on_train_begin` (after the load) is the checkpoint's.
"""

from __future__ import annotations

import copy
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from safetensors.torch import load_file  # noqa: E402

from ckptdoctor import trainer_view  # noqa: E402
from ckptdoctor.discover import discover  # noqa: E402
from ckptdoctor.integrations.transformers import ResumeGateError, check_resume  # noqa: E402
from ckptdoctor.resume_gate import gate  # noqa: E402
from ckptdoctor.scanner import scan  # noqa: E402
from tests.helpers.trainer_runs import Tokens, llama  # noqa: E402

STEPS = 4
TARGETS = ["q_proj", "v_proj"]
ADAPTER_TENSORS = 8  # 2 layers x (q_proj, v_proj) x (lora_A, lora_B)
VARIANTS = {  # what real code writes beside the adapter: (file name, what the resume restores of the adapter)
    "base-save-pretrained": ("model.safetensors", 0),  # peft_model.get_base_model().save_pretrained(ckpt)
    "base-state-dict": ("pytorch_model.bin", 0),  # torch.save(peft_model.get_base_model().state_dict(), ...)
    "peft-state-dict": ("pytorch_model.bin", ADAPTER_TENSORS),  # torch.save(peft_model.state_dict(), ...)
    "stub": ("pytorch_model.bin", 0),  # torch.save({}, ...) from a save hook
    "merged": ("model.safetensors", 0),  # peft_model.merge_and_unload().save_pretrained(ckpt), of a copy
}


def lora_model(seed: int) -> Any:
    """The tiny Llama with a LoRA adapter whose initial lora_A values depend on ``seed`` (lora_B starts at 0)."""
    model = llama()
    torch.manual_seed(seed)
    return peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=TARGETS,
                                                      task_type="CAUSAL_LM"))


class SaveVariants(transformers.TrainerCallback):  # type: ignore[misc]
    """At each save, writes every variant of ``VARIANTS`` for that step into ``variants/<name>/checkpoint-N``."""

    def on_save(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        root = Path(args.output_dir).parent / "variants"
        step = f"checkpoint-{state.global_step}"
        for name in VARIANTS:
            (root / name / step).mkdir(parents=True)
        base = model.get_base_model()
        base.save_pretrained(root / "base-save-pretrained" / step)
        torch.save(base.state_dict(), root / "base-state-dict" / step / "pytorch_model.bin")
        torch.save(model.state_dict(), root / "peft-state-dict" / step / "pytorch_model.bin")
        torch.save({}, root / "stub" / step / "pytorch_model.bin")
        copy.deepcopy(model).merge_and_unload().save_pretrained(root / "merged" / step)


def trainer(out: Path, model: Any, callbacks: list[Any] | None = None) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=STEPS, save_steps=2, logging_steps=1, per_device_train_batch_size=4,
        learning_rate=1e-2, use_cpu=True, report_to="none", disable_tqdm=True, seed=0,
    )
    return transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)


@pytest.fixture(scope="module")
def lora_saves(tmp_path_factory: pytest.TempPathFactory) -> Path:
    top = tmp_path_factory.mktemp("restore")
    trainer(top / "out", lora_model(0), [SaveVariants()]).train()
    return top


def planted(lora_saves: Path, tmp_path: Path, variant: str) -> Path:
    """A copy of the run whose `checkpoint-2` also holds ``variant``'s full-weights file."""
    out = tmp_path / "out"
    shutil.copytree(lora_saves / "out", out)
    name, _ = VARIANTS[variant]
    shutil.copy(lora_saves / "variants" / variant / "checkpoint-2" / name, out / "checkpoint-2" / name)
    return out


class Snapshot(transformers.TrainerCallback):  # type: ignore[misc]
    """The PeftModel's adapter parameters at ``on_train_begin``: after ``_load_from_checkpoint``, before a step."""

    def __init__(self) -> None:
        self.params: dict[str, Any] = {}

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.params = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}


def really_restored(out: Path, snapshot: dict[str, Any]) -> tuple[int, int]:
    """Of the checkpoint's adapter tensors, how many the resumed PeftModel holds (all; and the lora_B ones)."""
    saved = load_file(str(out / "checkpoint-2" / "adapter_model.safetensors"))
    assert len(saved) == ADAPTER_TENSORS and all(bool(t.any()) for k, t in saved.items() if "lora_B" in k)
    equal = {k for k, t in saved.items()
             if torch.equal(snapshot[re.sub(r"\.(lora_[AB])\.weight$", r".\1.default.weight", k)], t)}
    return len(equal), sum("lora_B" in k for k in equal)


def ckd201(out: Path) -> list[str]:
    return [f.message for f in scan(str(out)).findings if f.rule == "CKD201" and f.path.startswith("checkpoint-2/")]


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ckptdoctor_counts_what_the_real_resume_restores(lora_saves: Path, tmp_path: Path, variant: str) -> None:
    out = planted(lora_saves, tmp_path, variant)
    name, expected = VARIANTS[variant]
    snap = Snapshot()
    tr = trainer(out, lora_model(1), [snap])
    found = ckd201(out)
    if expected == ADAPTER_TENSORS:
        assert found == []
        assert check_resume(tr, str(out / "checkpoint-2")).adapter_tensors == (ADAPTER_TENSORS, ADAPTER_TENSORS)
    else:
        (msg,) = found
        assert msg.startswith(f"`checkpoint-2/{name}` holds "), msg
        assert f"restores {expected} of {ADAPTER_TENSORS} adapter tensors" in msg, msg
        with pytest.raises(ResumeGateError) as info:
            check_resume(tr, str(out / "checkpoint-2"))
        result = info.value.result
        assert result.weights_branch == "full" and result.adapter_tensors == (expected, ADAPTER_TENSORS)
        assert [f.message for f in result.findings if f.rule == "CKD201"] == [msg.replace("checkpoint-2/", "", 1)]
    tr.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    restored, lora_b = really_restored(out, snap.params)
    assert (restored, lora_b) == (expected, expected // 2)


@pytest.mark.slow
def test_the_gate_fails_on_a_base_model_save(lora_saves: Path, tmp_path: Path) -> None:
    """`gate` of the run: `weights: full`, and CKD201 says what the load restores."""
    out = planted(lora_saves, tmp_path, "base-save-pretrained")
    result = gate(out, checkpoint="checkpoint-2")
    assert result.verdict == "fail" and result.weights_branch == "full"
    assert result.to_json()["resolved"]["adapter_tensors_restored"] == {"restored": 0, "total": ADAPTER_TENSORS}
    (msg,) = [f.message for f in result.findings if f.rule == "CKD201"]
    assert f"restores 0 of {ADAPTER_TENSORS} adapter tensors" in msg
    assert "`model.layers.0.self_attn.q_proj.lora_A.default.weight`" in msg


def test_adapter_keys_map_to_the_parameters_peft_loads_them_into(tmp_path: Path) -> None:
    """A PeftModel with a second named adapter and a `modules_to_save` head, saved by its own save_pretrained (the
    root adapter and `aux/`) and as a whole state dict: every adapter key names a real parameter of that model, and
    the state dict restores all of them; the base model's state dict restores none."""
    from peft.utils.save_and_load import _insert_adapter_name_into_state_dict

    model = lora_model(0)
    model.add_adapter("aux", peft.LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj"], modules_to_save=["lm_head"],
                                             task_type="CAUSAL_LM"))
    ck = tmp_path / "checkpoint-2"
    model.save_pretrained(ck, selected_adapters=["default", "aux"])
    params = dict(model.state_dict())
    saved = load_file(str(ck / "aux" / "adapter_model.safetensors"))
    assert "base_model.model.lm_head.weight" in saved  # modules_to_save: saved without its wrapper's names
    for key in saved:
        mapped = trainer_view.model_key(key, "aux", "lora_", ("lm_head",))
        assert mapped in params, mapped
        if ".lora_" in key:
            assert {mapped} == set(_insert_adapter_name_into_state_dict({key: 0}, "aux", "lora_"))
    for whole, restored in ((model.state_dict(), 8 + len(saved)), (model.get_base_model().state_dict(), 0)):
        torch.save(whole, ck / "pytorch_model.bin")
        (found,) = [trainer_view.adapter_restore(c) for r in discover(str(ck)).runs for c in r.checkpoints]
        assert found is not None and (found.restored, found.total) == (restored, 8 + len(saved))


@pytest.mark.slow
def test_the_fix_lets_the_real_resume_restore_the_adapter(lora_saves: Path, tmp_path: Path) -> None:
    """CKD201's quarantine of a base model's `model.safetensors`: the next real resume loads the adapter, all of it."""
    from ckptdoctor.api import fix

    out = planted(lora_saves, tmp_path, "base-save-pretrained")
    result = fix(out, select=["CKD201"], force=True)  # force: a copy made a moment ago looks like a run being written
    assert result.exit_code() == 0 and not (out / "checkpoint-2" / "model.safetensors").exists()
    assert ckd201(out) == []
    snap = Snapshot()
    trainer(out, lora_model(1), [snap]).train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert really_restored(out, snap.params) == (ADAPTER_TENSORS, ADAPTER_TENSORS // 2)
