"""Numbers a corrupt checkpoint or an attacker controls never size an allocation or a loop.

A rank in a file name (``__999999999_0.distcp``, ``zero_pp_rank_R_...``), a world size in a pickle (DeepSpeed's
``dp_world_size``, torchtitan's ``dataloader.world_size``), a shard count in a TensorFlow index: each once sized a
``set(range(n))`` or a loop. Each tree here is a copy of a real checkpoint (the repo's fixtures, tests/data, or a
``torch.distributed.checkpoint.save`` made here) with one hostile name or value, and ``scan``, ``gate`` and
``fix --dry-run`` run on it in a child process whose address space is limited to 2 GiB
(``tests/robustness/hostile_child.py``): they exit 0 or 1, report no internal error, and say what is wrong in
words that count the missing ranks rather than list them. No timing is asserted: memory is bounded by the limit and
by ``tracemalloc``'s peak, loops by counting their work.
"""

from __future__ import annotations

import io
import json
import pickle
import resource
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from ckptdoctor.limits import DEFAULT_LIMITS
from ckptdoctor.model import ReadOutcome, TfIndexFacts
from ckptdoctor.readers import tfbundle
from tests.helpers.console import HANG_GUARD, environ
from tests.helpers.paths import REPO, TESTS

torch = pytest.importorskip("torch")

ADDRESS_SPACE = 2 << 30  # the child's RLIMIT_AS: a materialised range of 10**9 ranks needs far more
FIXTURES = REPO / "fixtures"
DATA = TESTS / "data"
DS = DATA / "deepspeed-0.19.8-zero2-elastic"
BIG = 999_999_999
HUGE = 10**5000  # past Python's 4,300-digit print limit: a pickle carries it


def _limited() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def _child(*args: str) -> Any:
    """Run ``tests/robustness/hostile_child.py`` under the address-space limit; its JSON answer."""
    proc = subprocess.run([sys.executable, "-m", "tests.robustness.hostile_child", *args], cwd=REPO, env=environ(),
                          capture_output=True, text=True, timeout=HANG_GUARD, preexec_fn=_limited, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def _commands(*paths: Path, gate: tuple[str, ...] = ()) -> dict[str, list[dict[str, Any]]]:
    """scan, gate (with the options ``gate``) and fix --dry-run of each path: each exits 0 or 1 and reports no
    internal error."""
    options = [a for option in gate for a in ("--gate", option)]
    results: dict[str, list[dict[str, Any]]] = _child("commands", *options, *map(str, paths))
    for path, runs in results.items():
        for r in runs:
            assert r["code"] in (0, 1), (path, r["command"], r["output"][-2000:])
            assert "internal error" not in r["output"], (path, r["command"], r["output"][-2000:])
    return results


def _messages(runs: list[dict[str, Any]], rule: str, command: str = "scan") -> list[str]:
    """The messages of ``rule``'s findings in the JSON report of ``command`` (scan or gate)."""
    (run,) = [r for r in runs if r["command"] == command]
    return [f["message"] for f in json.loads(run["output"])["findings"] if f["rule"] == rule]


# ---------------------------------------------------------------------------------------------------------------
# The trees: each a real checkpoint with one hostile number


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def distcp_rank(tmp: Path, n: int = BIG) -> Path:
    """An FSDP checkpoint (rng_state_0/1) with one more model shard named for rank ``n``: the saved world size
    the name implies is ``n + 1``."""
    root = _copy(FIXTURES / "fsdp", tmp / f"distcp-{n}")
    model = root / "checkpoint-4" / "pytorch_model_fsdp_0"
    shutil.copy(model / "__0_0.distcp", model / f"__{n}_0.distcp")
    return root


def distcp_empty(tmp: Path) -> Path:
    """The report's reproduction: an empty ``__999999999_0.distcp`` in the newest checkpoint of a run."""
    root = _copy(FIXTURES / "stale-higher", tmp / "stale-higher")
    (root / "checkpoint-12" / f"__{BIG}_0.distcp").touch()
    return root


def zero_rank(tmp: Path, n: int = BIG) -> Path:
    """A DeepSpeed ZeRO-2 checkpoint whose model states (and their ``dp_world_size``) are gone, with a partition
    named for rank ``n``: the world size is then the highest rank present plus one."""
    root = _copy(DS, tmp / f"zero-{n}")
    tag = root / "checkpoint-4" / "global_step4"
    (tag / "mp_rank_00_model_states.pt").unlink()
    shutil.copy(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt", tag / f"zero_pp_rank_{n}_mp_rank_00_optim_states.pt")
    return root


def dp_world_size(tmp: Path, world: int) -> Path:
    """A DeepSpeed checkpoint whose model states record ``dp_world_size = world`` (rewritten by torch)."""
    root = _copy(DS, tmp / f"dp-world-{world.bit_length()}")
    states = root / "checkpoint-4" / "global_step4" / "mp_rank_00_model_states.pt"
    saved = torch.load(states, weights_only=False)  # the repo's own test data, written by DeepSpeed 0.19.8
    saved["dp_world_size"] = world
    torch.save(saved, states)
    return root


def titan_world(tmp: Path, world: int, rank: str = "") -> Path:
    """A torchtitan-layout save (``checkpoint/step-2``, by ``torch.distributed.checkpoint.save`` in one process)
    whose dataloader records ``world_size = world`` and holds the state of dp rank 0 only (and of ``rank``, a
    string of digits, when given)."""
    import torch.distributed.checkpoint as dcp

    loader: dict[str, Any] = {"dp_rank_0": pickle.dumps({"consumed": 2}), "world_size": world}
    if rank:
        loader[f"dp_rank_{rank}"] = pickle.dumps({"consumed": 2})
    state = {
        "weight": torch.zeros(2, 4), "bias": torch.zeros(2),
        "dataloader": loader,
        "train_state": {"step": 2, "ntokens_seen": 0},
        "lr_scheduler": {"last_epoch": 2},
    }
    root = tmp / f"titan-{world.bit_length()}-{len(rank)}"
    with pytest.warns(UserWarning):  # no process group: dcp saves as the only rank, and says so
        dcp.save(state, checkpoint_id=str(root / "checkpoint" / "step-2"))
    return root


# ---------------------------------------------------------------------------------------------------------------
# Each hostile path: bounded, and the finding counts what is missing


def _more(n: int) -> str:
    return f" ... and {n:,} more"


CASES: dict[str, tuple[Callable[[Path], Path], str, str]] = {
    # rule, what its message holds
    "distcp-rank": (distcp_rank, "CKD404", "saved by 1000000000 ranks but `rng_state_2.pth`, `rng_state_3.pth`, "
                    "`rng_state_4.pth`, `rng_state_5.pth`, `rng_state_6.pth`, `rng_state_7.pth`, `rng_state_8.pth`, "
                    f"`rng_state_9.pth`{_more(10**9 - 10)} are missing"),
    "distcp-empty": (distcp_empty, "CKD404", f"`rng_state_8.pth`{_more(10**9 - 9)} are missing"),
    "zero-rank": (zero_rank, "CKD502", "2 of 1000000000 ZeRO optimizer partitions present; missing rank(s) 1, 2, 3, "
                  f"4, 5, 6, 7, 8{_more(10**9 - 10)}"),
    "dp-world-size": (lambda tmp: dp_world_size(tmp, 10**12), "CKD502",
                      f"1 of 1000000000000 ZeRO optimizer partitions present; missing rank(s) 1, 2, 3, 4, 5, 6, 7, "
                      f"8{_more(10**12 - 9)}"),
    "dp-world-size-unprintable": (lambda tmp: dp_world_size(tmp, HUGE), "CKD502",
                                  "1 of <an integer of 16,610 bits> ZeRO optimizer partitions present; missing rank(s) "
                                  "1, 2, 3, 4, 5, 6, 7, 8 ... and <an integer of 16,610 bits> more"),
    "titan-world-size": (lambda tmp: titan_world(tmp, 10**12), "CKD513",
                         "`dataloader.world_size` is 1,000,000,000,000 but the save holds 1 `dataloader.dp_rank_<r>` "
                         f"states (missing dp rank(s) 1, 2, 3, 4, 5, 6, 7, 8{_more(10**12 - 9)})"),
    "titan-world-size-unprintable": (lambda tmp: titan_world(tmp, HUGE), "CKD513",
                                     "`dataloader.world_size` is <an integer of 16,610 bits> but the save holds 1"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_number_is_counted_not_materialised(case: str, tmp_path: Path) -> None:
    build, rule, said = CASES[case]
    root = build(tmp_path)
    runs = _commands(root)[str(root)]
    messages = _messages(runs, rule)
    assert any(said in m for m in messages), messages


@pytest.mark.parametrize("world", [10**12, HUGE], ids=["10**12", "10**5000"])
def test_titan_world_size_against_the_planned_degree(world: int, tmp_path: Path) -> None:
    """The gate's CKD514 (``--world-size`` against the saved dataloader's) prints the saved degree, whatever it is."""
    root = titan_world(tmp_path, world)
    messages = _messages(_commands(root, gate=("--world-size=2",))[str(root)], "CKD514", "gate")
    (msg,) = [m for m in messages if "data-parallel degree" in m]  # the other: the save holds no optimizer state
    degree = "1,000,000,000,000" if world < HUGE else "<an integer of 16,610 bits>"
    assert msg.startswith(f"the save's dataloader state is for data-parallel degree {degree}, the resume runs 2: ")


def test_titan_rank_key_too_long_to_be_a_rank(tmp_path: Path) -> None:
    """A `dataloader.dp_rank_<r>` key whose r has 5,000 digits (past int()'s 4,300): no rank loads it, the world
    size's other ranks are still counted."""
    root = titan_world(tmp_path, 2, rank="9" * 5000)
    runs = _commands(root, gate=("--world-size=2",))[str(root)]
    (msg,) = _messages(runs, "CKD513")
    assert "(missing dp rank(s) 1)" in msg
    assert not any("data-parallel degree" in m for m in _messages(runs, "CKD514", "gate"))


def test_honest_missing_ranks_are_all_listed(tmp_path: Path) -> None:
    """Up to 32 missing indices the message names every one, as it always did."""
    root = distcp_rank(tmp_path, 29)  # a model shard of rank 29, RNG states of ranks 0 and 1: 28 missing
    (msg,) = _messages(_commands(root)[str(root)], "CKD404")
    assert msg == "saved by 30 ranks but " + ", ".join(f"`rng_state_{r}.pth`" for r in range(2, 30)) + " are missing"


def test_hostile_names_elsewhere_stay_bounded(tmp_path: Path) -> None:
    """Every other number a file or folder name holds (ranks, shard counts, steps, epochs, save counters): the
    commands exit 0 or 1 under the limit with no internal error."""
    trees: list[Path] = []

    def tree(name: str, src: Path) -> Path:
        trees.append(_copy(src, tmp_path / name))
        return trees[-1]

    huge = str(BIG) * 3
    ck = tree("rng", FIXTURES / "fsdp") / "checkpoint-4"
    shutil.copy(ck / "rng_state_1.pth", ck / f"rng_state_{BIG}.pth")
    tag = tree("mp-rank", DS) / "checkpoint-4" / "global_step4"
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / f"mp_rank_{BIG}_model_states.pt")
    optim = "zero_pp_rank_0_mp_rank_{}_optim_states.pt"
    shutil.copy(tag / optim.format("00"), tag / optim.format(BIG))
    ck = tree("global-step", DS) / "checkpoint-4"
    (ck / "global_step4").rename(ck / f"global_step{huge}")
    (ck / "latest").write_text(f"global_step{huge}")
    ck = tree("shards", FIXTURES / "sharded") / "checkpoint-8"
    (ck / "model-00005-of-00005.safetensors").rename(ck / "model-00005-of-99999.safetensors")
    shutil.copy(ck / "model-00004-of-00005.safetensors", ck / f"model-{huge}-of-{huge}.safetensors")
    run = tree("checkpoint-n", FIXTURES / "stale-higher")
    shutil.copytree(run / "checkpoint-12", run / f"checkpoint-{huge}")
    ckpts = tree("lightning", DATA / "lightning-2.6.6" / "plain") / "checkpoints"
    shutil.copy(ckpts / "epoch=1-step=4.ckpt", ckpts / f"epoch={huge}-step={huge}.ckpt")
    steps = tree("titan-step", DATA / "torchtitan-0.3.0-layout" / "full") / "checkpoint"
    shutil.copytree(steps / "step-4", steps / f"step-{huge}")
    (steps / "step-4" / f"__{BIG}_0.distcp").touch()
    tf = tree("tf-ckpt", DATA / "tf" / "tf-trainer") / "checkpoint"
    shutil.copy(tf / "ckpt-3.index", tf / f"ckpt-{huge}.index")
    shutil.copy(tf / "ckpt-3.data-00000-of-00001", tf / f"ckpt-{huge}.data-00000-of-99999")
    acc = tree("accelerate", DATA / "stacks" / "accelerate-1.15.0-deepspeed-0.19.8-zero3")
    shutil.copy(acc / "random_states_0.pkl", acc / f"random_states_{BIG}.pkl")
    (acc / f"custom_checkpoint_{BIG}.pkl").write_bytes(pickle.dumps({}))
    assert set(_commands(*trees)) == {str(t) for t in trees}


def _every_int(value: Any, v: int) -> Any:
    """``value`` with every int in it (but parameter ids) replaced by ``v``."""
    if isinstance(value, dict):
        return {k: x if k == "params" else _every_int(x, v) for k, x in value.items()}
    if isinstance(value, list):
        return [_every_int(x, v) for x in value]
    return v if isinstance(value, int) and not isinstance(value, bool) else value


def lightning_ints(tmp: Path, v: int) -> Path:
    """A Lightning 2.6.6 run whose `.ckpt` files hold ``v`` as epoch, global step, every loop counter and a
    OneCycleLR's ``last_epoch`` / ``total_steps`` (rewritten by torch)."""
    root = _copy(DATA / "lightning-2.6.6" / "plain", tmp / f"lightning-{v.bit_length()}")
    for ckpt in root.glob("checkpoints/*.ckpt"):
        saved = torch.load(ckpt, weights_only=False)  # the repo's own test data, written by Lightning 2.6.6
        for key in ("epoch", "global_step", "loops", "optimizer_states"):
            saved[key] = _every_int(saved[key], v)
        saved["lr_schedulers"] = [{"last_epoch": v, "total_steps": v, "_step_count": v, "base_lrs": [0.1]}]
        torch.save(saved, ckpt)
    return root


@pytest.mark.parametrize("value", [-1, 10**18, HUGE], ids=["-1", "10**18", "10**5000"])
def test_hostile_lightning_counters(value: int, tmp_path: Path) -> None:
    """A step, epoch or scheduler count too long to print is not read (the gate says the steps are unknown)."""
    _commands(lightning_ints(tmp_path, value), gate=("--max-steps=10",))


def _scheduler_state(tmp: Path, values: dict[str, int]) -> Path:
    root = _copy(FIXTURES / "clean-full", tmp / "scheduler")
    for sched in root.glob("*/scheduler.pt"):
        state = torch.load(sched, weights_only=True)
        state.update(values)
        torch.save(state, sched)
    return root


@pytest.mark.parametrize("value", [-1, 2**63, 10**18, HUGE], ids=["-1", "2**63", "10**18", "10**5000"])
def test_hostile_scheduler_state(value: int, tmp_path: Path) -> None:
    """``last_epoch`` and ``_step_count`` of ``scheduler.pt`` (where the gate's resumed schedule starts)."""
    _commands(_scheduler_state(tmp_path, {"last_epoch": value, "_step_count": value}))


def test_hypothesis_sweep_of_the_gates_json_numbers() -> None:
    """Hostile integers (0, -1, 2**31, 2**63, 10**18, 10**100 and others) in trainer_state.json's step counts,
    intervals, epochs and log_history steps: scan, gate and fix --dry-run stay bounded, a few dozen examples."""
    assert _child("sweep", str(FIXTURES / "clean-full"), "30") == {"examples": 30}


# ---------------------------------------------------------------------------------------------------------------
# The cost follows the files, not the numbers

PEAK_BOUND = 64 << 20  # bytes Python allocates for these small trees, whatever rank the names claim


@pytest.mark.parametrize("n", [10**3, 10**12])
@pytest.mark.parametrize("build", [distcp_rank, zero_rank], ids=["distcp", "zero"])
def test_cost_follows_the_files(build: Callable[[Path, int], Path], n: int, tmp_path: Path) -> None:
    """The same findings (rule, path) whether a name claims rank 10**3 or 10**12, and a peak of allocations that a
    materialised ``range`` of the larger could not fit in."""
    expected = {distcp_rank: [["CKD404", "checkpoint-4"]],
                zero_rank: [["CKD404", "checkpoint-4"], ["CKD502", "checkpoint-4/global_step4"]]}[build]
    got = _child("peak", str(build(tmp_path, n)))
    assert [f for f in got["findings"] if f[0] in ("CKD404", "CKD502")] == expected
    assert got["peak"] < PEAK_BOUND


def test_tf_shard_count_does_not_drive_the_loop() -> None:
    """A bundle index claiming 2**31 - 1 shards: only the shards its entries place bytes in are named and
    checked (one here), not every index below the count."""
    data = (DATA / "tf" / "tf-trainer" / "checkpoint" / "ckpt-3.index").read_bytes()
    outcome = tfbundle.read_tf_index(io.BytesIO(data), len(data), DEFAULT_LIMITS)
    assert isinstance(outcome, ReadOutcome) and isinstance(outcome.content, TfIndexFacts)
    index = outcome.content
    hostile = TfIndexFacts(2**31 - 1, index.entries, index.endianness, index.version)
    named = mock.Mock(wraps=tfbundle.shard_name)
    with mock.patch.object(tfbundle, "shard_name", named):
        assert tfbundle.shard_problems("ckpt-3", index, {"ckpt-3.data-00000-of-00001": 10**6}) == ()
        problems = tfbundle.shard_problems("ckpt-3", hostile, {"ckpt-3.data-00000-of-00001": 10**6})
    assert named.call_count == 2
    ((name, problem),) = problems
    assert name == "ckpt-3.data-00000-of-2147483647" and "is missing" in problem.message
