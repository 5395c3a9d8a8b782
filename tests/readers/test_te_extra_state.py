"""A real-shaped TransformerEngine fp8 ``_extra_state``: what ``TransformerEngineBaseModule.get_extra_state``
(transformer_engine/pytorch/module/base.py) pickles into a uint8 tensor: a dict of the ``DelayedScaling`` recipe
(transformer_engine/common/recipe/__init__.py: a pydantic dataclass whose ``fp8_format`` is the ``Format`` enum, its
value a ``_FormatHelper`` NamedTuple), the CPU scale and amax-history tensors (plain ``pickle.dumps`` of a tensor
pickles its storage as ``torch.storage._load_from_bytes`` of a legacy ``torch.save`` in literal bytes) and
``extra_fp8_variables`` (plain values). TE itself cannot be imported here (the pip package without its compiled
core refuses to import), so the recipe module is loaded from TE's own source in the ``/work/stacks/te`` layer
(``pip install --no-deps --target /work/stacks/te transformer_engine==2.20.2``) under its real module path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ckptdoctor.scanner import scan

pytest.importorskip("torch")
pytest.importorskip("pydantic")

TE_LAYER = Path("/work/stacks/te/transformer_engine")

pytestmark = pytest.mark.skipif(not (TE_LAYER / "common" / "recipe").is_dir(), reason="the TE layer is not installed")

_BUILD = r"""
import importlib.util, os, pickle, sys, types
import torch
root = sys.argv[2]
for name, path in (("transformer_engine", root), ("transformer_engine.common", root + "/common")):
    package = types.ModuleType(name)  # TE's package __init__ loads its compiled core: only the recipe is needed
    package.__path__ = [path]
    sys.modules[name] = package
spec = importlib.util.spec_from_file_location("transformer_engine.common.recipe", root + "/common/recipe/__init__.py")
recipe = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = recipe
spec.loader.exec_module(recipe)
state = {"recipe": recipe.DelayedScaling(), "scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(16, 3),
         "scale_bwd": torch.ones(2), "amax_history_bwd": torch.zeros(16, 2),
         "extra_fp8_variables": {"num_gemms": 1, "fp8_checkpoint": True, "fp8_max_fwd": 448.0}}
if len(sys.argv) > 3:
    class Touch:
        def __reduce__(self):
            return os.system, ("touch " + sys.argv[3],)
    state["extra_fp8_variables"]["x"] = Touch()
extra = torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)
torch.save({"linear.weight": torch.zeros(2, 2), "linear._extra_state": extra}, sys.argv[1])
"""


def _build(path: Path, *canary: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", _BUILD, str(path), str(TE_LAYER), *canary], check=True, timeout=120,
                   capture_output=True)  # fmt: skip


def _security(root: Path) -> list[str]:
    return [f"{f.rule} {f.path}: {f.message}" for f in scan(str(root)).findings if f.rule.startswith("CKD6")]


@pytest.mark.xfail(
    strict=True,
    reason="issue 22 item 6: TE's recipe classes (DelayedScaling rebuilt, Format called as an enum, _FormatHelper "
    "a NamedTuple) need reviewed entries, and torch.storage._load_from_bytes (a full torch.load of its bytes) can be "
    "admitted only once those bytes are judged as torch.load reads them: the nested search reads only the main "
    "stream's value (merge_pickles keeps it alone, so an _extra_state pickle's bytes are never searched), reads a "
    "legacy torch blob's first stream only, and stops at 64 nested pickles per file",
)
def test_a_real_shaped_te_fp8_extra_state_scans_clean(tmp_path: Path) -> None:
    _build(tmp_path / "run" / "checkpoint-1" / "model.pt")
    assert _security(tmp_path / "run") == []


def test_a_payload_in_a_te_extra_state_stays_flagged(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    _build(tmp_path / "run" / "checkpoint-1" / "model.pt", str(canary))
    assert not canary.exists()
    assert any(f.startswith("CKD601") and "system" in f for f in _security(tmp_path / "run"))
