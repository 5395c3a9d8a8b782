"""CKD205's severity follows what the loaders do with a wrong shard index: an error only when a tensor is not loaded.

Shards are written by transformers' ``save_pretrained`` (tiny Llama, small ``max_shard_size``), then the index or a
shard is edited per case. Each case also runs the real resume loader (``load_sharded_checkpoint``) to show which
tensors keep their fresh values, so the expected severity rests on the loader, not on a belief about it.
"""

from __future__ import annotations

import gc
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.trainer_utils import load_sharded_checkpoint

from ckptdoctor import fixer as fixmod
from ckptdoctor.findings import Finding, OpKind, Severity
from ckptdoctor.scanner import scan
from tests.helpers.builders import trainer_state

INDEX = "model.safetensors.index.json"
CONFIG = LlamaConfig(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)
STILL_LOADS = "resume and `from_pretrained` still load every tensor, because they read every shard the index names"
OFFLOAD = "offloading to disk reads by entry and raises"

WeightMap = dict[str, str]
Index = dict[str, Any]
Edit = Callable[[Path, Index], None]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A sharded model folder (12 shards; `lm_head.weight` alone in the last) and its state dict."""
    torch.manual_seed(1)
    model = LlamaForCausalLM(CONFIG)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))  # far from a fresh init (whose norm weights are all ones)
    folder = tmp_path_factory.mktemp("saved") / "model"
    model.save_pretrained(folder, max_shard_size="3KB")
    return folder, {k: v.clone() for k, v in model.state_dict().items()}


def weight_map(folder: Path) -> WeightMap:
    return dict(json.loads((folder / INDEX).read_text())["weight_map"])


def edited(saved: tuple[Path, Any], dest: Path, edit: Edit) -> Path:
    """A copy of the saved folder with ``edit`` applied to its index (and, if it wants, to its shards)."""
    shutil.copytree(saved[0], dest)
    index = json.loads((dest / INDEX).read_text())
    edit(dest, index)
    (dest / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return dest


def swap(folder: Path, index: Index) -> None:
    """(a) the user's report: two entries' shards swapped; every shard still named."""
    wm = index["weight_map"]
    wm["lm_head.weight"], wm["model.norm.weight"] = wm["model.norm.weight"], wm["lm_head.weight"]


def wrong_named_shard(folder: Path, index: Index) -> None:
    """(b) an entry names another existing shard; its own shard is still named by `q_proj`."""
    wm = index["weight_map"]
    wm["model.layers.0.self_attn.k_proj.weight"] = wm["model.embed_tokens.weight"]


def unnamed_shard(folder: Path, index: Index) -> None:
    """(c) no entry names the last shard (`lm_head.weight` re-pointed at the first)."""
    wm = index["weight_map"]
    wm["lm_head.weight"] = wm["model.embed_tokens.weight"]


def dropped_entry(folder: Path, index: Index) -> None:
    """(d) an entry missing; its shard still named by `q_proj`."""
    wm = index["weight_map"]
    del wm["model.layers.0.self_attn.k_proj.weight"]


def dropped_only_entry(folder: Path, index: Index) -> None:
    """(c) by omission: the only entry of the last shard removed, so no entry names that shard."""
    wm = index["weight_map"]
    del wm["lm_head.weight"]


def phantom_entry(folder: Path, index: Index) -> None:
    """(e) an entry for a tensor no shard holds (and the model does not have)."""
    wm = index["weight_map"]
    wm["model.extra.weight"] = wm["model.embed_tokens.weight"]


def removed_tensor(folder: Path, index: Index) -> None:
    """(e) an entry for a model tensor that was removed from its shard (the shard rewritten without it)."""
    wm = index["weight_map"]
    shard = folder / wm["model.layers.0.self_attn.k_proj.weight"]
    tensors = load_file(str(shard))
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, str(shard), metadata={"format": "pt"})


def wrong_total_size(folder: Path, index: Index) -> None:
    """Only `total_size` is wrong (no loader reads it)."""
    index["metadata"]["total_size"] += 4


# (case, edit, severity, message parts, tensors the resume keeps fresh)
CASES: list[tuple[str, Edit, Severity, tuple[str, ...], set[str]]] = [
    ("a-swapped", swap, Severity.WARNING,
     ("index maps `lm_head.weight` to `model-00011-of-00012.safetensors`, which does not hold it (it is in "
      "`model-00012-of-00012.safetensors`)", STILL_LOADS, OFFLOAD), set()),
    ("b-wrong-named-shard", wrong_named_shard, Severity.WARNING,
     ("index maps `model.layers.0.self_attn.k_proj.weight` to `model-00001-of-00012.safetensors`", STILL_LOADS,
      OFFLOAD), set()),
    ("c-unnamed-shard", unnamed_shard, Severity.ERROR,
     ("`model-00012-of-00012.safetensors` is on disk but no index entry references it",), {"lm_head.weight"}),
    ("c-dropped-only-entry", dropped_only_entry, Severity.ERROR,
     ("`model-00012-of-00012.safetensors` holds 1 tensor the index omits (e.g. `lm_head.weight`)",
      "`model-00012-of-00012.safetensors` is on disk but no index entry references it"), {"lm_head.weight"}),
    ("d-dropped-entry", dropped_entry, Severity.WARNING,
     ("`model-00002-of-00012.safetensors` holds 1 tensor the index omits (e.g. "
      "`model.layers.0.self_attn.k_proj.weight`)", STILL_LOADS), set()),
    ("e-phantom-entry", phantom_entry, Severity.ERROR,
     ("index maps `model.extra.weight` to `model-00001-of-00012.safetensors`, which does not hold it, and no "
      "shard does",), set()),
    ("e-removed-tensor", removed_tensor, Severity.ERROR,
     ("index maps `model.layers.0.self_attn.k_proj.weight` to `model-00002-of-00012.safetensors`, which does not "
      "hold it, and no shard does",), {"model.layers.0.self_attn.k_proj.weight"}),
    ("total-size", wrong_total_size, Severity.WARNING, ("total_size is", STILL_LOADS), set()),
]  # fmt: skip


def ckd205(root: Path) -> list[Finding]:
    return [f for f in scan(str(root)).findings if f.rule == "CKD205"]


def resume_keeps_fresh(folder: Path, saved_state: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The tensors a Trainer resume (``load_sharded_checkpoint``, as ``_load_from_checkpoint`` calls it) leaves at
    their fresh values."""
    monkeypatch.setattr(gc, "collect", lambda *_: 0)  # run after every shard; seconds on a busy machine, no effect
    torch.manual_seed(123)
    model = LlamaForCausalLM(CONFIG)
    load_sharded_checkpoint(model, str(folder), strict=False)
    state = model.state_dict()
    return {k for k, v in saved_state.items() if not torch.equal(state[k], v)}


@pytest.mark.parametrize(
    ("case", "edit", "severity", "parts", "fresh"), CASES, ids=[c[0] for c in CASES]
)  # fmt: skip
def test_severity_follows_what_the_resume_loads(
    saved: tuple[Path, dict[str, torch.Tensor]],
    tmp_path: Path,
    case: str,
    edit: Edit,
    severity: Severity,
    parts: tuple[str, ...],
    fresh: set[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    folder = edited(saved, tmp_path / case, edit)
    assert resume_keeps_fresh(folder, saved[1], monkeypatch) == fresh  # the evidence the severity rests on
    (finding,) = ckd205(folder)
    assert finding.severity == severity
    assert finding.path == INDEX
    for part in parts:
        assert part in finding.message, finding.message
    if severity == Severity.ERROR:
        assert STILL_LOADS not in finding.message
    assert "1 tensors" not in finding.message


def test_clean_sharded_folder_is_silent(saved: tuple[Path, Any], tmp_path: Path) -> None:
    shutil.copytree(saved[0], tmp_path / "clean")
    assert ckd205(tmp_path / "clean") == []


@pytest.mark.parametrize("edit", [swap, dropped_entry, unnamed_shard], ids=["warning", "warning-omits", "error"])
def test_fix_plans_the_index_rebuild_whatever_the_severity(saved: tuple[Path, Any], tmp_path: Path, edit: Edit) -> None:
    folder = edited(saved, tmp_path / "model", edit)
    report = scan(str(folder))
    plan = fixmod.plan_root(report.trees[0], report.findings, root=str(folder))
    assert [f.rule for f in plan.planned] == ["CKD205"]
    (op,) = plan.ops
    assert (op.kind, op.path) == (OpKind.REWRITE_JSON, INDEX)
    assert op.content is not None
    assert json.loads(op.content)["weight_map"] == weight_map(saved[0])  # exactly what save_pretrained wrote
    assert (folder / INDEX).read_text() != op.content  # a plan writes nothing


def training_checkpoint(saved: tuple[Path, Any], folder: Path, edit: Edit) -> Path:
    """A Trainer-style checkpoint: the edited shards plus a real AdamW state (one step) and scheduler."""
    edited(saved, folder, edit)
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    torch.save(sched.state_dict(), folder / "scheduler.pt")
    (folder / "trainer_state.json").write_text(json.dumps(trainer_state(4, 8), indent=2) + "\n")
    return folder


@pytest.mark.parametrize("edit", [dropped_only_entry, unnamed_shard, swap], ids=["omitted", "unnamed", "swapped"])
def test_optimizer_is_compared_with_what_the_shards_hold_not_with_a_wrong_index(
    saved: tuple[Path, Any], tmp_path: Path, edit: Edit
) -> None:
    """The user's report: an index missing the entry of `lm_head.weight` (alone in its shard) also raised CKD405
    ("1 optimizer states have shapes no trainable tensor has"). The optimizer matches the model; the index does
    not: CKD205 alone reports it."""
    training_checkpoint(saved, tmp_path / "checkpoint-4", edit)
    codes = {f.rule for f in scan(str(tmp_path)).findings}
    assert "CKD205" in codes and "CKD405" not in codes


def test_a_real_optimizer_mismatch_is_still_reported_beside_a_wrong_index(
    saved: tuple[Path, Any], tmp_path: Path
) -> None:
    folder = training_checkpoint(saved, tmp_path / "checkpoint-4", swap)
    bigger = torch.nn.Linear(16, 48, bias=False)  # one more parameter than the model has, of a shape it lacks
    opt = torch.optim.AdamW([*LlamaForCausalLM(CONFIG).parameters(), bigger.weight], lr=1e-3)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    found = {f.rule: f for f in scan(str(tmp_path)).findings}
    assert found["CKD205"].severity == Severity.WARNING
    message = found["CKD405"].message
    assert "the optimizer holds 22 parameters but the weights only 21 tensors" in message
    assert "1 optimizer state has a shape no trainable tensor has ([48, 16] x1)" in message
