"""Plain pickle files (``pickle.dump`` output), and the streams a loader calling ``pickle.load`` again would read."""

from __future__ import annotations

import io
from typing import BinaryIO

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import PickleFacts, ProblemKind, ReadOutcome, ReadProblem
from ckptdoctor.readers.pickle_walk import JOBLIB_WRAPPER, merge_pickles, walk_pickle
from ckptdoctor.readers.zipdir import read_at, read_problem

__all__ = ["read_raw_pickle"]

_MAX_EXTRA_PICKLES = 64  # further streams walked after the first



def read_raw_pickle(f: BinaryIO, size: int, limits: Limits = DEFAULT_LIMITS, joblib: bool = True) -> ReadOutcome:
    """Walk a plain pickle file (``pickle.dump`` output); content is its ``PickleFacts``.

    ``joblib``: whether ``joblib.load`` may read the file; its value is then the one ``joblib.load`` reads (array
    bytes stepped over), with what ``pickle.load`` imports and calls added. A reader that steers on the value of a
    file only ``pickle.load`` reads (DCP's ``.metadata``) passes False."""
    if size == 0:
        return ReadOutcome(None, (read_problem(ProblemKind.EMPTY, "file is empty"),))
    if size > limits.pickle_bytes:
        return ReadOutcome(
            None, (read_problem(ProblemKind.LIMIT, f"pickle is {size} bytes (limit {limits.pickle_bytes})"),)
        )
    try:
        data = read_at(f, 0, size)
    except OSError as exc:
        return ReadOutcome(None, (read_problem(ProblemKind.UNREADABLE, f"I/O error: {exc}"),))
    facts, problems, end = walk_pickle(data, limits=limits, joblib=joblib)
    if joblib and facts is not None and JOBLIB_WRAPPER in facts.globals:
        facts, limited = _as_pickle_load_too(data, facts, limits)
        problems = (*problems, *limited)
    if facts is None or problems or end >= size:
        return ReadOutcome(facts, problems)
    # Bytes after STOP: pickle.load stops there, but a loader that calls it again (as legacy torch.load does)
    # runs the next stream. Walk what follows as further streams and report the layout.
    first_end = end
    extra: list[PickleFacts] = []
    more: list[ReadProblem] = []
    while end < size and len(extra) < _MAX_EXTRA_PICKLES:
        nxt, probs, new_end = walk_pickle(data, limits=limits, start=end)
        if nxt is None or new_end <= end:
            break
        extra.append(nxt)
        more.extend(probs)
        if probs:
            break
        end = new_end
    cut = len(extra) >= _MAX_EXTRA_PICKLES and end < size and not more
    more.append(
        read_problem(
            ProblemKind.SUSPICIOUS_ARCHIVE,
            f"{size - first_end} bytes after the pickle's STOP opcode"
            + (f", holding {len(extra)} more pickle stream(s)" if extra else "")
            + (f"; the bytes after the first {_MAX_EXTRA_PICKLES} are not walked" if cut else ""),
        )
    )
    return ReadOutcome(merge_pickles(facts, extra), tuple(more))



def _as_pickle_load_too(
    data: bytes, facts: PickleFacts, limits: Limits
) -> tuple[PickleFacts, tuple[ReadProblem, ...]]:
    """``facts`` of the stream as ``joblib.load`` reads it, with what ``pickle.load`` imports and calls reading the
    same file: it walks the array bytes joblib writes after each array wrapper as opcodes. That reading usually
    stops at the padding-length byte (1 to 16: no opcode), where ``pickle.load`` raises having run only what the
    walk recorded, so its malformed end is no finding; a limit it hit is (what lies past it was not judged)."""
    plain, problems, _ = walk_pickle(data, limits=limits)
    limited = tuple(
        ReadProblem(p.kind, f"read as pickle.load reads it: {p.message}")
        for p in problems
        if p.kind is ProblemKind.LIMIT
    )
    merged = merge_pickles(facts, [plain]) if plain is not None else None
    return (merged if merged is not None else facts), limited


def read_as_pickle(f: BinaryIO, size: int, limits: Limits) -> tuple[PickleFacts | None, tuple[ReadProblem, ...]]:
    """The streams ``pickle.load`` (called again, as legacy ``torch.load`` does) reads from the start of a file the
    sniffer gave another kind, when they import or call anything (else None: the usual answer, a real safetensors
    header is no pickle past its second byte); and the walk's own problems when the stream got past the first
    ``PICKLE_HEAD_BYTES`` before it failed (see ``walk_problems_kept``): a payload the walk cannot follow to its end
    is still reported, while a genuine header that merely starts like a pickle is not.

    Reads a growing prefix, and more only while the first stream runs on past it, so a large file that merely
    starts like a pickle costs one small read.
    """
    n = min(size, limits.pickle_bytes, 1 << 16)
    while True:
        data = read_at(f, 0, n)
        _, _, end = walk_pickle(data, limits=limits)
        if end < len(data) or n >= min(size, limits.pickle_bytes):
            break
        n = min(size, limits.pickle_bytes, n * 16)
    outcome = read_raw_pickle(io.BytesIO(data), len(data), limits)
    facts = outcome.content
    problems = tuple(
        ReadProblem(p.kind, f"read as a pickle (as pickle.load reads it): {p.message}")
        for p in outcome.problems
        if p.kind is not ProblemKind.SUSPICIOUS_ARCHIVE and walk_problems_kept(end)
    )
    if isinstance(facts, PickleFacts) and (facts.globals or facts.calls):
        return facts, problems
    return None, problems


# A file of another format may start like a pickle for a few bytes (safetensors' 8-byte header length: below its
# 100 MB limit, bytes 4-7 are zero, an opcode no unpickler knows, so any reading of it as a pickle stops by byte 8).
PICKLE_HEAD_BYTES = 8


def walk_problems_kept(stopped_at: int) -> bool:
    """Whether a walk that failed at byte ``stopped_at`` of a file a container reader read as another format went
    far enough to be a pickle: its problem is then reported (CKD603), never dropped with the container's verdict."""
    return stopped_at > PICKLE_HEAD_BYTES
