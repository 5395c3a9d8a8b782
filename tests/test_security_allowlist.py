"""The generated allowlist: regenerated from files the real libraries write here, it is a subset of the pinned
ckptdoctor/rules/allowlist.json; and the policy never lets a name slip through by pattern."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptdoctor.model import GlobalRef
from ckptdoctor.rules import pickle_policy
from ckptdoctor.rules.pickle_policy import is_allowed, is_dangerous

torch = pytest.importorskip("torch")

PINNED = Path(pickle_policy.__file__).with_name("allowlist.json")


def test_regenerated_globals_are_pinned(tmp_path: Path) -> None:
    from bench import make_allowlist

    make_allowlist.write_torch_files(tmp_path / "torch")
    make_allowlist.write_dcp(tmp_path)
    make_allowlist.write_peft_adapter(tmp_path)
    found = make_allowlist.globals_in(tmp_path)
    pinned = json.loads(PINNED.read_text())
    known = set(pinned["observed"]) | set(pinned["enums"])
    assert found, "the generator found no globals at all"
    assert set(found) <= known, sorted(set(found) - known)
    assert all(is_allowed(GlobalRef(*g.rsplit(".", 1))) for g in found)


def test_pinned_file_shape() -> None:
    doc = json.loads(PINNED.read_text())
    assert {"observed", "enums", "versions"} <= set(doc)
    assert "transformers.training_args.TrainingArguments" in doc["observed"]
    assert "deepspeed.runtime.zero.config.ZeroStageEnum" in doc["observed"] or not doc["deepspeed_runs"]
    assert not any(is_dangerous(GlobalRef(*g.rsplit(".", 1))) for g in doc["observed"])


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("transformers.trainer_utils", "os.system"),  # attribute chain through an allowed module
        ("transformers.trainer_utils", "set_seed"),  # a function of a module whose enums are allowed
        ("accelerate.utils.dataclasses", "subprocess"),
        ("torch.distributed.checkpoint.metadata", "torch.load"),
        ("ckptdoctor.reference.train", "replace_dir"),
        ("<dynamic>", "system"),
        ("torch", "load.__globals__"),
    ],
)
def test_no_pattern_lets_a_name_through(module: str, name: str) -> None:
    assert not is_allowed(GlobalRef(module, name))


@pytest.mark.parametrize(
    "dotted",
    ["torch.serialization.os.system", "pathlib.Path.write_text", "builtins.str.__class__.__subclasses__",
     "numpy.lib.npyio.pickle.loads", "torch.hub.load"],
)  # fmt: skip
def test_attribute_chains_through_dangerous_modules(dotted: str) -> None:
    module, _, rest = dotted.partition(".")
    first, _, name = rest.partition(".")
    g = GlobalRef(f"{module}.{first}", name)
    assert is_dangerous(g) or not is_allowed(g)
