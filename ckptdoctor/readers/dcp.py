"""Readers for ``torch.distributed.checkpoint`` files (``.metadata`` pickles, ``.distcp`` data), walked statically."""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, BinaryIO

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import (
    DcpItem,
    DcpMetadataFacts,
    DcpStorageRef,
    GlobalRef,
    Opaque,
    PickleFacts,
    ProblemKind,
    ReadOutcome,
    ReadProblem,
    TorchFacts,
)
from ckptdoctor.readers.pickle_walk import merge_pickles
from ckptdoctor.readers.rawpickle import read_raw_pickle
from ckptdoctor.readers.torchzip import read_zip_at

__all__ = ["read_dcp_data", "read_dcp_items", "read_dcp_metadata"]

_DCP_MODULE = "torch.distributed.checkpoint.metadata"
_SCALAR_TEXT = 256  # the longest string item kept as a value
_LISTED = 20  # problems listed word for word per file; past it, one more of each kind and a count


class _ProblemLog:
    """The problems of a file's blobs, bounded in size but never silent about a kind.

    A file of thousands of items could hold thousands of problems; the report lists the first ``_LISTED``, then
    still the first of every kind not yet listed (a limit reached in the 500th blob must stay a finding), and
    counts the rest per kind.
    """

    def __init__(self) -> None:
        self.problems: list[ReadProblem] = []
        self._kinds: set[ProblemKind] = set()
        self._unlisted: dict[ProblemKind, int] = {}

    def add(self, where: str, found: Sequence[ReadProblem]) -> None:
        for p in found:
            if len(self.problems) < _LISTED or p.kind not in self._kinds:
                self.problems.append(ReadProblem(p.kind, f"{where}: {p.message}"))
                self._kinds.add(p.kind)
            else:
                self._unlisted[p.kind] = self._unlisted.get(p.kind, 0) + 1

    def close(self) -> list[ReadProblem]:
        """The listed problems, then one line per kind saying how many more of it were not listed."""
        more = [ReadProblem(k, f"{n} more problem(s) of this kind not listed") for k, n in self._unlisted.items()]
        return self.problems + more


def _fields(v: Any) -> dict[str, Any] | None:
    """The attributes an Opaque dataclass instance would get from its BUILD state, in any of pickle's shapes."""
    if type(v) is not Opaque:
        return None
    state = v.state
    if type(state) is dict:
        return state
    if type(state) is tuple:
        # (dict_state, slot_state) for classes with __slots__; a tuple of pairs when the walk had to make a dict
        # key hashable (MetadataIndex is a storage_data key).
        if len(state) == 2 and (state[0] is None or type(state[0]) is dict) and type(state[1]) is dict:
            return {**(state[0] or {}), **state[1]}
        if all(type(p) is tuple and len(p) == 2 and type(p[0]) is str for p in state):
            return dict(state)
    return None


def _is_class(v: Any, module: str, name: str) -> bool:
    return type(v) is Opaque and v.func == GlobalRef(module, name)


def read_dcp_metadata(f: BinaryIO, size: int, limits: Limits = DEFAULT_LIMITS) -> ReadOutcome:
    """Walk a DCP ``.metadata`` pickle: the fqns it describes and the (file, offset, length) of every item."""
    outcome = read_raw_pickle(f, size, limits, joblib=False)  # torch.distributed.checkpoint reads it with pickle.load
    facts = outcome.content
    if not isinstance(facts, PickleFacts):
        return outcome
    problems = list(outcome.problems)
    root = facts.value
    fields = _fields(root)
    if not _is_class(root, _DCP_MODULE, "Metadata") or fields is None:
        if not problems:
            problems.append(
                ReadProblem(ProblemKind.MALFORMED, "pickle does not hold a torch.distributed.checkpoint `Metadata`")
            )
        return ReadOutcome(DcpMetadataFacts(facts, (), ()), tuple(problems))
    sdm = fields.get("state_dict_metadata")
    keys: tuple[str, ...] = ()
    if type(sdm) is dict:
        keys = tuple(k for k in sdm if type(k) is str)
    else:
        problems.append(ReadProblem(ProblemKind.MALFORMED, "`Metadata.state_dict_metadata` is not a dict"))
    storage: list[DcpStorageRef] = []
    bad = 0
    data = fields.get("storage_data")
    byte_items = (
        {k for k, v in sdm.items() if _is_class(v, _DCP_MODULE, "BytesStorageMetadata")} if type(sdm) is dict else set()
    )
    if type(data) is dict:
        for index, info in data.items():
            ref = _storage_ref(index, info, byte_items)
            if ref is None:
                bad += 1
            else:
                storage.append(ref)
    elif data is not None:
        problems.append(ReadProblem(ProblemKind.MALFORMED, "`Metadata.storage_data` is not a dict"))
    if bad:
        problems.append(
            ReadProblem(ProblemKind.MALFORMED, f"{bad} `storage_data` entries are not MetadataIndex -> _StorageInfo")
        )
    return ReadOutcome(DcpMetadataFacts(facts, keys, tuple(storage)), tuple(problems))


def _storage_ref(index: Any, info: Any, byte_items: set[Any]) -> DcpStorageRef | None:
    idx = _fields(index)
    fqn = idx.get("fqn") if idx is not None else None
    inf = _fields(info)
    if type(fqn) is not str or inf is None:
        return None
    path, offset, length = inf.get("relative_path"), inf.get("offset"), inf.get("length")
    if type(path) is not str or type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        return None
    return DcpStorageRef(fqn=fqn, relative_path=path, offset=offset, length=length, is_bytes=fqn in byte_items)


# ---------------------------------------------------------------------------------------------------------------
# `.distcp` data files: a run of complete torch.save zip blobs, one per item (filesystem.py ``_write_item``).

_EOCD_SIG = b"PK\x05\x06"
_CENTRAL_SIG = b"PK\x01\x02"
_ZIP64_LOCATOR_SIG = b"PK\x06\x07"
_CHUNK = 8 << 20


def read_dcp_items(
    f: BinaryIO, size: int, items: Sequence[DcpItem | tuple[int, int]], limits: Limits = DEFAULT_LIMITS
) -> ReadOutcome:
    """Walk the pickles of the torch.save blobs at ``items`` (from `.metadata`).

    This is how a scan reads a `.distcp` file: only the blobs torch would unpickle without restriction (BYTE_IO
    items; tensor items are loaded with weights_only=True), and the `_extra_state` tensors whose bytes
    TransformerEngine's set_extra_state unpickles after ``dcp.load`` (``extra_state.py``), located by the metadata,
    so the cost is the size of those blobs' directories and pickles, not of the file. Ranges past the end of the
    file are CKD501's business. The content's ``value`` maps the offset of each item that holds a number or a short
    string to it (a torchtitan save's ``train_state.step``, ``dataloader.world_size``), as ``dcp.load`` would return
    it; None when none does.
    """
    found: list[PickleFacts] = []
    scalars: dict[int, int | float | str] = {}
    log = _ProblemLog()
    problems = log.problems
    try:
        for n, item in enumerate(sorted(set(map(_item, items)))):
            start, length, fqn = item
            if n >= limits.zip_entries:
                problems.append(ReadProblem(ProblemKind.LIMIT, f"more than {limits.zip_entries} items"))
                break
            if start < 0 or length <= 0 or start + length > size:
                continue
            outcome = read_zip_at(f, start, length, limits, root=fqn)
            if isinstance(outcome.content, TorchFacts) and outcome.content.pickle is not None:
                found.append(outcome.content.pickle)
                value = outcome.content.pickle.value
                if type(value) in (int, float) or (type(value) is str and len(value) <= _SCALAR_TEXT):
                    scalars[start] = value
            log.add(f"item at byte {start}", outcome.problems)
    except OSError as exc:
        return ReadOutcome(None, (ReadProblem(ProblemKind.UNREADABLE, f"I/O error: {exc}"),))
    merged = merge_pickles(None, found)
    if merged is not None and scalars:
        merged = replace(merged, value=scalars)
    return ReadOutcome(merged, tuple(log.close()))


def _item(item: DcpItem | tuple[int, int]) -> DcpItem:
    return item if type(item) is DcpItem else DcpItem(*item)


def read_dcp_data(f: BinaryIO, size: int, limits: Limits = DEFAULT_LIMITS) -> ReadOutcome:
    """Walk the pickle of every torch.save blob inside a ``.distcp`` file; content is their merged ``PickleFacts``.

    ``torch.distributed.checkpoint`` loads non-tensor items with ``torch.load(weights_only=False)``, so each blob's
    ``data.pkl`` is a way in. Blobs are found from their end records (torch writes local headers with data
    descriptors, so the blob's length is only known at its end), scanning at most ``limits.dcp_data_bytes``.
    """
    if size == 0:
        return ReadOutcome(None, (ReadProblem(ProblemKind.EMPTY, "file is empty"),))
    log = _ProblemLog()
    problems = log.problems
    found: list[PickleFacts] = []
    blobs = 0
    start = 0  # where the next blob should begin: blobs are written back to back
    try:
        for end in _blob_ends(f, min(size, limits.dcp_data_bytes)):
            if end <= start:
                continue  # an end record inside the previous blob's comment: not a blob of its own
            blobs += 1
            if blobs > limits.zip_entries:
                problems.append(ReadProblem(ProblemKind.LIMIT, f"more than {limits.zip_entries} blobs"))
                break
            outcome = read_zip_at(f, start, end - start, limits)
            content = outcome.content
            if isinstance(content, TorchFacts) and content.pickle is not None:
                found.append(content.pickle)
            log.add(f"blob at byte {start}", outcome.problems)
            start = end
    except OSError as exc:
        return ReadOutcome(None, (ReadProblem(ProblemKind.UNREADABLE, f"I/O error: {exc}"),))
    if size > limits.dcp_data_bytes:
        problems.append(
            ReadProblem(ProblemKind.LIMIT, f"only the first {limits.dcp_data_bytes} of {size} bytes were searched")
        )
    elif start < size:
        problems.append(
            ReadProblem(
                ProblemKind.SUSPICIOUS_ARCHIVE if blobs else ProblemKind.MALFORMED,
                f"{size - start} bytes after the last torch.save blob" if blobs else "no torch.save blob found",
            )
        )
    return ReadOutcome(merge_pickles(None, found), tuple(log.close()))


def _blob_ends(f: BinaryIO, size: int) -> Iterator[int]:
    """End offsets of the zip archives in ``f``, in order; a signature inside tensor bytes is checked and skipped."""
    pos = 0
    carry = b""
    while pos < size:
        data_at = _next_data(f, pos)
        if data_at is None or data_at >= size:
            return  # only a hole is left: holes read as zeros and hold no end record
        if data_at > pos:
            carry = b""  # a hole in between: no signature spans it
            pos = data_at
        f.seek(pos)
        chunk = f.read(min(_CHUNK, size - pos))
        if not chunk:
            return
        buf = carry + chunk
        base = pos - len(carry)
        at = buf.find(_EOCD_SIG)
        while at >= 0:
            end = _valid_end(f, base + at, size)
            if end is not None:
                yield end
            at = buf.find(_EOCD_SIG, at + 1)
        carry = buf[-3:]
        pos += len(chunk)


def _next_data(f: BinaryIO, pos: int) -> int | None:
    """Where data resumes at or after ``pos`` (SEEK_DATA skips the holes of sparse files); ``pos`` if unknown."""
    seek_data = getattr(os, "SEEK_DATA", None)
    try:
        fd = f.fileno()
    except (OSError, AttributeError, ValueError):
        return pos
    if seek_data is None:
        return pos
    try:
        # Put the descriptor's offset back afterwards: the buffered reader above it keeps its own idea of it.
        cur = os.lseek(fd, 0, os.SEEK_CUR)
    except OSError:
        return pos
    try:
        return os.lseek(fd, pos, seek_data)
    except OSError as exc:
        return None if exc.errno == errno.ENXIO else pos  # ENXIO: no data after pos
    finally:
        os.lseek(fd, cur, os.SEEK_SET)


def _valid_end(f: BinaryIO, eocd: int, size: int) -> int | None:
    """The archive end for an end record at ``eocd`` whose central directory really precedes it, else None."""
    f.seek(eocd)
    rec = f.read(22)
    if len(rec) != 22:
        return None
    count, cd_size, cd_offset, comment = struct.unpack_from("<HLLH", rec, 10)
    end = eocd + 22 + comment
    if end > size:
        return None
    cd_end = eocd
    loc = b""
    if eocd >= 20:
        f.seek(eocd - 20)
        loc = f.read(20)
    # torch writes the zip64 end record and locator even for small archives; others only when a field overflows.
    if loc[:4] == _ZIP64_LOCATOR_SIG or count == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
        if loc[:4] != _ZIP64_LOCATOR_SIG:
            return None
        # The zip64 end record is 56 bytes just before the locator; its size field follows the signature.
        cd_end = eocd - 20 - 56
        if cd_end < 0:
            return None
        f.seek(cd_end)
        rec64 = f.read(56)
        if len(rec64) != 56:
            return None
        cd_size = struct.unpack_from("<Q", rec64, 40)[0]
    if cd_size > cd_end:
        return None
    f.seek(cd_end - cd_size)
    return end if f.read(4) == _CENTRAL_SIG or cd_size == 0 else None
