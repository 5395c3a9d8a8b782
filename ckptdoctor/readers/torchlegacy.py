"""The legacy (non-zip) ``torch.save`` format: five pickle streams, then the raw storages."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, BinaryIO

from ckptdoctor.limits import Limits
from ckptdoctor.model import PickleFacts, ProblemKind, ReadOutcome, ReadProblem, TorchFacts
from ckptdoctor.readers.extra_state import StorageReader, extra_state_pickles, has_extra_state
from ckptdoctor.readers.lightning import lightning_facts
from ckptdoctor.readers.pickle_walk import merge_pickles, ran_off_the_end, walk_pickle
from ckptdoctor.readers.rawpickle import walk_problems_kept
from ckptdoctor.readers.torchstore import Storages, storage_tensors
from ckptdoctor.readers.zipdir import listed_names, read_at, read_problem

MAGIC_NUMBER = 0x1950A86A20F9469CFC6C  # torch/serialization.py
LEGACY_PROTOCOL_VERSION = 1001


def read_legacy(f: BinaryIO, size: int, limits: Limits) -> ReadOutcome:
    """Magic number, protocol version, sys_info, the object, the storage keys, then the raw storages."""
    cap = min(size, limits.pickle_bytes)
    chunk = min(cap, 1 << 20)
    while True:
        buf = read_at(f, 0, chunk)
        outcome = _walk_legacy(f, size, buf, limits)
        # The pickles come first and their total length is unknown: read more only when a walk ran off the end.
        if outcome is not None or chunk >= cap:
            break
        chunk = min(cap, chunk * 4)
    if outcome is None:
        outcome = _walk_legacy(f, size, buf, limits, final=True)
    assert outcome is not None
    return outcome


def _walk_legacy(f: BinaryIO, size: int, buf: bytes, limits: Limits, final: bool = False) -> ReadOutcome | None:
    """One attempt on the first ``len(buf)`` bytes; None when the pickles continue past them (and not final).

    ``torch.load`` (``_legacy_load``) unpickles all five streams with the same unpickler, and the first three
    before it checks their values: a call in any of them runs. Every stream walked is therefore judged, whatever
    its value: the object's globals and calls are merged with those of the four others.
    """
    problems: list[ReadProblem] = []
    streams: list[PickleFacts] = []  # the streams other than the object, as far as they were walked
    pos = 0

    def step(persistent_load: Any = None) -> tuple[PickleFacts | None, tuple[ReadProblem, ...]]:
        nonlocal pos
        facts, probs, end = walk_pickle(buf, limits=limits, persistent_load=persistent_load, start=pos)
        pos = end
        return facts, probs

    def ran_off(probs: tuple[ReadProblem, ...]) -> bool:
        # A walk that ran off the end of a partial buffer may just need more bytes; on the full buffer it is final.
        # Any other problem stays with more bytes: a zeroed 1 TiB `.bin` read 870 MB in growing prefixes before.
        return ran_off_the_end(probs) and not final and len(buf) < size

    def failed(more: tuple[ReadProblem, ...]) -> ReadOutcome:
        # Not a loadable file, but whatever the streams read so far import or call still runs at torch.load.
        return ReadOutcome(None, (*problems, *more), merge_pickles(None, _calling(streams)))

    magic, probs = step()
    if magic is not None:
        streams.append(magic)
    if ran_off(probs):
        return None
    if probs or magic is None or magic.value != MAGIC_NUMBER:
        # Bytes that are neither a zip nor a legacy file (a zeroed or overwritten `.bin`): the walk's complaints are
        # about non-pickle bytes, so only the one fact that matters is reported; unless the bytes are a pickle that
        # torch.load's first pickle.load reads past its first opcodes: whatever stopped the walk there is reported.
        own = probs if probs and walk_problems_kept(pos) else ()
        return failed(
            (*own, read_problem(ProblemKind.MALFORMED, "not a torch file: no zip header and no legacy magic number"))
        )
    version, probs = step()
    if version is not None:
        streams.append(version)
    if ran_off(probs):
        return None
    if probs or version is None or version.value != LEGACY_PROTOCOL_VERSION:
        got = version.value if version is not None else None
        return failed((*probs, read_problem(ProblemKind.MALFORMED, f"invalid legacy protocol version {got!r}")))
    sys_info, probs = step()
    if sys_info is not None:
        streams.append(sys_info)
    if ran_off(probs):
        return None
    problems.extend(probs)
    byteorder = "little"
    if sys_info is not None and type(sys_info.value) is dict and sys_info.value.get("little_endian") is False:
        byteorder = "big"
    storages = Storages(None, legacy=True)
    obj, probs = step(storages)
    if ran_off(probs):
        return None
    problems.extend(probs)
    problems.extend(storages.problems)
    if probs:
        merged = merge_pickles(obj, _calling(streams))
        return ReadOutcome(TorchFacts("legacy", "", (), merged, (), byteorder), tuple(problems))
    keys, probs = step()
    if ran_off(probs):
        return None
    problems.extend(probs)
    if keys is not None:
        streams.append(keys)
    missing: set[str] = set()
    starts: dict[str, int] = {}  # storage key -> where its bytes start in the file
    if keys is not None and not probs:
        if type(keys.value) is not list or not all(type(k) is str for k in keys.value):
            problems.append(read_problem(ProblemKind.MALFORMED, "legacy storage key list is not a list of strings"))
        else:
            missing = _check_legacy_storages(f, size, pos, keys.value, storages, byteorder, problems, starts)
    tensors, tensor_problems = storage_tensors(obj.value) if obj is not None else ((), [])
    problems.extend(tensor_problems)
    if missing:
        tensors = tuple((p, replace(t, storage_nbytes=None) if t.storage_key in missing else t) for p, t in tensors)
    if starts and has_extra_state(tensors):
        inner, inner_problems = extra_state_pickles(tensors, _legacy_reader(f, starts, storages), limits)
        streams.extend(inner)
        problems.extend(inner_problems)
    merged = merge_pickles(obj, _calling(streams))
    facts = TorchFacts("legacy", "", (), merged, tensors, byteorder, lightning=lightning_facts(obj))
    return ReadOutcome(facts, tuple(problems))


def _calling(streams: list[PickleFacts]) -> list[PickleFacts]:
    """The streams that import or call anything (a genuine file's magic, version, sys_info and keys do not)."""
    return [s for s in streams if s.globals or s.calls]


def _legacy_reader(f: BinaryIO, starts: dict[str, int], storages: Storages) -> StorageReader:
    """Ranged reads of the raw storages of a legacy file (``starts``: where each storage's bytes begin)."""

    def read(key: str, start: int, n: int) -> bytes | None:
        at, declared = starts.get(key), storages.declared.get(key)
        if at is None or declared is None or start < 0 or start + n > declared[0] * declared[1]:
            return None
        return read_at(f, at + start, n)

    return read


def _check_legacy_storages(
    f: BinaryIO,
    size: int,
    pos: int,
    keys: list[str],
    storages: Storages,
    byteorder: str,
    problems: list[ReadProblem],
    starts: dict[str, int],
) -> set[str]:
    """Seek over each raw storage (8-byte element count + data); returns the keys whose bytes are absent, and
    records where each present storage's bytes start in ``starts``."""
    missing: set[str] = set()
    for key in keys:
        declared = storages.declared.get(key)
        if declared is None:
            problems.append(read_problem(ProblemKind.MALFORMED, f"storage `{key}` is listed but no tensor uses it"))
            missing.update(k for k in keys if k not in storages.declared)
            return missing
        numel, itemsize = declared
        head = read_at(f, pos, 8)
        if len(head) < 8:
            problems.append(
                read_problem(ProblemKind.TRUNCATED, f"storage `{key}` should start at byte {pos}; the file has {size}")
            )
            missing.update(keys[keys.index(key) :])
            return missing
        count = int.from_bytes(head, "little" if byteorder == "little" else "big")
        if count != numel:
            problems.append(
                read_problem(
                    ProblemKind.MALFORMED, f"storage `{key}` holds {count} elements, the pickle declares {numel}"
                )
            )
        end = pos + 8 + numel * itemsize
        starts[key] = pos + 8
        if end > size:
            problems.append(
                read_problem(ProblemKind.TRUNCATED, f"storage `{key}` ends at byte {end}; the file has {size} bytes")
            )
            missing.update(keys[keys.index(key) :])
            return missing
        pos = end
    unlisted = sorted(set(storages.declared) - set(keys))
    if unlisted:
        problems.append(read_problem(ProblemKind.MALFORMED, f"storages used but not stored: {listed_names(unlisted)}"))
        missing.update(unlisted)
    if pos != size:
        problems.append(read_problem(ProblemKind.MALFORMED, f"{size - pos} bytes after the last storage"))
    return missing
