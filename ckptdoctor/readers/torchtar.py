"""The oldest ``torch.save`` format, a tar archive, which ``torch.load`` tries before the magic-number format.

torch/serialization.py ``_legacy_load`` opens any non-zip file it was given by path with
``tarfile.open(fileobj=f, mode="r:")`` first; when that succeeds (``legacy_load``) it unpickles, with the full
unpickler, the streams of three members: ``storages`` (a count, then per storage a pickled
``(key, location, storage type)`` followed by the raw storage, then the pickled storage views), ``tensors`` (a
count, then per tensor a pickled ``(key, storage id, type)`` followed by its raw geometry) and ``pickle`` (the
object). Every stream of those members is walked statically, in the order torch reads them. The headers are parsed
by ``readers/archive.py`` (bounded, where ``tarfile`` reads PAX and GNU long-name bodies whole), and every other
member a loader could unpickle is judged too.
"""

from __future__ import annotations

import struct
from typing import Any, BinaryIO

from ckptdoctor.limits import Limits
from ckptdoctor.model import GlobalRef, Opaque, PickleFacts, ProblemKind, ReadOutcome, ReadProblem, TorchFacts
from ckptdoctor.readers.archive import ArchiveScan, FileReader, Over, TorchReader
from ckptdoctor.readers.pickle_walk import merge_pickles, walk_pickle
from ckptdoctor.readers.torchstore import STORAGE_DTYPES
from ckptdoctor.readers.zipdir import read_problem

__all__ = ["read_tar"]

_TORCH_MEMBERS = ("storages", "tensors", "pickle")
_MAX_ITEMS = 1_000_000  # storages or tensors a member may declare; more is walked no further
_U64 = struct.Struct("<Q")
_I32 = struct.Struct("<i")


def read_tar(f: BinaryIO, size: int, limits: Limits, read_torch: TorchReader) -> ReadOutcome:
    """Walk every stream ``torch.load`` would unpickle from the tar members ``storages``, ``tensors``, ``pickle``,
    and every other member a loader could unpickle (``readers/archive.py``, by content, any name; a torch file
    among them by ``read_torch``)."""
    problems: list[ReadProblem] = []
    scan = ArchiveScan(limits, read_torch, size)
    data_of: dict[str, bytes | None] = {}  # the last member of each name, as ``getmember`` answers
    names: list[str] = []
    try:
        for m, data in scan.tar(FileReader(f, 0, size), ""):
            names.append(m.name)
            if m.name not in _TORCH_MEMBERS:
                scan.member(data, m.name, m.size, 1)
            elif m.size > limits.pickle_bytes:
                data_of[m.name] = None
                problems.append(read_problem(ProblemKind.LIMIT, f"tar member `{m.name}` is {m.size} bytes"))
            else:
                data_of[m.name] = data.read(m.size)
    except Over as exc:
        problems.append(read_problem(exc.kind, f"{exc}: the rest is not checked"))
    if not names:
        return ReadOutcome(None, (read_problem(ProblemKind.MALFORMED, "not a readable tar archive"),))
    streams: list[PickleFacts] = []
    main: PickleFacts | None = None
    for name in _TORCH_MEMBERS:
        if name not in data_of:
            problems.append(read_problem(ProblemKind.MALFORMED, f"legacy tar has no `{name}` member"))
            continue
        raw = data_of[name]
        if raw is None:
            continue
        if name == "pickle":
            main = _walk(raw, 0, limits, problems, name, streams, _persistent)[0]
        else:
            _walk_records(raw, name, limits, problems, streams)
    problems.extend(scan.problems)
    extra = sorted(set(names) - set(_TORCH_MEMBERS))
    if extra:
        problems.append(read_problem(ProblemKind.SUSPICIOUS_ARCHIVE, f"legacy tar holds other members: {extra[:5]}"))
    calling = [s for s in (*streams, *scan.pickles) if s is not main and (s.globals or s.calls)]
    return ReadOutcome(TorchFacts("tar", "", (), merge_pickles(main, calling), ()), tuple(problems))


def _persistent(pid: Any) -> Any:
    """``legacy_load``'s persistent ids: a module with its source, or a storage key; only a stand-in here."""
    return Opaque(None, (pid,))


def _walk(
    data: bytes,
    pos: int,
    limits: Limits,
    problems: list[ReadProblem],
    name: str,
    streams: list[PickleFacts],
    persistent_load: Any = None,
) -> tuple[PickleFacts | None, int]:
    """One stream of member ``name`` from ``pos``: its facts (kept in ``streams``) and where the next one starts;
    (None, -1) when it does not walk (what follows is then out of reach, for torch too)."""
    facts, probs, end = walk_pickle(data, limits=limits, persistent_load=persistent_load, start=pos)
    if facts is not None:
        streams.append(facts)
    if probs or facts is None:
        problems.extend(ReadProblem(p.kind, f"in tar member `{name}`: {p.message}") for p in probs)
        return None, -1
    return facts, end


def _walk_records(
    data: bytes, name: str, limits: Limits, problems: list[ReadProblem], streams: list[PickleFacts]
) -> None:
    """The count, then per item a pickle and raw bytes, of ``storages`` or ``tensors`` (then the storage views)."""
    count, pos = _walk(data, 0, limits, problems, name, streams)
    if count is None:
        return
    n = count.value
    if type(n) is not int or not 0 <= n <= _MAX_ITEMS:
        problems.append(read_problem(ProblemKind.MALFORMED, f"tar member `{name}` declares {n!r} items"))
        return
    for _ in range(n):
        args, pos = _walk(data, pos, limits, problems, name, streams)
        if args is None:
            return
        skip = _raw_size(data, pos, name, args.value)
        if skip is None:
            what = repr(args.value)[:100]
            problems.append(read_problem(ProblemKind.MALFORMED, f"tar member `{name}`: unexpected item {what}"))
            return
        pos += skip
        if pos > len(data):
            problems.append(read_problem(ProblemKind.TRUNCATED, f"tar member `{name}` ends inside an item"))
            return
    if name == "storages":
        _walk(data, pos, limits, problems, name, streams)  # the storage views


def _raw_size(data: bytes, pos: int, name: str, args: Any) -> int | None:
    """How many raw bytes follow an item's pickle: a storage's 8-byte element count and its elements, or a
    tensor's ndim (4 bytes, 4 skipped), sizes and strides (8 bytes each per dimension) and offset (8 bytes)."""
    if type(args) is not tuple or len(args) != 3:
        return None
    if name == "storages":
        stype = args[2]
        if type(stype) is not GlobalRef or stype.name not in STORAGE_DTYPES or len(data) < pos + 8:
            return None
        return 8 + int(_U64.unpack_from(data, pos)[0]) * STORAGE_DTYPES[stype.name][1]
    if len(data) < pos + 4:
        return None
    ndim = _I32.unpack_from(data, pos)[0]
    return None if ndim < 0 else 8 + 16 * ndim + 8
