"""Every scan rule proved on real checkpoints: one where it fires (exact code, path, numbers) and one where it stays
silent (the nearest healthy variant).

The reference trainer builds each run once per module; a case copies it and changes exactly one thing the way users
do (delete, copy in, truncate, rename, link, torch.save a payload, edit trainer_state.json ...). ``FIRES`` and
``SILENT`` are the table; ``test_every_rule_has_a_firing_and_a_silent_case`` fails when a rule is added without
both.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import shutil
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptdoctor.findings import Finding, Severity
from ckptdoctor.reference.scenarios import SCENARIOS, base_config, build
from ckptdoctor.reference.train import train
from ckptdoctor.rules import all_rules
from ckptdoctor.scanner import scan
from tests.helpers import payloads
from tests.helpers.paths import REPO, TESTS

FIXTURES = REPO / "fixtures"
CK8 = "checkpoint-8"

Copy = Callable[[str], Path]  # a fresh copy of a named run, to change one thing in


# ---------------------------------------------------------------------------------------------------------------
# Runs trained once per module (reference scenarios plus a few variants), copied per test


def _trained(out: Path, **changes: Any) -> None:
    train(base_config(out, **changes), preempt_after_step=8)


def _resumed(out: Path, **changes: Any) -> None:
    """A run preempted at checkpoint-8 and resumed to the end: checkpoint-12 holds the whole log_history."""
    _trained(out, **changes)
    train(base_config(out, **changes), resume_from_checkpoint=True)


def _lr_jump(out: Path) -> None:
    """Resumed after a cleanup deleted checkpoint-8's scheduler.pt: the Trainer restarts the schedule at step 9."""
    _trained(out)
    (out / CK8 / "scheduler.pt").unlink()
    train(base_config(out), resume_from_checkpoint=True)


def _fresh_other_adapter(out: Path) -> None:
    """LoRA run on (q, v) finished, then a fresh run (no resume) on (k, v) in the same output_dir."""
    train(base_config(out, use_lora=True))
    _trained(out, use_lora=True, lora_target_modules=("k_proj", "v_proj"))


VARIANTS: dict[str, Callable[[Path], None]] = {
    "full-resumed": _resumed,
    "lora-resumed": lambda out: _resumed(out, use_lora=True),
    "lora-r4": lambda out: _trained(out, use_lora=True, lora_r=4),
    "bin-vocab64": lambda out: _trained(out, weights_format="bin", vocab_size=64),
    "lr-jump": _lr_jump,
    "fresh-other-adapter": _fresh_other_adapter,
}
# Two gloo processes take seconds to start: FSDP cases use the checked-in output of the `fsdp` scenario.
CHECKED_IN = {"fsdp"}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The pristine run ``name``, built on first use and shared by the module's tests (never modified)."""
    root = tmp_path_factory.mktemp("runs")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            if name in CHECKED_IN:
                cache[name] = FIXTURES / name
            elif name in VARIANTS:
                (root / name).mkdir()
                VARIANTS[name](root / name)
                cache[name] = root / name
            else:
                assert name in SCENARIOS, name
                cache[name] = build(name, root / name)
        return cache[name]

    return get


@pytest.fixture
def run_copy(pristine: Callable[[str], Path], tmp_path: Path) -> Copy:
    """A private copy of a run for one test to change."""

    def make(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(pristine(name), dst, symlinks=True)
        return dst

    return make


# ---------------------------------------------------------------------------------------------------------------
# One change each, the way users (or their tools) make it


def edit_json(path: Path, **changes: Any) -> None:
    """Rewrite a JSON file with some keys changed (a key set to ``...`` is deleted)."""
    value = json.loads(path.read_text())
    for k, v in changes.items():
        if v is ...:
            del value[k]
        else:
            value[k] = v
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def cut(path: Path, keep: int) -> None:
    """Truncate ``path`` to ``keep`` bytes (negative: drop that many from the end), as a full disk does."""
    os.truncate(path, keep if keep >= 0 else path.stat().st_size + keep)


def zero3_empty(path: Path) -> None:
    """Re-save a safetensors file as DeepSpeed ZeRO-3 does without gathering: same names, zero-size tensors."""
    save_file({k: torch.empty(0) for k in load_file(path)}, path, metadata={"format": "pt"})


def save_rng(path: Path) -> None:
    """``rng_state.pth`` as ``Trainer._save_rng_state`` writes it (one process, CPU)."""
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.get_rng_state()}, path)


def deepspeed_layout(ck: Path, tags: tuple[int, ...] = (8,), ranks: tuple[int, ...] = (0, 1), world: int = 2) -> None:
    """Turn a full checkpoint into what the Trainer writes under DeepSpeed ZeRO-2 with ``world`` ranks.

    ``global_stepN/`` holds ``mp_rank_00_model_states.pt`` and one ``*_optim_states.pt`` partition per rank (real
    ``torch.save`` files with DeepSpeed's keys), ``latest`` names the newest tag, there is one ``rng_state_R.pth``
    per rank, and no ``optimizer.pt``/``scheduler.pt`` (DeepSpeed keeps them).
    """
    weights = load_file(ck / "model.safetensors")
    flat = torch.cat([t.flatten() for t in weights.values()])
    for step in tags:
        tag = ck / f"global_step{step}"
        tag.mkdir()
        torch.save({"module": weights, "dp_world_size": world, "mp_world_size": 1, "global_steps": step,
                    "ds_version": "0.16.4"}, tag / "mp_rank_00_model_states.pt")
        for rank, part in enumerate(flat.chunk(world)):
            if rank in ranks:
                state = {"zero_stage": 2, "partition_count": world, "loss_scaler": None,
                         "single_partition_of_fp32_groups": [part.clone()],
                         "base_optimizer_state": {"state": {0: {"exp_avg": torch.zeros_like(part)}}}}
                torch.save({"optimizer_state_dict": state, "ds_version": "0.16.4"},
                           tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
    (ck / "latest").write_text(f"global_step{max(tags)}")
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth"):
        (ck / name).unlink()
    for rank in range(world):
        save_rng(ck / f"rng_state_{rank}.pth")


def rewrite_member(path: Path, suffix: str, change: Callable[[bytes], bytes]) -> None:
    """Rewrite one member of a torch zip archive (the zip itself stays valid)."""
    with zipfile.ZipFile(path) as z:
        items = [(info, z.read(info.filename)) for info in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for info, data in items:
            z.writestr(info, change(data) if info.filename.endswith(suffix) else data)


class WarmupCallback:
    """A user's callback class, not installed (its source is under the working folder, which the policy never
    reads: the scanned folder may be it); a reference to it pickled in a callback's state file is unproven."""


# ---------------------------------------------------------------------------------------------------------------
# The cases. Each builder returns the root to scan.


def clean(name: str) -> Callable[[Copy], Path]:
    return lambda run_copy: run_copy(name)


def unlinked(name: str, *rels: str) -> Callable[[Copy], Path]:
    def make(run_copy: Copy) -> Path:
        root = run_copy(name)
        for rel in rels:
            (root / rel).unlink()
        return root

    return make


def link_loop(run_copy: Copy) -> Path:
    root = run_copy("clean-full")
    os.symlink("b.json", root / CK8 / "a.json")
    os.symlink("a.json", root / CK8 / "b.json")
    return root


def bad_name(run_copy: Copy) -> Path:
    """A file copied from a latin-1 file system: its name is not valid UTF-8."""
    root = run_copy("clean-full")
    (Path(os.fsdecode(os.fsencode(root / CK8) + b"/notes-\xe9t\xe9.txt"))).write_text("lr sweep")
    return root


def link_inside(run_copy: Copy) -> Path:
    """Deduplicated by hand: checkpoint-8's config.json links to checkpoint-4's (inside the root)."""
    root = run_copy("clean-full")
    (root / CK8 / "config.json").unlink()
    os.symlink("../checkpoint-4/config.json", root / CK8 / "config.json")
    return root


def _moved_out_and_linked(run_copy: Copy, name: str) -> Path:
    """checkpoint-8's ``name`` moved to shared storage and linked back: the link leaves the scan root."""
    root = run_copy("clean-full")
    outside = root.parent / "shared" / name
    outside.parent.mkdir()
    shutil.move(root / CK8 / name, outside)
    os.symlink(outside, root / CK8 / name)
    return root


def link_outside(run_copy: Copy) -> Path:
    """The weights moved to shared storage and linked back."""
    return _moved_out_and_linked(run_copy, "model.safetensors")


def trainer_state_linked_out(run_copy: Copy) -> Path:
    """trainer_state.json kept on shared storage and linked back: a resume follows the link, nothing is torn."""
    return _moved_out_and_linked(run_copy, "trainer_state.json")


def stale_removed(run_copy: Copy) -> Path:
    """stale-higher after the first run's leftover checkpoint-12 was quarantined."""
    root = run_copy("stale-higher")
    shutil.rmtree(root / "checkpoint-12")
    return root


def no_state_in_older(run_copy: Copy) -> Path:
    root = run_copy("clean-full")
    (root / "checkpoint-4" / "trainer_state.json").unlink()
    return root


def temp_left(run_copy: Copy) -> Path:
    """A transformers 4.36-4.38 staging folder: the crash came after the weights of step 12 were written."""
    root = run_copy("clean-full")
    (root / "tmp-checkpoint-12").mkdir()
    shutil.copy(root / CK8 / "model.safetensors", root / "tmp-checkpoint-12")
    return root


def logs_only(run_copy: Copy) -> Path:
    """An output_dir whose checkpoints are gone (rotated, moved, never saved): only TensorBoard-style logs remain."""
    root = run_copy("clean-full")
    for ck in root.glob("checkpoint-*"):
        shutil.rmtree(ck)
    (root / "runs").mkdir()
    (root / "runs" / "events.txt").write_text("step 4 loss 2.1\n")
    return root


def backup_copy(run_copy: Copy) -> Path:
    """A hand-made backup `checkpoint-8.bak`: invisible to resume, not a staging folder."""
    root = run_copy("clean-full")
    shutil.copytree(root / CK8, root / "checkpoint-8.bak")
    return root


def renamed(run_copy: Copy) -> Path:
    root = run_copy("clean-full")
    os.rename(root / CK8, root / "checkpoint-10")
    return root


def best_elsewhere(run_copy: Copy) -> Path:
    """A run copied from another machine: best_model_checkpoint keeps that machine's absolute path."""
    root = run_copy("clean-full")
    edit_json(root / CK8 / "trainer_state.json", best_model_checkpoint="/home/alice/runs/x/checkpoint-4",
              best_metric=3.1)
    return root


def best_deleted(run_copy: Copy) -> Path:
    """The best checkpoint was deleted to save space."""
    root = run_copy("clean-full")
    edit_json(root / CK8 / "trainer_state.json", best_model_checkpoint=str(root / "checkpoint-6"), best_metric=3.1)
    return root


def best_here(run_copy: Copy) -> Path:
    """What the Trainer writes for an absolute output_dir: os.path.join(output_dir, 'checkpoint-4')."""
    root = run_copy("clean-full")
    edit_json(root / CK8 / "trainer_state.json", best_model_checkpoint=str(root / "checkpoint-4"), best_metric=3.1)
    return root


def truncated(name: str, rel: str, keep: int) -> Callable[[Copy], Path]:
    def make(run_copy: Copy) -> Path:
        root = run_copy(name)
        cut(root / rel, keep)
        return root

    return make


def stray_bin(source: str) -> Callable[[Copy], Path]:
    """A `pytorch_model.bin` from another run copied next to checkpoint-8's `model.safetensors`."""

    def make(run_copy: Copy) -> Path:
        root = run_copy("clean-full")
        shutil.copy(run_copy(source) / CK8 / "pytorch_model.bin", root / CK8)
        return root

    return make


def json_edit(name: str, rel: str, **changes: Any) -> Callable[[Copy], Path]:
    def make(run_copy: Copy) -> Path:
        root = run_copy(name)
        edit_json(root / rel, **changes)
        return root

    return make


def emptied(name: str, rel: str) -> Callable[[Copy], Path]:
    def make(run_copy: Copy) -> Path:
        root = run_copy(name)
        zero3_empty(root / rel)
        return root

    return make


def r4_over_r2(run_copy: Copy) -> Path:
    """An r=4 adapter copied over checkpoint-8's r=2 adapter; optimizer.pt is still the r=2 run's."""
    root, r4 = run_copy("clean-lora"), run_copy("lora-r4")
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        shutil.copy(r4 / CK8 / name, root / CK8 / name)
    return root


def sharded_with_lora_optimizer(run_copy: Copy) -> Path:
    """A sharded full checkpoint whose optimizer.pt is a LoRA run's (4 adapter matrices)."""
    root, lora = run_copy("sharded"), run_copy("clean-lora")
    shutil.copy(lora / CK8 / "optimizer.pt", root / CK8 / "optimizer.pt")
    return root


def deepspeed(tags: tuple[int, ...] = (8,), ranks: tuple[int, ...] = (0, 1), drop: str | None = None
              ) -> Callable[[Copy], Path]:
    def make(run_copy: Copy) -> Path:
        root = run_copy("clean-full")
        deepspeed_layout(root / CK8, tags, ranks)
        if drop:
            shutil.rmtree(root / CK8 / drop)  # a cleanup script kept the older tag only
        return root

    return make


def malicious_args(run_copy: Copy) -> Path:
    """training_args.bin replaced by a torch.save'd object whose unpickling runs a shell command."""
    root = run_copy("clean-full")
    canary = root.parent / "canary"
    torch.save(payloads._reducer(os.system, (f"touch {canary}",)), root / CK8 / "training_args.bin")
    return root


def smuggled_pickle(run_copy: Copy) -> Path:
    """A second `data.pkl` appended to a real optimizer.pt: zip readers disagree on which one is loaded."""
    import warnings
    import zipfile

    root = run_copy("clean-full")
    path = root / CK8 / "optimizer.pt"
    with warnings.catch_warnings(), zipfile.ZipFile(path, "a") as z:
        warnings.simplefilter("ignore")  # "Duplicate name": exactly the trick
        z.writestr("optimizer/data.pkl", pickle.dumps({"state": {}, "param_groups": []}, protocol=2))
    return root


def callback_state(run_copy: Copy) -> Path:
    root = run_copy("clean-full")
    torch.save({"callback": WarmupCallback, "step": 8}, root / CK8 / "callback_state.pt")
    return root


def installed_class_state(run_copy: Copy) -> Path:
    """A state file naming (never calling) a class of an installed package outside the known ones."""
    root = run_copy("clean-full")
    torch.save({"parser": argparse.ArgumentParser, "step": 8}, root / CK8 / "callback_state.pt")
    return root


def cut_rng_pickle(run_copy: Copy) -> Path:
    """rng_state.pth whose data.pkl lost its last 30 bytes inside an intact zip."""
    root = run_copy("clean-full")
    rewrite_member(root / CK8 / "rng_state.pth", "data.pkl", lambda data: data[:-30])
    return root


SAMPLES = TESTS / "data"  # real MindNLP and TensorFlow/Keras output (tests/stacks/test_frameworks.py)


def sample(rel: str, change: Callable[[Path], None] = lambda root: None) -> Callable[[Copy], Path]:
    """A writable copy of the real sample ``tests/data/<rel>``, changed by ``change``."""

    def make(run_copy: Copy) -> Path:
        root = run_copy("clean-full").parent / "sample"
        shutil.copytree(SAMPLES / rel, root)
        for p in root.rglob("*"):
            p.chmod(0o644 if p.is_file() else 0o755)
        change(root)
        return root

    return make


TITAN = "torchtitan-0.3.0-layout"  # tests/stacks/titan_run.py: real two-rank DCP saves in torchtitan's layout


def _titan_steps(root: Path) -> Path:
    return root / "checkpoint"


def _drop_titan_metadata(root: Path) -> None:
    (_titan_steps(root) / "step-4" / ".metadata").unlink()


def _drop_titan_rank_file(root: Path) -> None:
    (_titan_steps(root) / "step-4" / "__1_0.distcp").unlink()


def _rename_titan_step(root: Path) -> None:
    (_titan_steps(root) / "step-2").rename(_titan_steps(root) / "step-6")


def _drop_tf_bundle_3(root: Path) -> None:
    for p in (root / "checkpoint").glob("ckpt-3.*"):
        p.unlink()


def _cut_h5(root: Path) -> None:
    with open(root / "tf_model.h5", "r+b") as f:
        f.truncate(1000)


def _add_flax(root: Path) -> None:
    (root / "flax_model.msgpack").write_bytes(b"\x81\xa6params\x80")



def lm_save(untie_config: bool) -> Callable[[Copy], Path]:
    """A tiny tied Llama saved by transformers' own save_pretrained; ``untie_config`` sets its config's
    ``tie_word_embeddings`` to False first (the weights stay tied in memory, so the head is not written)."""

    def make(run_copy: Copy) -> Path:
        import transformers

        root = run_copy("clean-full").parent / "lm"
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=2, tie_word_embeddings=True))
        model.config.tie_word_embeddings = not untie_config
        model.save_pretrained(root)
        return root

    return make

def started_from_checkpoint(copy: Copy) -> Path:
    """A run whose model was built from another run's checkpoint, as transformers 4.x records it in config.json."""
    root = copy("clean-full")
    for ck in root.glob("checkpoint-*"):
        config = json.loads((ck / "config.json").read_text())
        config["_name_or_path"] = "/jobs/run-a/checkpoint-500"  # what 4.x from_pretrained(that path) writes
        (ck / "config.json").write_text(json.dumps(config))
    return root


@dataclass(frozen=True, slots=True)
class Fires:
    """Rule ``code`` reports ``path`` with ``severity`` and a message holding every fragment of ``says``."""

    code: str
    case: str
    make: Callable[[Copy], Path]
    path: str
    severity: Severity
    says: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Silent:
    """Rule ``code`` reports nothing on the tree ``make`` builds."""

    code: str
    case: str
    make: Callable[[Copy], Path]


WARN, ERR, INFO = Severity.WARNING, Severity.ERROR, Severity.INFO
LORA_Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

def foreign_checkpoint(run_copy: Copy) -> Path:
    """A run whose only `checkpoint-N` a custom loop wrote: weights and its own pickled state, no Trainer file."""
    root = run_copy("clean-full")
    weights = (root / CK8 / "model.safetensors").read_bytes()
    for ck in root.glob("checkpoint-*"):
        shutil.rmtree(ck)
    (root / "checkpoint-5").mkdir()
    (root / "checkpoint-5" / "model.safetensors").write_bytes(weights)
    (root / "checkpoint-5" / "state.pkl").write_bytes(pickle.dumps({"step": 5}, protocol=4))
    return root


def accelerate_run(change: Callable[[Path], None] = lambda root: None, *, custom: int = 0,
                   resumed: bool = False) -> Callable[[Copy], Path]:
    """A real accelerate 1.15 automatic-naming project (four steps, a save after each, ``total_limit=3``:
    ``checkpoints/checkpoint_1`` to ``_3``; ``custom`` registered objects), changed by ``change``; ``resumed``: then
    resumed by a new program with ``load_state()`` and trained two more steps, saving after each."""

    def make(copy: Copy) -> Path:
        from tests.helpers.accelerate_run import Program

        root = copy("clean-full").parent / "accelerate"
        Program(root, custom=custom).train(4)
        if resumed:
            again = Program(root, custom=custom)
            again.resume()
            again.train(2)
        change(root)
        return root

    return make


def _unlink(*rels: str) -> Callable[[Path], None]:
    def change(root: Path) -> None:
        for rel in rels:
            (root / rel).unlink()
    return change


def _lightning_edit(change: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    """Rewrite the real Lightning sample's `last.ckpt` as a user's script does (torch.load, change, torch.save)."""

    def edit(root: Path) -> None:
        path = root / "checkpoints" / "last.ckpt"
        ckpt = torch.load(path, weights_only=True)
        change(ckpt)
        torch.save(ckpt, path)

    return edit


def _lightning_last_from(other: str, name: str, after: float) -> Callable[[Path], None]:
    """The namespace run's `last.ckpt` (step 2) put into the plain run's folder (`last.ckpt` and
    `epoch=1-step=4.ckpt`, step 4) as ``name``, its modification time ``after`` seconds after theirs (below zero:
    before them)."""

    def change(root: Path) -> None:
        ck = root / "checkpoints"
        when = max(p.stat().st_mtime for p in ck.iterdir())
        shutil.copy(SAMPLES / "lightning-2.6.6" / other / "checkpoints" / "last.ckpt", ck / name)
        for p in ck.iterdir():
            t = when + after if p.name == name else when
            os.utime(p, (t, t))

    return change


# `last.ckpt` at step 2 saved before `epoch=1-step=4.ckpt`: the order of a `last.ckpt` kept behind by `save_last`
_lightning_stale_last = _lightning_last_from("namespace", "last.ckpt", -60)


def _lightning_dangling_last(root: Path) -> None:
    (root / "checkpoints" / "last.ckpt").unlink()
    (root / "checkpoints" / "last.ckpt").symlink_to("epoch=2-step=6.ckpt")


def _lightning_outside(c: dict[str, Any]) -> None:
    for state in c["callbacks"].values():
        state["best_model_path"] = "/elsewhere/run/checkpoints/epoch=0-step=2.ckpt"


FIRES: tuple[Fires, ...] = (
    Fires("CKD120", "accelerate-notes", accelerate_run(lambda r: (r / "checkpoints" / "notes.txt").write_text("x")),
          "checkpoints/notes.txt", ERR, ("`load_state()`", "`IndexError` on `notes.txt`")),
    Fires("CKD121", "accelerate-cut", accelerate_run(_unlink("checkpoints/checkpoint_3/scheduler.bin",
                                                             "checkpoints/checkpoint_3/random_states_0.pkl")),
          "checkpoints/checkpoint_3", ERR, ("`load_state()` picks this interrupted save", "no `scheduler.bin`")),
    Fires("CKD430", "accelerate-resumed", accelerate_run(resumed=True), "checkpoints/checkpoint_3", ERR,
          ("scheduler at step 4", "`checkpoint_1` holds step 6")),
    Fires("CKD431", "accelerate-gap", accelerate_run(_unlink("checkpoints/checkpoint_3/custom_checkpoint_1.pkl"),
                                                     custom=3),
          "checkpoints/checkpoint_3", ERR, ("no `custom_checkpoint_1.pkl`",)),
    Fires("CKD108", "custom-loop", foreign_checkpoint, "checkpoint-5", INFO,
          ("no known training program", "`state.pkl`", "never quarantined")),
    Fires("CKD416", "lightning-namespace", sample("lightning-2.6.6/namespace"), "checkpoints/last.ckpt", ERR,
          ("`Trainer.fit(ckpt_path=...)` raises `UnpicklingError`", "`argparse.Namespace`", "`hyper_parameters`")),
    Fires("CKD440", "lightning-stale-last", sample("lightning-2.6.6/plain", _lightning_stale_last),
          "checkpoints/last.ckpt", ERR, ("`fit(ckpt_path=\"last\")` loads `last.ckpt` at step 2", "holds step 4")),
    Fires("CKD447", "lightning-later-fit", sample("lightning-2.6.6/plain", _lightning_last_from(
          "namespace", "last-v1.ckpt", 60)), "checkpoints/last-v1.ckpt", INFO,
          ("loads `last-v1.ckpt` (step 2), saved by a later fit than `last.ckpt` beside it (step 4",)),
    Fires("CKD448", "lightning-last-tied", sample("lightning-2.6.6/plain", _lightning_last_from(
          "namespace", "last-v1.ckpt", 0)), "checkpoints/last-v1.ckpt", WARN,
          ("`last-v1.ckpt` (step 2), `last.ckpt` (step 4) share one modification time", "hash seed")),
    Fires("CKD441", "lightning-dangling-last", sample("lightning-2.6.6/plain", _lightning_dangling_last),
          "checkpoints/last.ckpt", ERR, ("does not exist", "trains from scratch", "`epoch=1-step=4.ckpt`")),
    Fires("CKD442", "lightning-global-step-edited", sample("lightning-2.6.6/plain", _lightning_edit(
          lambda c: c.update(global_step=0))), "checkpoints/last.ckpt", WARN,
          ("`global_step` is 0 but the fit loop counts 4 optimizer steps", "`_CheckpointConnector.restore_loops`")),
    Fires("CKD443", "lightning-weights-only", sample("lightning-2.6.6/plain", _lightning_edit(
          lambda c: [c.pop("optimizer_states"), c.pop("lr_schedulers")])), "checkpoints/last.ckpt", INFO,
          ("holds only the model", "`KeyError`")),
    Fires("CKD444", "lightning-best-elsewhere", sample("lightning-2.6.6/plain", _lightning_edit(_lightning_outside)),
          "checkpoints/last.ckpt", WARN, ("`/elsewhere/run/checkpoints/epoch=0-step=2.ckpt`", "outside its `dirpath`")),
    Fires("CKD002", "logs-only", logs_only, ".", ERR, ("no checkpoint here", "none of its 1 file", "--allow-empty")),
    Fires("CKD107", "tf-bundle-deleted", sample("tf/tf-trainer", _drop_tf_bundle_3), "checkpoint/checkpoint", ERR,
          ("model_checkpoint_path", '"ckpt-3"', "NotFoundError")),
    Fires("CKD215", "truncated-h5", sample("tf/tf-trainer", _cut_h5), "tf_model.h5", ERR,
          ("HDF5", "16,208 missing", "truncated")),
    Fires("CKD216", "flax-msgpack", sample("tf/keras-weights", _add_flax), "flax_model.msgpack", INFO,
          ("Flax msgpack", "not checked")),
    Fires("CKD001", "symlink-loop", link_loop, f"{CK8}/a.json", WARN, ("symbolic link loop",)),
    Fires("CKD001", "undecodable-name", bad_name, f"{CK8}/notes-\\xe9t\\xe9.txt", WARN, ("not valid UTF-8",)),
    Fires("CKD101", "stale-higher", clean("stale-higher"), "checkpoint-12", ERR,
          ("picks `checkpoint-12`", "`checkpoint-8` belongs to another run", "step 1", "learning_rate 0.02 vs 0.05",
           "max_steps 10 vs 12")),
    Fires("CKD102", "interrupted-save", clean("interrupted-save"), CK8, ERR,
          ("picks this interrupted save", "no `trainer_state.json`", "`optimizer.pt`", "`scheduler.pt`")),
    Fires("CKD102", "older-without-state", no_state_in_older, "checkpoint-4", WARN, ("no `trainer_state.json`",)),
    Fires("CKD103", "tmp-checkpoint", temp_left, "tmp-checkpoint-12", WARN, ("`tmp-checkpoint-12`", "staging")),
    Fires("CKD104", "renamed-folder", renamed, "checkpoint-10", WARN, ("step 10", "global_step 8")),
    Fires("CKD105", "absolute-best-path", best_elsewhere, f"{CK8}/trainer_state.json", WARN,
          ("/home/alice/runs/x/checkpoint-4", "`checkpoint-4`")),
    Fires("CKD105", "best-deleted", best_deleted, f"{CK8}/trainer_state.json", WARN,
          ("checkpoint-6", "does not exist")),
    Fires("CKD106", "weights-deleted", unlinked("clean-full", f"{CK8}/model.safetensors"), CK8, ERR,
          ("no weights file", "resume_from_checkpoint=True picks it", "Can't find a valid checkpoint")),
    Fires("CKD201", "stub-shadow", clean("stub-shadow"), f"{CK8}/pytorch_model.bin", ERR,
          ("holds 0 tensors", "1,297 bytes", "instead of `adapter_model.safetensors`", "a stub")),
    Fires("CKD202", "truncated-shard", clean("sharded-truncated-shard"), f"{CK8}/model-00005-of-00005.safetensors",
          ERR, ("2,168 bytes", "1,084 (1,084 missing)")),
    Fires("CKD202", "truncated-weights", truncated("clean-full", f"{CK8}/model.safetensors", -100),
          f"{CK8}/model.safetensors", ERR, ("100 missing",)),
    Fires("CKD203", "truncated-optimizer", truncated("clean-full", f"{CK8}/optimizer.pt", 4000),
          f"{CK8}/optimizer.pt", ERR, ("truncated", "failed finding central directory")),
    Fires("CKD204", "missing-shard", clean("sharded-missing-shard"), f"{CK8}/model.safetensors.index.json", ERR,
          ("maps 8 tensors to `model-00002-of-00005.safetensors`", "does not exist")),
    Fires("CKD205", "wrong-index", clean("sharded-wrong-index"), f"{CK8}/model.safetensors.index.json", ERR,
          ("`lm_head.weight` to `model-00001-of-00005.safetensors`", "it is in `model-00005-of-00005.safetensors`",
           "no index entry references it", "total_size")),
    Fires("CKD206", "bin-of-resized-model", stray_bin("bin-vocab64"), CK8, WARN,
          ("2 differing full-weight forms", "loads `model.safetensors`", "ignores `pytorch_model.bin`")),
    Fires("CKD207", "torch-compile-keys", clean("prefixed-keys-compile"), f"{CK8}/model.safetensors", WARN,
          ("all 21 keys", "`_orig_mod.`")),
    Fires("CKD207", "ddp-keys", clean("prefixed-keys-ddp"), f"{CK8}/model.safetensors", WARN,
          ("all 21 keys", "`module.`")),
    Fires("CKD208", "vocab-edited", json_edit("clean-full", f"{CK8}/config.json", vocab_size=64),
          f"{CK8}/config.json", WARN, ("vocab_size 64", "`model.embed_tokens.weight` has 32 rows")),
    Fires("CKD210", "zero3-empty-adapter", emptied("clean-lora", f"{CK8}/adapter_model.safetensors"),
          f"{CK8}/adapter_model.safetensors", ERR, ("4 tensors, all of them empty", "a resume loads nothing")),
    Fires("CKD210", "zero3-empty-full", emptied("clean-full", f"{CK8}/model.safetensors"),
          f"{CK8}/model.safetensors", ERR, ("21 tensors, all of them empty",)),
    Fires("CKD211", "cut-config", truncated("clean-full", f"{CK8}/config.json", 100), f"{CK8}/config.json", ERR,
          ("JSON ends mid-document", "line")),
    Fires("CKD301", "config-not-copied", unlinked("clean-lora", f"{CK8}/adapter_config.json"), CK8, ERR,
          ("`checkpoint-8/adapter_model.safetensors` has no `adapter_config.json`",)),
    Fires("CKD301", "aux-config-not-copied", unlinked("lora-second-adapter", f"{CK8}/aux/adapter_config.json"),
          f"{CK8}/aux", ERR, ("`checkpoint-8/aux/adapter_model.safetensors` has no `adapter_config.json`",)),
    Fires("CKD302", "r-edited", json_edit("clean-lora", f"{CK8}/adapter_config.json", r=4),
          f"{CK8}/adapter_model.safetensors", ERR, ("r is 4", "4 of 4 LoRA matrices have rank 2", LORA_Q_A)),
    Fires("CKD401", "finished-run", clean("lr-finished"), CK8, INFO, ("global_step 8 of max_steps 8", "LR 0")),
    Fires("CKD402", "no-global-step", json_edit("clean-full", f"{CK8}/trainer_state.json", global_step=...),
          f"{CK8}/trainer_state.json", ERR, ("no `global_step`",)),
    Fires("CKD402", "cut-state", truncated("clean-full", f"{CK8}/trainer_state.json", 500),
          f"{CK8}/trainer_state.json", ERR, ("not valid JSON",)),
    Fires("CKD403", "scheduler-deleted", unlinked("clean-full", f"{CK8}/scheduler.pt"), CK8, WARN,
          ("optimizer state but no `scheduler.pt`", "restores neither")),
    Fires("CKD404", "rng-deleted", unlinked("clean-full", f"{CK8}/rng_state.pth"), CK8, INFO, ("no `rng_state*.pth`",)),
    Fires("CKD404", "fsdp-rank-rng-deleted", unlinked("fsdp", "checkpoint-4/rng_state_1.pth"), "checkpoint-4", INFO,
          ("saved by 2 ranks", "`rng_state_1.pth` is missing")),
    Fires("CKD405", "resumed-with-other-modules", clean("optimizer-mismatch"), "checkpoint-12", ERR,
          ("resumed from `checkpoint-8`", "[q_proj, v_proj] (r=2)", "trains [k_proj, v_proj] (r=2)")),
    Fires("CKD405", "sharded-weights-other-optimizer", sharded_with_lora_optimizer, f"{CK8}/optimizer.pt", ERR,
          ("4 optimizer states have shapes no trainable tensor has", "[2, 16] x2")),
    Fires("CKD405", "r4-adapter-over-r2-optimizer", r4_over_r2, f"{CK8}/optimizer.pt", ERR,
          ("4 optimizer states", "[2, 16] x2", "[16, 2] x2", "the adapter has [4, 16] x2, [16, 4] x2")),
    Fires("CKD406", "resumed-without-scheduler", clean("lr-jump"), "checkpoint-12/trainer_state.json", WARN,
          ("from 0.0208 at step 8 to 0.05 at step 9",)),
    Fires("CKD501", "fsdp-rank-file-missing", unlinked("fsdp", "checkpoint-4/pytorch_model_fsdp_0/__1_0.distcp"),
          "checkpoint-4/pytorch_model_fsdp_0/__1_0.distcp", ERR, ("references 21 items in `__1_0.distcp`",)),
    Fires("CKD501", "fsdp-rank-file-short", truncated("fsdp", "checkpoint-4/optimizer_0/__1_0.distcp", 100),
          "checkpoint-4/optimizer_0/__1_0.distcp", ERR, ("has 100 bytes", "references bytes up to")),
    Fires("CKD501", "torchtitan-rank-file-missing", sample(f"{TITAN}/full", _drop_titan_rank_file),
          "checkpoint/step-4/__1_0.distcp", ERR, ("references", "which does not exist")),
    Fires("CKD510", "torchtitan-step-without-metadata", sample(f"{TITAN}/full", _drop_titan_metadata),
          "checkpoint/step-4", ERR, ("`_find_load_step` skips it", "resumes from `step-2`, 2 steps earlier")),
    Fires("CKD511", "torchtitan-model-only-final-step", sample(f"{TITAN}/model-only"), "checkpoint/step-4", INFO,
          ("model-only save", "`Missing key in checkpoint state_dict`", "`optimizer`, `lr_scheduler`")),
    Fires("CKD512", "torchtitan-renamed-step", sample(f"{TITAN}/full", _rename_titan_step), "checkpoint/step-6", ERR,
          ("`train_state.step` is 2 but the folder is `step-6`", "continues from step 2")),
    Fires("CKD513", "torchtitan-loader-world-4", sample(f"{TITAN}/loader-world-4"), "checkpoint/step-2", WARN,
          ("`dataloader.world_size` is 4", "missing dp rank(s) 2, 3")),
    Fires("CKD502", "zero-partition-missing", deepspeed(ranks=(0,)), f"{CK8}/global_step8", ERR,
          ("1 of 2 ZeRO optimizer partitions", "missing rank(s) 1")),
    Fires("CKD503", "latest-tag-deleted", deepspeed(tags=(4, 8), drop="global_step8"), f"{CK8}/latest", ERR,
          ("names `global_step8`", "present: global_step4")),
    Fires("CKD601", "malicious-training-args", malicious_args, f"{CK8}/training_args.bin", ERR,
          (f"calls `{os.name}.system`", "can run code")),
    Fires("CKD601", "callback-class", callback_state, f"{CK8}/callback_state.pt", ERR,
          (f"`{__name__}.WarmupCallback`", "can run code")),
    Fires("CKD217", "untied-config-tied-save", lm_save(untie_config=True), "config.json", ERR,
          ("`tie_word_embeddings` is false", "no `lm_head.weight`", "`model.embed_tokens.weight`")),
    Fires("CKD422", "name-or-path-checkpoint", started_from_checkpoint, f"{CK8}/config.json", WARN,
          ("`_name_or_path` names `/jobs/run-a/checkpoint-500`", "as a new run", "not resumed from it")),
    Fires("CKD602", "installed-class", installed_class_state, f"{CK8}/callback_state.pt", WARN,
          ("`argparse.ArgumentParser`", "outside the allowlist")),
    Fires("CKD603", "cut-pickle-in-zip", cut_rng_pickle, f"{CK8}/rng_state.pth", ERR, ("truncated stream",)),
    Fires("CKD605", "duplicate-data-pkl", smuggled_pickle, f"{CK8}/optimizer.pt", ERR, ("data.pkl",)),
    Fires("CKD604", "weights-linked-out", link_outside, f"{CK8}/model.safetensors", ERR,  # in the picked checkpoint
          ("outside the scan root", "shared/model.safetensors", "what it loads was not checked")),
)

SILENT: tuple[Silent, ...] = (
    Silent("CKD120", "accelerate", accelerate_run()),
    Silent("CKD121", "accelerate", accelerate_run()),
    Silent("CKD430", "accelerate", accelerate_run(custom=1)),
    Silent("CKD431", "accelerate", accelerate_run(custom=2)),
    Silent("CKD108", "clean-full", lambda run_copy: run_copy("clean-full")),
    Silent("CKD416", "lightning-plain", sample("lightning-2.6.6/plain")),
    *(Silent(code, "lightning-plain", sample("lightning-2.6.6/plain"))
      for code in ("CKD440", "CKD441", "CKD442", "CKD443", "CKD444", "CKD447", "CKD448")),
    # a later fit's `last-v1.ckpt` beside an earlier run's `last.ckpt` that holds more steps: not stale
    Silent("CKD440", "lightning-later-fit", sample("lightning-2.6.6/plain", _lightning_last_from(
           "namespace", "last-v1.ckpt", 60))),
    Silent("CKD107", "tf-trainer", sample("tf/tf-trainer")),
    Silent("CKD215", "mindnlp", sample("mindnlp")),
    Silent("CKD215", "tf-trainer", sample("tf/tf-trainer")),
    Silent("CKD216", "keras-weights", sample("tf/keras-weights")),
    Silent("CKD217", "tied-save", lm_save(untie_config=False)),
    Silent("CKD217", "clean-full", clean("clean-full")),
    Silent("CKD422", "clean-full", clean("clean-full")),
    Silent("CKD422", "mindnlp-siblings", sample("mindnlp")),
    Silent("CKD001", "link-inside-root", link_inside),
    Silent("CKD002", "clean-full", clean("clean-full")),
    Silent("CKD002", "fsdp", clean("fsdp")),
    Silent("CKD002", "tf-trainer", sample("tf/tf-trainer")),
    Silent("CKD101", "stale-quarantined", stale_removed),
    Silent("CKD101", "clean-full", clean("clean-full")),
    Silent("CKD102", "clean-full", clean("clean-full")),
    Silent("CKD102", "trainer-state-linked-out", trainer_state_linked_out),
    Silent("CKD102", "sharded", clean("sharded")),
    Silent("CKD103", "backup-copy", backup_copy),
    Silent("CKD104", "clean-full", clean("clean-full")),
    Silent("CKD105", "best-in-this-run", best_here),
    Silent("CKD106", "weights-linked-out", link_outside),
    Silent("CKD106", "deepspeed", deepspeed()),
    Silent("CKD201", "clean-lora", clean("clean-lora")),
    Silent("CKD201", "lora-second-adapter", clean("lora-second-adapter")),
    Silent("CKD202", "sharded", clean("sharded")),
    Silent("CKD203", "clean-bin", clean("clean-bin")),
    Silent("CKD204", "sharded", clean("sharded")),
    Silent("CKD205", "sharded", clean("sharded")),
    Silent("CKD206", "same-weights-as-bin", stray_bin("clean-bin")),
    Silent("CKD207", "clean-full", clean("clean-full")),
    Silent("CKD208", "clean-full", clean("clean-full")),
    Silent("CKD210", "clean-lora", clean("clean-lora")),
    Silent("CKD211", "clean-full", clean("clean-full")),
    Silent("CKD301", "lora-second-adapter", clean("lora-second-adapter")),
    Silent("CKD302", "lora-second-adapter", clean("lora-second-adapter")),
    Silent("CKD401", "preempted-mid-schedule", clean("clean-full")),
    Silent("CKD402", "clean-full", clean("clean-full")),
    Silent("CKD403", "deepspeed-owns-both", deepspeed()),
    Silent("CKD404", "fsdp", clean("fsdp")),
    Silent("CKD404", "deepspeed", deepspeed()),
    Silent("CKD405", "lora-resumed", clean("lora-resumed")),
    Silent("CKD405", "sharded", clean("sharded")),
    Silent("CKD405", "fresh-run-other-adapter", clean("fresh-other-adapter")),
    Silent("CKD405", "config-r-edited", json_edit("clean-lora", f"{CK8}/adapter_config.json", r=4)),
    Silent("CKD405", "zero3-empty-adapter", emptied("clean-lora", f"{CK8}/adapter_model.safetensors")),
    Silent("CKD406", "full-resumed", clean("full-resumed")),
    Silent("CKD501", "fsdp", clean("fsdp")),
    Silent("CKD501", "torchtitan", sample(f"{TITAN}/full")),
    Silent("CKD510", "torchtitan", sample(f"{TITAN}/full")),
    Silent("CKD511", "torchtitan", sample(f"{TITAN}/full")),
    Silent("CKD512", "torchtitan", sample(f"{TITAN}/full")),
    Silent("CKD513", "torchtitan", sample(f"{TITAN}/full")),
    Silent("CKD502", "deepspeed", deepspeed()),
    Silent("CKD503", "deepspeed", deepspeed()),
    Silent("CKD601", "clean-full", clean("clean-full")),
    Silent("CKD602", "clean-lora", clean("clean-lora")),
    Silent("CKD603", "clean-full", clean("clean-full")),
    Silent("CKD604", "link-inside-root", link_inside),
    Silent("CKD605", "clean-full", clean("clean-full")),
)


def findings(root: Path) -> list[Finding]:
    return list(scan(str(root)).findings)


def describe(fs: list[Finding]) -> str:
    return "\n".join(f"{f.rule} {f.severity.value} {f.path}: {f.message}" for f in fs) or "(no findings)"


@pytest.mark.parametrize("case", FIRES, ids=lambda c: f"{c.code}-{c.case}")
def test_rule_fires(case: Fires, run_copy: Copy) -> None:
    found = findings(case.make(run_copy))
    hits = [f for f in found if f.rule == case.code and f.path == case.path]
    assert len(hits) == 1, describe(found)
    hit = hits[0]
    assert hit.severity == case.severity, describe(found)
    for fragment in case.says:
        assert fragment in hit.message, f"{fragment!r} not in {hit.message!r}"


@pytest.mark.parametrize("case", SILENT, ids=lambda c: f"{c.code}-{c.case}")
def test_rule_stays_silent(case: Silent, run_copy: Copy) -> None:
    found = findings(case.make(run_copy))
    assert not [f for f in found if f.rule == case.code], describe(found)


HEALTHY = ("clean-full", "clean-bin", "clean-lora", "lora-second-adapter", "sharded", "fsdp", "full-resumed",
           "lora-resumed")


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_runs_have_no_findings_but_the_finished_schedule(name: str, pristine: Callable[[str], Path]) -> None:
    found = findings(pristine(name))
    # A resumed run ran to its end: its last checkpoint legitimately ends the schedule (CKD401 is information).
    allowed = {("CKD401", "checkpoint-12")} if name.endswith("-resumed") else set()
    assert not [f for f in found if (f.rule, f.path) not in allowed], describe(found)


def test_the_malicious_pickle_is_reported_without_running(run_copy: Copy) -> None:
    root = malicious_args(run_copy)
    assert [f.rule for f in findings(root) if f.path.endswith("training_args.bin")] == ["CKD601"]
    assert not (root.parent / "canary").exists()


def test_deepspeed_layout_is_scanned_as_deepspeed(run_copy: Copy) -> None:
    """The DeepSpeed builder's files are read as real torch archives with DeepSpeed's world size."""
    root = deepspeed()(run_copy)
    assert findings(root) == []
    tree = scan(str(root)).trees[0]
    ck = next(c for c in tree.runs[0].checkpoints if c.path == CK8)
    model_states = ck.file("global_step8/mp_rank_00_model_states.pt")
    assert model_states is not None and model_states.content is not None and not model_states.problems


def test_a_deepspeed_tag_of_any_name_is_a_tag(tmp_path: Path) -> None:
    """accelerate's `save_state` with DeepSpeed writes tag `pytorch_model` (real files): its folder is the tag `latest`
    names, so CKD503 stays silent; with that folder gone, `latest` dangles and CKD503 fires."""
    real = TESTS / "data" / "stacks" / "accelerate-1.15.0-deepspeed-0.19.8-zero3"
    root = tmp_path / "run"
    shutil.copytree(real, root)
    assert (root / "latest").read_text().strip() == "pytorch_model"
    assert [f.rule for f in findings(root)] == []
    shutil.move(root / "pytorch_model", tmp_path / "elsewhere")
    got = [(f.rule, f.path) for f in findings(root) if f.rule == "CKD503"]
    assert got == [("CKD503", "latest")]


def _scan_rules() -> Iterator[str]:
    for r in all_rules():
        if not r.gate_only and not r.deep_only:
            yield r.code


def test_every_rule_has_a_firing_and_a_silent_case() -> None:
    """Adding a scan rule without a real checkpoint that fires it and one that does not fails here."""
    firing = {c.code for c in FIRES}
    silent = {c.code for c in SILENT}
    for code in _scan_rules():
        assert code in firing, f"{code} has no checkpoint where it fires (add it to FIRES)"
        assert code in silent, f"{code} has no checkpoint where it stays silent (add it to SILENT)"
    known = set(_scan_rules())
    assert firing <= known and silent <= known, "a case names a rule that is not a registered scan rule"
