"""Tests for the torch.save readers (zip and legacy) and the raw pickle reader, on files torch really wrote."""

from __future__ import annotations

import io
import os
import pickle
import random
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptdoctor.limits import Limits
from ckptdoctor.model import GlobalRef, Opaque, ProblemKind, ReadOutcome, TensorRef, TorchFacts
from ckptdoctor.readers.rawpickle import read_raw_pickle
from ckptdoctor.readers.torchzip import STORAGE_DTYPES, read_torch
from tests.helpers import payloads

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("torchfiles")
    out = payloads.save_training_files(folder)
    out["model.bin"] = folder / "pytorch_model.bin"
    payloads.save_model_state(out["model.bin"])
    out["legacy.bin"] = folder / "legacy.bin"
    payloads.save_model_state(out["legacy.bin"], legacy=True)
    return out


DEFAULT = Limits()


def read(data: bytes, limits: Limits = DEFAULT) -> ReadOutcome:
    return read_torch(io.BytesIO(data), len(data), limits)


def facts_of(path: Path) -> TorchFacts:
    outcome = read(path.read_bytes())
    assert outcome.problems == ()
    assert isinstance(outcome.content, TorchFacts)
    return outcome.content


def test_model_state_dict(files: dict[str, Path]) -> None:
    sd = torch.load(files["model.bin"], weights_only=True)
    facts = facts_of(files["model.bin"])
    assert facts.format == "zip" and facts.prefix == "pytorch_model" and facts.byteorder == "little"
    tensors = dict(facts.tensors)
    assert list(tensors) == list(sd)
    for name, t in sd.items():
        ref = tensors[name]
        assert ref.shape == tuple(t.shape) and ref.stride == t.stride() and ref.storage_offset == t.storage_offset()
        assert ref.storage_nbytes == t.untyped_storage().nbytes()
    assert tensors["2.weight"].dtype == "BF16"
    assert tensors["view"].storage_key == tensors["0.weight"].storage_key == tensors["tied"].storage_key
    assert tensors["view"].storage_offset == 4
    assert facts.pickle is not None
    assert {g.dotted for g in facts.pickle.calls} == {"collections.OrderedDict", "torch._utils._rebuild_tensor_v2"}


def test_legacy_format_matches_zip(files: dict[str, Path]) -> None:
    legacy = facts_of(files["legacy.bin"])
    zipped = facts_of(files["model.bin"])
    assert legacy.format == "legacy" and legacy.prefix == "" and legacy.members == ()
    assert [(n, t.shape, t.dtype, t.storage_offset) for n, t in legacy.tensors] == [
        (n, t.shape, t.dtype, t.storage_offset) for n, t in zipped.tensors
    ]
    assert all(t.storage_nbytes == t.storage_numel * STORAGE_DTYPES["FloatStorage"][1] or t.dtype == "BF16"
               for _, t in legacy.tensors)  # fmt: skip


def test_optimizer(files: dict[str, Path]) -> None:
    facts = facts_of(files["optimizer.pt"])
    assert facts.pickle is not None
    value = facts.pickle.value
    groups = value["param_groups"]
    assert [g["lr"] for g in groups] == pytest.approx([0.000875, 0.000875])  # linear: 2 warm-up, 10 total, 3 steps
    assert all(g["initial_lr"] == 1e-3 for g in groups)
    assert [g["params"] for g in groups] == [[0, 1], [2, 3]]  # positions in the concatenation of the groups
    state = value["state"]
    assert sorted(state) == [0, 1, 2, 3]
    for entry in state.values():
        assert set(entry) == {"step", "exp_avg", "exp_avg_sq"}
        assert all(type(t) is TensorRef for t in entry.values())
        assert entry["step"].shape == ()
    paths = [p for p, _ in facts.tensors]
    assert "state.0.exp_avg" in paths and len(paths) == 12


def test_scheduler(files: dict[str, Path]) -> None:
    facts = facts_of(files["scheduler.pt"])
    assert facts.pickle is not None and facts.pickle.globals == ()
    value = facts.pickle.value
    assert value["base_lrs"] == [1e-3, 1e-3]
    assert value["last_epoch"] == 3 and value["_step_count"] == 4
    assert value["_last_lr"] == pytest.approx([0.000875, 0.000875])
    assert value["lr_lambdas"] == [{}, {}]


def test_rng_state(files: dict[str, Path]) -> None:
    facts = facts_of(files["rng_state.pth"])
    assert facts.pickle is not None
    value = facts.pickle.value
    version, internal, gauss = value["python"]
    assert version == 3 and len(internal) == 625 and gauss is None
    kind, arr, pos, has_gauss, cached = value["numpy"]
    assert kind == "MT19937" and type(pos) is int and has_gauss == 0 and cached == 0.0
    assert type(arr) is Opaque and arr.func is not None and arr.func.name == "_reconstruct"
    assert type(arr.state[4]) is bytes and len(arr.state[4]) == 624 * 4  # _codecs.encode rebuilt as bytes
    assert dict(facts.tensors)["cpu"].dtype == "U8"
    assert GlobalRef("_codecs", "encode") in facts.pickle.calls


def test_training_args(files: dict[str, Path]) -> None:
    facts = facts_of(files["training_args.bin"])
    assert facts.pickle is not None
    args = facts.pickle.value
    assert type(args) is Opaque and args.func == GlobalRef("transformers.training_args", "TrainingArguments")
    state = args.state
    assert state["learning_rate"] == 3e-4 and state["num_train_epochs"] == 3.0
    assert state["lr_scheduler_type"].args == ("linear",)
    assert state["output_dir"].endswith("out")


def test_raw_pickle_protocols() -> None:
    value = {"a": [1, 2.0, "three", b"four", None], "b": (True, {1})}
    for protocol in range(6):
        data = pickle.dumps(value, protocol=protocol)
        outcome = read_raw_pickle(io.BytesIO(data), len(data))
        assert outcome.problems == () and outcome.content is not None
        assert outcome.content.value == value  # type: ignore[union-attr]
    assert read_raw_pickle(io.BytesIO(b""), 0).problems[0].kind is ProblemKind.EMPTY
    assert read_raw_pickle(io.BytesIO(b"x" * 10), 10, Limits(pickle_bytes=5)).problems[0].kind is ProblemKind.LIMIT


def _rezip(src: bytes, *, drop: str = "", replace: dict[str, bytes] | None = None, method: int = 0) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(src)) as zin, zipfile.ZipFile(out, "w", method) as zout:
        for info in zin.infolist():
            if info.filename.endswith(drop) and drop:
                continue
            data = (replace or {}).get(info.filename.split("/", 1)[1], zin.read(info))
            zout.writestr(info.filename, data, compress_type=method)
    return out.getvalue()


def test_missing_and_wrong_size_storage_records(files: dict[str, Path]) -> None:
    raw = files["model.bin"].read_bytes()
    outcome = read(_rezip(raw, drop="/data/3"))
    assert any(p.message == "missing storage record `data/3`" for p in outcome.problems)
    assert isinstance(outcome.content, TorchFacts)
    assert dict(outcome.content.tensors)["1.bias"].storage_nbytes is None
    outcome = read(_rezip(raw, replace={"data/0": b"\0" * 8}))
    assert any("record size 8 of `data/0` does not match expected size 48" in p.message for p in outcome.problems)


def test_missing_data_pkl_and_compressed_records(files: dict[str, Path]) -> None:
    raw = files["model.bin"].read_bytes()
    outcome = read(_rezip(raw, drop="/data.pkl"))
    assert any("missing record `pytorch_model/data.pkl`" in p.message for p in outcome.problems)
    outcome = read(_rezip(raw, method=zipfile.ZIP_DEFLATED))
    assert [p.kind for p in outcome.problems] == [ProblemKind.SUSPICIOUS_ARCHIVE]
    assert "compressed" in outcome.problems[0].message
    assert isinstance(outcome.content, TorchFacts) and len(outcome.content.tensors) == 8


def test_zip_bombs_and_huge_declared_sizes(files: dict[str, Path]) -> None:
    raw = files["model.bin"].read_bytes()
    bomb = _rezip(raw, replace={"data.pkl": b"\0" * 2_000_000}, method=zipfile.ZIP_DEFLATED)
    outcome = read(bomb, Limits(pickle_bytes=100_000))
    assert any(p.kind is ProblemKind.LIMIT for p in outcome.problems)
    # Declare 4 GB for every record in the central directory.
    data = bytearray(raw)
    at = 0
    while (at := data.find(b"PK\x01\x02", at)) >= 0:
        struct.pack_into("<L", data, at + 24, 0xFFFFFFF0)
        at += 4
    outcome = read(bytes(data))
    assert outcome.problems
    assert all(p.kind in (ProblemKind.MALFORMED, ProblemKind.LIMIT, ProblemKind.TRUNCATED) for p in outcome.problems)
    outcome = read(raw, Limits(zip_entries=3))
    assert outcome.problems[0].kind is ProblemKind.LIMIT


@pytest.mark.parametrize("name", ["model.bin", "optimizer.pt", "legacy.bin", "rng_state.pth"])
def test_truncations(files: dict[str, Path], name: str) -> None:
    raw = files[name].read_bytes()
    for cut in [0, 1, 4, 10, 100, len(raw) // 2, len(raw) - 30, len(raw) - 1]:
        outcome = read(raw[:cut])
        assert outcome.problems, cut
    assert read(b"").problems[0].kind is ProblemKind.EMPTY


def test_legacy_truncated_storage_is_reported_without_reading_it(files: dict[str, Path]) -> None:
    raw = files["legacy.bin"].read_bytes()
    outcome = read(raw[:-10])
    assert [p.kind for p in outcome.problems] == [ProblemKind.TRUNCATED]
    assert isinstance(outcome.content, TorchFacts)
    assert any(t.storage_nbytes is None for _, t in outcome.content.tensors)


def test_hostile_pickle_inside_a_zip(files: dict[str, Path], tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    evil, _ = payloads.hostile_payloads(canary)["os.system"]
    outcome = read(_rezip(files["model.bin"].read_bytes(), replace={"data.pkl": evil}))
    assert isinstance(outcome.content, TorchFacts) and outcome.content.pickle is not None
    assert f"{os.name}.system" in {g.dotted for g in outcome.content.pickle.calls}
    assert not canary.exists()


def _mutations(raw: bytes) -> Any:
    return st.tuples(
        st.integers(0, len(raw)),
        st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)), max_size=6),
    )


@pytest.mark.parametrize("name", ["optimizer.pt", "legacy.bin"])
def test_random_mutations_never_raise(files: dict[str, Path], name: str) -> None:
    raw = files[name].read_bytes()

    @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_mutations(raw))
    def check(mut: tuple[int, list[tuple[int, int]]]) -> None:
        cut, flips = mut
        data = bytearray(raw)
        for at, byte in flips:
            data[at] = byte
        read(bytes(data[:cut]) if cut % 2 else bytes(data))

    check()


def test_random_garbage_never_raises() -> None:
    rnd = random.Random(7)
    for _ in range(200):
        head = rnd.choice([b"PK\x03\x04", b"\x80\x02", b""])
        data = head + rnd.randbytes(rnd.randrange(200))
        read(data)
