"""MindSpore tensors feed the same rules as safetensors ones: CKD208 (config against shapes), CKD210 (weights with
nothing to load) and CKD405 (optimizer state against the weights), each fired by a MindNLP checkpoint rewritten
from the real sample (tests/data/mindnlp: checkpoint-6 of a save_safetensors=False run), and silent on the
sample itself."""

from __future__ import annotations

import json
import math
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from ckptdoctor.cli import main
from ckptdoctor.readers.protowire import varint
from tests.helpers.mindspore import ms_value, ms_values
from tests.helpers.paths import TESTS

SAMPLE = TESTS / "data" / "mindnlp"
CK = "checkpoint-6"


def _scan(path: Path) -> tuple[int, list[dict[str, Any]]]:
    result = CliRunner().invoke(main, ["scan", str(path), "--format", "json", "--no-config"])
    return result.exit_code, [f for f in json.loads(result.output)["findings"] if f["severity"] != "info"]


def _copy(tmp_path: Path) -> Path:
    dst = tmp_path / SAMPLE.name
    shutil.copytree(SAMPLE, dst)
    for p in dst.rglob("*"):
        p.chmod(0o644 if p.is_file() else 0o755)
    return dst


def _fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    """The (field number, value) pairs of one message: varints as ints, LEN fields as bytes (the only wire types
    MindSpore's `Checkpoint` uses)."""
    out: list[tuple[int, int | bytes]] = []
    pos = 0
    while pos < len(buf):
        key, pos = varint(buf, pos, len(buf))
        if key & 7 == 0:
            v, pos = varint(buf, pos, len(buf))
            out.append((key >> 3, v))
        else:
            assert key & 7 == 2
            n, pos = varint(buf, pos, len(buf))
            out.append((key >> 3, buf[pos : pos + n]))
            pos += n
    return out


def _decode(record: bytes) -> tuple[str, list[int], str, bytes]:
    """One top-level `Value` record (key and length included) as (tag, dims, tensor_type, tensor_content)."""
    ((_, value),) = _fields(record)
    assert isinstance(value, bytes)
    fields = dict(_fields(value))
    tensor = _fields(fields[2])  # type: ignore[arg-type]
    dims = [v for n, v in tensor if n == 1 and isinstance(v, int)]
    rest = {n: v for n, v in tensor if n != 1}
    return fields[1].decode(), dims, rest[2].decode(), rest[3]  # type: ignore[union-attr,return-value]


def _rewrite_weights(run: Path, shapes: dict[str, list[int]]) -> None:
    """Rewrite `mindspore_model.ckpt` with new dims (and zero bytes of the matching size) for the named tensors."""
    path = run / CK / "mindspore_model.ckpt"
    out = []
    for record in ms_values(path.read_bytes()):
        tag, dims, dtype, content = _decode(record)
        if tag in shapes:
            itemsize = len(content) // math.prod(dims)
            dims = shapes.pop(tag)
            content = bytes(math.prod(dims) * itemsize)
        out.append(ms_value(tag, dims, dtype, content))
    assert not shapes, f"not in the sample: {shapes}"
    path.write_bytes(b"".join(out))


def test_decode_and_reencode_give_back_the_real_file() -> None:
    data = (SAMPLE / CK / "mindspore_model.ckpt").read_bytes()
    assert b"".join(ms_value(*_decode(r)) for r in ms_values(data)) == data


def test_clean_sample_is_silent() -> None:
    code, findings = _scan(SAMPLE)
    assert code == 0 and not findings, findings


def test_ckd208_embedding_rows_disagree_with_vocab_size(tmp_path: Path) -> None:
    # resize_token_embeddings(72) saved without updating vocab_size: from_pretrained of the folder fails
    run = _copy(tmp_path)
    _rewrite_weights(run, {"transformer.wte.weight": [72, 16]})
    code, findings = _scan(run)
    assert code == 0 and [(f["rule"], f["path"], f["message"]) for f in findings] == [
        ("CKD208", f"{CK}/config.json", "vocab_size 64 but `transformer.wte.weight` has 72 rows")
    ]


@pytest.mark.parametrize(
    ("content", "what"),
    [
        (b"", "no tensors (0 bytes)"),  # protobuf's encoding of a `Checkpoint` with no values
        (ms_value("note", [], "str", b"resume me"), "no tensors (26 bytes)"),  # only a string: no tensor
    ],
    ids=["zero-bytes", "no-tensor-values"],
)
def test_ckd210_weights_with_no_tensors(tmp_path: Path, content: bytes, what: str) -> None:
    run = _copy(tmp_path)
    (run / CK / "mindspore_model.ckpt").write_bytes(content)
    code, findings = _scan(run)
    assert code == 1 and [(f["rule"], f["path"], f["message"]) for f in findings] == [
        (
            "CKD210",
            f"{CK}/mindspore_model.ckpt",
            f"`mindspore_model.ckpt` holds {what}: mindspore.load_checkpoint raises ValueError "
            '("The loaded parameter dict is empty")',
        )
    ]


def _rewrite_optimizer(run: Path, old: bytes, new: bytes, count: int) -> None:
    """Replace the first ``count`` ``old`` by ``new`` in the pickle of `optimizer.ckpt` (a zip holding one
    `archive/data.pkl` and no storages) and rewrite the archive."""
    path = run / CK / "optimizer.ckpt"
    with zipfile.ZipFile(path) as z:
        (info,) = z.infolist()
        data = z.read(info)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr(info.filename, data.replace(old, new, count))


def test_ckd405_optimizer_state_shapes_disagree_with_the_weights(tmp_path: Path) -> None:
    # The Adam moments of the embedding rebuilt as (72, 16), as in an optimizer.ckpt copied from a run with a
    # resized vocabulary: the numpy BUILD state of each inline MindSpore tensor is (version, shape, dtype, ...).
    run = _copy(tmp_path)
    # param 0 (`transformer.wte.weight`): its exp_avg, then its exp_avg_sq (later matches are tensor bytes)
    _rewrite_optimizer(run, b"K\x01K@K\x10\x86", b"K\x01KHK\x10\x86", 2)
    code, findings = _scan(run)
    assert code == 1 and [(f["rule"], f["path"], f["message"]) for f in findings] == [
        (
            "CKD405",
            f"{CK}/optimizer.ckpt",
            "1 optimizer state has a shape no trainable tensor has ([72, 16] x1); the weights have [64, 16] x2 "
            "instead",
        )
    ]
