"""Pickles inside pickles, found when a file is read: bytes and strings in a stream's values that hold a pickle, a
``torch.save`` file or base64 text of either, and the bytes handed to ``torch.storage._load_from_bytes``.

A loader may hand such bytes to ``pickle.loads`` or ``torch.load`` (``torch.storage._load_from_bytes`` is what a
plain ``pickle.dumps`` of a tensor writes for its storage; TransformerEngine's ``_extra_state`` holds four of them per
module). Each is read as that loader reads it (``read_torch`` for a ``torch.save`` file: zip, tar or all five legacy
streams) and carried in the stream's facts (``PickleFacts.nested``), so the judge judges them without walking
anything again. Every bound of the search is a finding: what it did not look at is named in
``PickleFacts.unsearched``, never dropped.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import itertools
from collections.abc import Iterator
from typing import Any

from ckptdoctor.limits import Limits
from ckptdoctor.model import (
    ArchiveFacts,
    DcpMetadataFacts,
    NestedPickle,
    NumpyFacts,
    Opaque,
    PickleFacts,
    PickleValue,
    ReadOutcome,
    TorchFacts,
)
from ckptdoctor.readers.pickle_walk import walk_pickle
from ckptdoctor.readers.sniff import HEAD_BYTES, pickled_head

__all__ = ["MAX_NESTED", "MAX_NESTED_DEPTH", "MAX_VALUES", "NestedBudget", "search_nested", "with_nested"]

# Per file. A real TransformerEngine model holds hundreds of `_extra_state` records, each with four pickled storages:
# the count only bounds the per-pickle overhead; bytes and opcodes bound the work.
MAX_NESTED = 16_384
MAX_NESTED_DEPTH = 3  # pickle in bytes in a pickle in bytes ...
MAX_VALUES = 2_000_000  # values visited per stream while looking for nested pickles
_MIN_B64 = 16  # shorter strings cannot hold a pickle that calls anything
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch/serialization.py MAGIC_NUMBER: the first stream of a legacy save


class NestedBudget:
    """What one file's nested search may still spend: pickles, bytes and opcodes walked."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.count = MAX_NESTED
        self.bytes = limits.pickle_bytes
        self.opcodes = limits.pickle_opcodes

    def spent(self, blob: bytes, facts: PickleFacts) -> None:
        self.count -= 1
        self.bytes -= len(blob)
        self.opcodes -= facts.opcodes


def with_nested(outcome: ReadOutcome, limits: Limits) -> ReadOutcome:
    """``outcome`` with the pickles nested in every stream it holds (its content's and ``alt_pickle``'s) attached,
    under one budget for the file."""
    budget = NestedBudget(limits)
    c = outcome.content
    if isinstance(c, PickleFacts):
        outcome = dataclasses.replace(outcome, content=search_nested(c, budget))
    elif isinstance(c, (TorchFacts, DcpMetadataFacts, NumpyFacts, ArchiveFacts)) and c.pickle is not None:
        outcome = dataclasses.replace(outcome, content=dataclasses.replace(c, pickle=search_nested(c.pickle, budget)))
    if outcome.alt_pickle is not None:
        outcome = dataclasses.replace(outcome, alt_pickle=search_nested(outcome.alt_pickle, budget))
    return outcome


def search_nested(pf: PickleFacts, budget: NestedBudget, depth: int = 1) -> PickleFacts:
    """``pf`` with each of its streams' nested pickles attached (``PickleFacts.nested``, ``unsearched``); streams
    searched before are kept as they are."""
    if pf.streams:
        parts = tuple(_search_stream(s, budget, depth) for s in pf.streams)
        return dataclasses.replace(pf, streams=parts)
    return _search_stream(pf, budget, depth)


def _search_stream(pf: PickleFacts, budget: NestedBudget, depth: int) -> PickleFacts:
    if pf.nested is not None:
        return pf
    found: list[NestedPickle] = []
    past: list[str] = []
    limits = budget.limits
    loaded = {id(b) for b in pf.loads if b is not None}
    blobs: Iterator[tuple[int, bytes | None]] = itertools.chain(
        ((i, b) for i, b in enumerate(pf.loads) if b is not None),
        ((-1, v if v is _CUT else _candidate(v)) for _, v in _texts(pf.value) if id(v) not in loaded),
    )
    for load, blob in blobs:
        if blob is _CUT:
            past.append(f"values past the first {MAX_VALUES:,} (not searched for nested pickles)")
            break
        if blob is None:
            continue
        if len(blob) > budget.bytes:
            past.append(f"nested pickles past {limits.pickle_bytes:,} bytes in all (not judged)")
            break
        inner = _read_blob(blob, limits, load >= 0)
        if inner is None:
            continue
        facts, clean = inner
        if load < 0 and not (clean or facts.globals or facts.calls):
            continue  # bytes that merely start like a pickle: pickle.loads stops where the walk stopped
        if depth > MAX_NESTED_DEPTH:
            past.append(f"a pickle nested more than {MAX_NESTED_DEPTH} deep (not judged)")
            break
        if budget.count <= 0:
            past.append(f"nested pickles past the first {MAX_NESTED:,} (not judged)")
            break
        if facts.opcodes > budget.opcodes:
            past.append(f"nested pickles past {limits.pickle_opcodes:,} opcodes in all (not judged)")
            break
        budget.spent(blob, facts)
        found.append(NestedPickle(search_nested(facts, budget, depth + 1), clean, load))
    return dataclasses.replace(pf, nested=tuple(found), unsearched=tuple(dict.fromkeys(past)))


def _read_blob(blob: bytes, limits: Limits, torch_load: bool) -> tuple[PickleFacts, bool] | None:
    """The facts of a nested pickle or ``torch.save`` file, and whether it was read without problems.
    ``torch_load``: the bytes are handed to ``torch.load`` (a zip, a tar or a legacy file, all its streams)."""
    from ckptdoctor.readers.torchzip import read_torch

    if not torch_load and blob[:4] != b"PK\x03\x04":
        facts, problems, _ = walk_pickle(blob, limits=limits)
        if facts is None:
            return None
        if problems or type(facts.value) is not int or facts.value != _LEGACY_MAGIC:
            return facts, not problems
        # the first stream of a legacy torch.save: torch.load reads five streams and the storages behind them
    outcome = read_torch(io.BytesIO(blob), len(blob), limits)
    content = outcome.content
    pickle = content.pickle if isinstance(content, TorchFacts) else None
    if pickle is None:
        pickle = outcome.alt_pickle
    if pickle is None:
        return None
    return pickle, not outcome.problems


# Values ``_texts`` looks into (the containers ``iter_values`` enters) or yields (what ``_candidate`` reads).
_OPEN = frozenset({dict, list, tuple, Opaque, bytes, str})
_CUT: Any = object()  # yielded by ``_texts`` when its budget ends the search with values left unsearched


def _texts(value: PickleValue) -> Iterator[tuple[int, Any]]:
    """The bytes and strings long enough to hold a serialized object, with the number of values visited so far.

    The same walk as ``iter_values`` (root first, children in order, a shared container entered once) without
    building paths, so the per-stream budget cuts at the same values. A container whose children are all closed
    values (tensors, numbers, globals: most of a state dict) is counted without visiting them one by one. Past
    ``MAX_VALUES`` values, ``_CUT`` is yielded when anything that could hold a pickle is left unsearched.
    """
    seen: set[int] = set()
    todo: list[Any] = [value]
    i = 0
    while todo:
        v = todo.pop()
        index = i
        if index >= MAX_VALUES:
            todo.append(v)
            if any(type(x) in _OPEN for x in todo):
                yield index, _CUT
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
    """A pickle of any protocol (0 and 1 have no PROTO opcode: their head must walk as one) or a torch zip."""
    return b[:4] == b"PK\x03\x04" or pickled_head(b[:HEAD_BYTES])


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
