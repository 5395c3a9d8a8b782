"""Tests for the torch.distributed.checkpoint ``.metadata`` reader on a checkpoint DCP really wrote."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptdoctor.model import DcpMetadataFacts, ProblemKind
from ckptdoctor.readers.dcp import read_dcp_metadata
from tests import payloads

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def dcp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return payloads.save_dcp(tmp_path_factory.mktemp("dcp"))


def read(data: bytes) -> Any:
    return read_dcp_metadata(io.BytesIO(data), len(data))


def test_keys_and_storage_refs_match_the_data_file(dcp_dir: Path) -> None:
    outcome = read((dcp_dir / ".metadata").read_bytes())
    assert outcome.problems == ()
    facts = outcome.content
    assert isinstance(facts, DcpMetadataFacts)
    assert facts.pickle.protocol == 4
    assert "model.0.weight" in facts.keys and "optimizer.state.0.exp_avg" in facts.keys
    assert "optimizer.param_groups.0.lr" in facts.keys
    assert {r.fqn for r in facts.storage} == set(facts.keys)
    size = (dcp_dir / "__0_0.distcp").stat().st_size
    for ref in facts.storage:
        assert ref.relative_path == "__0_0.distcp"
        assert ref.offset + ref.length <= size
    assert max(r.offset + r.length for r in facts.storage) == size


def test_not_metadata(tmp_path: Path) -> None:
    outcome = read(pickle.dumps({"a": 1}, protocol=4))
    assert outcome.problems[0].kind is ProblemKind.MALFORMED
    assert isinstance(outcome.content, DcpMetadataFacts) and outcome.content.keys == ()


def test_metadata_carrying_posix_system(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    canary = tmp_path / "canary"
    evil = payloads._reducer(os.system, (f"touch {canary}",))
    data = pickle.dumps(Metadata(state_dict_metadata={}, storage_meta=evil), protocol=4)
    outcome = read(data)
    assert isinstance(outcome.content, DcpMetadataFacts)
    assert f"{os.name}.system" in {g.dotted for g in outcome.content.pickle.calls}
    assert not canary.exists()


def test_truncations(dcp_dir: Path) -> None:
    raw = (dcp_dir / ".metadata").read_bytes()
    for cut in range(0, len(raw), max(1, len(raw) // 50)):
        assert read(raw[:cut]).problems


def test_random_mutations_never_raise(dcp_dir: Path) -> None:
    raw = (dcp_dir / ".metadata").read_bytes()

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)), min_size=1, max_size=6))
    def check(flips: list[tuple[int, int]]) -> None:
        data = bytearray(raw)
        for at, byte in flips:
            data[at] = byte
        read(bytes(data))

    check()
