"""The MindSpore `.ckpt`, TensorFlow bundle and HDF5 readers, on real files written by MindNLP 0.4.1 / MindSpore 2.7
and TensorFlow 2.21 (tests/data/mindnlp, tests/data/tf, copied from the samples of issue 17), and mutations of them."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path
from typing import BinaryIO

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import (
    FileKind,
    Hdf5Facts,
    MindSporeFacts,
    ProblemKind,
    ReadOutcome,
    TfCheckpointStateFacts,
    TfIndexFacts,
)
from ckptdoctor.readers import Reader, read_file
from ckptdoctor.readers.hdf5 import read_hdf5
from ckptdoctor.readers.mindspore import read_mindspore
from ckptdoctor.readers.protowire import varint
from ckptdoctor.readers.sniff import HEAD_BYTES, TAIL_BYTES, sniff, wants_tail
from ckptdoctor.readers.tfbundle import (
    crc32c,
    crc_problems,
    mask_crc,
    parse_data_name,
    read_tf_checkpoint_state,
    read_tf_index,
    shard_problems,
)
from tests.helpers.mindspore import _key, _len_field, _varint, ms_value, ms_values
from tests.helpers.paths import REPO, TESTS

DATA = TESTS / "data"
MS_CKPT = DATA / "mindnlp" / "checkpoint-6"
TF_TRAINER = DATA / "tf" / "tf-trainer"
TF_CKPT = TF_TRAINER / "checkpoint"
KERAS = DATA / "tf" / "keras-weights"
FIXTURES = REPO / "fixtures"


def read_bytes(reader: Reader, data: bytes, limits: Limits = DEFAULT_LIMITS) -> ReadOutcome:
    outcome = reader(io.BytesIO(data), len(data), limits)
    assert isinstance(outcome, ReadOutcome)
    return outcome


def ms_facts(data: bytes) -> MindSporeFacts:
    outcome = read_bytes(read_mindspore, data)
    assert outcome.problems == (), outcome.problems
    assert isinstance(outcome.content, MindSporeFacts)
    return outcome.content


# ---------------------------------------------------------------------------------------------------------------
# MindSpore protobuf, built by hand for the cases the sample lacks


# ---------------------------------------------------------------------------------------------------------------
# MindSpore: the real file


def test_mindspore_sample_reads_with_the_configs_shapes() -> None:
    data = (MS_CKPT / "mindspore_model.ckpt").read_bytes()
    facts = ms_facts(data)
    config = json.loads((MS_CKPT / "config.json").read_text())
    e, v, p, layers = config["n_embd"], config["vocab_size"], config["n_positions"], config["n_layer"]
    shapes = {t.name: t.shape for t in facts.tensors}
    assert shapes["transformer.wte.weight"] == (v, e)
    assert shapes["transformer.wpe.weight"] == (p, e)
    assert shapes["lm_head.weight"] == (v, e)  # saved although tied to wte
    for i in range(layers):
        assert shapes[f"transformer.h.{i}.attn.c_attn.weight"] == (e, 3 * e)  # GPT-2 Conv1D: (in, out)
        assert shapes[f"transformer.h.{i}.mlp.c_fc.weight"] == (e, 4 * e)
        assert shapes[f"transformer.h.{i}.ln_1.bias"] == (e,)
    assert f"transformer.h.{layers}.ln_1.weight" not in shapes
    assert len(facts.tensors) == facts.values == 4 + 12 * layers + 1  # wte, wpe, ln_f x2, lm_head + per layer
    assert {t.dtype for t in facts.tensors} == {"F32"}  # config ms_dtype mindspore.float32
    assert all(t.nbytes == t.numel * 4 for t in facts.tensors)
    assert sum(t.nbytes for t in facts.tensors) < len(data)


def test_mindspore_sample_matches_the_protobuf_runtime() -> None:
    """The oracle: the protobuf runtime, given the schema of mindspore/ccsrc/utils/checkpoint.proto."""
    pytest.importorskip("google.protobuf")
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory  # type: ignore[import-untyped]

    fd = descriptor_pb2.FileDescriptorProto(name="ckd_ms_checkpoint.proto", package="ckdms", syntax="proto2")
    F = descriptor_pb2.FieldDescriptorProto
    tensor = fd.message_type.add(name="TensorProto")
    tensor.field.add(name="dims", number=1, type=F.TYPE_INT64, label=F.LABEL_REPEATED)
    tensor.field.add(name="tensor_type", number=2, type=F.TYPE_STRING, label=F.LABEL_REQUIRED)
    tensor.field.add(name="tensor_content", number=3, type=F.TYPE_BYTES, label=F.LABEL_REQUIRED)
    ckpt = fd.message_type.add(name="Checkpoint")
    value = ckpt.nested_type.add(name="Value")
    value.field.add(name="tag", number=1, type=F.TYPE_STRING, label=F.LABEL_REQUIRED)
    value.field.add(
        name="tensor", number=2, type=F.TYPE_MESSAGE, label=F.LABEL_OPTIONAL, type_name=".ckdms.TensorProto"
    )
    ckpt.field.add(
        name="value", number=1, type=F.TYPE_MESSAGE, label=F.LABEL_REPEATED, type_name=".ckdms.Checkpoint.Value"
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    cls = message_factory.GetMessageClass(pool.FindMessageTypeByName("ckdms.Checkpoint"))
    data = (MS_CKPT / "mindspore_model.ckpt").read_bytes()
    msg = cls.FromString(data)
    facts = ms_facts(data)
    assert [(t.name, t.shape, t.nbytes) for t in facts.tensors] == [
        (v.tag, tuple(v.tensor.dims), len(v.tensor.tensor_content)) for v in msg.value
    ]
    assert {v.tensor.tensor_type for v in msg.value} == {"mindspore.float32"}


# ---------------------------------------------------------------------------------------------------------------
# MindSpore: damage


@pytest.fixture(scope="module")
def small_ms() -> bytes:
    """Three real values of the sample (ln_1 weight and bias, c_attn bias): a small file of library bytes."""
    values = ms_values((MS_CKPT / "mindspore_model.ckpt").read_bytes())
    return values[2] + values[3] + values[5]


def test_every_truncation_of_a_mindspore_file_is_a_problem_or_a_shorter_file(small_ms: bytes) -> None:
    whole = ms_facts(small_ms)
    boundaries = {0}
    for v in ms_values(small_ms):
        boundaries.add(max(boundaries) + len(v))
    for cut in range(len(small_ms)):
        outcome = read_bytes(read_mindspore, small_ms[:cut])
        if cut in boundaries:
            # Cut between two values: a complete, shorter Checkpoint. Only the rules can tell (missing tensors).
            if cut == 0:
                assert [p.kind for p in outcome.problems] == [ProblemKind.EMPTY]
            else:
                assert isinstance(outcome.content, MindSporeFacts)
                assert outcome.content.tensors == whole.tensors[: len(outcome.content.tensors)]
            continue
        assert outcome.problems, cut
        assert outcome.problems[0].kind in (ProblemKind.TRUNCATED, ProblemKind.MALFORMED), (cut, outcome)


def test_truncated_real_file_names_the_tensor_it_ends_in() -> None:
    data = (MS_CKPT / "mindspore_model.ckpt").read_bytes()
    outcome = read_bytes(read_mindspore, data[: len(data) - 100])
    assert outcome.content is None
    (p,) = outcome.problems
    assert p.kind is ProblemKind.TRUNCATED
    assert "`lm_head.weight`" in p.message and "100 missing" in p.message


def test_flipped_header_bytes_are_problems(small_ms: bytes) -> None:
    # The dims, the tensor_type and the content length of the first value, located in the real bytes.
    first = ms_values(small_ms)[0]
    type_at = small_ms.index(b"mindspore.float32")
    dims_at = first.index(b"\x08\x10")  # dims: field 1 varint 16
    content_len_at = type_at + len(b"mindspore.float32") + 1  # after the tensor_content key
    for at, new in [
        (dims_at + 1, 0x11),  # 16 -> 17 elements
        (type_at + len("mindspore.float"), ord("1")),  # float32 -> float12: not a tensor any more ...
        (type_at + len("mindspore.float"), ord("6")),  # float32 -> float62: ... nor this
        (type_at + len("mindspore."), ord("i")),  # float32 -> ifloat32
        (content_len_at, 0x41),  # content length 64 -> 65: the rest is misparsed
        (0, 0x0B),  # wire type 3 (group start)
        (1, 0xFF),  # the value's length becomes a longer varint
    ]:
        data = bytearray(small_ms)
        data[at] = new
        outcome = read_bytes(read_mindspore, bytes(data))
        names = {t.name for t in outcome.content.tensors} if isinstance(outcome.content, MindSporeFacts) else set()
        # A wrong dtype string makes the value no tensor MindSpore knows: it disappears from the tensors, which
        # the rules see as a missing weight; every other flip here is a problem of the file.
        assert outcome.problems or "transformer.h.0.ln_1.weight" not in names, (at, new, outcome)
    data = bytearray(small_ms)
    data[dims_at + 1] = 0x11
    (p,) = read_bytes(read_mindspore, bytes(data)).problems
    assert p.kind is ProblemKind.MALFORMED and "needs 68 bytes but its tensor_content holds 64" in p.message


def test_mindspore_slices_scalars_strings_and_other_types() -> None:
    data = (
        ms_value("big", [4, 2], "Float16", b"\x00" * 8)  # a tensor over 512 MB is saved in slices under one tag
        + ms_value("big", [4, 2], "Float16", b"\x00" * 8)
        + ms_value("step", [0], "Int64", b"\x00" * 8)  # a scalar: dims [0]
        + ms_value("empty", [0], "Int32", b"")  # dims [0] without its element: MindSpore fails on it
        + ms_value("name", [0], "str", b"hello")
        + ms_value("q", [2], "Int4", b"\x00")
    )
    outcome = read_bytes(read_mindspore, data)
    assert isinstance(outcome.content, MindSporeFacts)
    assert [(t.name, t.dtype, t.shape, t.nbytes) for t in outcome.content.tensors] == [
        ("big", "F16", (4, 2), 16),
        ("step", "I64", (), 8),
        ("empty", "I32", (), 0),
    ]
    assert outcome.content.values == 6
    (p,) = outcome.problems
    assert "`empty` I32 [] needs 4 bytes" in p.message


@pytest.mark.parametrize(
    ("data", "kind", "words"),
    [
        (b"\x0a\x05\x0a\x03abc", ProblemKind.MALFORMED, "`abc` holds no tensor"),
        (_len_field(1, _len_field(2, _len_field(2, b"F32"))), ProblemKind.MALFORMED, "no tag"),
        (ms_value("t", [1 << 64 - 1], "Float32", b""), ProblemKind.MALFORMED, "negative dimension"),
        (b"\x0a" + b"\xff" * 11, ProblemKind.MALFORMED, "longer than 10 bytes"),
        (b"\x0a\x80", ProblemKind.TRUNCATED, "past the end of the file"),
        (b"\x0f", ProblemKind.MALFORMED, "wire type 7"),
        (b"\x0a\x02\x0a\x05ab", ProblemKind.MALFORMED, "its message ends"),
        (_len_field(1, _len_field(1, b"t") + _len_field(2, _len_field(2, b"Float32"))), ProblemKind.MALFORMED,
         "no tensor_content"),
    ],
)
def test_mindspore_structure_problems(data: bytes, kind: ProblemKind, words: str) -> None:
    outcome = read_bytes(read_mindspore, data)
    assert outcome.problems, outcome
    assert outcome.problems[0].kind is kind, outcome
    assert words in outcome.problems[0].message


def test_unknown_fields_are_skipped_as_protobuf_does() -> None:
    extra = _key(9, 0) + _varint(5) + _key(10, 1) + b"\x00" * 8 + _key(11, 5) + b"\x00" * 4 + _len_field(12, b"xyz")
    data = extra + ms_value("w", [2], "Float32", b"\x00" * 8) + extra
    facts = ms_facts(data)
    assert [(t.name, t.shape) for t in facts.tensors] == [("w", (2,))]


# ---------------------------------------------------------------------------------------------------------------
# TensorFlow bundle index


def tf_index(path: Path) -> TfIndexFacts:
    outcome = read_bytes(read_tf_index, path.read_bytes())
    assert outcome.problems == (), outcome.problems
    assert isinstance(outcome.content, TfIndexFacts)
    return outcome.content


def test_tf_index_sample_reads() -> None:
    facts = tf_index(TF_CKPT / "ckpt-3.index")
    assert facts.num_shards == 1 and facts.endianness == "little" and facts.version == 1
    entries = {e.key: e for e in facts.entries}
    assert len(entries) == 16
    kernel = entries["optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE"]
    assert (kernel.dtype, kernel.shape, kernel.shard_id, kernel.size) == ("F32", (8, 16), 0, 512)
    assert entries["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"].dtype == "I64"
    assert entries["_CHECKPOINTABLE_OBJECT_GRAPH"].dtype == "DT_STRING"
    # Adam keeps two slots per trainable variable: m and v have each variable's shape.
    trainable = sorted(e.shape for k, e in entries.items() if "_trainable_variables/" in k)
    slots = sorted(e.shape for k, e in entries.items() if "optimizer/_variables/" in k)
    assert slots == sorted(trainable * 2)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_tf_save_counter_is_the_checkpoint_number(n: int) -> None:
    """Cross-check against the data shard: N in ckpt-N counts saves (save_counter), it is not a step."""
    facts = tf_index(TF_CKPT / f"ckpt-{n}.index")
    (counter,) = [e for e in facts.entries if e.key == "save_counter/.ATTRIBUTES/VARIABLE_VALUE"]
    shard = (TF_CKPT / f"ckpt-{n}.data-00000-of-00001").read_bytes()
    assert struct.unpack("<q", shard[counter.offset : counter.offset + counter.size]) == (n,)


def test_every_truncation_of_a_tf_index_is_a_problem() -> None:
    data = (TF_CKPT / "ckpt-3.index").read_bytes()
    for cut in range(len(data)):
        outcome = read_bytes(read_tf_index, data[:cut])
        assert outcome.content is None and len(outcome.problems) == 1, cut
        kind = outcome.problems[0].kind
        assert kind is (ProblemKind.EMPTY if cut == 0 else ProblemKind.TRUNCATED), (cut, outcome)


def test_every_flipped_byte_of_a_tf_index_is_a_problem() -> None:
    data = (TF_CKPT / "ckpt-3.index").read_bytes()
    footer = len(data) - 48
    handles_end = footer
    for _ in range(4):
        _, handles_end = varint(data, handles_end, len(data))
    for at in range(len(data)):
        if handles_end <= at < len(data) - 8:
            continue  # the footer's zero padding: LevelDB ignores it too
        flipped = bytearray(data)
        flipped[at] ^= 0x5A
        outcome = read_bytes(read_tf_index, bytes(flipped))
        assert outcome.problems, at


def test_tf_index_snappy_block_is_reported_not_read() -> None:
    raw = (TF_CKPT / "ckpt-3.index").read_bytes()
    data = bytearray(raw)
    # The index block's trailer: set the type to snappy (1) and recompute its checksum.
    footer = len(raw) - 48
    _, pos = varint(raw, footer, len(raw))
    _, pos = varint(raw, pos, len(raw))
    index_off, pos = varint(raw, pos, len(raw))
    index_size, _ = varint(raw, pos, len(raw))
    t = index_off + index_size
    data[t] = 1
    data[t + 1 : t + 5] = mask_crc(crc32c(bytes(data[index_off : t + 1]))).to_bytes(4, "little")
    (p,) = read_bytes(read_tf_index, bytes(data)).problems
    assert p.kind is ProblemKind.LIMIT and "snappy-compressed, not read" in p.message


def test_tf_index_not_a_table() -> None:
    (p,) = read_bytes(read_tf_index, b"\x01" * 100).problems
    assert p.kind is ProblemKind.MALFORMED and "bad table magic" in p.message


def test_crc32c_known_values() -> None:
    assert crc32c(b"") == 0
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(b"6789", crc32c(b"12345")) == 0xE3069283


# ---------------------------------------------------------------------------------------------------------------
# TensorFlow data shards


def test_clean_shards_have_no_problems_and_pass_the_crc() -> None:
    for index in sorted(TF_CKPT.glob("*.index")) + sorted((KERAS / "checkpoint").glob("*.index")):
        facts = tf_index(index)
        prefix = index.name[: -len(".index")]
        sizes = {p.name: p.stat().st_size for p in index.parent.iterdir()}
        assert shard_problems(prefix, facts, sizes) == ()
        shard = index.parent / f"{prefix}.data-00000-of-00001"
        with open(shard, "rb") as f:
            assert crc_problems(facts, 0, f, shard.stat().st_size) == ()


def test_shard_cut_to_100_bytes_and_missing_shard() -> None:
    facts = tf_index(TF_CKPT / "ckpt-3.index")
    ((name, p),) = shard_problems("ckpt-3", facts, {"ckpt-3.data-00000-of-00001": 100})
    assert name == "ckpt-3.data-00000-of-00001" and p.kind is ProblemKind.TRUNCATED
    assert "has 100 bytes" in p.message and "4,785 missing" in p.message
    ((name, p),) = shard_problems("ckpt-3", facts, {"ckpt-2.data-00000-of-00001": 4885})
    assert name == "ckpt-3.data-00000-of-00001" and p.kind is ProblemKind.MALFORMED and "is missing" in p.message


def test_flipped_data_byte_fails_the_crc_of_its_tensor() -> None:
    facts = tf_index(TF_CKPT / "ckpt-3.index")
    data = (TF_CKPT / "ckpt-3.data-00000-of-00001").read_bytes()
    for e in facts.entries:
        for at in (e.offset, e.offset + e.size - 1):
            flipped = bytearray(data)
            flipped[at] ^= 1
            problems = crc_problems(facts, 0, io.BytesIO(bytes(flipped)), len(data))
            assert [f"`{e.key}`" in p.message for p in problems] == [True], (e.key, at, problems)


def test_data_names() -> None:
    assert parse_data_name("ckpt-12.data-00001-of-00004") == ("ckpt-12", 1, 4)
    assert parse_data_name("ckpt-12.index") is None


# ---------------------------------------------------------------------------------------------------------------
# The `checkpoint` state file


def test_checkpoint_state_sample() -> None:
    outcome = read_bytes(read_tf_checkpoint_state, (TF_CKPT / "checkpoint").read_bytes())
    assert outcome == ReadOutcome(TfCheckpointStateFacts("ckpt-3", ("ckpt-1", "ckpt-2", "ckpt-3")))
    outcome = read_bytes(read_tf_checkpoint_state, (KERAS / "checkpoint" / "checkpoint").read_bytes())
    assert outcome == ReadOutcome(TfCheckpointStateFacts("ckpt-3", ("ckpt-2", "ckpt-3")))


@pytest.mark.parametrize(
    ("text", "latest", "paths"),
    [
        ("", None, ()),
        ('model_checkpoint_path: "a\\"b\\\\c\\x41\\101"', 'a"b\\cAA', ()),
        ("# comment\nmodel_checkpoint_path: 'x'  all_model_checkpoint_paths: \"y\"", "x", ("y",)),
        ('model_checkpoint_path: "/abs/ckpt-9"\nlast_preserved_timestamp: 1.5e9\n', "/abs/ckpt-9", ()),
    ],
)
def test_checkpoint_state_text_format(text: str, latest: str | None, paths: tuple[str, ...]) -> None:
    outcome = read_bytes(read_tf_checkpoint_state, text.encode())
    assert outcome == ReadOutcome(TfCheckpointStateFacts(latest, paths))


@pytest.mark.parametrize(
    "text",
    [
        'model_checkpoint_path: "ckpt-3',  # cut inside the string
        "model_checkpoint_path: ckpt-3",  # a string must be quoted
        'model_checkpoint_pa',  # cut inside the name
        'checkpoint_path: "ckpt-3"',  # not a CheckpointState field
        "all_model_checkpoint_timestamps: abc",
        'model_checkpoint_path: "\\q"',
        '\x00\x00\x00',
    ],
)
def test_checkpoint_state_tensorflow_would_refuse(text: str) -> None:
    (p,) = read_bytes(read_tf_checkpoint_state, text.encode()).problems
    assert p.kind is ProblemKind.MALFORMED and "TensorFlow then finds no checkpoint" in p.message


def test_every_truncation_of_the_checkpoint_state_parses_or_is_a_problem() -> None:
    data = (TF_CKPT / "checkpoint").read_bytes()
    for cut in range(len(data)):
        outcome = read_bytes(read_tf_checkpoint_state, data[:cut])
        assert outcome.problems or isinstance(outcome.content, TfCheckpointStateFacts)


# ---------------------------------------------------------------------------------------------------------------
# HDF5


@pytest.mark.parametrize("path", [TF_TRAINER / "tf_model.h5", KERAS / "model.weights.h5"], ids=["tf", "keras"])
def test_hdf5_samples(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ckptdoctor.readers.hdf5.h5py_module", lambda: None)  # the superblock alone, as without h5py
    outcome = read_bytes(read_hdf5, path.read_bytes())
    assert outcome == ReadOutcome(Hdf5Facts(0, 0, 8, 8, 0, path.stat().st_size))


def test_every_truncation_of_an_h5_is_a_problem() -> None:
    data = (KERAS / "model.weights.h5").read_bytes()
    for cut in range(len(data)):
        outcome = read_bytes(read_hdf5, data[:cut])
        assert len(outcome.problems) == 1, cut
        want = ProblemKind.EMPTY if cut == 0 else ProblemKind.TRUNCATED
        assert outcome.problems[0].kind is want, (cut, outcome)
    (p,) = read_bytes(read_hdf5, data[:1000]).problems
    assert "ends at byte 14,512 but it has 1,000" in p.message


@pytest.mark.parametrize(
    ("at", "value", "words"),
    [
        (0, 0x88, "no HDF5 superblock signature"),
        (8, 7, "superblock version 7 is unknown"),
        (13, 3, "offsets of 3"),
        (14, 0, "lengths of 0"),
        (47, 0x01, "truncated"),  # the end-of-file address's high byte
    ],
)
def test_hdf5_flipped_superblock_bytes(at: int, value: int, words: str) -> None:
    data = bytearray((TF_TRAINER / "tf_model.h5").read_bytes())
    data[at] = value
    (p,) = read_bytes(read_hdf5, bytes(data)).problems
    assert words in p.message


def test_hdf5_user_block_and_version_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ckptdoctor.readers.hdf5.h5py_module", lambda: None)  # the superblock alone, as without h5py
    sample = (TF_TRAINER / "tf_model.h5").read_bytes()
    shifted = bytearray(b"\x00" * 512 + sample)
    shifted[512 + 24 : 512 + 32] = (512).to_bytes(8, "little")  # base address: the superblock's own offset
    assert read_bytes(read_hdf5, bytes(shifted)) == ReadOutcome(Hdf5Facts(512, 0, 8, 8, 512, len(sample)))
    v2 = bytearray(b"\x89HDF\r\n\x1a\n" + bytes([2, 8, 8, 0]) + (0).to_bytes(8, "little") + b"\xff" * 8)
    v2 += (4096).to_bytes(8, "little") + (48).to_bytes(8, "little") + b"\x00" * 4
    (p,) = read_bytes(read_hdf5, bytes(v2) + b"\x00" * 100).problems
    assert p.kind is ProblemKind.TRUNCATED and "ends at byte 4,096" in p.message
    v2 += b"\x00" * (4096 - len(v2))
    assert read_bytes(read_hdf5, bytes(v2)).problems == ()


# ---------------------------------------------------------------------------------------------------------------
# Sniffing and dispatch


def _sniff(path: Path, frameworks: bool) -> FileKind:
    data = path.read_bytes()
    tail = data[-TAIL_BYTES:] if wants_tail(path.name) else b""
    return sniff(data[:HEAD_BYTES], path.name, len(data), frameworks=frameworks, tail=tail)


SAMPLE_KINDS = {
    "mindspore_model.ckpt": (FileKind.TORCH_ZIP, FileKind.MINDSPORE),
    "optimizer.ckpt": (FileKind.TORCH_ZIP, FileKind.TORCH_ZIP),
    "scheduler.json": (FileKind.TORCH_ZIP, FileKind.TORCH_ZIP),  # MindNLP's scheduler.json is a torch-style zip
    "config.json": (FileKind.JSON, FileKind.JSON),
    "trainer_state.json": (FileKind.JSON, FileKind.JSON),
    "generation_config.json": (FileKind.JSON, FileKind.JSON),
    "ckpt-1.index": (FileKind.OTHER, FileKind.TF_INDEX),
    "ckpt-2.index": (FileKind.OTHER, FileKind.TF_INDEX),
    "ckpt-3.index": (FileKind.OTHER, FileKind.TF_INDEX),
    "ckpt-1.data-00000-of-00001": (FileKind.OTHER, FileKind.TF_DATA),
    "ckpt-2.data-00000-of-00001": (FileKind.OTHER, FileKind.TF_DATA),
    "ckpt-3.data-00000-of-00001": (FileKind.OTHER, FileKind.TF_DATA),
    "checkpoint": (FileKind.OTHER, FileKind.TF_CHECKPOINT_STATE),
    "tf_model.h5": (FileKind.OTHER, FileKind.HDF5),
    "model.weights.h5": (FileKind.OTHER, FileKind.HDF5),
}


def _sample_files() -> list[Path]:
    return sorted(p for p in (DATA / "mindnlp").rglob("*") if p.is_file()) + sorted(
        p for p in (DATA / "tf").rglob("*") if p.is_file()
    )


def test_sample_kinds_unchanged_by_default_and_recognised_with_frameworks() -> None:
    files = _sample_files()
    assert {p.name for p in files} == set(SAMPLE_KINDS)
    for p in files:
        assert (_sniff(p, False), _sniff(p, True)) == SAMPLE_KINDS[p.name], p


_CONTENT = {
    FileKind.MINDSPORE: MindSporeFacts,
    FileKind.TF_INDEX: TfIndexFacts,
    FileKind.TF_CHECKPOINT_STATE: TfCheckpointStateFacts,
    FileKind.HDF5: Hdf5Facts,
}


def test_read_file_dispatches_the_new_kinds() -> None:
    for p in _sample_files():
        facts = read_file(str(p), p.name, p.stat(), frameworks=True)
        assert facts.kind is SAMPLE_KINDS[p.name][1], p
        if facts.kind in _CONTENT:
            assert isinstance(facts.content, _CONTENT[facts.kind]) and facts.problems == (), (p, facts)
        if facts.kind is FileKind.TF_DATA:
            assert facts.content is None and facts.problems == ()  # checked through its index
    p = MS_CKPT / "mindspore_model.ckpt"
    facts = read_file(str(p), p.name, p.stat())
    assert facts.kind is FileKind.TORCH_ZIP and facts.problems  # as before: frameworks is off by default


def test_damaged_framework_files_keep_their_kind(tmp_path: Path) -> None:
    """A truncated index (no footer left) and a zeroed MindSpore weights file still go to their readers."""
    index = (TF_CKPT / "ckpt-3.index").read_bytes()
    (tmp_path / "ckpt-3.index").write_bytes(index[:300])
    (tmp_path / "mindspore_model.ckpt").write_bytes(b"\x00" * 64)
    (tmp_path / "tf_model.h5").write_bytes(b"\x00" * 64)
    for name, kind in [
        ("ckpt-3.index", FileKind.TF_INDEX),
        ("mindspore_model.ckpt", FileKind.MINDSPORE),
        ("tf_model.h5", FileKind.HDF5),
    ]:
        p = tmp_path / name
        facts = read_file(str(p), name, p.stat(), frameworks=True)
        assert facts.kind is kind and facts.content is None and facts.problems, facts


def test_torch_names_stay_torch_with_frameworks() -> None:
    h5 = (TF_TRAINER / "tf_model.h5").read_bytes()
    for name in ("pytorch_model.bin", "optimizer.pt", "rng_state.pth", "model.safetensors"):
        assert sniff(h5[:HEAD_BYTES], name, len(h5), frameworks=True) is sniff(h5[:HEAD_BYTES], name, len(h5))
    assert sniff(b"\x00\x00\x06\x08\x01", "faiss.index", 5000, frameworks=True, tail=b"\x00" * 8) is FileKind.TF_INDEX
    assert sniff(b"IxF2" + b"\x00" * 60, "faiss.index", 5000, frameworks=True, tail=b"\x00" * 8) is FileKind.OTHER


def test_a_clean_transformers_checkpoint_reads_the_same_with_frameworks() -> None:
    files = [p for p in sorted((FIXTURES / "clean-full").rglob("*")) if p.is_file()]
    files += [p for p in sorted((FIXTURES / "sharded").rglob("*")) if p.is_file()]
    if not files:
        pytest.skip("fixtures not generated")
    for p in files:
        rel = str(p.relative_to(FIXTURES))
        assert read_file(str(p), rel, p.stat(), frameworks=True) == read_file(str(p), rel, p.stat()), p


# ---------------------------------------------------------------------------------------------------------------
# Never raise: hypothesis over mutations of the real files and over arbitrary bytes

_SEEDS = {
    "mindspore": (read_mindspore, (MS_CKPT / "mindspore_model.ckpt").read_bytes()[:2000]),
    "tf_index": (read_tf_index, (TF_CKPT / "ckpt-3.index").read_bytes()),
    "tf_state": (read_tf_checkpoint_state, (TF_CKPT / "checkpoint").read_bytes()),
    "hdf5": (read_hdf5, (TF_TRAINER / "tf_model.h5").read_bytes()[:600]),
}
_SMALL = Limits(json_bytes=100_000)


def _mutate(seed: bytes, flips: list[tuple[int, int]], cut: int, insert: bytes) -> bytes:
    data = bytearray(seed)
    for at, value in flips:
        data[at % len(data)] = value
    at = cut % (len(data) + 1)
    return bytes(data[:at]) + insert + bytes(data[at:]) if insert else bytes(data[: max(at, len(data) // 2)])


@pytest.mark.parametrize("name", sorted(_SEEDS))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    flips=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=6),
    cut=st.integers(0, 1 << 16),
    insert=st.binary(max_size=24),
)
def test_readers_never_raise_on_mutations(
    name: str, flips: list[tuple[int, int]], cut: int, insert: bytes
) -> None:
    reader, seed = _SEEDS[name]
    data = _mutate(seed, flips, cut, insert)
    outcome = read_bytes(reader, data, _SMALL)
    assert outcome.content is not None or outcome.problems


@pytest.mark.parametrize("name", sorted(_SEEDS))
@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300))
def test_readers_never_raise_on_bytes(name: str, data: bytes) -> None:
    reader, _ = _SEEDS[name]
    read_bytes(reader, data, _SMALL)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300), name=st.sampled_from(["a.ckpt", "ckpt-1.index", "x.h5", "checkpoint", "y.bin"]))
def test_sniff_with_frameworks_never_raises(data: bytes, name: str) -> None:
    assert isinstance(sniff(data[:HEAD_BYTES], name, len(data), frameworks=True, tail=data[-8:]), FileKind)


class _Failing(io.BytesIO):
    def read(self, n: int | None = -1) -> bytes:
        raise OSError(5, "Input/output error")


@pytest.mark.parametrize("name", sorted(_SEEDS))
def test_os_errors_are_unreadable(name: str) -> None:
    reader, seed = _SEEDS[name]
    f: BinaryIO = _Failing(seed)
    outcome = reader(f, len(seed), DEFAULT_LIMITS)
    assert [p.kind for p in outcome.problems] == [ProblemKind.UNREADABLE], outcome


def test_limits_bound_the_state_file() -> None:
    data = (TF_CKPT / "checkpoint").read_bytes()
    (p,) = read_bytes(read_tf_checkpoint_state, data, Limits(json_bytes=10)).problems
    assert p.kind is ProblemKind.LIMIT

