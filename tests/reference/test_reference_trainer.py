"""The reference trainer itself: determinism across resumes, the Trainer's file layout, schedules and rotation."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ckptdoctor.reference.train import (
    TrainConfig,
    create_optimizer,
    create_scheduler,
    get_last_checkpoint,
    train,
)
from tests.helpers.reference import TOL, max_difference, uninterrupted_losses

VARIANTS = {
    "full-safetensors": {},
    "full-bin": {"weights_format": "bin"},
    "sharded": {"weights_format": "sharded"},
    "lora": {"use_lora": True},
    "lora-second-adapter": {"use_lora": True, "second_adapter": "aux"},
    "ga2-cosine-warmup-ratio": {"gradient_accumulation_steps": 2, "lr_scheduler_type": "cosine",
                                "warmup_steps": 0.25},
    "constant-with-warmup-2-epochs": {"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 2,
                                      "num_samples": 24},
    "constant-for-loop-adamw": {"lr_scheduler_type": "constant", "optim": "adamw_torch"},
}


def config(tmp_path: Path, **changes: object) -> TrainConfig:
    """12 steps, a checkpoint every 4."""
    return TrainConfig(output_dir=str(tmp_path / "run"), max_steps=12, save_steps=4).replace(**changes)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_resume_from_a_healthy_checkpoint_reproduces_the_uninterrupted_losses(tmp_path: Path, variant: str) -> None:
    cfg = config(tmp_path, **VARIANTS[variant])
    train(cfg, preempt_after_step=8)
    resumed = train(cfg, resume_from_checkpoint=True)
    assert resumed.resumed_from == tmp_path / "run" / "checkpoint-8"
    assert sorted(resumed.losses) == [9, 10, 11, 12]
    assert resumed.optimizer_restored and resumed.rng_restored
    assert max_difference(uninterrupted_losses(cfg), resumed.losses) <= TOL


def test_resume_from_an_older_checkpoint_path_also_reproduces(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    full = train(cfg)
    resumed = train(cfg, resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    assert sorted(resumed.losses) == list(range(5, 13))
    assert max_difference(full.losses, resumed.losses) <= TOL


def test_the_loss_falls(tmp_path: Path) -> None:
    losses = train(config(tmp_path, max_steps=24, num_samples=48)).losses
    assert sum(list(losses.values())[-4:]) < sum(list(losses.values())[:4]) - 0.5


def test_checkpoint_layout_matches_the_trainer(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    train(cfg, preempt_after_step=8)
    out = tmp_path / "run"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-4", "checkpoint-8"]
    folder = out / "checkpoint-8"
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt",
        "trainer_state.json", "training_args.bin"]
    # trainer_state.json is written last (the Trainer's order) ...
    assert max(folder.iterdir(), key=lambda p: p.stat().st_mtime_ns).name == "trainer_state.json"
    # ... with every TrainerState field of transformers 5.x, in its exact serialisation.
    from transformers.trainer_callback import TrainerState

    text = (folder / "trainer_state.json").read_text()
    state = json.loads(text)
    assert set(state) == {f.name for f in dataclasses.fields(TrainerState)}
    assert text == json.dumps(state, indent=2, sort_keys=True) + "\n"
    loaded = TrainerState.load_from_json(str(folder / "trainer_state.json"))
    assert (loaded.global_step, loaded.max_steps, loaded.save_steps, loaded.train_batch_size) == (8, 12, 4, 4)
    assert [entry["step"] for entry in loaded.log_history] == list(range(1, 9))
    assert set(loaded.log_history[0]) == {"epoch", "grad_norm", "learning_rate", "loss", "step"}
    assert state["stateful_callbacks"]["TrainerControl"]["args"]["should_save"] is True

    config_json = json.loads((folder / "config.json").read_text())
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [config_json["vocab_size"],
                                                                         config_json["hidden_size"]]
        assert len(f.keys()) > 10

    optimizer = torch.load(folder / "optimizer.pt", weights_only=True)
    assert len(optimizer["param_groups"]) == 2
    assert all(float(s["step"]) == 8 for s in optimizer["state"].values())
    assert optimizer["param_groups"][0]["initial_lr"] == cfg.learning_rate
    scheduler = torch.load(folder / "scheduler.pt", weights_only=True)
    assert scheduler["last_epoch"] == 8 and scheduler["_step_count"] == 9
    assert scheduler["lr_lambdas"] == [{}, {}] and scheduler["base_lrs"] == [cfg.learning_rate] * 2
    rng = torch.load(folder / "rng_state.pth", weights_only=False)
    assert set(rng) == {"python", "numpy", "cpu"}
    args = torch.load(folder / "training_args.bin", weights_only=False)
    assert isinstance(args, TrainConfig) and args.max_steps == 12


def test_sharded_and_lora_layouts(tmp_path: Path) -> None:
    train(config(tmp_path, weights_format="sharded", max_steps=4))
    folder = tmp_path / "run" / "checkpoint-4"
    index_text = (folder / "model.safetensors.index.json").read_text()
    index = json.loads(index_text)
    assert index_text == json.dumps(index, indent=2, sort_keys=True) + "\n"
    shards = sorted(p.name for p in folder.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == 4 * index["metadata"]["total_parameters"]  # float32

    train(config(tmp_path, output_dir=str(tmp_path / "lora"), use_lora=True, second_adapter="aux", max_steps=4))
    folder = tmp_path / "lora" / "checkpoint-4"
    names = {p.name for p in folder.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "aux"} <= names
    assert not names & {"model.safetensors", "pytorch_model.bin", "config.json"}
    assert (folder / "aux" / "adapter_model.safetensors").is_file()
    adapter_config = json.loads((folder / "adapter_config.json").read_text())
    assert adapter_config["peft_type"] == "LORA" and sorted(adapter_config["target_modules"]) == ["q_proj", "v_proj"]


@pytest.mark.parametrize("kind, warmup", [("linear", 0), ("linear", 3), ("linear", 0.2), ("cosine", 2),
                                          ("constant", 0), ("constant_with_warmup", 3),
                                          ("constant_with_warmup", 0.5), ("polynomial", 2),
                                          ("cosine_with_restarts", 1), ("inverse_sqrt", 2)])
def test_schedules_match_transformers(kind: str, warmup: float) -> None:
    from transformers.optimization import get_scheduler

    cfg = TrainConfig(lr_scheduler_type=kind, warmup_steps=warmup)
    ours_opt = create_optimizer(torch.nn.Linear(2, 2), cfg)
    theirs_opt = create_optimizer(torch.nn.Linear(2, 2), cfg)
    ours = create_scheduler(ours_opt, cfg, 10)
    # transformers 5.x: warmup_steps < 1 is a ratio of num_training_steps (TrainingArguments.get_warmup_steps).
    theirs = get_scheduler(kind, theirs_opt, num_warmup_steps=warmup if warmup >= 1 else int(-(-10 * warmup // 1)),
                           num_training_steps=10)
    for _ in range(10):
        assert ours.get_last_lr() == pytest.approx(theirs.get_last_lr(), abs=1e-12)
        ours_opt.step()
        theirs_opt.step()
        ours.step()
        theirs.step()
    expected = None if kind == "constant" else {}
    assert ours.state_dict()["lr_lambdas"] == [expected, expected]


def test_get_last_checkpoint_agrees_with_transformers(tmp_path: Path) -> None:
    from transformers.trainer_utils import get_last_checkpoint as theirs

    for name in ["checkpoint-4", "checkpoint-0010", "tmp-checkpoint-99", "checkpoint-15.bak", "Checkpoint-40"]:
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint-50").write_text("a file, not a folder")
    assert get_last_checkpoint(tmp_path) == tmp_path / "checkpoint-0010"
    assert theirs(str(tmp_path)) == str(tmp_path / "checkpoint-0010")


def test_save_total_limit_rotates_the_oldest(tmp_path: Path) -> None:
    train(config(tmp_path, save_steps=2, save_total_limit=2))
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-10", "checkpoint-12"]


def test_a_crash_during_an_atomic_save_leaves_no_checkpoint_folder(tmp_path: Path) -> None:
    class Killed(Exception):
        pass

    def kill(path: Path) -> None:
        if path.name == "optimizer.pt" and path.parent.name == "tmp-checkpoint-8":
            raise Killed

    cfg = config(tmp_path)
    with pytest.raises(Killed):
        train(cfg, save_hook=kill)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-4", "tmp-checkpoint-8"]
    resumed = train(cfg, resume_from_checkpoint=True)  # tmp-checkpoint-8 never matches checkpoint-N
    assert resumed.resumed_from == tmp_path / "run" / "checkpoint-4"
    assert max_difference(uninterrupted_losses(cfg), resumed.losses) <= TOL


def test_rerun_into_the_same_folder_replaces_checkpoints_whole(tmp_path: Path) -> None:
    cfg = config(tmp_path, max_steps=4)
    train(cfg)
    (tmp_path / "run" / "checkpoint-4" / "stray.txt").write_text("from before")
    train(cfg.replace(learning_rate=1e-2))
    assert not (tmp_path / "run" / "checkpoint-4" / "stray.txt").exists()
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith("tmp-")]


def test_optimizer_and_scheduler_are_restored_together_or_not_at_all(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    train(cfg, preempt_after_step=8)
    os.remove(tmp_path / "run" / "checkpoint-8" / "scheduler.pt")
    resumed = train(cfg, resume_from_checkpoint=True)
    assert not resumed.optimizer_restored
    # A fresh schedule from its step 0: the full base LR, while global_step continues at 9.
    assert resumed.learning_rates[9] == cfg.learning_rate
    assert max_difference(uninterrupted_losses(cfg), resumed.losses) > 1e-4


def test_unknown_settings_are_rejected() -> None:
    with pytest.raises(ValueError, match="lr_scheduler_type"):
        TrainConfig(lr_scheduler_type="wsd")
    with pytest.raises(ValueError, match="weights_format"):
        TrainConfig(weights_format="gguf")


def test_resuming_a_finished_run_mid_epoch_trains_one_step_at_lr_zero_like_the_trainer(tmp_path: Path) -> None:
    """transformers checks `should_training_stop` only after a step: a checkpoint at max_steps in the middle of an
    epoch resumes into one more step (at the LR 0 stored in optimizer.pt). ckptdoctor's gate predicts the same and is
    checked against the real Trainer in tests/gate/test_gate_transformers.py."""
    cfg = config(tmp_path, max_steps=6, save_steps=3, num_samples=16)  # 4 steps per epoch: step 6 is mid-epoch 2
    train(cfg)
    resumed = train(cfg, resume_from_checkpoint=True)
    assert resumed.resumed_from == tmp_path / "run" / "checkpoint-6"
    assert sorted(resumed.losses) == [7]
    assert resumed.learning_rates[7] == 0.0
