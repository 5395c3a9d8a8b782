"""Content sniffing and the reader dispatch (read_file), on files written by the real libraries."""

from __future__ import annotations

import io
import os
import pickle
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import ckptdoctor.readers.jsonfiles as jsonfiles
from ckptdoctor.model import FileKind, JsonFacts, ProblemKind, TextFacts
from ckptdoctor.readers import read_file
from ckptdoctor.readers.sniff import HEAD_BYTES, sniff


def _sniff_file(path: Path, in_dcp_dir: bool = False) -> FileKind:
    data = path.read_bytes()
    return sniff(data[:HEAD_BYTES], path.name, len(data), in_dcp_dir)


def _sniff_bytes(data: bytes, name: str, in_dcp_dir: bool = False) -> FileKind:
    return sniff(data[:HEAD_BYTES], name, len(data), in_dcp_dir)


def _torch_bytes(obj: object, legacy: bool = False) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=not legacy)
    return buf.getvalue()


@pytest.fixture()
def st_file(tmp_path: Path) -> Path:
    p = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2, 3), "b": torch.ones(3)}, str(p), metadata={"format": "pt"})
    return p


# ---------------------------------------------------------------------------------------------------------------
# sniff


def test_safetensors_by_content_whatever_the_name(st_file: Path) -> None:
    data = st_file.read_bytes()
    assert _sniff_bytes(data, "model.safetensors") is FileKind.SAFETENSORS
    assert _sniff_bytes(data, "pytorch_model.bin") is FileKind.SAFETENSORS
    assert _sniff_bytes(data, "config.json") is FileKind.SAFETENSORS
    # A truncated file is still a safetensors file (its reader reports the truncation).
    assert _sniff_bytes(data[:20], "model.safetensors") is FileKind.SAFETENSORS


def test_empty_safetensors_header_is_safetensors(tmp_path: Path) -> None:
    p = tmp_path / "adapter_model.safetensors"
    save_file({}, str(p))
    assert _sniff_file(p) is FileKind.SAFETENSORS


def test_torch_zip_and_legacy() -> None:
    sd = {"w": torch.zeros(2)}
    assert _sniff_bytes(_torch_bytes(sd), "optimizer.pt") is FileKind.TORCH_ZIP
    assert _sniff_bytes(_torch_bytes(sd), "model.safetensors") is FileKind.TORCH_ZIP
    assert _sniff_bytes(_torch_bytes(sd, legacy=True), "pytorch_model.bin") is FileKind.TORCH_LEGACY
    assert _sniff_bytes(_torch_bytes(sd, legacy=True), "weights") is FileKind.TORCH_LEGACY


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_binary_pickle_is_pickle_whatever_the_name(protocol: int) -> None:
    data = pickle.dumps({"state": [1, 2, 3]}, protocol=protocol)
    assert _sniff_bytes(data, "model.safetensors") is FileKind.PICKLE
    assert _sniff_bytes(data, "trainer_state.json") is FileKind.PICKLE
    assert _sniff_bytes(data, "latest") is FileKind.PICKLE


@pytest.mark.parametrize("protocol", [0, 1])
def test_old_protocol_pickle(protocol: int) -> None:
    data = pickle.dumps({"learning_rate": 1e-3, "steps": [1, 2]}, protocol=protocol)
    assert _sniff_bytes(data, "training_args.bin") is FileKind.PICKLE
    assert _sniff_bytes(data, "no_extension") is FileKind.PICKLE
    # Content first: a protocol-0 pickle named like safetensors or JSON is still a pickle.
    assert _sniff_bytes(data, "model.safetensors") is FileKind.PICKLE
    assert _sniff_bytes(data, "config.json") is FileKind.PICKLE


def test_tiny_old_pickle_needs_a_pickle_name() -> None:
    data = pickle.dumps(None, protocol=0)  # b"N."
    assert _sniff_bytes(data, "x.pkl") is FileKind.PICKLE


def test_hostile_protocol0_global_is_pickle() -> None:
    data = b"cos\nsystem\n(S'echo hi'\ntR."
    assert _sniff_bytes(data, "pytorch_model.bin") is FileKind.PICKLE
    assert _sniff_bytes(data, "README") is FileKind.PICKLE


def test_json_by_name_and_content() -> None:
    assert _sniff_bytes(b'{\n  "global_step": 8\n}\n', "trainer_state.json") is FileKind.JSON
    assert _sniff_bytes(b"not json at all", "config.json") is FileKind.JSON  # reader reports it
    assert _sniff_bytes(b"  [1, 2, 3]", "weight_map") is FileKind.JSON
    # Text formats that may start with a bracket are not JSON documents.
    assert _sniff_bytes(b"[![badge](x)](y)\n# Model card\n", "README.md") is FileKind.OTHER
    assert _sniff_bytes(b"{{ template }}", "chat_template.txt") is FileKind.OTHER


def test_latest_is_text() -> None:
    assert _sniff_bytes(b"global_step12", "latest") is FileKind.TEXT
    assert _sniff_bytes(b"global_step12", "latest_universal") is FileKind.OTHER


def test_dcp_files(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.zeros(3)}}, checkpoint_id=str(tmp_path))
    meta = tmp_path / ".metadata"
    assert _sniff_file(meta, in_dcp_dir=True) is FileKind.DCP_METADATA
    assert _sniff_file(meta, in_dcp_dir=False) is FileKind.PICKLE
    assert _sniff_file(tmp_path / "__0_0.distcp", in_dcp_dir=True) is FileKind.DCP_DATA


def test_empty_and_other() -> None:
    assert sniff(b"", "model.safetensors", 0) is FileKind.EMPTY
    assert _sniff_bytes(b"#!/usr/bin/env python\nimport os\n", "zero_to_fp32.py") is FileKind.OTHER
    assert _sniff_bytes(b"# Model card\n\nsome text", "README.md") is FileKind.OTHER
    assert _sniff_bytes(b"\x0a\x0b\x00\x01sentencepiece", "tokenizer.model") is FileKind.OTHER
    assert _sniff_bytes(b"0\n1\n2\n", "numbers.txt") is FileKind.OTHER


def test_zero_length_prefix_is_not_safetensors() -> None:
    # n = 0 or 1 cannot hold a JSON object.
    assert _sniff_bytes(b"\x01" + b"\x00" * 7 + b"{}", "blob") is FileKind.OTHER
    # ... but a file *named* like a format goes to that reader, which reports why the bytes are wrong.
    assert _sniff_bytes(b"\x01" + b"\x00" * 7 + b"{}", "model.safetensors") is FileKind.SAFETENSORS
    assert _sniff_bytes(b"\x00" * 64, "optimizer.pt") is FileKind.TORCH_ZIP


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=300), name=st.sampled_from(["a.bin", "a.json", "latest", ".metadata", "x"]))
def test_sniff_never_raises(data: bytes, name: str) -> None:
    assert isinstance(_sniff_bytes(data, name, in_dcp_dir=True), FileKind)
    assert isinstance(_sniff_bytes(data, name), FileKind)


# ---------------------------------------------------------------------------------------------------------------
# read_file dispatch


def _read(path: Path, in_dcp_dir: bool = False) -> object:
    return read_file(str(path), path.name, os.stat(path), in_dcp_dir=in_dcp_dir)


def test_read_file_json_and_latest(tmp_path: Path) -> None:
    p = tmp_path / "trainer_state.json"
    p.write_text('{"global_step": 8, "best_metric": NaN}\n')
    facts = read_file(str(p), "checkpoint-8/trainer_state.json", os.stat(p))
    assert facts.kind is FileKind.JSON
    assert facts.path == "checkpoint-8/trainer_state.json"
    assert facts.name == "trainer_state.json"
    assert isinstance(facts.content, JsonFacts)
    assert facts.content.value["global_step"] == 8
    assert facts.size == p.stat().st_size
    latest = tmp_path / "latest"
    latest.write_text("global_step8\n")
    lf = read_file(str(latest), "latest", os.stat(latest))
    assert lf.kind is FileKind.TEXT and lf.content == TextFacts("global_step8")


def test_read_file_empty(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"")
    facts = read_file(str(weights), "model.safetensors", os.stat(weights))
    # The kind says it; rules decide from the name whether zero bytes is broken.
    assert facts.kind is FileKind.EMPTY and facts.problems == () and facts.size == 0
    readme = tmp_path / "README.md"
    readme.write_bytes(b"")
    facts = read_file(str(readme), "README.md", os.stat(readme))
    assert facts.kind is FileKind.EMPTY and facts.problems == ()


def test_read_file_other_is_not_parsed(tmp_path: Path) -> None:
    p = tmp_path / "README.md"
    p.write_text("# card\n")
    facts = read_file(str(p), "README.md", os.stat(p))
    assert facts.kind is FileKind.OTHER and facts.content is None and facts.problems == ()


def test_read_file_fifo_never_opened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)

    def no_open(*args: object, **kwargs: object) -> int:
        raise AssertionError("a FIFO must never be opened")

    st_fifo = os.stat(fifo)
    monkeypatch.setattr(os, "open", no_open)
    facts = read_file(str(fifo), "model.safetensors", st_fifo)
    assert facts.kind is FileKind.SPECIAL
    assert [p.kind for p in facts.problems] == [ProblemKind.SPECIAL_FILE]


def test_read_file_fifo_swapped_in_after_stat(tmp_path: Path) -> None:
    # The stat says regular file, the path now holds a FIFO: O_NONBLOCK + fstat catch it without blocking.
    reg = tmp_path / "reg"
    reg.write_bytes(b"x")
    st_reg = os.stat(reg)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    facts = read_file(str(fifo), "fifo", st_reg)
    assert facts.kind is FileKind.SPECIAL


def test_read_file_unreadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "optimizer.pt"
    p.write_bytes(_torch_bytes({"state": {}}))
    st_p = os.stat(p)
    real_open = os.open

    def deny(path: str, flags: int, *args: int) -> int:
        if path == str(p):
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", deny)
    facts = read_file(str(p), "optimizer.pt", st_p)
    assert [x.kind for x in facts.problems] == [ProblemKind.UNREADABLE]
    assert "Permission denied" in facts.problems[0].message


def test_read_file_vanished(tmp_path: Path) -> None:
    p = tmp_path / "gone.json"
    p.write_text("{}")
    st_p = os.stat(p)
    p.unlink()
    facts = read_file(str(p), "gone.json", st_p)
    assert [x.kind for x in facts.problems] == [ProblemKind.UNREADABLE]


def test_read_file_symlink_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "t.json"
    target.write_text("{}")
    link = tmp_path / "l.json"
    link.symlink_to(target)
    facts = read_file(str(link), "l.json", os.stat(link))  # a link planted after the walk's stat
    assert [x.kind for x in facts.problems] == [ProblemKind.UNREADABLE]


def _raise(exc: Exception) -> Any:
    def broken(*args: object, **kwargs: object) -> Any:
        raise exc

    return broken


@pytest.mark.parametrize(
    ("target", "replacement", "fragment"),
    [
        ("read_json", _raise(ZeroDivisionError("boom")), "ZeroDivisionError: boom"),  # a reader bug
        ("read_json", lambda f, size, limits: "oops", "returned str"),  # a reader returning the wrong type
        ("sniff", _raise(IndexError("sniffer bug")), "IndexError: sniffer bug"),  # a sniffer bug
    ],
)
def test_bugs_become_malformed_problems(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str, replacement: Any, fragment: str
) -> None:
    import sys

    p = tmp_path / "config.json"
    p.write_text("{}")
    # the dispatch imports the sniffer from its module when it first reads a file
    monkeypatch.setattr(jsonfiles if target == "read_json" else sys.modules["ckptdoctor.readers.sniff"], target,
                        replacement)
    facts = read_file(str(p), "config.json", os.stat(p))
    assert [x.kind for x in facts.problems] == [ProblemKind.MALFORMED]
    assert fragment in facts.problems[0].message and "bug" in facts.problems[0].message


# Dispatch to readers written by other modules: skipped until those modules exist.


def test_dispatch_safetensors(st_file: Path) -> None:
    pytest.importorskip("ckptdoctor.readers.safetensors")
    from ckptdoctor.model import SafetensorsFacts

    facts = read_file(str(st_file), "model.safetensors", os.stat(st_file))
    assert facts.kind is FileKind.SAFETENSORS
    assert isinstance(facts.content, SafetensorsFacts), facts.problems
    assert sorted(t.name for t in facts.content.tensors) == ["b", "w"]
    # The same bytes under a .bin name go to the same reader.
    renamed = st_file.with_name("pytorch_model.bin")
    st_file.rename(renamed)
    facts = read_file(str(renamed), "pytorch_model.bin", os.stat(renamed))
    assert isinstance(facts.content, SafetensorsFacts)


def test_dispatch_torch(tmp_path: Path) -> None:
    pytest.importorskip("ckptdoctor.readers.torchzip")
    from ckptdoctor.model import PickleFacts, TorchFacts

    for name, legacy, fmt in (("optimizer.pt", False, "zip"), ("pytorch_model.bin", True, "legacy")):
        p = tmp_path / name
        p.write_bytes(_torch_bytes({"w": torch.zeros(2)}, legacy=legacy))
        facts = read_file(str(p), name, os.stat(p))
        assert isinstance(facts.content, TorchFacts), facts.problems
        assert facts.content.format == fmt
    raw = tmp_path / "model.safetensors"
    raw.write_bytes(pickle.dumps({"a": 1}, protocol=4))
    facts = read_file(str(raw), "model.safetensors", os.stat(raw))
    assert facts.kind is FileKind.PICKLE
    assert isinstance(facts.content, PickleFacts), facts.problems


def test_dispatch_dcp(tmp_path: Path) -> None:
    pytest.importorskip("ckptdoctor.readers.dcp")
    import torch.distributed.checkpoint as dcp

    from ckptdoctor.model import DcpMetadataFacts

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.zeros(3)}}, checkpoint_id=str(tmp_path))
    meta = tmp_path / ".metadata"
    facts = read_file(str(meta), ".metadata", os.stat(meta), in_dcp_dir=True)
    assert facts.kind is FileKind.DCP_METADATA
    assert isinstance(facts.content, DcpMetadataFacts), facts.problems
    data = tmp_path / "__0_0.distcp"
    facts = read_file(str(data), "__0_0.distcp", os.stat(data), in_dcp_dir=True)
    assert facts.kind is FileKind.DCP_DATA and facts.problems == ()  # its torch.save blobs are walked


@pytest.mark.parametrize(
    "text",
    [b"Notes about the run\n", b"1122334455", b"0\n1\n2\n", b"Version 1.0\nbuilt today\n", b"(draft) text"],
)
def test_text_made_of_opcode_letters_is_not_a_pickle(text: bytes) -> None:
    assert _sniff_bytes(text, "NOTES") is FileKind.OTHER


def test_hostile_protocol0_with_trailing_garbage_is_pickle() -> None:
    # pickle.load would run os.system before choking on the garbage: this must reach the pickle reader.
    data = b"cos\nsystem\n(S'echo hi'\ntR\xff\xfe garbage"
    assert _sniff_bytes(data, "notes") is FileKind.PICKLE


@pytest.mark.parametrize("protocol", [0, 1])
def test_old_protocol_pickle_longer_than_the_head(protocol: int) -> None:
    data = pickle.dumps({f"layer.{i}.weight": [i, float(i)] for i in range(100)}, protocol=protocol)
    assert len(data) > HEAD_BYTES
    assert _sniff_bytes(data, "state") is FileKind.PICKLE


def test_json_text_whose_ninth_byte_opens_an_object_is_no_safetensors_file() -> None:
    """LLaMA-Factory's ``dataset_info.json`` (``{"tiny": {"file_name": ...}}``): its first eight bytes read as a
    header length past 2**56, far past the file's end, so ``safe_open`` could never read it; it is JSON. A
    ``*.safetensors`` name with the same bytes still goes to the safetensors reader, which reports the length."""
    text = b'{"tiny": {"file_name": "tiny.json"}}'
    assert sniff(text, "dataset_info.json", len(text)) is FileKind.JSON
    assert sniff(text, "model.safetensors", len(text)) is FileKind.SAFETENSORS
