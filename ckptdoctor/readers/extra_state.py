"""Pickles inside tensor bytes: the ``*._extra_state`` tensors TransformerEngine unpickles after a weights-only load.

``torch.nn.Module.load_state_dict`` hands the value stored under ``<module>._extra_state`` (torch/nn/modules/module.py,
``_EXTRA_STATE_KEY_SUFFIX``) to the module's ``set_extra_state``; TransformerEngine's (Megatron-LM and NeMo models,
transformer_engine/pytorch/module/base.py ``TransformerEngineBaseModule.set_extra_state``) runs
``pickle.loads(state.detach().cpu().numpy().tobytes())`` on a tensor. ``weights_only=True`` loads the tensor as
plain data, so the pickle inside runs with no check at all: those bytes are judged here as the pickle they are, in a
``torch.save`` file (zip or legacy), a safetensors file (``safetensors.torch.load_file`` then ``load_state_dict``)
or a DCP `.distcp` item (``dcp.load`` into the module's state dict). Only a record's head is read to know whether it
holds a pickle at all; the rest only when the walk of the head runs past it, within ``Limits.pickle_bytes``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable
from typing import BinaryIO

from ckptdoctor.limits import Limits
from ckptdoctor.model import PickleFacts, ProblemKind, ReadProblem, SafetensorsFacts, TensorRef
from ckptdoctor.readers.pickle_walk import ran_off_the_end, walk_pickle
from ckptdoctor.readers.rawpickle import walk_problems_kept
from ckptdoctor.readers.sniff import HEAD_BYTES
from ckptdoctor.readers.torchstore import STORAGE_DTYPES

__all__ = ["EXTRA_STATE_SUFFIX", "extra_state_pickles", "has_extra_state", "named_extra_state",
           "safetensors_extra_state"]

EXTRA_STATE_SUFFIX = "_extra_state"  # torch/nn/modules/module.py _EXTRA_STATE_KEY_SUFFIX
_ITEMSIZE = dict(STORAGE_DTYPES.values())
_MAX_TENSORS = 4096  # `_extra_state` tensors judged per file: one per TE module (a few per layer)
_MAX_GATHERED = 1 << 20  # elements of a non-contiguous view gathered one by one

_PATH = operator.itemgetter(0)


def has_extra_state(tensors: tuple[tuple[str, TensorRef], ...]) -> bool:
    """Whether a path of ``tensors`` ends with ``EXTRA_STATE_SUFFIX`` (``named_extra_state``)."""
    return named_extra_state(map(_PATH, tensors))


def named_extra_state(names: Iterable[str]) -> bool:
    """Whether a name ends with ``EXTRA_STATE_SUFFIX``: one join and one search in C, where an ``endswith`` call per
    tensor cost a Python call for each of a 7B optimizer's ~870 tensors, in every file. A name holding a newline may
    make it say yes where no name ends so (``extra_state_pickles`` checks each), never no."""
    joined = "\n".join(names)
    return joined.endswith(EXTRA_STATE_SUFFIX) or _SUFFIX_LINE in joined


_SUFFIX_LINE = EXTRA_STATE_SUFFIX + "\n"

# Reads ``n`` bytes of storage ``key`` from byte ``start``; None when the record does not hold them.
StorageReader = Callable[[str, int, int], "bytes | None"]


def extra_state_pickles(
    tensors: tuple[tuple[str, TensorRef], ...], read: StorageReader, limits: Limits
) -> tuple[list[PickleFacts], list[ReadProblem]]:
    """The pickle in each ``*_extra_state`` tensor's bytes (as ``tobytes()`` lays them out: the view's elements in
    C order) and the problems of walking them; a tensor whose bytes are no pickle at all is left alone (``pickle.loads``
    refuses its first byte)."""
    found: list[PickleFacts] = []
    problems: list[ReadProblem] = []
    judged = 0
    for path, t in tensors:
        if not path.endswith(EXTRA_STATE_SUFFIX):
            continue
        where = f"`{path}` (an `_extra_state` tensor TransformerEngine's set_extra_state unpickles)"
        judged += 1
        if judged > _MAX_TENSORS:
            problems.append(ReadProblem(ProblemKind.LIMIT, f"more than {_MAX_TENSORS} `_extra_state` tensors: "
                                        "the rest are not judged"))  # fmt: skip
            break
        data, problem = _view_bytes(t, read, limits)
        if problem is not None:
            problems.append(ReadProblem(ProblemKind.LIMIT, f"{where}: {problem}: not judged"))
            continue
        if not data:
            continue
        facts, walk_problems, end = walk_pickle(data, limits=limits)
        if facts is not None and (not walk_problems or facts.globals or facts.calls):
            found.append(facts)  # bytes that are no pickle (pickle.loads refuses them) import and call nothing
        if walk_problems and ((facts is not None and (facts.globals or facts.calls)) or walk_problems_kept(end)):
            problems.extend(ReadProblem(p.kind, f"in {where}: {p.message}") for p in walk_problems)
    return found, problems


def _view_bytes(t: TensorRef, read: StorageReader, limits: Limits) -> tuple[bytes | None, str | None]:
    """The bytes ``tobytes()`` returns for ``t`` (b"" when its storage does not hold them), or why they were not
    read (past the limits)."""
    itemsize = _ITEMSIZE.get(t.dtype)
    if itemsize is None or len(t.shape) != len(t.stride) or any(d < 0 for d in t.shape) or t.numel == 0:
        return b"", None
    numel = t.numel
    offsets = [0]
    lo = hi = 0  # element offsets the view reaches, relative to its storage offset
    for dim, step in zip(t.shape, t.stride, strict=True):
        if dim > 1:
            reach = (dim - 1) * step
            lo, hi = lo + min(0, reach), hi + max(0, reach)
    dims = enumerate(zip(t.shape, t.stride, strict=True))
    contiguous = all(s == math.prod(t.shape[i + 1 :]) for i, (d, s) in dims if d > 1)
    if contiguous:
        key, start = t.storage_key, t.storage_offset * itemsize
        return _head_first(lambda n: read(key, start, n), numel * itemsize, limits)
    if numel * itemsize > limits.pickle_bytes:
        return None, f"{numel * itemsize} bytes (limit {limits.pickle_bytes})"
    if numel > _MAX_GATHERED or (hi - lo + 1) * itemsize > limits.pickle_bytes:
        return None, f"a strided view of {numel} elements over {hi - lo + 1} (limit {_MAX_GATHERED})"
    first = t.storage_offset + lo
    if first < 0:
        return b"", None
    raw = read(t.storage_key, first * itemsize, (hi - lo + 1) * itemsize)
    if raw is None:
        return b"", None
    for dim, step in zip(t.shape, t.stride, strict=True):  # element offsets in C order, dimension by dimension
        offsets = [o + i * step for o in offsets for i in range(dim)]
    base = -lo
    return b"".join(raw[(base + o) * itemsize : (base + o + 1) * itemsize] for o in offsets), None


def _head_first(read: Callable[[int], bytes | None], n: int, limits: Limits) -> tuple[bytes | None, str | None]:
    """The first bytes of an ``n``-byte record that a pickle loader reads: its head, when the walk of the head ends
    (or fails for good) inside it; else all of it, within ``limits.pickle_bytes`` (past it, why not)."""
    head = read(min(n, HEAD_BYTES))
    if head is None:
        return b"", None
    if len(head) < n:
        _, problems, _ = walk_pickle(head, limits=limits)
        if not ran_off_the_end(problems):
            return head, None  # the stream ends, or stops for good, inside its head: nothing after it is read
        if n > limits.pickle_bytes:
            return None, f"{n} bytes (limit {limits.pickle_bytes})"
        head = read(n)
    return (head or b""), None


def safetensors_extra_state(
    f: BinaryIO, facts: SafetensorsFacts, limits: Limits
) -> tuple[list[PickleFacts], list[ReadProblem]]:
    """``extra_state_pickles`` of the ``*_extra_state`` tensors of a safetensors file (laid end to end from the byte
    after the header, in header order: ``read_safetensors`` refuses holes and overlaps)."""
    starts: dict[str, tuple[int, int]] = {}  # name -> (first byte in the file, bytes)
    refs: list[tuple[str, TensorRef]] = []
    at = 8 + facts.header_bytes
    for t in facts.tensors:
        if t.name.endswith(EXTRA_STATE_SUFFIX):
            starts[t.name] = (at, t.nbytes)
            stride = tuple(math.prod(t.shape[i + 1 :]) for i in range(len(t.shape)))
            refs.append((t.name, TensorRef(t.dtype, t.shape, stride, 0, t.name, t.numel, "cpu", t.nbytes)))
        at += t.nbytes
    if not refs:
        return [], []

    def read(key: str, start: int, n: int) -> bytes | None:
        first, nbytes = starts[key]
        if start < 0 or start + n > nbytes:
            return None
        f.seek(first + start)
        return f.read(n)

    return extra_state_pickles(tuple(refs), read, limits)
