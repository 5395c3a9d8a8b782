"""No false positives on checkpoints the real transformers Trainer writes, and real hazards still found on them.

Tiny models built from configs (no downloads), a synthetic token dataset, CPU only: a full fine-tune with a tied
lm_head, warm-up and evaluation (best_model_checkpoint), LoRA, two named adapters, and a model whose save is
sharded. A clean Trainer checkpoint yields no warning or error and no CKD6xx finding at all (training_args.bin and
rng_state.pth are allowlisted); the only info allowed is CKD401 on the last checkpoint of a finished schedule.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.trainer_runs import STEPS, VOCAB, describe, llama, llama_config, train

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from ckptdoctor.findings import Severity  # noqa: E402
from ckptdoctor.scanner import scan  # noqa: E402


def gpt2() -> Any:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def lora(model: Any, *, second: bool = False, targets: tuple[str, ...] = ("q_proj", "v_proj")) -> Any:
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=list(targets), task_type="CAUSAL_LM")
    m = peft.get_peft_model(model, cfg)
    if second:
        # A second named adapter, saved by PeftModel.save_pretrained into the `aux/` subfolder.
        m.add_adapter("aux", peft.LoraConfig(r=4, lora_alpha=8, target_modules=["k_proj"], task_type="CAUSAL_LM"))
    return m


class ShardedLlama(transformers.LlamaForCausalLM):  # type: ignore[misc]
    """A model whose save_pretrained (and so the Trainer's save) shards at 4 KB."""

    def save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["max_shard_size"] = "4KB"
        return super().save_pretrained(*args, **kwargs)


def sharded_llama() -> Any:
    torch.manual_seed(0)
    return ShardedLlama(llama_config())


def _full(out: Path) -> Path:
    return train(out, gpt2(), warmup_steps=1, eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
                 metric_for_best_model="loss")


RUNS: dict[str, Callable[[Path], Path]] = {
    "full": _full,
    "lora": lambda out: train(out, lora(llama())),
    "multi-adapter": lambda out: train(out, lora(llama(), second=True)),
    "sharded": lambda out: train(out, sharded_llama()),
    # The LR rises at each restart by design: training_args.bin says so, and CKD406 must read it.
    "cosine-restarts": lambda out: train(out, llama(), lr_scheduler_type="cosine_with_restarts",
                                         lr_scheduler_kwargs={"num_cycles": 2}),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Each Trainer run once per module, built on first use."""
    root = tmp_path_factory.mktemp("trainer")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = RUNS[name](root / name)
        return cache[name]

    return get


def files(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("name", sorted(RUNS))
def test_trainer_checkpoints_have_no_false_positives(name: str, trained: Callable[[str], Path]) -> None:
    out = trained(name)
    found = list(scan(str(out)).findings)
    bad = [f for f in found if f.severity != Severity.INFO or f.rule.startswith("CKD6")]
    assert not bad, describe(found)
    # The schedule ends at LR 0 at max_steps: only the last checkpoint may say so.
    assert [(f.rule, f.path) for f in found] == [("CKD401", f"checkpoint-{STEPS}")], describe(found)


def test_the_runs_hold_what_they_claim(trained: Callable[[str], Path]) -> None:
    """Guard the premise: each run wrote the layout its name promises."""
    full = files(trained("full") / "checkpoint-2")
    assert {"model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt", "training_args.bin"} <= full
    state = json.loads((trained("full") / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["best_model_checkpoint"] is not None
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files(trained("lora") / "checkpoint-2")
    aux = {"aux/adapter_model.safetensors", "aux/adapter_config.json"}
    assert aux <= files(trained("multi-adapter") / "checkpoint-2")
    sharded = files(trained("sharded") / "checkpoint-2")
    assert "model.safetensors.index.json" in sharded and "model.safetensors" not in sharded
    assert len([n for n in sharded if n.startswith("model-0")]) >= 3
    state_file = trained("cosine-restarts") / "checkpoint-4" / "trainer_state.json"
    history = json.loads(state_file.read_text())["log_history"]
    lrs = [e["learning_rate"] for e in history if "learning_rate" in e]
    steps = list(itertools.pairwise(lrs))
    assert any(b > a for a, b in steps) and any(b < a for a, b in steps), lrs


def test_copied_to_another_machine_the_run_stays_clean(trained: Callable[[str], Path], tmp_path: Path) -> None:
    """A relative output_dir (what most scripts use) and a later copy: best_model_checkpoint is relative."""
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        train(Path("rel-out"), llama(), save_only_model=True, eval_strategy="steps", eval_steps=2,
              load_best_model_at_end=True)
    finally:
        os.chdir(cwd)
    moved = tmp_path / "moved"
    shutil.copytree(tmp_path / "rel-out", moved)
    state = json.loads((moved / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["best_model_checkpoint"].startswith("rel-out/checkpoint-")
    found = list(scan(str(moved)).findings)
    assert not [f for f in found if f.severity != Severity.INFO], describe(found)


class StrayStateDict(transformers.TrainerCallback):  # type: ignore[misc]
    """A save callback that stores `torch.save(state_dict)` of an unpopulated model: `{}` (ZeRO-3 style)."""

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        torch.save({}, folder / "pytorch_model.bin")


def test_stub_shadowing_a_trainer_lora_checkpoint_is_found(tmp_path: Path) -> None:
    out = train(tmp_path / "stub", lora(llama()), callbacks=[StrayStateDict()])
    found = list(scan(str(out)).findings)
    hits = [f for f in found if f.rule == "CKD201"]
    assert [f.path for f in hits] == ["checkpoint-2/pytorch_model.bin", "checkpoint-4/pytorch_model.bin"], describe(
        found
    )
    size = (out / "checkpoint-4" / "pytorch_model.bin").stat().st_size
    assert f"holds 0 tensors ({size:,} bytes)" in hits[1].message
    assert "instead of `adapter_model.safetensors`" in hits[1].message


def test_a_second_trainer_run_leaves_a_stale_higher_checkpoint(tmp_path: Path) -> None:
    """Run 1: 6 steps (checkpoint-2/4/6). Run 2, same output_dir, 4 steps at another LR: resume picks run 1's 6."""
    out = tmp_path / "stale"
    train(out, llama(), max_steps=6)
    train(out, llama(), learning_rate=5e-4)
    found = list(scan(str(out)).findings)
    hits = [f for f in found if f.rule == "CKD101"]
    assert [f.path for f in hits] == ["checkpoint-6"], describe(found)
    assert "picks `checkpoint-6`" in hits[0].message
    # Whether file times can tell which run is newer depends on how far apart the runs are: both messages name the
    # other run's newest checkpoint and say it belongs to another run.
    assert "`checkpoint-4`" in hits[0].message and "belongs to another run" in hits[0].message
    assert "learning_rate" in hits[0].message and "max_steps 4 vs 6" in hits[0].message


def test_a_trainer_resume_with_other_lora_modules_is_found(tmp_path: Path) -> None:
    """Trained on (q_proj, v_proj), resumed on (k_proj, v_proj): same shapes, so only the history tells."""
    out = train(tmp_path / "swap", lora(llama()))
    train(out, lora(llama(), targets=("k_proj", "v_proj")), max_steps=STEPS + 2, resume_from_checkpoint=True)
    found = list(scan(str(out)).findings)
    hits = [f for f in found if f.rule == "CKD405"]
    assert [f.path for f in hits] == [f"checkpoint-{STEPS + 2}"], describe(found)
    assert f"resumed from `checkpoint-{STEPS}`" in hits[0].message
    assert "[q_proj, v_proj] (r=2)" in hits[0].message and "trains [k_proj, v_proj] (r=2)" in hits[0].message
