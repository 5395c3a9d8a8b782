"""Helpers shared by several test files (moved from tests/fixer/test_fix.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from ckptdoctor.cli import main
from tests.helpers.builders import make_checkpoint, trainer_state
from tests.helpers.paths import REPO
from tests.helpers.payloads import hostile_payloads


def tree_state(root: Path, *, mtimes: bool = True) -> dict[str, tuple[Any, ...]]:
    """Every entry under ``root`` except ckptdoctor's own folder: type, mode, content hash (and mtime)."""
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not (Path(dirpath) == root and d == ".ckptdoctor"))
        for name in [*dirs, *files]:
            p = Path(dirpath) / name
            st = p.lstat()
            rel = str(p.relative_to(root))
            if stat.S_ISLNK(st.st_mode):
                content = os.readlink(p)
            elif stat.S_ISREG(st.st_mode):
                content = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                content = "dir"
            entry: tuple[Any, ...] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), content)
            out[rel] = (*entry, st.st_mtime_ns) if mtimes else entry
    st = root.stat()
    out["."] = (stat.S_IMODE(st.st_mode), st.st_mtime_ns) if mtimes else (stat.S_IMODE(st.st_mode),)
    return out


def age(root: Path, seconds: float = 3600.0) -> Path:
    """Move every mtime under ``root`` ``seconds`` into the past, keeping their order (a run not being written)."""
    paths = [root, *root.rglob("*")]
    for p in sorted(paths, key=lambda q: -len(q.parts)):
        st = p.lstat()
        shift = int(seconds * 1e9)
        os.utime(p, ns=(st.st_atime_ns - shift, st.st_mtime_ns - shift), follow_symlinks=False)
    return root


def run_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), env=env)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def make_lora_checkpoint(folder: Path, step: int = 4, max_steps: int = 8) -> Path:
    """A LoRA checkpoint written by peft (adapter_model.safetensors + adapter_config.json) plus training state."""
    from peft import LoraConfig, get_peft_model

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(8, 8)
            self.v_proj = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.v_proj(self.q_proj(x))

    model = get_peft_model(Tiny(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(str(folder))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps(trainer_state(step, max_steps), indent=2) + "\n")
    return folder


def stub_run(root: Path) -> Path:
    """CKD201: LoRA checkpoints with a `torch.save({})` stub `pytorch_model.bin` beside the adapter in the last."""
    for s in (2, 4):
        make_lora_checkpoint(root / f"checkpoint-{s}", s)
    torch.save({}, root / "checkpoint-4" / "pytorch_model.bin")
    os.chmod(root / "checkpoint-4" / "pytorch_model.bin", 0o600)  # an unusual mode, to see it kept
    return root


def sharded_checkpoint(folder: Path, *, wrong: bool) -> Path:
    """A checkpoint with weights in two safetensors shards and an index (wrong: one tensor mapped to shard 1)."""
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    shards = {
        "model-00001-of-00002.safetensors": {"embed.weight": torch.randn(16, 8)},
        "model-00002-of-00002.safetensors": {"head.weight": torch.randn(16, 8), "head.bias": torch.randn(16)},
    }
    weight_map: dict[str, str] = {}
    total = 0
    for name, tensors in shards.items():
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    if wrong:
        weight_map["head.bias"] = "model-00001-of-00002.safetensors"
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (folder / "trainer_state.json").write_text(json.dumps(trainer_state(4, 8), indent=2) + "\n")
    (folder / "config.json").write_text(json.dumps({"vocab_size": 16, "hidden_size": 8}))
    return folder


def deepspeed_checkpoint(folder: Path) -> Path:
    """CKD503: a checkpoint whose DeepSpeed `latest` names `global_step9` while only `global_step8/` exists."""
    make_checkpoint(folder, 8, 8)
    tag = folder / "global_step8"
    tag.mkdir()
    torch.save({"module": {"w": torch.zeros(2)}}, tag / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {}}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (folder / "latest").write_text("global_step9")
    return folder


def mixed_run(root: Path) -> Path:
    """One output_dir holding one hazard of each safe fix kind: quarantine file, folder, rewrite JSON and text."""
    stub_run(root)  # CKD201 in checkpoint-4
    make_checkpoint(root / "tmp-checkpoint-6", 6)  # CKD103
    (root / "tmp-checkpoint-6" / "trainer_state.json").unlink()
    sharded_checkpoint(root / "checkpoint-1", wrong=True)  # CKD205
    deepspeed_checkpoint(root / "checkpoint-3")  # CKD503
    return root


def clone(src: Path, dest: Path) -> Path:
    """A copy of ``src`` with names, contents, modes and every mtime (folders' too) kept."""
    shutil.copytree(src, dest, symlinks=True)
    for p in sorted([src, *src.rglob("*")], key=lambda q: -len(q.parts)):
        st = p.lstat()
        os.utime(dest / p.relative_to(src), ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
    return dest


FIXTURES = REPO / "fixtures"


def fixture(name: str, tmp_path: Path) -> Path:
    """A copy of a shipped fixture, every mtime an hour old (a run nobody is writing)."""
    return age(Path(shutil.copytree(FIXTURES / name, tmp_path / name)))


def stubs_and_hostile_pickle(tmp_path: Path) -> Path:
    """stub-shadow (two stub pytorch_model.bin the fix quarantines) with a hostile rng_state.pth (CKD601, no fix)."""
    root = fixture("stub-shadow", tmp_path)
    (root / "checkpoint-4" / "rng_state.pth").write_bytes(
        hostile_payloads(tmp_path / "canary")["posix.system protocol 0"][0]
    )
    return age(root)
