"""A payload in any stream any loader unpickles is a security error: legacy torch streams, the legacy tar format,
a pickle the sniffer also reads as safetensors, numpy object arrays, a case-folded data.pkl. Each payload is proved
live by loading it as a victim would (in a child process, creating a canary file), and each is caught by a scan
that never creates the canary."""

from __future__ import annotations

import io
import pickle
import tarfile
from pathlib import Path

import pytest

from ckptdoctor.model import FileKind, NumpyFacts
from ckptdoctor.readers import read_file
from ckptdoctor.scanner import scan
from tests.helpers import payloads

pytest.importorskip("torch")
np = pytest.importorskip("numpy")

_LOADER = r"""
import json, pickle, sys
for item in json.load(sys.stdin):
    try:
        if item["loader"] == "pickle":
            with open(item["path"], "rb") as f:
                pickle.load(f)
        elif item["loader"] == "numpy":
            import numpy as np
            got = np.load(item["path"], allow_pickle=True)
            if hasattr(got, "files"):
                for key in got.files:
                    got[key]
        else:
            import torch
            torch.load(item["path"], weights_only=False)
    except BaseException:
        pass  # most payloads break the load after their call ran
"""


def test_every_container_payload_is_live(tmp_path: Path) -> None:
    assert payloads.dead(payloads.container_payloads, tmp_path, _LOADER) == []


def test_every_container_payload_is_a_security_error(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    placed = {}
    for p in payloads.container_payloads(canary):
        folder = tmp_path / "root" / payloads.slug(p.name) / "checkpoint-1"
        folder.mkdir(parents=True)
        (folder / p.filename).write_bytes(p.data)
        placed[f"{payloads.slug(p.name)}/checkpoint-1/{p.filename}"] = p
    assert payloads.missed(scan(str(tmp_path / "root")).findings, placed) == []
    assert not canary.exists()


def _clean_arrays(folder: Path) -> None:
    np.save(folder / "plain.npy", np.arange(6, dtype=np.float32).reshape(2, 3))
    np.save(folder / "objects.npy", np.array([{"lr": 0.1}, [1, 2]], dtype=object), allow_pickle=True)
    np.savez(folder / "both.npz", a=np.arange(3), b=np.array([None, "x"], dtype=object))
    np.savez_compressed(folder / "packed.npz", a=np.ones((2, 2)))
    structured = np.zeros(2, dtype=[("x", "<i4"), ("y", "<f8", (2,))])
    np.save(folder / "structured.npy", structured)


def test_clean_numpy_files_raise_no_security_finding(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "checkpoint-1"
    folder.mkdir(parents=True)
    _clean_arrays(folder)
    found = [f"{f.rule} {f.path}: {f.message}" for f in scan(str(tmp_path / "run")).findings
             if f.rule.startswith(("CKD2", "CKD6"))]  # fmt: skip
    assert found == []


def test_npy_headers_are_read_without_numpy(tmp_path: Path) -> None:
    _clean_arrays(tmp_path)
    facts = {p.name: read_file(str(p), p.name, p.stat()) for p in tmp_path.iterdir()}
    assert all(f.kind is FileKind.NUMPY and isinstance(f.content, NumpyFacts) for f in facts.values())
    plain = facts["plain.npy"].content
    assert isinstance(plain, NumpyFacts)
    assert [(a.descr, a.shape, a.pickled) for a in plain.arrays] == [("<f4", (2, 3), False)]
    assert plain.pickle is None
    both = facts["both.npz"].content
    assert isinstance(both, NumpyFacts) and both.pickle is not None
    assert [(a.name, a.pickled) for a in both.arrays] == [("a.npy", False), ("b.npy", True)]
    structured = facts["structured.npy"].content
    assert isinstance(structured, NumpyFacts) and not structured.arrays[0].pickled


@pytest.mark.parametrize(
    "data",
    [b"\x93NUMPY", b"\x93NUMPY\x01\x00\xff\xff{", b"\x93NUMPY\x09\x00\x10\x00" + b" " * 16,
     b"\x93NUMPY\x01\x00\x10\x00" + b"__import__('os')", b"\x93NUMPY\x01\x00\x08\x00" + b"((((((((" ],
)  # fmt: skip
def test_broken_npy_headers_never_raise(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "x.npy"
    path.write_bytes(data)
    facts = read_file(str(path), "x.npy", path.stat())
    assert facts.kind is FileKind.NUMPY and facts.content is None and facts.problems


def test_a_clean_legacy_tar_is_read_and_raises_nothing(tmp_path: Path) -> None:
    """The tar format's own streams (counts, storage descriptors and views, tensor records) walk cleanly."""
    import torch

    storage_args = pickle.dumps(("0", "cpu", torch.FloatStorage), protocol=2)
    storages = pickle.dumps(1, protocol=2) + storage_args + (2).to_bytes(8, "little") + b"\0" * 8
    storages += pickle.dumps([], protocol=2)
    tensors = pickle.dumps(1, protocol=2) + pickle.dumps(("t", "0", torch.FloatTensor), protocol=2)
    tensors += (1).to_bytes(4, "little") + b"\0" * 4 + (2).to_bytes(8, "little") + (1).to_bytes(8, "little")
    tensors += (0).to_bytes(8, "little")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for name, data in {"storages": storages, "tensors": tensors, "pickle": pickle.dumps({"a": 1}, 2)}.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    path = tmp_path / "old.pt"
    path.write_bytes(buf.getvalue())
    facts = read_file(str(path), "old.pt", path.stat())
    assert facts.problems == ()
    assert facts.content is not None and getattr(facts.content, "format", None) == "tar"


def test_nested_pickles_that_only_build_data_are_not_errors(tmp_path: Path) -> None:
    """A pickle inside a value (raw bytes, base64 text, a torch.save zip, two levels deep) that only rebuilds data
    raises nothing; the same nesting around a call is CKD601, attributed to the nested pickle."""
    import base64
    import collections

    import torch

    inner = pickle.dumps(collections.OrderedDict(lr=0.1, betas=(0.9, 0.99)), protocol=2)
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(2)}, buf)
    twice = pickle.dumps({"again": inner}, protocol=4)
    clean = {"raw": inner, "b64": base64.b64encode(inner).decode(), "pt": buf.getvalue(), "twice": twice}
    (tmp_path / "clean").mkdir()
    (tmp_path / "clean" / "state.pkl").write_bytes(pickle.dumps(clean, protocol=4))
    assert [f.rule for f in scan(str(tmp_path / "clean")).findings] == []
    evil = pickle.dumps({"again": b'cos\nsystem\n(S"true"\ntR.'.replace(b"c", b"\x80\x02c", 1)}, protocol=4)
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / "state.pkl").write_bytes(pickle.dumps({"twice": evil}, protocol=4))
    found = [(f.rule, f.message) for f in scan(str(tmp_path / "evil")).findings]
    assert any(rule == "CKD601" and "nested pickle: `os.system`" in msg for rule, msg in found), found


def test_empty_bytes_in_a_torch_save_is_data(tmp_path: Path) -> None:
    """torch.save pickles with protocol 2, which writes b"" as a call of `builtins.bytes` with no argument (found by
    bench/soundness.py's clean run): no security finding."""
    import torch

    torch.save({"w": torch.zeros(2), "blob": b"", "ok": b"ab"}, tmp_path / "optimizer.pt")
    (tmp_path / "state.pkl").write_bytes(pickle.dumps({"k": [b"", bytearray()]}, protocol=0))
    assert [f.rule for f in scan(str(tmp_path)).findings if f.rule.startswith("CKD6")] == []
