"""Reader for ``torch.distributed.checkpoint`` ``.metadata`` files: a plain pickle, walked statically."""

from __future__ import annotations

from typing import Any, BinaryIO

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import (
    DcpMetadataFacts,
    DcpStorageRef,
    GlobalRef,
    Opaque,
    PickleFacts,
    ProblemKind,
    ReadOutcome,
    ReadProblem,
)
from ckptdoctor.readers.torchzip import read_raw_pickle

__all__ = ["read_dcp_metadata"]

_DCP_MODULE = "torch.distributed.checkpoint.metadata"


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
    outcome = read_raw_pickle(f, size, limits)
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
    if type(data) is dict:
        for index, info in data.items():
            ref = _storage_ref(index, info)
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


def _storage_ref(index: Any, info: Any) -> DcpStorageRef | None:
    idx = _fields(index)
    fqn = idx.get("fqn") if idx is not None else None
    inf = _fields(info)
    if type(fqn) is not str or inf is None:
        return None
    path, offset, length = inf.get("relative_path"), inf.get("offset"), inf.get("length")
    if type(path) is not str or type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        return None
    return DcpStorageRef(fqn=fqn, relative_path=path, offset=offset, length=length)
