"""Torch storages and tensors as the pickle describes them: persistent ids -> storage descriptors, and the
tensors of a walked value checked against their storages. Shared by the zip, legacy and tar readers."""

from __future__ import annotations

from typing import Any

from ckptdoctor.model import GlobalRef, Opaque, ProblemKind, ReadProblem, TensorRef
from ckptdoctor.readers.pickle_values import key_text
from ckptdoctor.readers.pickle_walk import iter_values
from ckptdoctor.readers.seen import Seen
from ckptdoctor.readers.zipdir import read_problem

__all__ = ["STORAGE_DTYPES"]

# torch's legacy storage classes (torch/storage.py ``_dtype_to_storage_type_map``) -> (safetensors code, itemsize).
STORAGE_DTYPES: dict[str, tuple[str, int]] = {
    "DoubleStorage": ("F64", 8),
    "FloatStorage": ("F32", 4),
    "HalfStorage": ("F16", 2),
    "BFloat16Storage": ("BF16", 2),
    "LongStorage": ("I64", 8),
    "IntStorage": ("I32", 4),
    "ShortStorage": ("I16", 2),
    "CharStorage": ("I8", 1),
    "ByteStorage": ("U8", 1),
    "BoolStorage": ("BOOL", 1),
    "ComplexDoubleStorage": ("C128", 16),
    "ComplexFloatStorage": ("C64", 8),
    "QInt8Storage": ("QI8", 1),
    "QInt32Storage": ("QI32", 4),
    "QUInt8Storage": ("QU8", 1),
    "QUInt4x2Storage": ("QU4x2", 1),
    "QUInt2x4Storage": ("QU2x4", 1),
    # dtypes newer than the legacy classes (float8, uint16 ...) are saved as bytes and retyped by
    # _rebuild_tensor_v3's dtype argument.
    "UntypedStorage": ("U8", 1),
}



# ---------------------------------------------------------------------------------------------------------------
# Storages


_STORAGE_REFS: dict[tuple[str, int, str, str, int | None], TensorRef] = {}
_STORAGE_REFS_ENTRIES = 100_000


class Storages:
    """Turns torch's persistent ids into storage descriptors (1-D TensorRefs over the whole storage)."""

    def __init__(self, record_sizes: dict[str, int] | None, legacy: bool) -> None:
        self.record_sizes = record_sizes  # zip: key -> record size; legacy: None (checked after the walk)
        self.legacy = legacy
        self.want = 6 if legacy else 5  # ('storage', class, key, location, numel[, view metadata (legacy)])
        self.cache: dict[str, TensorRef] = {}
        self.declared: dict[str, tuple[int, int]] = {}  # key -> (numel, itemsize)
        self.problems: list[ReadProblem] = []
        self.bad_ids = 0

    def __call__(self, pid: Any) -> Any:
        # Called once per storage (hundreds per optimizer.pt): the common, valid id is checked first and cheaply.
        if type(pid) is tuple and len(pid) == self.want and pid[0] in ("storage", b"storage"):
            stype, key, location, numel = pid[1], pid[2], pid[3], pid[4]
            if (
                type(stype) is GlobalRef
                and type(key) is str
                and type(numel) is int
                and numel >= 0
                and type(location) in (str, bytes)
                and stype.module == "torch"
                and stype.name in STORAGE_DTYPES
            ):
                cached = self.cache.get(key)
                return cached if cached is not None else self._storage(stype.name, key, location, numel)
        elif self.legacy and type(pid) is tuple and len(pid) >= 2 and pid[0] in ("module", b"module"):
            return pid[1]  # an nn.Module class saved with its source: only its name matters here
        self.bad_ids += 1
        if self.bad_ids == 1:
            self.problems.append(read_problem(ProblemKind.MALFORMED_PICKLE, f"unexpected persistent id {_short(pid)}"))
        return Opaque(None, (pid,))

    # A pickle walk resumed from a snapshot of an earlier file (``pickle_resume.Resumable``) carries this state: the
    # answers depend on the record sizes and the kind of file, and what was declared and reported so far.

    def walk_state(self) -> tuple[Any, ...]:
        """What later calls depend on or report, copied."""
        return (self.record_sizes, self.legacy, dict(self.cache), dict(self.declared), list(self.problems),
                self.bad_ids)  # fmt: skip

    def walk_state_fits(self, state: tuple[Any, ...]) -> bool:
        """Whether this object, given ``state``, answers every later call as the one it was taken from."""
        sizes = state[0]
        return state[1] == self.legacy and (sizes is self.record_sizes or sizes == self.record_sizes)

    def walk_restore(self, state: tuple[Any, ...]) -> None:
        """Take ``state``'s declarations and problems (copied: it serves other walks too)."""
        self.cache, self.declared = dict(state[2]), dict(state[3])
        self.problems, self.bad_ids = list(state[4]), state[5]

    def _storage(self, storage_class: str, key: str, location: str | bytes, numel: int) -> TensorRef:
        """The descriptor of a storage met for the first time, checked against its record."""
        dtype, itemsize = STORAGE_DTYPES[storage_class]
        loc = location if isinstance(location, str) else location.decode("ascii", "replace")
        nbytes: int | None = numel * itemsize
        if self.record_sizes is not None:
            nbytes = self.record_sizes.get(key)
            if nbytes is None:
                self.problems.append(read_problem(ProblemKind.MALFORMED, f"missing storage record `data/{key}`"))
            elif nbytes != numel * itemsize:
                self.problems.append(
                    read_problem(
                        ProblemKind.MALFORMED,
                        f"record size {nbytes} of `data/{key}` does not match expected size {numel * itemsize} "
                        f"({numel} x {storage_class})",
                    )
                )
        self.declared[key] = (numel, itemsize)
        # One object per distinct descriptor across files: every checkpoint of a run describes the same storages,
        # and the pickle walk rebuilds a tensor over an identical (same object) storage without recomputing it.
        ident = (dtype, numel, key, loc, nbytes)
        ref = _STORAGE_REFS.get(ident)
        if ref is None:
            if len(_STORAGE_REFS) >= _STORAGE_REFS_ENTRIES:
                _STORAGE_REFS.clear()
            ref = _STORAGE_REFS[ident] = TensorRef(dtype, (numel,), (1,), 0, key, numel, loc, nbytes)
        self.cache[key] = ref
        return ref


def _short(v: Any) -> str:
    text = repr(v) if type(v) in (tuple, str, bytes, int) and len(str(type(v))) < 100 else type(v).__name__
    return text if len(text) <= 120 else text[:117] + "..."


def _reaches_past(t: TensorRef) -> bool:
    """Whether the tensor's view needs elements beyond its storage (torch's ``set_`` refuses that)."""
    shape, stride, offset = t.shape, t.stride, t.storage_offset
    rank = len(shape)
    if rank != len(stride):
        return True
    # Ranks 0-2 (nearly every tensor of a checkpoint) without generators; the general sum below gives the same.
    if rank == 0:
        last = offset
    elif 0 in shape:
        return False
    elif rank == 1:
        last = offset + (shape[0] - 1) * stride[0]
    elif rank == 2:
        last = offset + (shape[0] - 1) * stride[0] + (shape[1] - 1) * stride[1]
    else:
        last = offset + sum((d - 1) * s for d, s in zip(shape, stride, strict=True))
    return last >= t.storage_numel or offset < 0


def storage_tensors(value: Any) -> tuple[tuple[tuple[str, TensorRef], ...], list[ReadProblem]]:
    """Every TensorRef under ``value`` with its dotted path, and problems for the ones past their storage."""
    if type(value) is dict and len(value) <= _TOP_ITEMS:
        found = _by_parts(value)
        if found is not None:
            return found[0], list(found[1])
    return _listed(value, "", None)


def _listed(
    value: Any, path: str, seen: set[int] | None
) -> tuple[tuple[tuple[str, TensorRef], ...], list[ReadProblem]]:
    out = [(p, v) for p, v in iter_values(value, path, seen) if type(v) is TensorRef]
    problems: list[ReadProblem] = []
    for p, v in out:
        if _reaches_past(v):
            problems.append(
                read_problem(
                    ProblemKind.MALFORMED,
                    f"tensor `{p}` (shape {list(v.shape)}, stride {list(v.stride)}, offset "
                    f"{v.storage_offset}) reaches past its storage `{v.storage_key}` of {v.storage_numel} "
                    "elements",
                )
            )
            if len(problems) == _MAX_PROBLEMS:
                break
    return tuple(out), problems


# A checkpoint's pickle is mostly a small dict (an optimizer's ``state`` and ``param_groups``, a trainer's
# ``model``/``optimizer``/...): its items are listed one by one, each listing kept by the item's identity. The pickle
# walk hands out the very objects of the checkpoint before for equal items (``pickle_values.shared``), so a run's
# later checkpoints take the listing of its tensors (and the problems of them) as made: the same pairs.
_TOP_ITEMS = 16
_MAX_PROBLEMS = 10
_Listing = tuple[Any, tuple[tuple[str, TensorRef], ...], tuple[ReadProblem, ...], frozenset[int]]
_PARTS: Seen[tuple[str, int], _Listing] = Seen(256)  # (path, id(item)) -> (item, pairs, problems, containers)


def forget() -> None:
    """Drop the listings kept for a run's later checkpoints: a scan calls it once a run is judged (with
    ``pickle_values.forget``, which drops the items they are keyed by: none of them can be met again)."""
    _PARTS.clear()


def _by_parts(
    value: dict[Any, Any],
) -> tuple[tuple[tuple[str, TensorRef], ...], tuple[ReadProblem, ...]] | None:
    """``storage_tensors`` of the dict ``value`` put together from its items' listings; None when two items that
    hold tensors share a container (the whole walk would enter it once, under the first)."""
    parts: list[_Listing] = []
    for k, x in value.items():
        path = k if type(k) is str else key_text(k)
        t = type(x)
        if t is not dict and t is not list and t is not tuple and t is not Opaque:
            if t is TensorRef:
                return None  # a flat state dict: nothing to share
            continue
        key = (path, id(x))
        part = _PARTS.get(key)
        if part is None or part[0] is not x:
            seen: set[int] = set()
            pairs, problems = _listed(x, path, seen)
            part = (x, pairs, tuple(problems), frozenset(seen))
            _PARTS.put(key, part)
        if part[1]:
            parts.append(part)
    if not parts:
        return (), ()
    if len(parts) == 1:
        return parts[0][1], parts[0][2]
    held: set[int] = set()
    for part in parts:
        if not held.isdisjoint(part[3]):
            return None
        held.update(part[3])
    return (
        tuple(pair for part in parts for pair in part[1]),
        tuple(problem for part in parts for problem in part[2])[:_MAX_PROBLEMS],
    )
