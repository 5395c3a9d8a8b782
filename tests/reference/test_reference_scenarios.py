"""Every scenario builds, leaves the hazard it names on disk, and the checked-in fixtures match the builders."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from ckptdoctor.reference.__main__ import main
from ckptdoctor.reference.scenarios import SCENARIOS, build
from tests.helpers.paths import REPO
from tests.helpers.reference import build_scenario

FIXTURES = REPO / "fixtures"
DISTRIBUTED = {"fsdp", "fsdp-missing-rank"}  # two processes each: checked once, in the slow test below
FULL = {"config.json", "model.safetensors", "optimizer.pt", "rng_state.pth", "scheduler.pt", "trainer_state.json",
        "training_args.bin"}
LORA = (FULL - {"config.json", "model.safetensors"}) | {"README.md", "adapter_config.json",
                                                         "adapter_model.safetensors"}


def names(folder: Path) -> set[str]:
    """File and folder names directly inside ``folder``."""
    return {p.name for p in folder.iterdir()}


def shards(folder: Path) -> list[Path]:
    """The ``model-*-of-*.safetensors`` files."""
    return sorted(folder.glob("model-*-of-*.safetensors"))


# What each scenario must leave behind: checkpoint folders, and the files of the checkpoint that matters.
def check_clean_full(out: Path) -> None:
    assert names(out / "checkpoint-8") == FULL


def check_clean_bin(out: Path) -> None:
    assert names(out / "checkpoint-8") == FULL - {"model.safetensors"} | {"pytorch_model.bin"}


def check_clean_lora(out: Path) -> None:
    assert names(out / "checkpoint-8") == LORA


def check_lora_second_adapter(out: Path) -> None:
    assert names(out / "checkpoint-8") == LORA | {"aux"}
    assert names(out / "checkpoint-8" / "aux") == {"adapter_config.json", "adapter_model.safetensors"}


def check_sharded(out: Path) -> None:
    folder = out / "checkpoint-8"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(shards(folder)) >= 3 and set(index["weight_map"].values()) == {p.name for p in shards(folder)}


def check_stub_shadow(out: Path) -> None:
    for step in (4, 8):
        assert names(out / f"checkpoint-{step}") == LORA | {"pytorch_model.bin"}
        assert (out / f"checkpoint-{step}" / "pytorch_model.bin").stat().st_size < 2000


def check_stale_higher(out: Path) -> None:
    assert names(out) == {"checkpoint-4", "checkpoint-8", "checkpoint-12"}
    stale = json.loads((out / "checkpoint-12" / "trainer_state.json").read_text())
    current = json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())
    assert (stale["max_steps"], current["max_steps"]) == (12, 10)
    assert stale["log_history"][0]["learning_rate"] != current["log_history"][0]["learning_rate"]


def check_lr_finished(out: Path) -> None:
    state = json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["global_step"] == state["max_steps"] == 8


def check_sharded_missing_shard(out: Path) -> None:
    index = json.loads((out / "checkpoint-8" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) - {p.name for p in shards(out / "checkpoint-8")}


def check_sharded_wrong_index(out: Path) -> None:
    index = json.loads((out / "checkpoint-8" / "model.safetensors.index.json").read_text())
    assert shards(out / "checkpoint-8")[-1].name not in set(index["weight_map"].values())


def check_sharded_truncated_shard(out: Path) -> None:
    healthy, cut = shards(out / "checkpoint-4")[-1], shards(out / "checkpoint-8")[-1]
    assert cut.stat().st_size == healthy.stat().st_size // 2


def check_interrupted_save(out: Path) -> None:
    assert names(out / "checkpoint-8") == FULL - {"rng_state.pth", "trainer_state.json"}
    assert names(out / "checkpoint-4") == FULL


def check_optimizer_mismatch(out: Path) -> None:
    assert names(out) == {"checkpoint-4", "checkpoint-8", "checkpoint-12"}
    targets = [sorted(json.loads((out / f"checkpoint-{s}" / "adapter_config.json").read_text())["target_modules"])
               for s in (8, 12)]
    assert targets == [["q_proj", "v_proj"], ["k_proj", "v_proj"]]


def check_prefixed(prefix: str) -> object:
    def check(out: Path) -> None:
        from safetensors import safe_open

        with safe_open(str(out / "checkpoint-8" / "model.safetensors"), "pt") as f:
            assert all(key.startswith(prefix) for key in f.keys())  # noqa: SIM118 (safe_open is not iterable)

    return check


def check_fsdp_missing_rank(out: Path) -> None:
    folder = out / "checkpoint-4"
    assert names(folder) == {"pytorch_model_fsdp_0", "optimizer_0", "rng_state_0.pth", "rng_state_1.pth",
                             "scheduler.pt", "trainer_state.json"}
    assert names(folder / "optimizer_0") == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    assert names(folder / "pytorch_model_fsdp_0") == {".metadata", "__0_0.distcp"}


CHECKS = {
    "clean-full": check_clean_full,
    "clean-bin": check_clean_bin,
    "clean-lora": check_clean_lora,
    "lora-second-adapter": check_lora_second_adapter,
    "sharded": check_sharded,
    "stub-shadow": check_stub_shadow,
    "stale-higher": check_stale_higher,
    "lr-finished": check_lr_finished,
    "sharded-missing-shard": check_sharded_missing_shard,
    "sharded-wrong-index": check_sharded_wrong_index,
    "sharded-truncated-shard": check_sharded_truncated_shard,
    "interrupted-save": check_interrupted_save,
    "optimizer-mismatch": check_optimizer_mismatch,
    "prefixed-keys-compile": check_prefixed("_orig_mod."),
    "prefixed-keys-ddp": check_prefixed("module."),
    "fsdp": lambda out: None,  # built (and checked) as part of fsdp-missing-rank
    "fsdp-missing-rank": check_fsdp_missing_rank,
}


def test_every_scenario_has_a_check() -> None:
    assert set(CHECKS) == set(SCENARIOS)


@pytest.mark.parametrize("name", sorted(set(SCENARIOS) - DISTRIBUTED))
def test_scenario_builds_its_hazard(tmp_path: Path, name: str) -> None:
    out = build_scenario(name, tmp_path)
    CHECKS[name](out)  # type: ignore[operator]
    fixture = FIXTURES / name
    if fixture.is_dir():  # the checked-in copy has the same layout as a fresh build
        assert layout(fixture) == layout(out)


@pytest.mark.slow
def test_fsdp_scenarios_build(tmp_path: Path) -> None:
    out = build_scenario("fsdp-missing-rank", tmp_path)
    check_fsdp_missing_rank(out)
    for name in DISTRIBUTED:
        if (FIXTURES / name).is_dir():
            assert layout(FIXTURES / name) - {"checkpoint-4/pytorch_model_fsdp_0/__1_0.distcp"} == layout(out)


def layout(root: Path) -> set[str]:
    """Relative paths of every file under ``root``."""
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def test_build_refuses_a_non_empty_folder_and_unknown_names(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        build("clean-full", tmp_path)
    with pytest.raises(KeyError, match="unknown scenario"):
        build("no-such-scenario", tmp_path / "new")


def test_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in SCENARIOS)
    assert main(["scenario", "interrupted-save", str(tmp_path / "s")]) == 0
    check_interrupted_save(tmp_path / "s")
    assert main(["scenario", "nope", str(tmp_path / "t")]) == 2


def test_checked_in_fixtures_are_small_complete_and_world_readable() -> None:
    if not any(FIXTURES.glob("*/checkpoint-*")):
        pytest.skip("fixtures not generated (python fixtures/make_fixtures.py)")
    assert {p.name for p in FIXTURES.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))} == set(SCENARIOS)
    files = [p for p in FIXTURES.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert sum(p.stat().st_size for p in files) < 5 * 1024 * 1024
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o644 for p in files if p.name != "make_fixtures.py")
