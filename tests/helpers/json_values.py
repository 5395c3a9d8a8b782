"""Helpers shared by several test files (moved from tests/readers/test_reader_cost.py)."""

from __future__ import annotations

import io
import itertools
import json
import operator
import re
from typing import BinaryIO

from hypothesis import strategies as st

import ckptdoctor.readers.jsonfiles as jsonfiles
from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import JsonFacts, ProblemKind, ReadOutcome, ReadProblem
from ckptdoctor.readers.jsonfiles import read_json

_OLD_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


_OLD_NOT_BRACKET = re.compile(r"[^{}\[\]]+")


_OLD_DEPTH_STEP = bytes.maketrans(b"{[}]", b"\x02\x02\x00\x00")


_OLD_DEPTH_CHUNK = 1 << 16


def old_read_json(f: BinaryIO, size: int, limits: Limits = DEFAULT_LIMITS) -> ReadOutcome:
    data = jsonfiles.read_bounded(f, size, limits.json_bytes, "JSON file")
    if isinstance(data, ReadProblem):
        return ReadOutcome(None, (data,))
    if not data:
        return ReadOutcome(None, (ReadProblem(ProblemKind.EMPTY, "JSON file is empty"),))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line, col = jsonfiles._line_col_bytes(data, e.start)
        msg = f"invalid UTF-8 at line {line} column {col} (byte {e.start})"
        return ReadOutcome(None, (ReadProblem(ProblemKind.INVALID_JSON, msg),))
    depth = _old_max_depth(text, limits.nesting_depth)
    if depth > limits.nesting_depth:
        msg = f"JSON nested deeper than the {limits.nesting_depth}-level limit; not parsed"
        return ReadOutcome(None, (ReadProblem(ProblemKind.LIMIT, msg),))
    try:
        value = json.loads(text, object_pairs_hook=jsonfiles._no_duplicates)
    except jsonfiles._DuplicateKeyError as e:
        msg = jsonfiles._duplicate_message(text, e.key)
        return ReadOutcome(None, (ReadProblem(ProblemKind.INVALID_JSON, msg),))
    except json.JSONDecodeError as e:
        if jsonfiles.cut_short(text, e):  # a document that ends early is TRUNCATED, as the reader says since dbabd70
            msg = f"JSON ends mid-document at line {e.lineno} column {e.colno}: {e.msg}"
            return ReadOutcome(None, (ReadProblem(ProblemKind.TRUNCATED, msg),))
        msg = f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
        return ReadOutcome(None, (ReadProblem(ProblemKind.INVALID_JSON, msg),))
    except RecursionError:
        msg = "JSON nested too deeply for the parser; not parsed"
        return ReadOutcome(None, (ReadProblem(ProblemKind.LIMIT, msg),))
    except ValueError as e:
        return ReadOutcome(None, (ReadProblem(ProblemKind.INVALID_JSON, f"invalid JSON: {e}"),))
    return ReadOutcome(JsonFacts(value))


def _old_max_depth(text: str, limit: int) -> int:
    if text.count("{") + text.count("[") <= limit:
        return 0
    brackets = _OLD_NOT_BRACKET.sub("", _OLD_STRING.sub("", text)).encode("ascii")
    steps = brackets.translate(_OLD_DEPTH_STEP)
    depth = 0
    for start in range(0, len(steps), _OLD_DEPTH_CHUNK):
        chunk = steps[start : start + _OLD_DEPTH_CHUNK]
        peak: int = max(map(operator.sub, itertools.accumulate(chunk), range(1, len(chunk) + 1)))
        if depth + peak > limit:
            return depth + peak
        depth += 2 * chunk.count(2) - len(chunk)
    return depth


def assert_same_json_outcome(data: bytes, limits: Limits = DEFAULT_LIMITS) -> ReadOutcome:
    """The reader and the oracle agree on problems and facts (compared by repr, so NaN equals NaN)."""
    new = read_json(io.BytesIO(data), len(data), limits)
    old = old_read_json(io.BytesIO(data), len(data), limits)
    assert new.problems == old.problems, data[:200]
    assert repr(new.content) == repr(old.content), data[:200]
    return new


_TRICKY_CHARS = st.sampled_from(list('"\\{}[]:,/ \n\t\x7fuU0é€😀\u2028'))


_TEXT = st.text(_TRICKY_CHARS | st.characters(exclude_categories=["Cs"]), max_size=8)


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=25,
)
