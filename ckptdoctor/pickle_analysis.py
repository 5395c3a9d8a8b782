"""Judging a statically walked pickle: which of its globals would run code on load, including nested pickles."""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import GlobalRef, PickleFacts, TorchFacts
from ckptdoctor.readers.pickle_walk import UNRESOLVED_CALL, iter_values, walk_pickle
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
    calls_unsafe = any(describe(g) in unsafe for g in pf.calls)
    budget = [_MAX_NESTED, limits.pickle_bytes]
    nested = _nested(pf, limits, unsafe, unknown, 1, budget)
    return Verdict(tuple(unsafe), tuple(unknown), nested, calls_unsafe)


def _judge_globals(pf: PickleFacts, unsafe: dict[str, None], unknown: dict[str, None], where: str) -> None:
    called = set(pf.calls)
    for g in (*pf.globals, *pf.calls):
        text = where + describe(g)
        unresolved = g.module.startswith("<") or g.name.startswith("<")
        if unresolved or is_dangerous(g):
            unsafe[text] = None
        elif is_allowed(g):
            continue
        elif g in called or "." in g.name:
            unsafe[text] = None
        else:
            unknown[text] = None


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
    for i, (_, v) in enumerate(iter_values(pf.value)):
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
