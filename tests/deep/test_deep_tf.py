"""``--deep`` on TensorFlow bundles: every entry of each ``ckpt-N.index`` against the crc32c of its data shard's
bytes, streamed by the deep pass (bounded chunks, progress, workers), on the real TFTrainer and Keras samples."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckptdoctor import deep
from ckptdoctor.cli import main
from ckptdoctor.discover import discover
from ckptdoctor.model import FileData, ProblemKind
from ckptdoctor.readers import tfbundle
from tests.helpers.paths import TESTS

TF = TESTS / "data" / "tf"  # tf-trainer: TFTrainer's checkpoint/ + tf_model.h5; keras-weights
SHARD = "checkpoint/ckpt-3.data-00000-of-00001"


def _scan(path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(main, ["scan", str(path), "--format", "json", "--no-config", *extra])
    return result.exit_code, json.loads(result.output)


def _hits(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(f["rule"], f["path"]) for f in doc["findings"] if f["severity"] != "info"}


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / "tf-trainer"
    shutil.copytree(TF / "tf-trainer", dst)
    for p in dst.rglob("*"):
        p.chmod(0o644 if p.is_file() else 0o755)
    return dst


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _check_shard(root: Path, rel: str = SHARD, **kw: Any) -> FileData:
    tree = discover(str(root))
    facts = next(f for f in tree.all_files() if f.path == rel)
    return deep.check_file(str(root / rel), facts, tf_shard=deep.tf_shards(tree)[rel], **kw)


@pytest.mark.parametrize("root", [TF, TF / "tf-trainer", TF / "keras-weights"])
def test_clean_samples_with_deep_raise_nothing(root: Path) -> None:
    code, doc = _scan(root, "--deep")
    assert code == 0 and _hits(doc) == set(), doc["findings"]


def test_deep_reads_every_shard_of_every_index() -> None:
    tree = discover(str(TF))
    shards = deep.tf_shards(tree)
    assert len(shards) == 5 and all(p.endswith(".data-00000-of-00001") for p in shards)
    data = {d.path: d for d in deep.check_tree(tree, jobs=2)}
    for path, (index, _k, _name) in shards.items():
        d = data[path]
        assert d.corrupt == () and d.problems == () and d.tensors == ()
        # every entry's bytes were streamed (a DT_STRING entry's length varints are read while planning)
        assert sum(e.size for e in index.entries) - 10 <= d.bytes_read <= sum(e.size for e in index.entries)


def test_flipped_byte_in_a_tensor_is_caught_with_deep_only(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    index = deep.tf_shards(discover(str(root)))[SHARD][0]
    e = next(e for e in index.entries if e.dtype == "F32" and e.size == 512)
    _flip(root / SHARD, e.offset + 100)
    code, doc = _scan(root)  # the size still matches: only the crc32c sees it
    assert code == 0 and _hits(doc) == set()
    code, doc = _scan(root, "--deep")
    assert code == 1 and _hits(doc) == {("CKD215", SHARD)}
    (finding,) = [f for f in doc["findings"] if f["rule"] == "CKD215"]
    assert f"`{e.key}`" in finding["message"] and "crc32c `ckpt-3.index` records" in finding["message"]


def test_every_entry_first_and_last_byte(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    shard = root / SHARD
    clean = shard.read_bytes()
    index = deep.tf_shards(discover(str(root)))[SHARD][0]
    for e in index.entries:
        for at in (e.offset, e.offset + e.size - 1):
            _flip(shard, at)
            d = _check_shard(root)
            shard.write_bytes(clean)
            assert [f"`{e.key}`" in p.message for p in d.corrupt] == [True], (e.key, at, d.corrupt)
            assert d.problems == () and all(p.kind is ProblemKind.MALFORMED for p in d.corrupt)


def test_pure_python_crc_gives_the_same_verdicts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = os.urandom(3 << 20)
    assert tfbundle.crc32c_extender()(data, 7) == tfbundle.crc32c(data, 7)
    root = _copy(tmp_path)
    _flip(root / SHARD, 2000)
    fast = _check_shard(root)
    monkeypatch.setattr(tfbundle, "crc32c_extender", lambda: tfbundle.crc32c)
    assert _check_shard(root).corrupt == fast.corrupt != ()


def test_one_read_feeds_progress_checksum_and_crc(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    _flip(root / SHARD, 2000)
    seen: list[int] = []
    d = _check_shard(root, advance=seen.append, checksum=True)
    size = (root / SHARD).stat().st_size
    assert d.bytes_read == sum(seen) == size and d.sha256 is not None and len(d.corrupt) == 1


def test_a_shard_that_shrinks_under_the_scan_is_not_called_corrupt(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    tree = discover(str(root))
    facts = next(f for f in tree.all_files() if f.path == SHARD)
    with open(root / SHARD, "r+b") as f:
        f.truncate(100)
    d = deep.check_file(str(root / SHARD), facts, tf_shard=deep.tf_shards(tree)[SHARD])
    assert d.corrupt == () and [p.kind for p in d.problems] == [ProblemKind.UNREADABLE]
