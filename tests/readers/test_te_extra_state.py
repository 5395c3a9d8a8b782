"""A real-shaped TransformerEngine fp8 ``_extra_state``: what ``TransformerEngineBaseModule.get_extra_state``
(transformer_engine/pytorch/module/base.py) pickles into a uint8 tensor: a dict of the ``DelayedScaling`` recipe
(transformer_engine/common/recipe/__init__.py: a pydantic dataclass whose ``fp8_format`` is the ``Format`` enum, its
value a ``_FormatHelper`` NamedTuple), the CPU scale and amax-history tensors (plain ``pickle.dumps`` of a tensor
pickles its storage as ``torch.storage._load_from_bytes`` of a legacy ``torch.save`` in literal bytes) and
``extra_fp8_variables`` (plain values). TE itself cannot be imported here (the pip package without its compiled
core refuses to import), so the recipe module is loaded from TE's own source in the ``/work/stacks/te`` layer
(``pip install --no-deps --target /work/stacks/te transformer_engine==2.20.2``) under its real module path. Each
record is saved as a module's state dict is: ``torch.save``, ``safetensors.torch.save_file`` and a one-process
``torch.distributed.checkpoint.save``; a clean one scans clean, a payload in any record is CKD601."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ckptdoctor.scanner import scan
from tests.helpers.te_recipe import LOAD_TE_RECIPE

pytest.importorskip("torch")
pytest.importorskip("pydantic")

TE_LAYER = Path("/work/stacks/te/transformer_engine")

pytestmark = pytest.mark.skipif(not (TE_LAYER / "common" / "recipe").is_dir(), reason="the TE layer is not installed")

_BUILD = r"""
import os, pickle, sys
import torch
root = sys.argv[2]
""" + LOAD_TE_RECIPE + r"""
state = {"recipe": recipe.DelayedScaling(), "scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(16, 3),
         "scale_bwd": torch.ones(2), "amax_history_bwd": torch.zeros(16, 2),
         "extra_fp8_variables": {"num_gemms": 1, "fp8_checkpoint": True, "fp8_max_fwd": 448.0}}
class Touch:
    def __reduce__(self):
        return os.system, ("touch " + sys.argv[3],)
saved = {}
records = int(sys.argv[4])
for i in range(records):  # one record per TE module, as many as a real model holds; a payload in the last one
    if sys.argv[3] and i == records - 1:
        state["extra_fp8_variables"]["x"] = Touch()
    saved[f"layers.{i}.linear.weight"] = torch.zeros(2, 2)
    saved[f"layers.{i}.linear._extra_state"] = torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)
if sys.argv[5] == "torch":
    torch.save(saved, sys.argv[1])
elif sys.argv[5] == "safetensors":  # the record as safetensors holds it (safetensors.torch.save_file)
    from safetensors.torch import save_file
    save_file(saved, sys.argv[1])
else:  # one process's torch.distributed.checkpoint save of the state dict: a folder
    import torch.distributed.checkpoint as dcp
    dcp.save(saved, checkpoint_id=sys.argv[1])
"""


_NAMES = {"torch": "model.pt", "safetensors": "model.safetensors", "dcp": "dcp"}


def _build(path: Path, canary: str = "", records: int = 1, fmt: str = "torch") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-c", _BUILD, str(path), str(TE_LAYER), canary, str(records), fmt], check=True,
                   timeout=120, capture_output=True)  # fmt: skip


def _security(root: Path) -> list[str]:
    return [f"{f.rule} {f.path}: {f.message}" for f in scan(str(root)).findings if f.rule.startswith("CKD6")]


@pytest.mark.parametrize("fmt", list(_NAMES))
def test_a_real_shaped_te_fp8_extra_state_scans_clean(tmp_path: Path, fmt: str) -> None:
    _build(tmp_path / "run" / "checkpoint-1" / _NAMES[fmt], fmt=fmt)
    assert _security(tmp_path / "run") == []


def test_a_model_with_hundreds_of_te_extra_state_records_scans_clean(tmp_path: Path) -> None:
    """Four pickled storages per record, 1,600 nested pickles in one file: inside the nested search's budget."""
    _build(tmp_path / "run" / "checkpoint-1" / "model.pt", records=400)
    assert _security(tmp_path / "run") == []


def test_a_payload_in_one_of_hundreds_of_te_extra_state_records_stays_flagged(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    _build(tmp_path / "run" / "checkpoint-1" / "model.pt", str(canary), records=400)
    assert not canary.exists()
    assert any(f.startswith("CKD601") and "system" in f for f in _security(tmp_path / "run"))


@pytest.mark.parametrize("fmt", list(_NAMES))
def test_a_payload_in_a_te_extra_state_stays_flagged(tmp_path: Path, fmt: str) -> None:
    canary = tmp_path / "canary"
    _build(tmp_path / "run" / "checkpoint-1" / _NAMES[fmt], str(canary), fmt=fmt)
    assert not canary.exists()
    assert any(f.startswith("CKD601") and "system" in f for f in _security(tmp_path / "run"))
