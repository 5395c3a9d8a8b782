"""The generated allowlist: regenerated from files the real libraries write here, it is a subset of the pinned
ckptdoctor/pickle_verdict/allowlist.json, which records every stack of the matrix with its versions; the policy never
lets a name slip through by pattern; and clean files from the matrix's older stacks raise no alarm.

tests/data/stacks/ holds real files written by bench/stack_writer.py under the matrix's layers (see
bench/make_allowlist.py): a 2-step Trainer run of transformers 4.40.2 saved as ``.bin``, TrainingArguments
(default and FSDP) of 4.44.2, 4.46.3, 4.49.0, 4.51.3 and 4.55.4, a 4.40.2 Seq2SeqTrainingArguments holding a
GenerationConfig, peft 0.11.1 adapters (LoRA, DoRA, IA3, modules_to_save, prompt tuning) trained by the 4.40.2
Trainer, a Trainer run and numpy arrays, scalars and object arrays under numpy 1.26.4, a DeepSpeed 0.19.8 ZeRO-3
TrainingArguments of 4.40.2, and accelerate 1.15's ``save_state`` under a ZeRO-3 ``DeepSpeedPlugin``. None of those
releases is installed in the test environment: the verdict comes from the files' own facts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ckptdoctor import scan
from ckptdoctor.findings import Severity
from ckptdoctor.model import GlobalRef, PickleFacts
from ckptdoctor.pickle_verdict import policy as pickle_policy
from ckptdoctor.pickle_verdict.policy import is_allowed, is_dangerous
from ckptdoctor.readers import read_file
from tests.helpers.paths import REPO, TESTS

torch = pytest.importorskip("torch")

PINNED = Path(pickle_policy.__file__).with_name("allowlist.json")
STACKS = TESTS / "data" / "stacks"
LAYERS = Path(os.environ.get("CKPTDOCTOR_STACKS", "/work/stacks"))  # where bench/make_allowlist.py finds the matrix
TRANSFORMERS_4 = ("4.40.2", "4.44.2", "4.46.3", "4.49.0", "4.51.3", "4.55.4")
PEFT_VARIANTS = ("lora", "dora", "ia3", "modules_to_save", "prompt_tuning")


def _alarms(root: Path) -> list[str]:
    """Every finding above info, and every security finding whatever its severity."""
    report = scan(str(root), no_config=True)
    return [f"{f.rule} {f.path}: {f.message}" for f in report.findings
            if f.severity is not Severity.INFO or f.rule.startswith("CKD6")]  # fmt: skip


def _globals(path: Path) -> set[str]:
    """The globals a file's pickles name, read statically."""
    facts = read_file(str(path), path.name, path.stat())
    content = facts.content
    pf = content if isinstance(content, PickleFacts) else getattr(content, "pickle", None)
    assert isinstance(pf, PickleFacts), f"{path} holds no pickle"
    return {g.dotted for g in (*pf.globals, *pf.calls)}


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


def test_pinned_file_records_every_stack_of_the_matrix() -> None:
    from bench import make_allowlist

    doc = json.loads(PINNED.read_text())
    assert set(doc["stacks"]) == {name for name, *_ in make_allowlist.STACKS}
    for name, covered in doc["stacks"].items():
        # A stack is recorded with the versions it ran, or with why it did not: never left out, never guessed.
        recorded = isinstance(covered, dict) and bool(covered["versions"])
        assert recorded or str(covered).startswith(("not installed", "failed")), (name, covered)
    ran = {c["versions"]["transformers"] for c in doc["stacks"].values() if isinstance(c, dict) and "transformers" in
           c.get("versions", {})}  # fmt: skip
    assert {v for v in TRANSFORMERS_4 if v in ran} == set(TRANSFORMERS_4), sorted(ran)
    assert doc["adapter_globals"] and not any(g.startswith("peft") for g in doc["adapter_globals"])


def test_a_transformers_4_40_checkpoint_raises_no_alarm() -> None:
    run = STACKS / "transformers-4.40.2"
    assert {p.name for p in (run / "checkpoint-2").iterdir()} >= {"pytorch_model.bin", "optimizer.pt", "scheduler.pt",
                                                                 "rng_state.pth", "training_args.bin"}  # fmt: skip
    assert _alarms(run) == []


@pytest.mark.parametrize("version", TRANSFORMERS_4)
def test_transformers_4x_training_args_raise_no_alarm(version: str) -> None:
    folder = STACKS / f"transformers-{version}"
    args = sorted(folder.glob("training_args-*.bin"))
    assert {p.name for p in args} >= {"training_args-fsdp.bin"}
    assert "transformers.trainer_utils.FSDPOption" in _globals(folder / "training_args-fsdp.bin")
    assert _alarms(folder) == []


def test_a_seq2seq_variant_with_a_generation_config_is_pinned_and_raises_no_alarm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Seq2SeqTrainingArguments with ``generation_config=GenerationConfig(...)`` (transformers 4.40.2) pickles the
    GenerationConfig object too: the matrix writes that variant under every transformers stack, so the name is in the
    pinned file and passes where transformers is not installed (no source to prove it a class)."""
    path = STACKS / "transformers-4.40.2-seq2seq-training_args.bin"
    gen = "transformers.generation.configuration_utils.GenerationConfig"
    assert {gen, "transformers.training_args_seq2seq.Seq2SeqTrainingArguments"} <= _globals(path)
    assert gen in pickle_policy.GENERATED
    monkeypatch.setattr(pickle_policy, "_module_defs", lambda module: None)  # as if transformers were not installed
    for cached in (pickle_policy._settled, pickle_policy.standing):
        cached.cache_clear()
    try:
        report = scan(str(path), no_config=True)
        assert [f.rule for f in report.findings if f.rule.startswith("CKD6")] == []
    finally:
        for cached in (pickle_policy._settled, pickle_policy.standing):
            cached.cache_clear()


@pytest.mark.parametrize("variant", PEFT_VARIANTS)
def test_peft_adapters_add_no_globals(variant: str) -> None:
    folder = STACKS / "peft-0.11.1" / variant
    names = _globals(folder / "adapter_model.bin")
    assert names <= {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2", "torch.FloatStorage"}, names
    assert _alarms(folder) == []


def test_numpy_1_files_use_the_numpy_core_names_and_raise_no_alarm() -> None:
    folder = STACKS / "numpy-1.26.4"
    assert "numpy.core.multiarray._reconstruct" in _globals(folder / "checkpoint-2" / "rng_state.pth")
    assert "numpy.core.multiarray.scalar" in _globals(folder / "np.pt")
    assert "numpy.core.multiarray._reconstruct" in _globals(folder / "objects.npy")  # an object array's pickle
    assert _alarms(folder) == []


def test_deepspeed_with_transformers_4_40_training_args_is_clean() -> None:
    path = STACKS / "deepspeed-0.19.8-transformers-4.40.2-zero3-training_args.bin"
    assert "transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig" in _globals(path)
    report = scan(str(path), no_config=True)
    assert [f.rule for f in report.findings if f.rule.startswith("CKD6")] == []


def test_a_deepspeed_trainer_checkpoint_raises_no_alarm() -> None:
    """A real transformers 5.24 Trainer run under DeepSpeed 0.19.8 (tests/data/deepspeed-0.19.8-zero2-elastic, its
    README says how it was written). Its ``training_args.bin`` holds the DeepSpeed plugin's weak-reference config
    (accelerate/utils/dataclasses.py ``DeepSpeedPlugin.set_deepspeed_weakref``), a ``HfDeepSpeedConfig`` rebuilt as
    data: an exact entry of the pinned file, written by the matrix's DeepSpeed Trainer stacks. DeepSpeed is not
    installed where this runs."""
    run = TESTS / "data" / "deepspeed-0.19.8-zero2-elastic"
    args = run / "checkpoint-4" / "training_args.bin"
    config = "transformers.integrations.deepspeed.HfDeepSpeedConfig"
    assert config in _globals(args) and config in pickle_policy.GENERATED
    assert config in json.loads(PINNED.read_text())["observed"]
    assert _alarms(run) == []


_DS_CONFIG = b"\x80\x02ctransformers.integrations.deepspeed\nHfDeepSpeedConfig\n"
_DS_STATE = b"}X\x06\x00\x00\x00config}sX\x06\x00\x00\x00_stageK\x02s"


@pytest.mark.parametrize(
    ("name", "body", "clean"),
    [
        ("rebuilt as the Trainer writes it", b")\x81" + _DS_STATE + b"b.", True),
        ("called with a path (its __init__ reads the file)", b"X\x04\x00\x00\x00/etc\x85R.", False),
        ("NEWOBJ with arguments", b"}\x85\x81.", False),
        ("BUILD of slot state (setattr)", b")\x81N" + _DS_STATE + b"\x86b.", False),
        ("SETITEM on the built object", b")\x81X\x01\x00\x00\x00aK\x01s.", False),
    ],
)
def test_the_deepspeed_plugin_config_is_admitted_only_rebuilt_as_data(
    tmp_path: Path, name: str, body: bytes, clean: bool
) -> None:
    """``HfDeepSpeedConfig`` is an exact entry for its rebuild (``NEWOBJ`` of no arguments, then a ``BUILD`` of its
    dict: no code of it runs); any call of it stays CKD601 (docs/security.md, "Calls")."""
    (tmp_path / "training_args.bin").write_bytes(_DS_CONFIG + body)
    found = [f.rule for f in scan(str(tmp_path), no_config=True).findings if f.rule.startswith("CKD6")]
    assert (found == []) if clean else ("CKD601" in found), (name, found)


ACCELERATE_DS = STACKS / "accelerate-1.15.0-deepspeed-0.19.8-zero3"


def test_accelerate_save_state_with_deepspeed_has_no_security_finding() -> None:
    """``Accelerator.save_state`` under a ZeRO-3 ``DeepSpeedPlugin``: DeepSpeed's engine files under the tag
    ``pytorch_model`` (accelerate/accelerator.py ``save_state``), accelerate's RNG state and scheduler."""
    assert (ACCELERATE_DS / "latest").read_text() == "pytorch_model"
    report = scan(str(ACCELERATE_DS), no_config=True)
    assert [f.rule for f in report.findings if f.rule.startswith("CKD6")] == []


def test_accelerate_save_state_with_deepspeed_raises_no_alarm() -> None:
    assert _alarms(ACCELERATE_DS) == []


@pytest.mark.slow
@pytest.mark.parametrize(("layer", "family"), [("tf440", "transformers"), ("numpy-1.26.4", "numpy")])
def test_a_live_layer_of_the_matrix_writes_clean_files(tmp_path: Path, layer: str, family: str) -> None:
    """The oldest transformers and numpy 1.x layers write files again here; they scan clean."""
    import subprocess
    import sys

    where = LAYERS / layer
    if not where.is_dir():
        pytest.skip(f"{where} is not installed (bench/make_allowlist.py documents the layer)")
    writer = REPO / "bench" / "stack_writer.py"
    env = {**os.environ, "PYTHONPATH": str(where)}
    proc = subprocess.run([sys.executable, str(writer), str(tmp_path), family], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert "trainer" in result["configs"], result
    assert [a for a in _alarms(tmp_path) if " CKD6" in f" {a}"] == []
