"""The cheaper JSON and safetensors readers decide exactly as the implementations they replaced.

Each oracle is the earlier code, kept here verbatim (JSON) or swapped back in with ``mock.patch`` (safetensors).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO
from unittest import mock

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptdoctor.readers.jsonfiles as jsonfiles
import ckptdoctor.readers.safetensors as stmod
from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import JsonFacts, ProblemKind, ReadOutcome, SafetensorsFacts, TensorInfo
from ckptdoctor.readers.jsonfiles import deeper_than, read_json
from ckptdoctor.readers.safetensors import read_safetensors
from tests.helpers.json_values import _JSON_VALUES, _OLD_STRING, assert_same_json_outcome

# ---------------------------------------------------------------------------------------------------------------
# The JSON reader before it got cheaper (regex string stripping, object_pairs_hook on every object): the oracle.
# Only what changed is copied; the duplicate-key hook and messages are the module's own, unchanged.


# ---------------------------------------------------------------------------------------------------------------
# JSON helpers


def reference_structure(text: bytes) -> bytes:
    """``{}[]:`` outside strings, rebuilt from Python's own parse with every key kept in text order."""
    out = bytearray()
    todo: list[Any] = [json.loads(text, object_pairs_hook=tuple)]  # values, and bytes still to write
    while todo:
        item = todo.pop()
        if isinstance(item, bytes):
            out += item
        elif isinstance(item, tuple):  # an object, as its pairs
            out += b"{"
            todo.append(b"}")
            for _, value in reversed(item):
                todo += [value, b":"]
        elif isinstance(item, list):
            out += b"["
            todo.append(b"]")
            todo += reversed(item)
    return bytes(out)


def reference_depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(reference_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(reference_depth, value), default=0)
    return 0


def running_peak(brackets: bytes) -> int:
    """The old scanner's notion of depth for any run of brackets: the highest running sum, openers +1."""
    depth = peak = 0
    for b in brackets:
        depth += 1 if b in b"{[" else -1
        peak = max(peak, depth)
    return peak


_DUMPS = st.fixed_dictionaries(
    {
        "indent": st.sampled_from([None, 0, 2, "\t"]),
        "ensure_ascii": st.booleans(),
        "sort_keys": st.booleans(),
        "separators": st.sampled_from([None, (",", ":"), (" , ", " : ")]),
    }
)


# ---------------------------------------------------------------------------------------------------------------
# JSON: structure and depth read off the bytes are exact for what json.dumps writes


@settings(max_examples=300, deadline=None)
@given(value=_JSON_VALUES, dumps=_DUMPS)
def test_structure_and_depth_are_exact_for_json_dumps(value: Any, dumps: dict[str, Any]) -> None:
    data = json.dumps(value, **dumps).encode()
    structure = jsonfiles._structure(data)
    assert structure == reference_structure(data)
    depth = reference_depth(value)
    for limit in {0, max(depth - 1, 0), depth, depth + 1}:
        assert deeper_than(data, limit) is (depth > limit)
    # At exactly the limit the file parses; one level tighter it is a LIMIT problem, as before.
    out = assert_same_json_outcome(data, Limits(nesting_depth=depth))
    assert out.problems == ()
    if depth:
        tight = assert_same_json_outcome(data, Limits(nesting_depth=depth - 1))
        assert [p.kind for p in tight.problems] == [ProblemKind.LIMIT]


def test_structure_of_long_documents_with_brackets_in_strings() -> None:
    """Strings holding brackets, colons and quotes, some longer than the chunks the bytes are split in."""
    value = [["[{:", {"a]": "}" * 70_001, 'q"': "x" * 65_535 + "["}]] * 3 + [{"k": [1, "{" * 131_073]}] * 2
    for indent in (None, 1):
        data = json.dumps(value, indent=indent).encode()
        assert jsonfiles._structure(data) == reference_structure(data)
        assert_same_json_outcome(data, Limits(nesting_depth=4))


@settings(max_examples=300, deadline=None)
@given(brackets=st.binary(max_size=60).map(lambda b: bytes(b"{}[]"[x % 4] for x in b)), limit=st.integers(0, 8))
def test_bracket_depth_matches_the_running_sum(brackets: bytes, limit: int) -> None:
    assert (jsonfiles._bracket_depth(brackets, limit) > limit) is (running_peak(brackets) > limit)


@pytest.mark.parametrize("limit", [3, 40])
def test_bracket_depth_on_long_runs(limit: int) -> None:
    """Runs that peel away, runs that stop peeling (openers, one deep spike) and runs past the scan's chunk."""
    flat = b"[]" * 40_000
    for brackets in (
        flat,
        b"{" + flat + b"}",
        b"[" * limit + flat + b"]" * limit,
        b"[" * (limit + 1) + flat + b"]" * (limit + 1),
        flat + b"[" * (limit + 1),
        b"]" * 10 + b"[" * (limit + 5),
        b"[" * 200_000,
        b"{[" * 30_000 + b"]}" * 30_000,
    ):
        assert (jsonfiles._bracket_depth(brackets, limit) > limit) is (running_peak(brackets) > limit)


# ---------------------------------------------------------------------------------------------------------------
# JSON: outcomes equal the oracle's on a corpus of valid, invalid and hostile texts

_LIMIT = DEFAULT_LIMITS.nesting_depth


def _nested(depth: int, kind: str) -> bytes:
    if kind == "array":
        return b"[" * depth + b"]" * depth
    if kind == "object":
        return b'{"k":' * depth + b"1" + b"}" * depth
    return b'{"k":[' * (depth // 2) + (b"[]" if depth % 2 else b"0") + b"]}" * (depth // 2)


_CORPUS: list[bytes] = [
    b"null",
    b" 1 ",
    b'"just a string"',
    b"{}",
    b"[]",
    b'{"a": NaN, "b": Infinity, "c": -Infinity, "d": -0.0, "e": 1e400}',
    b'["[", "]", "{", "}", ":", "[{:}]"]',
    b'{"k": "v:1", "url": "http://x/y", "t": "12:30"}',
    b'{"a": "x:y", "a": 1}',
    b'{"a\\"b": 1, "a\\"b": 2}',
    b'{"a\\\\": 1, "b\\\\\\"[": [2]}',
    b'["\\\\", "\\\\\\\\", "\\"", "\\\\\\"[[[["]',
    b'["a\\\\"' + b"[" * 600,
    b'"\\"' + b"[" * 600,
    b'\\"' + b"[" * 600 + b'"',
    b'["\\"' + b"[" * 600 + b"]",
    b'"' + b"[" * 600,
    b'["' + b"[" * 600 + b'"]',
    b"\\[[[[",
    b'{"a":1,"a":2} x',
    b'{"a":1 "a":2}',
    b'{"x": [{"a": 1, "b": {"a": 2}}, {"b": 1, "b": 2}], "x": 3}',
    b'{"a": {"b": 1, "b": 2}, "a": 3}',
    b'{"\xc3\xa9": "\xf0\x9f\x98\x80", "\\u00e9": "\\ud83d\\ude00", "\xc3\xa9": 1}',
    b'"\\ud800"',
    b'{"a": "\\ud800", "b": "\\udfff\\ud800"}',
    b"\xef\xbb\xbf{}",
    b'{"a": "\xff"}',
    b"1" * 5000,
    b"[" + b"1" * 5000 + b"]",
    b'{\r\n  "a": 1,\r\n  "b": [true, false, null]\r\n}\r\n',
    b"[1, 2,]",
    b'{"a": 1,}',
    b"{'a': 1}",
    b'{"a" 1}',
    b"\x00" * 10,
    b"[]" * 10,
    b'{"a": [1, {"b": "]}"}]}',
    b'{"a": "\\u005b\\u007b", "b": "\\/"}',
    b'[{"":""}, {"": "", "": ""}]',
]
for _depth in (_LIMIT - 1, _LIMIT, _LIMIT + 1):
    for _kind in ("array", "object", "mixed"):
        _doc = _nested(_depth, _kind)
        _CORPUS += [_doc, _doc[:-1], _doc[: len(_doc) // 2], b'"' + _doc, b'\\"' + _doc + b'"', _doc + b"]"]
        _CORPUS.append(b'["' + b"[" * _depth + b'", ' + _doc + b"]")


@pytest.mark.parametrize("data", _CORPUS, ids=range(len(_CORPUS)))
def test_corpus_outcomes_equal_the_old_reader(data: bytes) -> None:
    try:
        json.loads(data)
    except ValueError:
        pass
    else:  # what json.loads accepts, the bytes-level reading gets exactly right (not only the outcome)
        assert jsonfiles._structure(data) == reference_structure(data)
    assert_same_json_outcome(data)
    assert_same_json_outcome(data, Limits(nesting_depth=3))
    assert_same_json_outcome(data, Limits(nesting_depth=0))


@pytest.mark.parametrize("kind", ["array", "object", "mixed"])
def test_limit_at_exactly_the_limit_and_one_over(kind: str) -> None:
    assert assert_same_json_outcome(_nested(_LIMIT, kind)).problems == ()
    over = assert_same_json_outcome(_nested(_LIMIT + 1, kind))
    assert [p.kind for p in over.problems] == [ProblemKind.LIMIT]
    assert f"{_LIMIT}-level limit" in over.problems[0].message


def test_every_truncation_and_edit_of_a_trainer_state() -> None:
    state = {
        "best_metric": float("nan"),
        "log_history": [{"loss": 2.5, "step": 4, "note": 'a "quoted" [x] {y}: \\ é'}, {"loss": 2.1, "step": 8}],
        "stateful_callbacks": {"TrainerControl": {"args": {"should_save": True}, "attributes": {}}},
    }
    data = json.dumps(state, indent=2, sort_keys=True).encode()
    for cut in range(len(data) + 1):
        assert_same_json_outcome(data[:cut], Limits(nesting_depth=3))
    for pos in range(0, len(data), 3):
        for byte in b'"\\{}[]:,':
            assert_same_json_outcome(data[:pos] + bytes([byte]) + data[pos:], Limits(nesting_depth=4))
        assert_same_json_outcome(data[:pos] + data[pos + 1 :], Limits(nesting_depth=4))


_EDIT = st.tuples(st.integers(0, 10_000), st.sampled_from(list(b'"\\{}[]:,x0 ')), st.booleans())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=_JSON_VALUES, dumps=_DUMPS, edits=st.lists(_EDIT, min_size=1, max_size=3), limit=st.integers(0, 6))
def test_damaged_json_outcomes_equal_the_old_reader(
    value: Any, dumps: dict[str, Any], edits: list[tuple[int, int, bool]], limit: int
) -> None:
    data = json.dumps(value, **dumps).encode()
    for where, byte, insert in edits:
        pos = where % (len(data) + 1)
        data = data[:pos] + bytes([byte]) + data[pos + (0 if insert else 1) :]
    assert_same_json_outcome(data, Limits(nesting_depth=limit))


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300))
def test_random_bytes_outcomes_equal_the_old_reader(data: bytes) -> None:
    assert_same_json_outcome(data, Limits(nesting_depth=2))


def test_a_well_formed_file_never_takes_the_strict_path() -> None:
    """The cost this change removed: regex stripping and a tuple per key, for every ordinary file."""
    docs = [
        json.dumps({"log_history": [{"loss": float("nan"), "step": i} for i in range(700)]}, indent=2),
        json.dumps({"note": 'a "q" \\ [ { : é', "nested": [[{"a": [1]}]]}, ensure_ascii=False),
    ]
    with mock.patch.object(jsonfiles, "_read_strict", side_effect=AssertionError("strict path taken")):
        for doc in docs:
            data = doc.encode()
            out = read_json(io.BytesIO(data), len(data))
            assert out.problems == () and isinstance(out.content, JsonFacts)


# ---------------------------------------------------------------------------------------------------------------
# safetensors: the per-entry checks before they got cheaper, swapped back in as the oracle


def _old_entry(name: str, value: Any) -> tuple[str, tuple[int, ...], int, int]:
    if isinstance(value, stmod._Obj):
        fields: dict[str, Any] = {}
        for key, item in value.pairs:
            if key in stmod._FIELDS:
                if key in fields:
                    raise stmod._Reject(f"tensor `{name}` has the field `{key}` twice")
                fields[key] = item
        missing = [k for k in stmod._FIELDS if k not in fields]
        if missing:
            raise stmod._Reject(f"tensor `{name}` has no `{missing[0]}`")
        dtype_v, shape_v, offsets_v = fields["dtype"], fields["shape"], fields["data_offsets"]
    elif isinstance(value, list):
        if len(value) != len(stmod._FIELDS):
            raise stmod._Reject(
                f"tensor `{name}` is an array of {len(value)} items, expected [dtype, shape, data_offsets]"
            )
        dtype_v, shape_v, offsets_v = value
    else:
        raise stmod._Reject(f"tensor `{name}` is a JSON {stmod._json_type(value)}, expected an object")
    dtype = _old_dtype(name, dtype_v)
    if not isinstance(shape_v, list):
        raise stmod._Reject(f"tensor `{name}` shape is a JSON {stmod._json_type(shape_v)}, expected an array")
    shape = tuple(_old_usize(name, "shape", d) for d in shape_v)
    if not isinstance(offsets_v, list) or len(offsets_v) != 2:
        raise stmod._Reject(f"tensor `{name}` data_offsets must be an array [begin, end]")
    begin, end = (_old_usize(name, "data_offsets", o) for o in offsets_v)
    return dtype, shape, begin, end


def _old_dtype(name: str, value: Any) -> str:
    if isinstance(value, stmod._Obj) and len(value.pairs) == 1 and value.pairs[0][1] is None:
        value = value.pairs[0][0]
    if not isinstance(value, str):
        raise stmod._Reject(f"tensor `{name}` dtype is a JSON {stmod._json_type(value)}, expected a dtype code")
    if value not in stmod.DTYPE_BITS:
        raise stmod._Reject(f"tensor `{name}` has unknown dtype `{value[:40]}`")
    return value


def _old_usize(name: str, field: str, value: Any) -> int:
    if type(value) is not int or not 0 <= value < 2**64:
        raise stmod._Reject(f"tensor `{name}` {field} entry {value!r} is not an integer in 0..2**64")
    return value


def _old_validate(
    header_bytes: int, metadata: dict[str, str] | None, entries: dict[str, tuple[str, tuple[int, ...], int, int]]
) -> SafetensorsFacts:
    ordered = sorted(entries.items(), key=lambda item: (item[1][2], item[1][3]))
    tensors: list[TensorInfo] = []
    start = 0
    for name, (dtype, shape, begin, end) in ordered:
        if end < begin:
            raise stmod._Reject(f"tensor `{name}` spans bytes {begin:,}..{end:,}: its end is before its begin")
        if begin != start:
            if not tensors:
                raise stmod._Reject(f"tensor `{name}` begins at byte {begin:,} but the first tensor must begin at 0")
            gap = "a hole" if begin > start else "an overlap"
            raise stmod._Reject(
                f"tensor `{name}` begins at byte {begin:,} but the previous tensor ends at {start:,} ({gap})"
            )
        start = end
        described = f"{dtype} {list(shape)}"
        numel = 1
        for d in shape:
            numel *= d
            if numel >= 2**64:
                raise stmod._Reject(f"tensor `{name}` {described} has more elements than fit in 64 bits")
        nbits = numel * stmod.DTYPE_BITS[dtype]
        if nbits >= 2**64:
            raise stmod._Reject(f"tensor `{name}` {described} needs more bits than fit in 64 bits")
        if nbits % 8:
            raise stmod._Reject(f"tensor `{name}` {described} is {nbits:,} bits, not a whole number of bytes")
        if end - begin != nbits // 8:
            raise stmod._Reject(f"tensor `{name}` spans bytes {begin:,}..{end:,} but {described} needs {nbits // 8:,}")
        tensors.append(TensorInfo(name=name, dtype=dtype, shape=shape, nbytes=end - begin))
    return SafetensorsFacts(header_bytes=header_bytes, metadata=metadata, tensors=tuple(tensors), data_bytes=start)


@contextlib.contextmanager
def old_safetensors_checks() -> Iterator[None]:
    """Every header through ``_parse_int`` and the full value walk, and the old per-entry code."""
    with mock.patch.multiple(
        stmod,
        _DIGIT_RUNS=b"0" * 256,  # every header of 20+ bytes then looks as if it held a long integer
        deeper_than=lambda data, limit: True,
        _entry=_old_entry,
        _validate=_old_validate,
    ):
        yield


def read_both(buf: bytes) -> tuple[ReadOutcome, ReadOutcome]:
    new = read_safetensors(io.BytesIO(buf), len(buf))
    with old_safetensors_checks():
        old = read_safetensors(io.BytesIO(buf), len(buf))
    return new, old


# ---------------------------------------------------------------------------------------------------------------
# safetensors: headers derived from a real file, edited where the cheaper checks differ from the old ones


@pytest.fixture(scope="module")
def real_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[tuple[str, list[tuple[str, str]]]], bytes]:
    """A file from safetensors.numpy: its header as (name, [(key, JSON text)]) entries, and its data bytes."""
    path: Path = tmp_path_factory.mktemp("st") / "model.safetensors"
    arrays: dict[str, np.ndarray[Any, Any]] = {
        "w": np.ones((3, 4), dtype=np.float32),
        "b": np.arange(3, dtype=np.int64),
        "e": np.zeros((0, 5), dtype=np.float16),
        "m": np.array([True, False, True]),
        "u": np.arange(6, dtype=np.uint8).reshape(2, 3),
    }
    safetensors.numpy.save_file(arrays, str(path), metadata={"format": "pt"})
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    entries = [
        (name, [(key, json.dumps(value)) for key, value in header[name].items()])
        for name in header
        if name != "__metadata__"
    ]
    return entries, raw[8 + n :]


_ODD = [
    "0",
    "-0",
    "-1",
    "2",
    "1.0",
    "-0.0",
    "true",
    "null",
    '"F32"',
    '"\\u0046\\u0033\\u0032"',
    '"\\ud800"',
    "[]",
    "{}",
    '{"F32":null}',
    '{"F32":1}',
    "[0, 3]",
    "[3, 0]",
    "[1, -0]",
    "[4294967296, 4294967296, 0]",
    "[0, 4294967296, 4294967296]",
    "[18446744073709551615, 0]",
    "[18446744073709551615, 2]",
    "9999999999999999999",
    "18446744073709551615",
    "18446744073709551616",
    "-9223372036854775808",
    "-9223372036854775809",
    "1" + "0" * 21,
    "1" + "0" * 400,
    "1e400",
    "NaN",
    "[" * 126 + "]" * 126,
    "[" * 127 + "]" * 127,
]
_FIELD = st.sampled_from(["dtype", "shape", "data_offsets"])
_HEADER_EDIT = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 4), _FIELD, st.sampled_from(_ODD)),
    st.tuples(
        st.just("add"),
        st.integers(0, 4),
        st.sampled_from(["x", "dtype", "shape", "data_offsets"]),
        st.sampled_from(_ODD),
    ),
    st.tuples(st.just("drop"), st.integers(0, 4), _FIELD, st.just("")),
    st.tuples(st.just("seq"), st.integers(0, 4), st.just(""), st.just("")),
    st.tuples(st.just("repeat"), st.integers(0, 4), st.just(""), st.just("")),
    st.tuples(st.just("meta"), st.just(0), st.just(""), st.sampled_from(['{"format":"pt"}', '{"a":1}', "null", "[]"])),
    st.tuples(st.just("swap"), st.integers(0, 4), st.integers(0, 4).map(str), st.just("")),
    st.tuples(st.just("tie"), st.integers(0, 4), st.integers(0, 4).map(str), st.just("")),
)


def build_header(entries: list[tuple[str, list[tuple[str, str]]]], edits: list[tuple[str, int, str, str]]) -> bytes:
    entries = [(name, list(fields)) for name, fields in entries]
    metadata = '{"format":"pt"}'
    extra: list[tuple[str, str]] = []
    for kind, i, key, value in edits:
        name, fields = entries[i % len(entries)]
        if kind == "set":
            fields[:] = [(k, value if k == key else v) for k, v in fields]
        elif kind == "add":
            fields.append((key, value))
        elif kind == "drop":
            fields[:] = [(k, v) for k, v in fields if k != key]
        elif kind == "seq":
            extra.append((name, "[" + ",".join(v for _, v in fields) + "]"))
        elif kind == "repeat":
            extra.append((name, "{" + ",".join(f'"{k}":{v}' for k, v in fields) + "}"))
        elif kind == "meta":
            metadata = value
        else:  # swap: give two tensors each other's offsets; tie: give one the other's (they then sort together)
            j = int(key) % len(entries)
            a, b = dict(fields).get("data_offsets"), dict(entries[j][1]).get("data_offsets")
            if a is not None and b is not None:
                fields[:] = [(k, b if k == "data_offsets" else v) for k, v in fields]
                if kind == "swap":
                    entries[j][1][:] = [(k, a if k == "data_offsets" else v) for k, v in entries[j][1]]
    parts = [f'"__metadata__":{metadata}']
    parts += [f'"{name}":{{' + ",".join(f'"{k}":{v}' for k, v in fields) + "}" for name, fields in entries]
    parts += [f'"{name}":{value}' for name, value in extra]
    return ("{" + ",".join(parts) + "}").encode()


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(_HEADER_EDIT, max_size=3))
def test_edited_headers_read_as_before(
    real_file: tuple[list[tuple[str, list[tuple[str, str]]]], bytes], edits: list[tuple[str, int, str, str]]
) -> None:
    entries, data = real_file
    header = build_header(entries, edits)
    buf = len(header).to_bytes(8, "little") + header + data
    new, old = read_both(buf)
    assert new == old, (header, new, old)


@pytest.mark.parametrize("digits", range(15, 24))
@pytest.mark.parametrize("minus_elsewhere", [False, True])
def test_integer_lengths_around_the_u64_edge(
    real_file: tuple[list[tuple[str, list[tuple[str, str]]]], bytes], digits: int, minus_elsewhere: bool
) -> None:
    """Integers of 15-23 digits in a shape, an offset and an ignored field, with and without a '-' elsewhere."""
    entries, data = real_file
    for value in ("9" * digits, "1" + "0" * (digits - 1), "18446744073709551615"[:digits]):
        for edit in (
            ("set", 0, "shape", f"[{value}]"),
            ("set", 1, "data_offsets", f"[0, {value}]"),
            ("add", 2, "x", value),
        ):
            meta = ("meta", 0, "", '{"note":"a-b"}') if minus_elsewhere else ("meta", 0, "", '{"note":"ab"}')
            header = build_header(entries, [edit, meta])
            new, old = read_both(len(header).to_bytes(8, "little") + header + data)
            assert new == old, header


def test_real_shard_headers_skip_the_slow_checks(
    real_file: tuple[list[tuple[str, list[tuple[str, str]]]], bytes],
) -> None:
    """The cost this change removed: a Python call per integer and a walk over every value of a plain header."""
    entries, data = real_file
    header = build_header(entries, [])
    buf = len(header).to_bytes(8, "little") + header + data
    fail: Callable[..., Any] = mock.Mock(side_effect=AssertionError("slow check used"))
    with mock.patch.multiple(stmod, _parse_int=fail, _check_json_value=fail):
        out = read_safetensors(io.BytesIO(buf), len(buf))
    assert out.problems == () and isinstance(out.content, SafetensorsFacts)
    assert read_both(buf)[0] == read_both(buf)[1]


def test_tensors_at_the_same_offsets_keep_header_order() -> None:
    """Zero-size tensors share an offset: the sort is stable on (begin, end) alone, whatever their dtypes."""
    arrays: dict[str, np.ndarray[Any, Any]] = {
        "z": np.zeros((0,), dtype=np.uint8),
        "y": np.zeros((0, 3), dtype=np.float64),
        "x": np.zeros((2,), dtype=np.float32),
    }
    buf = safetensors.numpy.save(arrays)
    new, old = read_both(buf)
    assert new == old and new.problems == ()
    assert isinstance(new.content, SafetensorsFacts)
    n = int.from_bytes(buf[:8], "little")
    header = json.loads(buf[8 : 8 + n])
    in_header = [k for k in header if k != "__metadata__"]
    zero_size = [t.name for t in new.content.tensors if t.nbytes == 0]
    assert zero_size == [k for k in in_header if k in ("y", "z")]


# ---------------------------------------------------------------------------------------------------------------
# Small files read before are not parsed again (ckptdoctor.readers._OUTCOMES)


def _read(path: Path) -> Any:
    import os

    from ckptdoctor.readers import read_file

    return read_file(str(path), path.name, os.stat(path))


@contextlib.contextmanager
def _counting_parses() -> Iterator[list[int]]:
    """Sizes of the files a reader actually parsed (the outcome cache empty at the start)."""
    from ckptdoctor import readers

    readers._OUTCOMES.clear()
    calls: list[int] = []
    real = readers._reader_for
    wrapped: dict[Any, Any] = {}

    def counting(kind: Any) -> Any:
        if kind not in wrapped:  # one wrapper per kind: the cache keys on the reader, so it must be stable
            reader = real(kind)

            def parse(f: BinaryIO, size: int, limits: Limits) -> ReadOutcome:
                calls.append(size)
                return reader(f, size, limits)

            wrapped[kind] = parse
        return wrapped[kind]

    with mock.patch.object(readers, "_reader_for", counting):
        yield calls
    readers._OUTCOMES.clear()


def test_identical_small_files_share_one_parse(tmp_path: Path) -> None:
    import torch

    args = {"learning_rate": 1e-4, "output_dir": "out", "seed": 42}
    for step in (1, 2, 3):
        (tmp_path / f"checkpoint-{step}").mkdir()
        torch.save(args, tmp_path / f"checkpoint-{step}" / "training_args.bin")
        (tmp_path / f"checkpoint-{step}" / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with _counting_parses() as calls:
        facts = [_read(p) for p in sorted(tmp_path.glob("checkpoint-*/*"))]
    assert len(facts) == 6 and len(calls) == 2  # one parse per distinct content
    contents = [f.content for f in facts if f.path == "training_args.bin"]
    assert contents[0] is contents[1] is contents[2]  # frozen facts, shared
    assert {f.path for f in facts} == {"training_args.bin", "config.json"}


def test_other_bytes_of_the_same_size_are_parsed(tmp_path: Path) -> None:
    texts = ['{"hidden_size": 8}', '{"hidden_size": 9}', '{"a": 1, "a": 222}']  # same length, other bytes
    assert len({len(t) for t in texts}) == 1
    paths = []
    for i, text in enumerate(texts):
        (tmp_path / str(i)).mkdir()
        paths.append(tmp_path / str(i) / "config.json")
        paths[-1].write_text(text)
    with _counting_parses() as calls:
        facts = [_read(p) for p in paths]
    assert len(calls) == 3
    assert facts[0].content.value == {"hidden_size": 8} and facts[1].content.value == {"hidden_size": 9}
    assert facts[2].content is None and facts[2].problems[0].kind is ProblemKind.INVALID_JSON


def test_files_over_the_small_size_are_not_cached(tmp_path: Path) -> None:
    from ckptdoctor import readers

    big = json.dumps({"log_history": [{"step": i} for i in range(readers._SMALL_FILE // 10)]})
    for d in ("a", "b"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "trainer_state.json").write_text(big)
    with _counting_parses() as calls:
        _read(tmp_path / "a" / "trainer_state.json")
        _read(tmp_path / "b" / "trainer_state.json")
    assert len(calls) == 2 and not readers._OUTCOMES


# ---------------------------------------------------------------------------------------------------------------
# JSON strings matched with possessive repeats (Python 3.11+): the same matches, without memory per escape

_OLD_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\]:,]', re.DOTALL)


@settings(max_examples=500, deadline=None)
@given(text=st.text(st.sampled_from('"\\ab{}[]:,\n'), max_size=60))
def test_string_and_token_patterns_match_as_before(text: str) -> None:
    assert jsonfiles._STRING.sub("", text) == _OLD_STRING.sub("", text)
    assert [m.span() for m in jsonfiles._TOKEN.finditer(text)] == [m.span() for m in _OLD_TOKEN.finditer(text)]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="possessive repeats need Python 3.11")
def test_a_string_of_escapes_costs_no_memory_per_escape() -> None:
    """The strict path on a hostile file: 1 MB of escapes in one string, then a repeated key (old: 60 bytes each)."""
    data = b'{"a": "' + b"\\n" * 500_000 + b'", "a": 1}'
    tracemalloc.start()
    try:
        out = read_json(io.BytesIO(data), len(data))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [p.kind for p in out.problems] == [ProblemKind.INVALID_JSON]
    assert peak < 12 * len(data), peak
