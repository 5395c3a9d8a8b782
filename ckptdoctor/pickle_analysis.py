"""Judging a statically walked pickle: which of its globals would run code on load, including nested pickles."""

from __future__ import annotations

import base64
import binascii
import enum
import functools
import io
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import GlobalRef, Opaque, PickleFacts, PickleValue, TorchFacts
from ckptdoctor.readers.pickle_walk import UNRESOLVED_CALL, walk_pickle
from ckptdoctor.rules.pickle_policy import is_allowed, is_dangerous

__all__ = ["Verdict", "describe", "judge"]

_MAX_NESTED = 64  # nested pickles walked per file
_MAX_NESTED_DEPTH = 3  # pickle in bytes in a pickle in bytes ...
_MAX_VALUES = 2_000_000  # values visited per stream while looking for nested pickles
_MIN_B64 = 16  # shorter strings cannot hold a pickle that calls anything


@dataclass(frozen=True, slots=True)
class Verdict:
    """What loading a pickle could do. ``unsafe``: why loading it runs code (error); ``unknown``: imported
    globals outside the allowlist that nothing calls (warning); ``nested``: pickles found inside its values."""

    unsafe: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    nested: int = 0
    calls_unsafe: bool = False  # an unsafe global is called (not only imported) by the outer stream


def describe(g: GlobalRef) -> str:
    """A global as the user should read it; unresolved stand-ins spelled out."""
    if g == UNRESOLVED_CALL:
        return "a call of an object computed at load time"
    if g.module == "<extension>":
        return f"extension code {g.name} (resolved from the copyreg registry at load time)"
    if g.module.startswith("<") or g.name.startswith("<"):
        return f"`{g.dotted}` (a name computed at load time)"
    return f"`{g.dotted}`"


def judge(pf: PickleFacts, limits: Limits = DEFAULT_LIMITS) -> Verdict:
    """Judge every global ``pf`` imports or calls, then the pickles nested in its values.

    Unsafe: anything dangerous (imported or called), any call of a global outside the allowlist, anything the walk
    could not resolve (computed names, extension codes, calls of computed objects), and attribute chains outside
    the allowlist (``GLOBAL transformers.trainer_utils os.system`` reaches ``os``).
    """
    unsafe: dict[str, None] = {}
    unknown: dict[str, None] = {}
    _judge_globals(pf, unsafe, unknown, "")
    calls_unsafe = any(_standing(g)[0] in unsafe for g in pf.calls)
    budget = [_MAX_NESTED, limits.pickle_bytes]
    nested = _nested(pf, limits, unsafe, unknown, 1, budget)
    return Verdict(tuple(unsafe), tuple(unknown), nested, calls_unsafe)


def _judge_globals(pf: PickleFacts, unsafe: dict[str, None], unknown: dict[str, None], where: str) -> None:
    called = set(pf.calls)
    for g in (*pf.globals, *pf.calls):
        text, standing = _standing(g)
        if standing is _Standing.ALLOWED:
            continue
        if standing is _Standing.UNSAFE or g in called:
            unsafe[where + text] = None
        else:
            unknown[where + text] = None


class _Standing(enum.Enum):
    UNSAFE = "unsafe"  # unresolved, dangerous, or an attribute chain outside the allowlist
    ALLOWED = "allowed"
    UNKNOWN = "unknown"  # unsafe when the stream calls it, else unknown


@functools.lru_cache(maxsize=4096)
def _standing(g: GlobalRef) -> tuple[str, _Standing]:
    """How ``g`` reads and what it is, whoever imports it: the same few globals recur in every file of a run."""
    unresolved = g.module.startswith("<") or g.name.startswith("<")
    if unresolved or is_dangerous(g):
        return describe(g), _Standing.UNSAFE
    if is_allowed(g):
        return describe(g), _Standing.ALLOWED
    return describe(g), _Standing.UNSAFE if "." in g.name else _Standing.UNKNOWN


def _nested(
    pf: PickleFacts,
    limits: Limits,
    unsafe: dict[str, None],
    unknown: dict[str, None],
    depth: int,
    budget: list[int],
) -> int:
    """Walk pickles hidden in ``pf``'s bytes and strings (raw, base64, torch zip); returns how many were walked."""
    if pf.value is None or depth > _MAX_NESTED_DEPTH:
        return 0
    count = 0
    for i, v in _texts(pf.value):
        if i >= _MAX_VALUES or budget[0] <= 0:
            break
        blob = _candidate(v)
        if blob is None or len(blob) > budget[1]:
            continue
        inner = _walk_blob(blob, limits)
        if inner is None:
            continue
        budget[0] -= 1
        budget[1] -= len(blob)
        count += 1
        facts, clean = inner
        sub_unsafe: dict[str, None] = {}
        sub_unknown: dict[str, None] = {}
        _judge_globals(facts, sub_unsafe, sub_unknown, "nested pickle: ")
        # A stream that does not walk cleanly may be random bytes that happen to start like a pickle: only what
        # is dangerous counts then (a payload may break its stream after the call on purpose, and still runs).
        unsafe.update(sub_unsafe if clean else {k: None for k in sub_unsafe if "computed" not in k})
        if clean:
            unknown.update(sub_unknown)
        count += _nested(facts, limits, unsafe, unknown, depth + 1, budget)
    return count


# Values ``_texts`` looks into (the containers ``iter_values`` enters) or yields (what ``_candidate`` reads).
_OPEN = frozenset({dict, list, tuple, Opaque, bytes, str})


def _texts(value: PickleValue) -> Iterator[tuple[int, bytes | str]]:
    """The bytes and strings long enough to hold a serialized object, with their index in ``iter_values(value)``.

    The same walk as ``iter_values`` (root first, children in order, a shared container entered once) without
    building paths, so the per-file budgets cut at the same values. A container whose children are all closed
    values (tensors, numbers, globals: most of a state dict) is counted without visiting them one by one.
    """
    seen: set[int] = set()
    todo: list[Any] = [value]
    i = 0
    while todo:
        v = todo.pop()
        index = i
        if index >= _MAX_VALUES:
            return
        i += 1
        t = type(v)
        if t is bytes or (t is str and len(v) >= _MIN_B64):
            yield index, v
            continue
        if not (t is dict or t is list or t is tuple or t is Opaque) or id(v) in seen:
            continue
        seen.add(id(v))
        kids: list[Any] | tuple[Any, ...]
        if t is dict:
            kids = list(v.values())
        elif t is Opaque:
            kids = list(v.args) if type(v.args) is tuple else []
            if type(v.state) is dict:
                kids.extend(v.state.values())
            elif v.state is not None:
                kids.append(v.state)
        else:
            kids = v
        kinds = set(map(type, kids))
        if _OPEN.isdisjoint(kinds):
            i += len(kids)  # visited right after their parent, and nothing in them can hold a pickle
        elif kinds == {dict} and _closed_dicts(kids, seen):
            i += len(kids) + sum(map(len, kids))  # optimizer ``state``: {param: {step, exp_avg, exp_avg_sq}}
        else:
            todo.extend(reversed(kids))


def _closed_dicts(dicts: list[Any] | tuple[Any, ...], seen: set[int]) -> bool:
    """Whether ``dicts`` (all plain dicts) are distinct, not entered before, and hold only closed values; marks
    them entered when they are. Each is then visited once followed by its values, as ``iter_values`` would."""
    ids = set(map(id, dicts))
    if len(ids) != len(dicts) or not seen.isdisjoint(ids):
        return False
    if not _OPEN.isdisjoint(map(type, itertools.chain.from_iterable(map(dict.values, dicts)))):
        return False
    seen.update(ids)
    return True


def _candidate(v: object) -> bytes | None:
    """Bytes that may be a serialized object: a pickle, a torch zip, or base64 text of either."""
    if type(v) is bytes:
        if _is_serialized(v):
            return v
        return _unbase64(v)
    if type(v) is str and len(v) >= _MIN_B64:
        try:
            return _unbase64(v.encode("ascii"))
        except UnicodeEncodeError:
            return None
    return None


def _is_serialized(b: bytes) -> bool:
    return (len(b) >= 2 and b[0] == 0x80 and 2 <= b[1] <= 5) or b[:4] == b"PK\x03\x04"


def _unbase64(b: bytes) -> bytes | None:
    if len(b) < _MIN_B64:
        return None
    text = b.strip()
    for alt in (b"+/", b"-_"):
        try:
            raw = base64.b64decode(text, altchars=alt, validate=True)
        except (binascii.Error, ValueError):
            continue
        if _is_serialized(raw):
            return raw
    return None


def _walk_blob(blob: bytes, limits: Limits) -> tuple[PickleFacts, bool] | None:
    """The facts of a nested pickle or torch zip, and whether it walked without problems."""
    if blob[:4] == b"PK\x03\x04":
        from ckptdoctor.readers.torchzip import read_torch

        outcome = read_torch(io.BytesIO(blob), len(blob), limits)
        content = outcome.content
        if isinstance(content, TorchFacts) and content.pickle is not None:
            return content.pickle, not outcome.problems
        return None
    facts, problems, _ = walk_pickle(blob, limits=limits)
    if facts is None:
        return None
    return facts, not problems
