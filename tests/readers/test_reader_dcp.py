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
from tests.helpers import payloads

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


def test_scan_walks_the_byte_items_metadata_locates_and_nothing_else(tmp_path: Path, monkeypatch: Any) -> None:
    """A payload saved as a non-tensor DCP item (torch unpickles those with weights_only=False) is found through
    `.metadata`, without searching the `.distcp` files (whose size is the model's): reading stays cheap."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ckptdoctor.readers import dcp as dcp_reader
    from ckptdoctor.scanner import scan

    canary = tmp_path / "canary"
    folder = tmp_path / "run" / "checkpoint-4" / "optimizer_0"
    evil = payloads._reducer(os.system, (f"touch {canary}",))
    dcp.save({"w": torch.zeros(1024), "param_groups": {"lr": 0.1, "hook": evil}}, checkpoint_id=str(folder))

    def no_search(*_: Any, **__: Any) -> Any:
        raise AssertionError("the whole .distcp was searched although .metadata locates its items")

    monkeypatch.setattr(dcp_reader, "read_dcp_data", no_search)
    findings = scan(str(tmp_path / "run")).findings
    hits = [f for f in findings if f.rule == "CKD601"]
    assert hits and all(f.path.startswith("checkpoint-4/optimizer_0/__0_") for f in hits), findings
    assert "system" in hits[0].message
    assert not canary.exists()


def test_distcp_without_metadata_is_still_searched(tmp_path: Path) -> None:
    """No `.metadata` (a torn or doctored folder): the files are searched for blobs, bounded by the limits."""
    import torch

    from ckptdoctor.scanner import scan

    folder = tmp_path / "run" / "checkpoint-4" / "pytorch_model_fsdp_0"
    folder.mkdir(parents=True)
    canary = tmp_path / "canary"
    blob = io.BytesIO()
    torch.save({"x": payloads._reducer(os.system, (f"touch {canary}",))}, blob)
    (folder / "__0_0.distcp").write_bytes(blob.getvalue())
    findings = scan(str(tmp_path / "run")).findings
    assert any(f.rule == "CKD601" and f.path.endswith("__0_0.distcp") for f in findings), findings
    assert not canary.exists()


def test_a_limit_past_the_listed_problems_is_still_reported() -> None:
    """Issue 22 §2: a budget reached in a late item stays a finding, however many problems came before it."""
    from dataclasses import replace

    from ckptdoctor.limits import DEFAULT_LIMITS
    from ckptdoctor.readers.dcp import read_dcp_items

    buf = io.BytesIO()
    torch.save({"deep": [[[[[[1]]]]]]}, buf)
    blob = buf.getvalue()
    garbage = b"x" * 100  # each range is a torn blob: a TRUNCATED problem
    data = garbage * 30 + blob
    items = [(i * 100, 100) for i in range(30)] + [(3000, len(blob))]
    outcome = read_dcp_items(io.BytesIO(data), len(data), items, replace(DEFAULT_LIMITS, nesting_depth=3))
    kinds = [p.kind for p in outcome.problems]
    assert ProblemKind.LIMIT in kinds
    assert kinds.count(ProblemKind.TRUNCATED) == 21  # 20 listed, then one line counting the rest
    assert outcome.problems[-1].message == "10 more problem(s) of this kind not listed"
