"""Read JSON files (trainer_state.json, configs, indexes) strictly: duplicate keys and bad UTF-8 are problems."""

from __future__ import annotations

import itertools
import json
import operator
import re
import sys
import threading
from collections import deque
from typing import Any, BinaryIO

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import HISTORY_KEYS, JsonFacts, ProblemKind, ReadOutcome, ReadProblem, frozen

# A JSON string, escapes included. The match is unambiguous (no backtracking can find another), so from Python 3.11
# the repeats are possessive: the same matches, but without a backtracking frame per escape, which cost 60 bytes
# each (a 20 MB string of escapes took 1.2 GB and 3.6 s; possessive, 0.14 s and no extra memory).
_STRING_PATTERN = r'"[^"\\]*+(?:\\.[^"\\]*+)*+"' if sys.version_info >= (3, 11) else r'"[^"\\]*(?:\\.[^"\\]*)*"'
# The tokens that matter for structure: strings (skipped whole, escapes included) and punctuation.
_TOKEN = re.compile(_STRING_PATTERN + r"|[{}\[\]:,]", re.DOTALL)
_STRING = re.compile(_STRING_PATTERN, re.DOTALL)
_NOT_BRACKET = re.compile(r"[^{}\[\]]+")
_DEPTH_STEP = bytes.maketrans(b"{[}]", b"\x02\x02\x00\x00")
_DEPTH_CHUNK = 1 << 16
# Every byte except quotes, brackets and colons (what ``_structure`` keeps).
_NOT_STRUCTURE = bytes(sorted(set(range(256)) - set(b'"{}[]:')))
_SPLIT_CHUNK = 1 << 16
_ONE_KIND = bytes.maketrans(b"[]", b"{}")


class _DuplicateKeyError(Exception):
    """Raised from the object hook to stop parsing at the first duplicated key."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def read_bounded(f: BinaryIO, size: int, cap: int, what: str) -> bytes | ReadProblem:
    """The whole file as bytes, or a LIMIT problem when ``size`` exceeds ``cap`` (nothing is read then)."""
    if size > cap:
        return ReadProblem(ProblemKind.LIMIT, f"{what} is {size} bytes, over the {cap}-byte limit; not read")
    f.seek(0)
    return f.read(size)


def read_json(f: BinaryIO, size: int, limits: Limits = DEFAULT_LIMITS) -> ReadOutcome:
    """Parse a JSON file the way Python's ``json`` does (NaN/Infinity accepted), rejecting duplicate keys.

    Problems: ``INVALID_JSON`` (syntax, duplicate keys, invalid UTF-8, with line and column), ``LIMIT`` (file too
    large or nested deeper than ``limits.nesting_depth``), ``EMPTY`` for a zero-byte file.
    """
    if _STREAM_MIN <= size <= limits.json_bytes:
        streamed = _read_streaming(f, size, limits.nesting_depth)
        if streamed is not _REFUSED:
            return ReadOutcome(JsonFacts(streamed, partial=True))
    data = read_bounded(f, size, limits.json_bytes, "JSON file")
    if isinstance(data, ReadProblem):
        return ReadOutcome(None, (data,))
    if not data:
        return ReadOutcome(None, (ReadProblem(ProblemKind.EMPTY, "JSON file is empty"),))
    if len(data) >= _HISTORY_MIN:
        value = _with_known_history(data, limits.nesting_depth)
        if value is not _REFUSED:
            return ReadOutcome(JsonFacts(value))
    try:
        # transformers opens JSON with encoding="utf-8": a BOM stays in the text and json rejects it below.
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line, col = _line_col_bytes(data, e.start)
        msg = f"invalid UTF-8 at line {line} column {col} (byte {e.start})"
        return ReadOutcome(None, (ReadProblem(ProblemKind.INVALID_JSON, msg),))
    value = _parse_fast(data, text, limits.nesting_depth)
    if value is not _REFUSED:
        return ReadOutcome(JsonFacts(value))
    return _read_strict(text, limits.nesting_depth)


_REFUSED: Any = object()  # what the fast paths return when they cannot vouch for a text


def _parse_fast(data: bytes, text: str, limit: int) -> Any:
    """The parsed value of the usual file: well formed, within ``limit`` and free of repeated keys; else _REFUSED.

    Nesting and key count come from the raw bytes (exact once json.loads accepts the text), and the parser builds
    plain dicts whose sizes add up to that count only when no object repeats a key. Anything else, or any doubt,
    is refused, and the strict path decides exactly as it always has and names the problem.
    """
    structure = _structure(data)
    if _bracket_depth(structure.translate(None, b":"), limit) <= limit:
        parsed = _parse_counting_keys(text)
        if parsed is not None and parsed[1] == structure.count(b":"):
            return parsed[0]
    return _REFUSED


# ---------------------------------------------------------------------------------------------------------------
# log_history seen before
#
# Every checkpoint of a run repeats the previous checkpoint's log_history and adds the entries logged since, so a
# scan of a 100-checkpoint run would parse the first entries 100 times (about 0.4 s and 100 copies in memory for
# a 7B-class run). The Trainer writes trainer_state.json with ``indent=2``: the array opens on a line of its own,
# ``\n  "log_history": [``, and closes on ``\n  ]``. A raw newline cannot occur inside a JSON string, so text after
# a newline is at a token boundary, and the three parses below are exact by the grammar alone:
#   * the document with the array replaced by a unique string parses, exactly one bracket is open before the key
#     (read off the bytes, exact once the text parses), and the top object's "log_history" is that string: the
#     array text sits at exactly that value position;
#   * the array's body (between the brackets) starts with the body of an array parsed before into at least one
#     element, followed by a comma, and ``[`` + the rest + ``]`` parses into at least one element: the body is the
#     old elements followed by the new ones;
#   * each parse passes the same depth and repeated-key checks as a whole file (depths offset by the nesting the
#     pieces sit at).
# Anything unexpected returns _REFUSED and the whole document is parsed as before. Elements are shared between
# the checkpoints' values, as small files' outcomes already are: nothing downstream mutates a parsed value.

_HISTORY_MIN = 64 * 1024  # smaller files parse in well under a millisecond
_HISTORY_OPEN = b'\n  "log_history": [\n'
_HISTORY_CLOSE = b"\n  ]"
_PLACEHOLDER = b'"ckptdoctor log_history placeholder"'
_PLACEHOLDER_VALUE = json.loads(_PLACEHOLDER)
_HISTORIES = 8  # bodies remembered: a few runs scanned side by side (threads) still find their predecessor
_HISTORY_BYTES = 64 * 1024 * 1024  # and at most this much body text, so a long-lived process stays small


@frozen
class _History:
    """The ``log_history`` array of a large ``trainer_state.json``, read without the rest of the document."""

    body: bytes  # from after the ``[`` up to the last element's closing brace
    elements: tuple[Any, ...]
    limit: int  # the nesting limit the elements were checked against


_histories: deque[_History] = deque(maxlen=_HISTORIES)
_histories_lock = threading.Lock()


def _with_known_history(data: bytes, limit: int) -> Any:
    """``data`` parsed with its log_history body apart (reusing the elements of an earlier body it extends), or
    _REFUSED when the file is not laid out as the Trainer writes it."""
    opened = data.find(_HISTORY_OPEN)
    # The last closing line: the Trainer writes no list after log_history, so the search from the end is short.
    end = data.rfind(_HISTORY_CLOSE)
    start = opened + len(_HISTORY_OPEN) - 1  # the body begins with the newline after ``[``
    if opened < 0 or end < start:
        return _REFUSED
    skeleton = data[: start - 1] + _PLACEHOLDER + data[end + len(_HISTORY_CLOSE) :]
    if skeleton.count(_PLACEHOLDER) != 1:
        return _REFUSED
    with _histories_lock:
        known = sorted((h for h in _histories if h.limit == limit), key=lambda h: len(h.body), reverse=True)
    # The longest earlier body this one starts with, followed by the end of this one or a comma and more elements.
    best: _History | None = None
    for h in known:
        after = start + len(h.body)
        if after <= end and data.startswith(h.body, start) and (after == end or data[after] == 0x2C):
            best = h
            break
    body = data[start:end]
    value = _skeleton_value(skeleton, data[:opened], limit)
    if value is _REFUSED:
        return _REFUSED
    if best is not None and len(best.body) == len(body):
        elements = best.elements
    else:
        tail = b"[" + (body[len(best.body) + 1 :] if best is not None else body) + b"]"
        try:
            tail_text = tail.decode("utf-8")
        except UnicodeDecodeError:
            return _REFUSED
        # The array sits at depth 2 (inside the top object): the bracketed tail may nest ``limit - 1`` deep.
        new = _parse_fast(tail, tail_text, limit - 1)
        if type(new) is not list or (best is not None and not new):
            return _REFUSED  # (an empty tail after a comma would be a trailing comma, which json refuses)
        elements = best.elements + tuple(new) if best is not None else tuple(new)
        if elements:  # a body of no values cannot be followed by a comma: nothing to extend
            _remember(_History(body, elements, limit), best)
    value["log_history"] = list(elements)  # a list of its own, as json.loads gives; the elements are shared
    return value


# ---------------------------------------------------------------------------------------------------------------
# A large trainer_state.json, read in pieces
#
# A 200 MB trainer_state.json parsed whole took 1.2 GB (a dict per log entry, with every key the Trainer logged).
# The scan needs only ``HISTORY_KEYS`` of each entry: the file is read in chunks, the document with its
# log_history replaced by a placeholder is parsed as in ``_with_known_history`` (the same layout checks), and the
# array's body is cut into batches where the Trainer's ``indent=2`` layout ends an entry and starts the next
# (``\n    },\n    {``, a raw newline never occurs inside a string). Each batch, bracketed, must parse as an
# array of objects through ``_parse_fast`` (depth and repeated keys checked as for a whole file): then the body
# is exactly the batches' elements in order, by the grammar alone, as in ``_with_known_history``. Each element is
# kept with those keys only; memory is a batch and the kept keys. Anything unexpected (another layout, bad UTF-8,
# a repeated key, a syntax error, no entry end within ``_ELEMENT_MAX``) returns _REFUSED, and the file is read
# whole as before, which names the problem exactly.

_STREAM_MIN = 32 * 1024 * 1024
_STREAM_CHUNK = 1 << 20
_STREAM_EDGE = 1 << 20  # the key is looked for this near the start, the array's closing line this near the end
_ELEMENT_MAX = 16 * 1024 * 1024
_ENTRY_END = b"\n    },\n    {"  # one entry's last line and the next one's first, as the Trainer writes them
_ENTRY_CLOSE = len(b"\n    }")


def _read_streaming(f: BinaryIO, size: int, limit: int) -> Any:
    """The document with each log_history entry cut to ``HISTORY_KEYS``, read in chunks; _REFUSED when the file is
    not laid out as the Trainer writes it or anything in it is not plainly valid."""
    f.seek(0)
    head = f.read(min(size, _STREAM_EDGE))
    opened = head.find(_HISTORY_OPEN)
    start = opened + len(_HISTORY_OPEN) - 1  # the body begins with the newline after ``[``
    if opened < 0:
        return _REFUSED
    tail_at = max(size - _STREAM_EDGE, start)
    f.seek(tail_at)
    tail = f.read(size - tail_at)
    close = tail.rfind(_HISTORY_CLOSE)
    if close < 0:
        return _REFUSED
    end = tail_at + close
    skeleton = head[: start - 1] + _PLACEHOLDER + tail[close + len(_HISTORY_CLOSE) :]
    if skeleton.count(_PLACEHOLDER) != 1:
        return _REFUSED
    value = _skeleton_value(skeleton, head[:opened], limit)
    if value is _REFUSED:
        return _REFUSED
    entries = _stream_entries(f, start, end, limit)
    if entries is _REFUSED:
        return _REFUSED
    value["log_history"] = entries
    return value


def _stream_entries(f: BinaryIO, start: int, end: int, limit: int) -> Any:
    """The array body between ``start`` and ``end``, batch by batch, as a list of its objects cut to
    ``HISTORY_KEYS``; _REFUSED when a batch is not an array of objects that parses plainly."""
    f.seek(start)
    left = end - start
    pending = b""
    out: list[dict[str, Any]] = []
    while left > 0 or pending:
        if left > 0:
            data = f.read(min(_STREAM_CHUNK, left))
            if not data:
                return _REFUSED  # the file shrank while being read
            left -= len(data)
            pending += data
        cut = pending.rfind(_ENTRY_END) if left > 0 else len(pending)
        if cut < 0:
            if len(pending) > _ELEMENT_MAX:
                return _REFUSED
            continue
        if left > 0:
            cut += _ENTRY_CLOSE  # the batch ends with the entry's ``}``; the comma after it is dropped
        batch, pending = b"[" + pending[:cut] + b"]", pending[cut + 1 :] if left > 0 else b""
        try:
            text = batch.decode("utf-8")
        except UnicodeDecodeError:
            return _REFUSED
        # The array sits at depth 2 (inside the top object): the bracketed batch may nest ``limit - 1`` deep.
        parsed = _parse_fast(batch, text, limit - 1)
        if type(parsed) is not list or not parsed or not all(type(e) is dict for e in parsed):
            return _REFUSED  # (an empty batch after a comma would be a trailing comma, which json refuses)
        out.extend({k: e[k] for k in HISTORY_KEYS if k in e} for e in parsed)
    return out


def _skeleton_value(skeleton: bytes, before_key: bytes, limit: int) -> Any:
    """The document with its log_history array replaced by the placeholder, parsed; _REFUSED unless the top
    object's own "log_history" is that placeholder (``before_key``: the text before the array's opening line)."""
    try:
        skeleton_text = skeleton.decode("utf-8")
    except UnicodeDecodeError:
        return _REFUSED
    value = _parse_fast(skeleton, skeleton_text, limit)
    if type(value) is not dict or value.get("log_history") != _PLACEHOLDER_VALUE:
        return _REFUSED
    # Indentation can lie: the opening line may be a key of a nested object, and the top object's own "log_history"
    # a string that equals the placeholder only once decoded (an escape). The skeleton parsed, so the structure of
    # the text before the key is exact: the key belongs to the top object only when one bracket is open there.
    brackets = _structure(before_key).translate(None, b":")
    if brackets.count(b"{") + brackets.count(b"[") - brackets.count(b"}") - brackets.count(b"]") != 1:
        return _REFUSED
    return value


def forget() -> None:
    """Drop the log_history bodies kept for the next checkpoints: a scan that judges one run at a time calls it
    once a run is judged, since another run's checkpoints do not extend this one's (each kept body holds one of
    its checkpoints' whole history, up to 800 KB and 5,000 parsed entries for a 7B-class run)."""
    with _histories_lock:
        _histories.clear()


def _remember(history: _History, extended: _History | None = None) -> None:
    """Keep ``history`` for the checkpoints read next, in place of the one it ``extended``: a body that another
    body starts with is rarely the longest match again (the next checkpoint extends the newer one), and keeping both
    held each run's bodies several times over (eight 800 KB bodies of one 7B-class run at once, bench/RESULTS.md)
    for no saved parse."""
    with _histories_lock:
        for i, h in enumerate(_histories):  # by identity: equal bodies compare in full
            if h is extended:
                del _histories[i]
                break
        _histories.append(history)
        while len(_histories) > 1 and sum(len(h.body) for h in _histories) > _HISTORY_BYTES:
            _histories.popleft()  # the newest stays: it is the one the next checkpoint extends


def _read_strict(text: str, limit: int) -> ReadOutcome:
    """Check the nesting with a tokenizer that tolerates any text, then parse, stopping at the first repeated key."""
    if _max_depth(text, limit) > limit:
        msg = f"JSON nested deeper than the {limit}-level limit; not parsed"
        return ReadOutcome(None, (ReadProblem(ProblemKind.LIMIT, msg),))
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates)
    except _DuplicateKeyError as e:
        return ReadOutcome(None, (ReadProblem(ProblemKind.INVALID_JSON, _duplicate_message(text, e.key)),))
    except json.JSONDecodeError as e:
        if cut_short(text, e):
            msg = f"JSON ends mid-document at line {e.lineno} column {e.colno}: {e.msg}"
            return ReadOutcome(None, (ReadProblem(ProblemKind.TRUNCATED, msg),))
        msg = f"invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
        return ReadOutcome(None, (ReadProblem(ProblemKind.INVALID_JSON, msg),))
    except RecursionError:
        msg = "JSON nested too deeply for the parser; not parsed"
        return ReadOutcome(None, (ReadProblem(ProblemKind.LIMIT, msg),))
    except ValueError as e:
        # e.g. an integer literal longer than Python's int/str conversion limit.
        return ReadOutcome(None, (ReadProblem(ProblemKind.INVALID_JSON, f"invalid JSON: {e}"),))
    return ReadOutcome(JsonFacts(value))


# What follows the point where json's decoder stopped when the text was cut there, by the decoder's complaint: a
# literal or a sign cut short ("Expecting value"), the rest of a number its pattern did not take, such as `1.` or
# `1.5e+` ("Expecting ',' delimiter"), or a \u escape cut short.
_CUT_AFTER = {
    "Expecting value": re.compile(r"-|-?I(n(f(i(n(i(ty?)?)?)?)?)?)?|t(r(ue?)?)?|f(a(l(se?)?)?)?|n(u(ll?)?)?|N(aN?)?"),
    "Expecting ',' delimiter": re.compile(r"(\.\d*)?([eE][+-]?\d*)?"),
    "Invalid \\uXXXX escape": re.compile(r"u[0-9a-fA-F]{0,4}"),  # even a whole one at the very end
}


def cut_short(text: str, e: json.JSONDecodeError) -> bool:
    """Whether ``text`` failed to parse only because it ends early: a string is still open at the end, or nothing
    but whitespace or a cut token follows where the decoder stopped. A file written in place and cut by a crash
    reads this way at any byte; a trailing comma, garbage or extra data does not."""
    if e.msg.startswith("Unterminated string"):  # the decoder met the end inside a string
        return True
    rest = text[e.pos :]
    if not rest.strip():
        return True
    pattern = _CUT_AFTER.get(e.msg)
    return pattern is not None and pattern.fullmatch(rest) is not None


def _parse_counting_keys(text: str) -> tuple[Any, int] | None:
    """The parsed value and the number of keys its objects hold, or None when json.loads refuses the text."""
    sizes: list[int] = []

    def count(obj: dict[str, Any]) -> dict[str, Any]:
        sizes.append(len(obj))
        return obj

    try:
        # object_hook keeps the parser's own dict building (object_pairs_hook would cost a tuple per key).
        return json.loads(text, object_hook=count), sum(sizes)
    except (ValueError, RecursionError):
        return None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        # Rare path: name the first repeated key.
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKeyError(key)
            seen.add(key)
    return out


def _structure(data: bytes) -> bytes:
    """The ``{}[]:`` bytes of a JSON text outside its strings, in order. Exact for any text json.loads accepts.

    Works on the raw bytes, which is sound for UTF-8: a multi-byte sequence never contains an ASCII byte. On text
    that is not JSON the result is only a guess; callers parse before they trust it.
    """
    if b"\\" in data:
        # In JSON a backslash occurs only inside strings, and escapes pair left to right from the first backslash
        # of a run: dropping every escaped backslash first leaves a backslash-quote only where a quote is escaped.
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    kept = data.translate(None, _NOT_STRUCTURE)
    # What is left of each string is its quotes around any brackets or colons it held, usually none: when no quote
    # survives dropping the empty pairs, every string was such a pair (a string with content would leave a quote).
    bare = kept.replace(b'""', b"")
    if b'"' not in bare:
        return bare
    # Keep what lies between strings. Split a chunk at a time: a list of one small bytes object per piece costs
    # tens of bytes per input byte, so the whole text at once could need gigabytes.
    outside: list[bytes] = []
    inside = 0  # whether the chunk starts inside a string
    for start in range(0, len(kept), _SPLIT_CHUNK):
        pieces = kept[start : start + _SPLIT_CHUNK].split(b'"')
        outside.append(b"".join(pieces[inside::2]))
        inside ^= (len(pieces) - 1) & 1
    return b"".join(outside)


def _max_depth(text: str, limit: int) -> int:
    """Deepest ``{``/``[`` nesting outside strings; 0 when it cannot exceed ``limit``. Linear, C-speed loops only."""
    if text.count("{") + text.count("[") <= limit:
        return 0  # cannot be deeper than the number of openers
    return _bracket_depth(_NOT_BRACKET.sub("", _STRING.sub("", text)).encode("ascii"), limit)


def _bracket_depth(brackets: bytes, limit: int) -> int:
    """Deepest nesting of a run of ``{[]}`` bytes, read as a running sum (kinds need not match); a value over
    ``limit`` exactly when the nesting goes deeper than ``limit``."""
    if brackets.count(b"{") + brackets.count(b"[") <= limit:
        return 0  # cannot be deeper than the number of openers
    # Peel the innermost pairs, one level per pass (replace does not rescan what it joins). A run that peels away
    # completely is balanced and exactly as deep as the passes taken. Real documents shrink fast; stop as soon as a
    # pass fails to halve what is left, so a hostile run of openers costs one pass before the scan below.
    peeled = brackets.translate(_ONE_KIND)
    level = 0
    while peeled:
        rest = peeled.replace(b"{}", b"")
        if 2 * len(rest) > len(peeled):
            break
        peeled = rest
        level += 1
    else:
        return level
    # Openers become 2, closers 0: after k brackets the running sum minus k is the depth. Chunked so that a
    # hostile file of openers stops at the first chunk instead of summing hundreds of megabytes.
    steps = brackets.translate(_DEPTH_STEP)
    depth = 0
    for start in range(0, len(steps), _DEPTH_CHUNK):
        chunk = steps[start : start + _DEPTH_CHUNK]
        peak: int = max(map(operator.sub, itertools.accumulate(chunk), range(1, len(chunk) + 1)))
        if depth + peak > limit:
            return depth + peak
        depth += 2 * chunk.count(2) - len(chunk)
    return depth


def _duplicate_message(text: str, key: str) -> str:
    """Locate the first key repeated inside one object, in text order, and describe it with line and column."""
    # Per open container: the keys seen so far (None for an array) and whether a key comes next.
    keys_stack: list[set[str] | None] = []
    expect_key: list[bool] = []
    for m in _TOKEN.finditer(text):
        tok = m.group()
        if tok in ("{", "["):
            keys_stack.append(set() if tok == "{" else None)
            expect_key.append(tok == "{")
        elif tok in ("}", "]"):
            if keys_stack:
                keys_stack.pop()
                expect_key.pop()
        elif tok == ",":
            if keys_stack and keys_stack[-1] is not None:
                expect_key[-1] = True
        elif tok.startswith('"') and keys_stack and expect_key[-1]:
            expect_key[-1] = False
            keys = keys_stack[-1]
            try:
                name = json.loads(tok)
            except ValueError:
                continue
            if keys is None:
                continue
            if name in keys:
                line, col = _line_col_text(text, m.start())
                return f"duplicate key {name!r} at line {line} column {col}"
            keys.add(name)
    return f"duplicate key {key!r}"


def _line_col_text(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


def _line_col_bytes(data: bytes, pos: int) -> tuple[int, int]:
    line = data.count(b"\n", 0, pos) + 1
    return line, pos - (data.rfind(b"\n", 0, pos) + 1) + 1


def deeper_than(data: bytes, limit: int) -> bool:
    """Whether a JSON text that json.loads accepts nests containers more than ``limit`` deep (read off the bytes)."""
    return _bracket_depth(_structure(data).translate(None, b":"), limit) > limit
