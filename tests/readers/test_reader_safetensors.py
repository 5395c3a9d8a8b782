"""The safetensors reader: real files from the library, and mutations of them judged by the library itself."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from ckptdoctor.limits import Limits
from ckptdoctor.model import ProblemKind, ReadOutcome, SafetensorsFacts
from ckptdoctor.readers import safetensors as safetensors_reader
from ckptdoctor.readers.safetensors import DTYPE_BITS, read_safetensors

# ---------------------------------------------------------------------------------------------------------------
# Helpers


def read_path(path: Path, limits: Limits | None = None) -> ReadOutcome:
    with open(path, "rb") as f:
        if limits is None:
            return read_safetensors(f, path.stat().st_size)
        return read_safetensors(f, path.stat().st_size, limits)


def library_rejects(path: Path) -> bool:
    """The oracle: does the safetensors library refuse to open this file?"""
    try:
        with safe_open(str(path), "np"):
            pass
    except Exception:
        return True
    return False


def facts_of(outcome: ReadOutcome) -> SafetensorsFacts:
    assert isinstance(outcome.content, SafetensorsFacts), outcome
    return outcome.content


def kinds(outcome: ReadOutcome) -> list[ProblemKind]:
    return [p.kind for p in outcome.problems]


def assert_matches_library(path: Path, outcome: ReadOutcome) -> None:
    """Facts equal what safe_open reports: names, dtypes, shapes, metadata, and the byte layout."""
    facts = facts_of(outcome)
    assert outcome.problems == ()
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert facts.header_bytes == n
    assert 8 + n + facts.data_bytes == len(raw)
    assert sum(t.nbytes for t in facts.tensors) == facts.data_bytes
    with safe_open(str(path), "np") as lib:
        assert facts.metadata == lib.metadata()
        assert sorted(t.name for t in facts.tensors) == sorted(lib.keys())
        for t in facts.tensors:
            sl = lib.get_slice(t.name)
            assert (t.dtype, list(t.shape)) == (sl.get_dtype(), sl.get_shape())


def split(buf: bytes) -> tuple[bytes, bytes]:
    (n,) = struct.unpack("<Q", buf[:8])
    return buf[8 : 8 + n], buf[8 + n :]


def pack(header: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def edit_json(fn: Callable[[dict[str, Any]], None]) -> Callable[[bytes], bytes]:
    """A mutation that changes the decoded header and writes it back (compact, unpadded)."""

    def mutate(buf: bytes) -> bytes:
        header, data = split(buf)
        doc = json.loads(header)
        fn(doc)
        return pack(json.dumps(doc, separators=(",", ":")).encode(), data)

    return mutate


def edit_text(fn: Callable[[str], str]) -> Callable[[bytes], bytes]:
    """A mutation of the header's text; the length prefix follows the new text."""

    def mutate(buf: bytes) -> bytes:
        header, data = split(buf)
        return pack(fn(header.decode()).encode(), data)

    return mutate


def edit_raw(fn: Callable[[bytes], bytes]) -> Callable[[bytes], bytes]:
    """A mutation of the header's bytes; the length prefix follows the new bytes."""

    def mutate(buf: bytes) -> bytes:
        header, data = split(buf)
        return pack(fn(header), data)

    return mutate


def set_length(fn: Callable[[int], int]) -> Callable[[bytes], bytes]:
    def mutate(buf: bytes) -> bytes:
        (n,) = struct.unpack("<Q", buf[:8])
        return struct.pack("<Q", fn(n) % 2**64) + buf[8:]

    return mutate


# ---------------------------------------------------------------------------------------------------------------
# The base file every mutation starts from: real, small, with metadata, a zero-size tensor and a U8 tensor that
# mutations turn into sub-byte dtypes.

BASE_TENSORS = {
    "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    "b": torch.tensor([1, 2], dtype=torch.int64),
    "c": torch.tensor([1, 2, 3], dtype=torch.uint8),
    "z": torch.zeros(0, 4, dtype=torch.float32),
}


@pytest.fixture(scope="module")
def base_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("base") / "model.safetensors"
    safetensors.torch.save_file(BASE_TENSORS, str(path), metadata={"format": "pt"})
    return path.read_bytes()


def _offsets(doc: dict[str, Any], name: str) -> list[int]:
    offsets: list[int] = doc[name]["data_offsets"]
    return offsets


def _shift_after(doc: dict[str, Any], name: str, delta: int) -> None:
    """Move every tensor that starts at or after ``name``'s end by ``delta`` (keeps later offsets consistent)."""
    end = _offsets(doc, name)[1]
    for key, entry in doc.items():
        if key != "__metadata__" and key != name and entry["data_offsets"][0] >= end:
            entry["data_offsets"] = [o + delta for o in entry["data_offsets"]]


def _as_dtype(name: str, dtype: str, shape: list[int]) -> Callable[[dict[str, Any]], None]:
    def fn(doc: dict[str, Any]) -> None:
        doc[name]["dtype"] = dtype
        doc[name]["shape"] = shape

    return fn


def _set(name: str, field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def fn(doc: dict[str, Any]) -> None:
        doc[name][field] = value

    return fn


def _hole(doc: dict[str, Any]) -> None:
    _shift_after(doc, "a", 4)


def _overlap(doc: dict[str, Any]) -> None:
    # "a" claims 4 bytes of the next tensor while keeping its size: the next tensor overlaps it.
    doc["a"]["data_offsets"][0] -= 4
    doc["a"]["data_offsets"][1] -= 4


def _first_not_zero(doc: dict[str, Any]) -> None:
    for key, entry in doc.items():
        if key != "__metadata__":
            entry["data_offsets"] = [o + 1 for o in entry["data_offsets"]]


def _append_empty(dtype: str, shape: list[int]) -> Callable[[dict[str, Any]], None]:
    """Add a tensor that claims no bytes, after the last one."""

    def fn(doc: dict[str, Any]) -> None:
        end = max(e["data_offsets"][1] for k, e in doc.items() if k != "__metadata__")
        doc["huge"] = {"dtype": dtype, "shape": shape, "data_offsets": [end, end]}

    return fn


def _reorder(doc: dict[str, Any]) -> None:
    items = list(doc.items())
    doc.clear()
    doc.update(reversed(items))


def _dup_tensor(first_dtype: str) -> Callable[[str], str]:
    def fn(text: str) -> str:
        entry = f'"c":{{"dtype":"{first_dtype}","shape":[3],"data_offsets":[0,3]}},'
        return "{" + entry + text.strip()[1:]

    return fn


def _extra_field(value: str) -> Callable[[str], str]:
    def fn(text: str) -> str:
        return text.replace('"dtype":"U8"', f'"x":{value},"dtype":"U8"', 1)

    return fn


def _metadata_text(value: str) -> Callable[[str], str]:
    def fn(text: str) -> str:
        doc = json.loads(text)
        del doc["__metadata__"]
        return '{"__metadata__":' + value + "," + json.dumps(doc)[1:]

    return fn


def _seq_entry(text: str) -> str:
    doc = json.loads(text)
    c = doc["c"]
    doc["c"] = [c["dtype"], c["shape"], c["data_offsets"]]
    return json.dumps(doc)


# (id, mutation, does the library reject it?)
MUTATIONS: list[tuple[str, Callable[[bytes], bytes], bool]] = [
    # Truncation and extension at several points.
    ("truncate-to-0", lambda b: b[:0], True),
    ("truncate-in-length", lambda b: b[:5], True),
    ("truncate-after-length", lambda b: b[:8], True),
    ("truncate-mid-header", lambda b: b[: 8 + len(split(b)[0]) // 2], True),
    ("truncate-after-header", lambda b: b[: 8 + len(split(b)[0])], True),
    ("truncate-mid-data", lambda b: b[:-7], True),
    ("truncate-last-byte", lambda b: b[:-1], True),
    ("extend-one-byte", lambda b: b + b"\0", True),
    ("extend-100-bytes", lambda b: b + b"x" * 100, True),
    # The length prefix.
    ("length-plus-1", set_length(lambda n: n + 1), True),
    ("length-minus-1", set_length(lambda n: n - 1), True),
    ("length-minus-8", set_length(lambda n: n - 8), True),
    ("length-plus-1000", set_length(lambda n: n + 1000), True),
    ("length-high-byte", set_length(lambda n: n | 1 << 56), True),
    ("length-max-u64", set_length(lambda n: 2**64 - 1), True),
    ("length-over-limit", set_length(lambda n: 100_000_001), True),
    ("length-zero", set_length(lambda n: 0), True),
    # JSON syntax.
    ("json-brace-replaced", edit_raw(lambda h: b"x" + h[1:]), True),
    ("json-closing-brace-dropped", edit_raw(lambda h: h.rstrip()[:-1]), True),
    ("json-nul-padding", edit_raw(lambda h: h.rstrip() + b"\0" * 6), True),
    ("json-trailing-garbage", edit_raw(lambda h: h.rstrip() + b"x"), True),
    ("json-leading-whitespace", edit_raw(lambda h: b" \n\t\r" + h), False),
    ("json-trailing-whitespace", edit_raw(lambda h: h.rstrip() + b"\t\r\n "), False),
    ("json-utf8-bom", edit_raw(lambda h: b"\xef\xbb\xbf" + h), True),
    ("json-not-utf8", edit_raw(lambda h: h.replace(b'"pt"', b'"p\xff"')), True),
    ("json-utf8-metadata", edit_raw(lambda h: h.replace(b'"pt"', '"pé"'.encode())), False),
    ("json-top-level-array", edit_raw(lambda h: b"[]"), True),
    ("json-empty-header", edit_raw(lambda h: b""), True),
    ("json-nan", edit_text(_extra_field("NaN")), True),
    ("json-infinity", edit_text(_extra_field("-Infinity")), True),
    ("json-number-out-of-range", edit_text(_extra_field("1e400")), True),
    ("json-big-integer-out-of-range", edit_text(_extra_field("1" + "0" * 400)), True),
    ("json-big-integer-as-float", edit_text(_extra_field("1" + "0" * 30)), False),
    ("json-minus-zero-extra", edit_text(_extra_field("-0")), False),
    ("json-lone-surrogate", edit_text(lambda t: t.replace('"pt"', '"\\ud800"')), True),
    ("json-surrogate-pair", edit_text(lambda t: t.replace('"pt"', '"\\ud83d\\ude00"')), False),
    ("json-control-char", edit_text(lambda t: t.replace('"pt"', '"p\x01"')), True),
    ("json-depth-127", edit_text(_extra_field("[" * 125 + "]" * 125)), False),
    ("json-depth-128", edit_text(_extra_field("[" * 126 + "]" * 126)), True),
    ("json-depth-2000", edit_text(_extra_field("[" * 2000 + "]" * 2000)), True),
    # Metadata.
    ("metadata-int-value", edit_text(_metadata_text('{"format":1}')), True),
    ("metadata-list", edit_text(_metadata_text("[]")), True),
    ("metadata-null", edit_text(_metadata_text("null")), False),
    ("metadata-empty", edit_text(_metadata_text("{}")), False),
    ("metadata-duplicate-key", edit_text(_metadata_text('{"format":"pt","format":"tf"}')), False),
    ("metadata-duplicate-key-bad-first", edit_text(_metadata_text('{"format":1,"format":"tf"}')), True),
    ("metadata-twice", edit_text(lambda t: '{"__metadata__":{},' + t.strip()[1:]), True),
    ("metadata-escaped-key", edit_text(lambda t: t.replace('"__metadata__"', '"\\u005f_metadata__"')), False),
    # Tensor entries.
    ("dtype-unknown", edit_json(_set("a", "dtype", "F31")), True),
    ("dtype-lowercase", edit_json(_set("a", "dtype", "f32")), True),
    ("dtype-enum-map", edit_json(_set("a", "dtype", {"F32": None})), False),
    ("dtype-enum-map-value", edit_json(_set("a", "dtype", {"F32": 1})), True),
    ("dtype-number", edit_json(_set("a", "dtype", 32)), True),
    ("shape-negative", edit_json(_set("b", "shape", [-2])), True),
    ("shape-float", edit_json(_set("b", "shape", [2.0])), True),
    ("shape-minus-zero", edit_text(lambda t: t.replace('"shape":[0,4]', '"shape":[-0,4]')), True),
    ("shape-bool", edit_json(_set("c", "shape", [True, 3])), True),
    ("shape-string", edit_json(_set("b", "shape", ["2"])), True),
    ("shape-not-list", edit_json(_set("b", "shape", 2)), True),
    ("shape-wrong-size", edit_json(_set("b", "shape", [3])), True),
    ("shape-scalar-of-one", edit_json(_set("c", "shape", [])), True),
    ("field-missing", edit_json(lambda d: d["a"].pop("shape")), True),
    ("field-unknown-accepted", edit_json(_set("a", "extra", {"anything": [1, 2]})), False),
    ("field-duplicate", edit_text(lambda t: t.replace('"dtype":"U8"', '"dtype":"U8","dtype":"U8"')), True),
    ("entry-not-object", edit_json(lambda d: d.update(c=3)), True),
    ("entry-null", edit_json(lambda d: d.update(c=None)), True),
    ("entry-sequence-form", edit_text(_seq_entry), False),
    ("entries-reordered", edit_json(_reorder), False),
    ("tensor-duplicate-last-wins", edit_text(_dup_tensor("F32")), False),
    ("tensor-duplicate-bad-first", edit_text(_dup_tensor("XX")), True),
    # Offsets.
    ("offsets-hole", edit_json(_hole), True),
    ("offsets-overlap", edit_json(_overlap), True),
    ("offsets-first-not-zero", edit_json(_first_not_zero), True),
    ("offsets-end-before-begin", edit_json(_set("z", "data_offsets", [40, 39])), True),
    ("offsets-three", edit_json(lambda d: d["a"]["data_offsets"].append(0)), True),
    ("offsets-one", edit_json(lambda d: d["a"]["data_offsets"].pop()), True),
    ("offsets-float", edit_json(lambda d: d["b"]["data_offsets"].__setitem__(0, 0.0)), True),
    ("offsets-over-u64", edit_json(_set("z", "data_offsets", [2**64, 2**64])), True),
    # Sub-byte dtypes and overflow.
    ("f4-even-count", edit_json(_as_dtype("c", "F4", [6])), False),
    ("f4-odd-count", edit_json(_as_dtype("c", "F4", [5])), True),
    ("f6-four-values", edit_json(_as_dtype("c", "F6_E2M3", [4])), False),
    ("f6-two-values", edit_json(_as_dtype("c", "F6_E3M2", [2])), True),
    ("numel-overflow-before-zero", edit_json(_append_empty("U8", [2**32, 2**32, 0])), True),
    ("numel-zero-before-huge", edit_json(_append_empty("U8", [0, 2**32, 2**32])), False),
    ("numel-max-times-zero", edit_json(_append_empty("U8", [2**64 - 1, 0])), False),
    ("numel-overflow", edit_json(_append_empty("U8", [2**64 - 1, 2])), True),
    ("nbits-overflow", edit_json(_append_empty("F64", [2**61])), True),
    ("nbits-just-fits", edit_json(_append_empty("F64", [2**61 - 1])), True),
]


@pytest.mark.parametrize(("mutate", "rejected"), [m[1:] for m in MUTATIONS], ids=[m[0] for m in MUTATIONS])
def test_mutation_agrees_with_library(
    tmp_path: Path, base_bytes: bytes, mutate: Callable[[bytes], bytes], rejected: bool
) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(mutate(base_bytes))
    assert library_rejects(path) == rejected, "the table disagrees with the installed safetensors"
    outcome = read_path(path)
    assert bool(outcome.problems) == rejected, outcome
    if not rejected:
        assert_matches_library(path, outcome)


# ---------------------------------------------------------------------------------------------------------------
# Valid files written by the real libraries

TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
}


def test_every_torch_dtype(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    tensors = {f"t.{code}": torch.zeros(2, 3).to(dtype) for code, dtype in TORCH_DTYPES.items()}
    # torch packs two F4 values per byte: a (2, 3) storage is a (2, 6) F4 tensor in the header.
    tensors["t.F4"] = torch.zeros(2, 3, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})
    outcome = read_path(path)
    assert_matches_library(path, outcome)
    facts = facts_of(outcome)
    by_name = {t.name: t for t in facts.tensors}
    assert facts.metadata == {"format": "pt"}
    for code in TORCH_DTYPES:
        info = by_name[f"t.{code}"]
        assert (info.dtype, info.shape, info.nbytes) == (code, (2, 3), 6 * DTYPE_BITS[code] // 8)
    assert (by_name["t.F4"].dtype, by_name["t.F4"].shape, by_name["t.F4"].nbytes) == ("F4", (2, 6), 6)


def test_numpy_file_with_metadata_and_zero_size(tmp_path: Path) -> None:
    path = tmp_path / "np.safetensors"
    arrays: dict[str, np.ndarray[Any, Any]] = {
        "weight": np.ones((3, 4), dtype=np.float32),
        "empty": np.zeros((0, 5), dtype=np.float16),
        "scalar": np.array(7, dtype=np.int64),
        "mask": np.array([True, False]),
    }
    safetensors.numpy.save_file(arrays, str(path), metadata={"step": "12", "note": "é"})
    outcome = read_path(path)
    assert_matches_library(path, outcome)
    facts = facts_of(outcome)
    by_name = {t.name: t for t in facts.tensors}
    assert by_name["empty"].nbytes == 0 and by_name["empty"].numel == 0
    assert by_name["scalar"].shape == () and by_name["scalar"].nbytes == 8
    assert facts.metadata == {"step": "12", "note": "é"}


def test_tensors_come_in_data_offset_order(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file(BASE_TENSORS, str(path))
    header, _ = split(path.read_bytes())
    doc = json.loads(header)
    facts = facts_of(read_path(path))
    assert [t.name for t in facts.tensors] == sorted(doc, key=lambda k: tuple(doc[k]["data_offsets"]))
    assert facts.metadata is None


@pytest.mark.parametrize(("metadata", "size"), [(None, 16), ({"format": "pt"}, 40)])
def test_empty_files_from_save_file(tmp_path: Path, metadata: dict[str, str] | None, size: int) -> None:
    """A model with no tensors: the 16-byte and 40-byte stubs that shadow real weights on resume (ANATOMY)."""
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file({}, str(path), metadata=metadata)
    assert path.stat().st_size == size
    outcome = read_path(path)
    assert_matches_library(path, outcome)
    assert facts_of(outcome) == SafetensorsFacts(header_bytes=size - 8, metadata=metadata, tensors=(), data_bytes=0)


def test_file_position_is_irrelevant(tmp_path: Path, base_bytes: bytes) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(base_bytes)
    with open(path, "rb") as f:
        f.seek(13)
        moved = read_safetensors(f, len(base_bytes))
    assert moved == read_path(path) and moved.problems == ()


class CountingReader:
    """A real file that records how many bytes were read from it."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.bytes_read = 0

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def read(self, n: int = -1) -> bytes:
        out = self.f.read(n)
        self.bytes_read += len(out)
        return out


def test_reads_only_the_header(tmp_path: Path) -> None:
    path = tmp_path / "big.safetensors"
    safetensors.torch.save_file({"w": torch.zeros(256, 1024)}, str(path))  # 1 MiB of data
    header, _ = split(path.read_bytes())
    with open(path, "rb") as f:
        counting = CountingReader(f)
        outcome = read_safetensors(counting, path.stat().st_size)  # type: ignore[arg-type]
    assert outcome.problems == ()
    assert counting.bytes_read == 8 + len(header)


# ---------------------------------------------------------------------------------------------------------------
# Problem kinds and messages


def write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    return path


def test_empty_file(tmp_path: Path) -> None:
    outcome = read_path(write(tmp_path, b""))
    assert outcome.content is None and kinds(outcome) == [ProblemKind.EMPTY]


def test_shorter_than_length_prefix(tmp_path: Path) -> None:
    outcome = read_path(write(tmp_path, b"\x08\x00\x00"))
    assert kinds(outcome) == [ProblemKind.TRUNCATED]
    assert "3 bytes" in outcome.problems[0].message


def test_header_cut_short(tmp_path: Path, base_bytes: bytes) -> None:
    header, _ = split(base_bytes)
    outcome = read_path(write(tmp_path, base_bytes[: 8 + 100]))
    assert outcome.content is None and kinds(outcome) == [ProblemKind.TRUNCATED]
    assert outcome.problems[0].message == (
        f"header declares {len(header):,} bytes but the file has 100 after the length prefix"
    )


def test_huge_declared_header_is_malformed_not_allocated(tmp_path: Path, base_bytes: bytes) -> None:
    outcome = read_path(write(tmp_path, struct.pack("<Q", 2**64 - 1) + base_bytes[8:]))
    assert kinds(outcome) == [ProblemKind.MALFORMED]
    assert "header too large" in outcome.problems[0].message
    assert "18,446,744,073,709,551,615" in outcome.problems[0].message


def test_header_limit_comes_from_limits(tmp_path: Path, base_bytes: bytes) -> None:
    path = write(tmp_path, base_bytes)
    header, _ = split(base_bytes)
    assert read_path(path, Limits(safetensors_header_bytes=len(header))).problems == ()
    tight = read_path(path, Limits(safetensors_header_bytes=len(header) - 1))
    assert kinds(tight) == [ProblemKind.MALFORMED] and "header too large" in tight.problems[0].message


def test_truncated_data_keeps_the_facts(tmp_path: Path, base_bytes: bytes) -> None:
    whole = facts_of(read_path(write(tmp_path, base_bytes)))
    outcome = read_path(write(tmp_path, base_bytes[:-10]))
    assert outcome.content == whole
    assert kinds(outcome) == [ProblemKind.TRUNCATED]
    assert f"should be {len(base_bytes):,} bytes, but it has {len(base_bytes) - 10:,}" in outcome.problems[0].message


def test_trailing_bytes_keep_the_facts(tmp_path: Path, base_bytes: bytes) -> None:
    whole = facts_of(read_path(write(tmp_path, base_bytes)))
    outcome = read_path(write(tmp_path, base_bytes + b"\0" * 5))
    assert outcome.content == whole
    assert kinds(outcome) == [ProblemKind.MALFORMED]
    assert "5 trailing bytes" in outcome.problems[0].message


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (edit_raw(lambda h: h.rstrip() + b"\0\0"), "non-whitespace bytes after the JSON object"),
        (edit_json(_set("a", "dtype", "F31")), "tensor `a` has unknown dtype `F31`"),
        (edit_json(_set("b", "shape", [-2])), "tensor `b` shape entry -2 is not an integer"),
        (edit_json(_hole), "previous tensor ends at"),
        (edit_json(_overlap), "(an overlap)"),
        (edit_json(_first_not_zero), "the first tensor must begin at 0"),
        (edit_json(_set("b", "shape", [3])), "tensor `b` spans bytes 0..16 but I64 [3] needs 24"),
        (edit_json(_as_dtype("c", "F4", [5])), "tensor `c` F4 [5] is 20 bits, not a whole number of bytes"),
        (edit_json(_append_empty("F64", [2**61])), "needs more bits than fit in 64 bits"),
        (edit_text(_metadata_text('{"format":1}')), "`__metadata__` value for `format` is a JSON integer"),
        (edit_raw(lambda h: h.replace(b'"pt"', b'"p\xff"')), "not valid UTF-8 (byte 0xff"),
    ],
)
def test_malformed_messages(tmp_path: Path, base_bytes: bytes, mutate: Callable[[bytes], bytes], expected: str) -> None:
    outcome = read_path(write(tmp_path, mutate(base_bytes)))
    assert outcome.content is None and kinds(outcome) == [ProblemKind.MALFORMED]
    assert expected in outcome.problems[0].message


def test_os_error_is_unreadable(tmp_path: Path, base_bytes: bytes) -> None:
    path = write(tmp_path, base_bytes)
    with open(path, "ab") as f:  # a write-only handle: reading raises io.UnsupportedOperation, an OSError
        outcome = read_safetensors(f, len(base_bytes))
    assert kinds(outcome) == [ProblemKind.UNREADABLE]


def test_dtype_table_matches_the_library(tmp_path: Path) -> None:
    """Every code in DTYPE_BITS opens with the library at exactly its bit size, and nothing else does."""
    for code, bits in DTYPE_BITS.items():
        header = json.dumps({"w": {"dtype": code, "shape": [8], "data_offsets": [0, bits]}}).encode()
        path = write(tmp_path, pack(header, b"\0" * bits))
        assert not library_rejects(path), code
        assert read_path(path).problems == (), code
    header = json.dumps({"w": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}).encode()
    assert library_rejects(write(tmp_path, pack(header, b"\0" * 16)))


# ---------------------------------------------------------------------------------------------------------------
# Property: random damage never raises and always agrees with the library

_op = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 10_000), st.integers(0, 255)),
    st.tuples(st.just("digit"), st.integers(0, 10_000), st.sampled_from("0123456789-.e")),
    st.tuples(st.just("truncate"), st.integers(0, 10_000), st.just(0)),
    st.tuples(st.just("insert"), st.integers(0, 10_000), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), st.integers(0, 10_000), st.integers(1, 8)),
)


def apply_op(buf: bytes, op: tuple[str, int, Any]) -> bytes:
    kind, where, arg = op
    if not buf:
        return buf + (arg if isinstance(arg, bytes) else b"")
    pos = where % len(buf)
    if kind == "set":
        return buf[:pos] + bytes([int(arg)]) + buf[pos + 1 :]
    if kind == "digit":
        # Rewrite one character of the header's numbers: the changes that keep JSON valid but move offsets.
        digits = [i for i, c in enumerate(buf) if i >= 8 and chr(c) in "0123456789"]
        if not digits:
            return buf
        i = digits[where % len(digits)]
        return buf[:i] + str(arg).encode() + buf[i + 1 :]
    if kind == "truncate":
        return buf[:pos]
    if kind == "insert":
        return buf[:pos] + bytes(arg) + buf[pos:]
    return buf[:pos] + buf[pos + int(arg) :]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, min_size=1, max_size=3))
def test_random_damage_agrees_with_library(
    tmp_path_factory: pytest.TempPathFactory, base_bytes: bytes, ops: list[tuple[str, int, Any]]
) -> None:
    buf = base_bytes
    for op in ops:
        buf = apply_op(buf, op)
    path = tmp_path_factory.getbasetemp() / "fuzz.safetensors"
    path.write_bytes(buf)
    outcome = read_path(path)
    assert bool(outcome.problems) == library_rejects(path), (buf, outcome)
    if not outcome.problems:
        assert isinstance(outcome.content, SafetensorsFacts)


# Headers built from parts: mostly consistent entries with odd values mixed in, to reach the JSON-level rules
# (number forms, enum forms, duplicates, nesting) that random byte damage rarely keeps parseable.
_ODD_JSON = st.sampled_from(
    [
        "0",
        "-0",
        "-1",
        "2",
        "1.0",
        "1e0",
        "true",
        "null",
        '"F32"',
        '"\\ud800"',
        "[]",
        "{}",
        "[[[]]]",
        '{"F32":null}',
        "18446744073709551615",
        "18446744073709551616",
        "-9223372036854775809",
        "1e400",
        "NaN",
        "1000000000000000000000000000000",
    ]
)


@st.composite
def _headers(draw: st.DrawFn) -> bytes:
    parts: list[str] = []
    pos = 0
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.integers(0, 9)) == 0:
            parts.append('"__metadata__":' + draw(st.sampled_from(['{"a":"b"}', "null", '{"a":1}', "[]"])))
        code = draw(st.sampled_from(sorted(DTYPE_BITS)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * DTYPE_BITS[code] // 8 + draw(st.sampled_from([0] * 8 + [-1, 1]))
        fields = {
            "dtype": json.dumps(code),
            "shape": json.dumps(shape),
            "data_offsets": json.dumps([pos, pos + nbytes]),
        }
        pos = max(pos + nbytes, pos) if draw(st.integers(0, 9)) else pos
        if draw(st.integers(0, 4)) == 0:
            fields[draw(st.sampled_from(sorted(fields)))] = draw(_ODD_JSON)
        body = ",".join(f'"{k}":{v}' for k, v in fields.items())
        if draw(st.integers(0, 9)) == 0:
            body += f',"{draw(st.sampled_from(["x", "dtype"]))}":{draw(_ODD_JSON)}'
        parts.append(f'"{draw(st.sampled_from("abc"))}":{{{body}}}')
    header = "{" + ",".join(draw(st.permutations(parts))) + "}"
    tail = draw(st.sampled_from(["", "", " ", "\n", "\0", "x"]))
    data = b"\0" * max(0, pos + draw(st.sampled_from([0, 0, 0, 1, -1])))
    return pack((header + tail).encode(), data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(buf=_headers())
def test_built_headers_agree_with_library(tmp_path_factory: pytest.TempPathFactory, buf: bytes) -> None:
    path = tmp_path_factory.getbasetemp() / "built.safetensors"
    path.write_bytes(buf)
    outcome = read_path(path)
    assert bool(outcome.problems) == library_rejects(path), (buf, outcome)


def test_a_header_seen_again_is_parsed_once(tmp_path: Path) -> None:
    """Shards of one layout saved at two checkpoints (real files from the library, other tensor data) hold the same
    header bytes: the second read hands out the first read's facts, the same object; a file whose header differs
    gets its own, and each file's own length problems are its own."""
    # a fresh memo, as in a new process: the headers earlier tests left in this worker could fill it (it is cleared
    # when full) between the reads below
    safetensors_reader._SEEN.clear()
    weights = {"a": torch.zeros(2, 3), "b": torch.ones(4)}
    safetensors.torch.save_file(weights, str(tmp_path / "one.safetensors"))
    safetensors.torch.save_file({k: v + 1 for k, v in weights.items()}, str(tmp_path / "two.safetensors"))
    safetensors.torch.save_file({"a": torch.zeros(3, 3)}, str(tmp_path / "other.safetensors"))
    one, two, other = (read_path(tmp_path / f"{n}.safetensors") for n in ("one", "two", "other"))
    assert one.content is two.content
    assert other.content != one.content
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes((tmp_path / "one.safetensors").read_bytes()[:-4])
    short = read_path(cut)
    assert short.content is one.content and short.problems and not one.problems
