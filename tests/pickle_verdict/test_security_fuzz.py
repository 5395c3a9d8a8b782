"""Property tests for every reader: any mutation of a real file, or any bytes, gives a ReadOutcome and never raises.

The long campaign (millions of inputs, with time and memory caps) is bench/fuzz_readers.py; these are its bounded
CI twins.
"""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.peer_corpus import _tar
from ckptdoctor.limits import Limits
from ckptdoctor.model import PickleFacts, ReadOutcome, TorchFacts
from ckptdoctor.pickle_verdict.judge import judge
from ckptdoctor.readers.dcp import read_dcp_data, read_dcp_metadata
from ckptdoctor.readers.deepspeed import read_latest
from ckptdoctor.readers.jsonfiles import read_json
from ckptdoctor.readers.rawpickle import read_raw_pickle
from ckptdoctor.readers.safetensors import read_safetensors
from ckptdoctor.readers.sniff import sniff
from ckptdoctor.readers.torchzip import read_archive, read_torch
from tests.helpers import payloads

torch = pytest.importorskip("torch")

LIMITS = Limits(pickle_bytes=2_000_000, json_bytes=2_000_000, safetensors_header_bytes=2_000_000,
                pickle_opcodes=200_000, zip_entries=10_000, dcp_data_bytes=4_000_000)  # fmt: skip
Reader = Callable[[BinaryIO, int, Limits], ReadOutcome]


@pytest.fixture(scope="module")
def seeds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("seeds")
    payloads.save_model_state(folder / "model.bin")
    payloads.save_model_state(folder / "legacy.bin", legacy=True)
    payloads.save_training_files(folder)
    payloads.save_dcp(folder / "dcp")
    save_file({"w": torch.zeros(3, 2)}, str(folder / "m.safetensors"))
    out = {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    out["state.json"] = json.dumps({"global_step": 8, "log_history": [{"loss": 1.5}]}).encode()
    members = {"run/model.bin": out["model.bin"], "run/args.pkl": pickle.dumps({"lr": 0.1}), "run/x": b"text"}
    out["archive.tar"] = _tar({**members, "inner.tar.xz": _tar(members, "w:xz")})
    out["archive.tar.gz"] = _tar(members, "w:gz")
    return out


def _mutated(raw: bytes) -> Any:
    return st.tuples(
        st.integers(0, len(raw)),
        st.lists(st.tuples(st.integers(0, max(0, len(raw) - 1)), st.integers(0, 255)), max_size=8),
        st.binary(max_size=16),
        st.integers(0, len(raw)),
    )


def _apply(raw: bytes, mut: tuple[int, list[tuple[int, int]], bytes, int]) -> bytes:
    cut, flips, insert, at = mut
    data = bytearray(raw)
    for pos, byte in flips:
        if data:
            data[pos % len(data)] = byte
    data[at:at] = insert
    return bytes(data[:cut] if cut % 3 == 0 else data)


def _check(reader: Reader, data: bytes) -> ReadOutcome:
    outcome = reader(io.BytesIO(data), len(data), LIMITS)
    assert isinstance(outcome, ReadOutcome)
    content = outcome.content
    pf = content if isinstance(content, PickleFacts) else getattr(content, "pickle", None)
    if isinstance(pf, PickleFacts):
        judge(pf, LIMITS)  # the rule-side analysis must not raise either
    return outcome


_CASES: list[tuple[str, str, Reader]] = [
    ("torch zip", "model.bin", read_torch),
    ("torch zip optimizer", "optimizer.pt", read_torch),
    ("torch zip training_args", "training_args.bin", read_torch),
    ("torch legacy", "legacy.bin", read_torch),
    ("raw pickle", ".metadata", read_raw_pickle),
    ("dcp metadata", ".metadata", read_dcp_metadata),
    ("dcp data", "__0_0.distcp", read_dcp_data),
    ("safetensors", "m.safetensors", read_safetensors),
    ("json", "state.json", read_json),
    ("tar", "archive.tar", read_archive),
    ("tar.gz", "archive.tar.gz", read_archive),
]


@pytest.mark.parametrize(("label", "seed", "reader"), _CASES, ids=[c[0] for c in _CASES])
def test_mutations_of_real_files_never_raise(seeds: dict[str, bytes], label: str, seed: str, reader: Reader) -> None:
    raw = seeds[seed]

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(_mutated(raw))
    def check(mut: tuple[int, list[tuple[int, int]], bytes, int]) -> None:
        _check(reader, _apply(raw, mut))

    check()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(st.sampled_from([b"", b"PK\x03\x04", b"PK\x05\x06", b"\x80\x02", b"\x80\x04\x95", b"{", b"\x08\0\0\0\0\0\0\0",
                        b"\x1f\x8b\x08", b"BZh91AY&SY", b"\xfd7zXZ\x00"]),
       st.binary(max_size=600))  # fmt: skip
def test_any_bytes_never_raise(head: bytes, body: bytes) -> None:
    data = head + body
    for reader in (read_torch, read_raw_pickle, read_dcp_metadata, read_dcp_data, read_safetensors, read_json,
                   read_latest, read_archive):  # fmt: skip
        _check(reader, data)
    sniff(data[:256], "x.bin", len(data))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(st.lists(st.sampled_from(sorted(payloads.hostile_payloads(Path("/x")))), min_size=1, max_size=3),
       st.integers(0, 2**16))  # fmt: skip
def test_payloads_stay_flagged_inside_torch_zips(names: list[str], salt: int) -> None:
    """Any hostile pickle as data.pkl or as extra records of a zip keeps being judged unsafe."""
    corpus = payloads.hostile_payloads(Path(f"/nonexistent/{salt}"))
    extra = {f"archive/x{i}.pkl": corpus[n][0] for i, n in enumerate(names[1:])}
    blob = payloads._torch_zip(corpus[names[0]][0], extra=extra)
    outcome = _check(read_torch, blob)
    assert isinstance(outcome.content, TorchFacts) and outcome.content.pickle is not None
    assert judge(outcome.content.pickle).unsafe
