"""``scan --deep --checksums write|verify``: a sha256 manifest written by the fixer, verified as CKD214 findings."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckptdoctor import deep
from ckptdoctor.scanner import scan
from tests.helpers.builders import make_run
from tests.helpers.checksums import _cli, _verify, _write

MANIFEST = Path(".ckptdoctor/manifest.json")
WEIGHTS = "checkpoint-4/model.safetensors"


def _snapshot(root: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every path under root with its bytes (None for folders) and mtime: what "nothing changed" compares."""
    out: dict[str, tuple[bytes | None, int]] = {".": (None, root.stat().st_mtime_ns)}
    for p in sorted(root.rglob("*")):
        out[p.relative_to(root).as_posix()] = (None if p.is_dir() else p.read_bytes(), p.stat().st_mtime_ns)
    return out


@pytest.fixture
def checksum_run(tmp_path: Path) -> Path:
    return make_run(tmp_path / "run")


def test_write_records_every_file_and_changes_nothing_else(checksum_run: Path) -> None:
    before = _snapshot(checksum_run)
    err = _write(checksum_run)
    after = _snapshot(checksum_run)
    assert set(after) - set(before) == {".ckptdoctor", ".ckptdoctor/manifest.json"}
    assert {k: after[k] for k in before} == before  # the root keeps its mtime; no lock or temp file is left
    doc = json.loads((checksum_run / MANIFEST).read_text())
    assert doc["schema"] == "ckptdoctor.manifest/1" and doc["algorithm"] == "sha256"
    assert doc["ckptdoctor"] and doc["created"].endswith("Z")
    files = {p: data for p, (data, _) in before.items() if data is not None}
    assert [e["path"] for e in doc["files"]] == sorted(files)
    for e in doc["files"]:
        assert e["size"] == len(files[e["path"]])
        assert e["sha256"] == hashlib.sha256(files[e["path"]]).hexdigest()
    assert f"sha256 of {len(files)} files" in err
    assert _verify(checksum_run) == []


def test_a_flipped_byte_in_tensor_data_keeps_the_header_valid_and_is_caught(checksum_run: Path) -> None:
    _write(checksum_run)
    path = checksum_run / WEIGHTS
    raw = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", raw[:8])
    raw[8 + header_len + 5] ^= 0x01  # inside the first tensor's data
    path.write_bytes(bytes(raw))
    tree = scan(str(checksum_run)).trees[0]
    assert not next(f for f in tree.all_files() if f.path == WEIGHTS).problems  # the header still reads cleanly
    (hit,) = _verify(checksum_run)
    assert (hit["path"], hit["severity"]) == (WEIGHTS, "error")
    assert "differs from" in hit["message"] and "sha256" in hit["message"]


def test_missing_resized_and_new_files_are_reported(checksum_run: Path) -> None:
    _write(checksum_run)
    (checksum_run / "checkpoint-2/optimizer.pt").unlink()
    with open(checksum_run / "checkpoint-4/trainer_state.json", "a") as fh:
        fh.write("\n")
    save_file({"w": torch.ones(3)}, str(checksum_run / "checkpoint-4/extra.safetensors"))
    hits = {f["path"]: (f["severity"], f["message"]) for f in _verify(checksum_run)}
    assert hits.keys() == {"checkpoint-2/optimizer.pt", "checkpoint-4/trainer_state.json",
                           "checkpoint-4/extra.safetensors"}
    assert hits["checkpoint-2/optimizer.pt"][0] == "error" and "missing" in hits["checkpoint-2/optimizer.pt"][1]
    assert hits["checkpoint-4/trainer_state.json"][0] == "error"
    assert "where the checksum manifest recorded" in hits["checkpoint-4/trainer_state.json"][1]
    assert hits["checkpoint-4/extra.safetensors"] == ("warning", "not listed in the checksum manifest (76 bytes)")


def test_an_unusable_manifest_is_a_finding_at_its_path(checksum_run: Path) -> None:
    _write(checksum_run)
    (checksum_run / MANIFEST).write_text('{"schema": "ckptdoctor.manifest/1", "files": [{"path": "../x", "size": 1}]}')
    (hit,) = _verify(checksum_run)
    assert hit["path"] == MANIFEST.as_posix() and "cannot be used" in hit["message"]
    (checksum_run / MANIFEST).write_bytes(b"\xff{")
    (hit,) = _verify(checksum_run)
    assert "not valid JSON" in hit["message"]


@pytest.mark.parametrize("chunk", [64, deep.CHUNK_BYTES])
def test_one_pass_feeds_the_digest_and_the_tensor_checks(tmp_path: Path, chunk: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole file is read once; shared (tied) torch storages still give per-tensor results."""
    monkeypatch.setattr(deep, "CHUNK_BYTES", chunk)
    t = torch.randn(40, 7)
    t[3, 3] = float("nan")
    torch.save({"a": t, "tied": t, "view": t[10:], "zeros": torch.zeros(5)}, tmp_path / "pytorch_model.bin")
    save_file({"x": torch.randn(9, 5), "z": torch.zeros(4, dtype=torch.bfloat16)}, str(tmp_path / "model.safetensors"))
    tree = scan(str(tmp_path), deep=True, checksums="write").trees[0]
    for d in tree.data:
        raw = (tmp_path / d.path).read_bytes()
        assert d.sha256 == hashlib.sha256(raw).hexdigest()
        assert d.bytes_read == len(raw)
    data = {d.path: {t.name: t for t in d.tensors} for d in tree.data}
    torch_file = data["pytorch_model.bin"]
    assert (torch_file["a"].nan, torch_file["tied"].nan, torch_file["view"].nan) == (1, 1, 0)
    assert torch_file["zeros"].all_zero and not torch_file["a"].all_zero
    assert data["model.safetensors"]["z"].all_zero and not data["model.safetensors"]["x"].all_zero
    plain = scan(str(tmp_path), deep=True).trees[0]
    assert [d.tensors for d in plain.data] == [d.tensors for d in tree.data if d.tensors]
    assert all(d.sha256 is None for d in plain.data)


def test_usage_errors_exit_2(checksum_run: Path, tmp_path: Path) -> None:
    code, _, err = _cli("scan", "--checksums", "write", str(checksum_run))
    assert code == 2 and "needs --deep" in err
    code, _, err = _cli("scan", "--deep", "--checksums", "verify", str(checksum_run))
    assert code == 2 and "has no .ckptdoctor/manifest.json" in err
    code, _, err = _cli("scan", "--deep", "--checksums", "write", str(checksum_run / WEIGHTS))
    assert code == 2 and "is not a folder" in err
    with pytest.raises(ValueError):
        scan(str(checksum_run), checksums="verify")
    assert not (checksum_run / ".ckptdoctor").exists()


def test_write_refuses_links_and_read_only_folders(checksum_run: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, checksum_run / ".ckptdoctor")
    code, _, err = _cli("scan", "--deep", "--checksums", "write", str(checksum_run))
    assert code == 2 and "not a plain folder" in err
    assert list(elsewhere.iterdir()) == []
    (checksum_run / ".ckptdoctor").unlink()
    (checksum_run / ".ckptdoctor").mkdir()
    os.symlink(elsewhere / "target.json", checksum_run / MANIFEST)
    code, _, err = _cli("scan", "--deep", "--checksums", "write", str(checksum_run))
    assert code == 2 and "not a plain file" in err
    assert list(elsewhere.iterdir()) == []
    (checksum_run / MANIFEST).unlink()
    os.chmod(checksum_run / ".ckptdoctor", 0o555)
    try:
        code, _, err = _cli("scan", "--deep", "--checksums", "write", str(checksum_run))
    finally:
        os.chmod(checksum_run / ".ckptdoctor", 0o755)
    assert code == 2 and "read-only" in err  # no write bit: refused even for root, who ignores permissions
