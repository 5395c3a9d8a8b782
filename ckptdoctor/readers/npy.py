"""numpy's `.npy` and `.npz` files, read without numpy: array headers, and the pickles of object arrays.

``np.load(allow_pickle=True)`` (numpy/lib/_npyio_impl.py ``load``; numpy/lib/format.py ``read_array``) reads a
`.npy` as the magic ``\\x93NUMPY``, a version, a header length, a header that is a Python dict literal (``descr``,
``fortran_order``, ``shape``) and the array's bytes; when the dtype holds Python objects those bytes are a pickle,
which it unpickles. A file starting like a zip is an `.npz`, and every member starting with the magic is read the
same way when its key is accessed. The header is parsed with ``ast.literal_eval`` (literals only, as numpy's own
``safe_eval``), never evaluated; the pickle is walked statically.
"""

from __future__ import annotations

import ast
import re
import struct
from typing import Any, BinaryIO

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import NpyArray, NumpyFacts, PickleFacts, ProblemKind, ReadOutcome, ReadProblem
from ckptdoctor.readers.pickle_walk import merge_pickles, walk_pickle
from ckptdoctor.readers.sniff import NPY_MAGIC
from ckptdoctor.readers.zipdir import (
    ZIP_EOCD,
    ZIP_LOCAL,
    member_bytes,
    member_head,
    read_at,
    read_directory,
    read_problem,
)

__all__ = ["read_npy_record", "read_numpy"]

_MAX_HEADER = 1 << 20  # numpy refuses headers past 10,000 bytes unless allow_pickle: bounded here instead
_MAX_RECORDS = 4096  # `.npz` members read per file
_OBJECT = re.compile(r"^[|<>=]?O\d*$")  # the dtype string of Python objects ('|O', 'O', 'O8')


def read_numpy(f: BinaryIO, size: int, limits: Limits = DEFAULT_LIMITS) -> ReadOutcome:
    """Read a `.npy` file or a `.npz` archive (by content, as ``np.load`` decides) into ``NumpyFacts``."""
    head = read_at(f, 0, 4)
    if head in (ZIP_LOCAL, ZIP_EOCD):
        return _read_npz(f, size, limits)
    cap = min(size, limits.pickle_bytes)
    # Enough for the version and header length, then for the whole header (up to _MAX_HEADER, as _header allows).
    first = read_at(f, 0, min(size, 12))
    if len(first) >= 10 and first[6:7] in (b"\x01", b"\x02", b"\x03"):
        wide = first[6] != 1
        n = struct.unpack_from("<I" if wide else "<H", first, 8)[0] if len(first) >= (12 if wide else 10) else 0
        first = read_at(f, 0, min(size, (12 if wide else 10) + min(n, _MAX_HEADER)))
    parsed = _header(first, size)
    if isinstance(parsed, ReadProblem):
        return ReadOutcome(None, (parsed,))
    fields, body = parsed
    array = NpyArray("", *fields)
    if not array.pickled:
        return ReadOutcome(NumpyFacts((array,), None))
    if size > cap:
        return ReadOutcome(
            NumpyFacts((array,), None),
            (read_problem(ProblemKind.LIMIT, f"object array is {size} bytes (limit {limits.pickle_bytes})"),),
        )
    data = read_at(f, body, size - body)
    facts, problems = _walk_body(data, "", limits)
    return ReadOutcome(NumpyFacts((array,), facts), problems)


def read_npy_record(
    data: bytes, name: str, limits: Limits
) -> tuple[NpyArray | None, PickleFacts | None, list[ReadProblem]]:
    """One `.npy` held in memory (an `.npz` member, or a record of any zip): its header, and the pickle of its
    body when the array holds objects."""
    parsed = _header(data, len(data))
    if isinstance(parsed, ReadProblem):
        return None, None, [ReadProblem(parsed.kind, f"in record `{name}`: {parsed.message}")]
    fields, body = parsed
    array = NpyArray(name, *fields)
    if not array.pickled:
        return array, None, []
    facts, problems = _walk_body(data[body:], name, limits)
    return array, facts, list(problems)


def _read_npz(f: BinaryIO, size: int, limits: Limits) -> ReadOutcome:
    d, problems = read_directory(f, size, limits)
    if d is None:
        return ReadOutcome(None, tuple(problems))
    arrays: list[NpyArray] = []
    pickles: list[PickleFacts] = []
    for m in d.members[:_MAX_RECORDS]:
        if member_head(f, m, len(NPY_MAGIC)) != NPY_MAGIC:
            continue  # NpzFile returns such a member's bytes as they are
        data, p = member_bytes(f, m, d.cd_offset, limits.pickle_bytes)
        if data is None:
            if p is not None:
                problems.append(p)
            continue
        array, facts, probs = read_npy_record(data, m.name, limits)
        problems.extend(probs)
        if array is not None:
            arrays.append(array)
        if facts is not None:
            pickles.append(facts)
    if len(d.members) > _MAX_RECORDS:
        problems.append(read_problem(ProblemKind.LIMIT, f"more than {_MAX_RECORDS} records; the rest were not read"))
    merged = merge_pickles(pickles[0], pickles[1:]) if pickles else None
    return ReadOutcome(NumpyFacts(tuple(arrays), merged), tuple(problems))


def _walk_body(data: bytes, name: str, limits: Limits) -> tuple[PickleFacts | None, tuple[ReadProblem, ...]]:
    facts, problems, _ = walk_pickle(data, limits=limits)
    where = f"in record `{name}`: " if name else "in the object array's pickle: "
    return facts, tuple(ReadProblem(p.kind, where + p.message) for p in problems)


_Header = tuple[tuple[int, int], str, bool, tuple[int, ...], bool]


def _header(data: bytes, size: int) -> tuple[_Header, int] | ReadProblem:
    """((version, descr, fortran_order, shape, pickled), where the body starts), or the problem numpy would raise."""
    if data[:6] != NPY_MAGIC or len(data) < 10:
        return read_problem(ProblemKind.MALFORMED, "not a .npy file: no \\x93NUMPY magic")
    major, minor = data[6], data[7]
    if major == 1:
        (n,) = struct.unpack_from("<H", data, 8)
        start = 10
    elif major in (2, 3) and len(data) >= 12:
        (n,) = struct.unpack_from("<I", data, 8)
        start = 12
    else:
        return read_problem(ProblemKind.MALFORMED, f".npy format version {major}.{minor} is not one numpy reads")
    if n > _MAX_HEADER:
        return read_problem(ProblemKind.LIMIT, f".npy header is {n} bytes (limit {_MAX_HEADER})")
    if start + n > min(len(data), size):
        return read_problem(ProblemKind.TRUNCATED, f".npy header of {n} bytes runs past the end of the data")
    raw = data[start : start + n]
    try:
        text = raw.decode("utf-8" if major == 3 else "latin-1")
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError, UnicodeDecodeError) as exc:
        return read_problem(ProblemKind.MALFORMED, f".npy header is not a Python literal: {type(exc).__name__}")
    if type(value) is not dict or set(value) != {"descr", "fortran_order", "shape"}:
        return read_problem(ProblemKind.MALFORMED, ".npy header is not a dict of descr, fortran_order and shape")
    descr, fortran, shape = value["descr"], value["fortran_order"], value["shape"]
    if type(shape) is not tuple or not all(type(x) is int for x in shape) or type(fortran) is not bool:
        return read_problem(ProblemKind.MALFORMED, ".npy header has a malformed shape or fortran_order")
    return ((major, minor), _descr_text(descr), fortran, shape, _holds_objects(descr)), start + n


def _descr_text(descr: Any) -> str:
    text = descr if type(descr) is str else repr(descr)
    return text if len(text) <= 200 else text[:197] + "..."


def _holds_objects(descr: Any, depth: int = 0) -> bool:
    """Whether numpy's dtype for ``descr`` has ``hasobject``: an object type anywhere in it. A ``descr`` of a shape
    this does not know counts as holding objects (the body is then judged rather than trusted)."""
    if depth > 32:
        return True
    if type(descr) is str:
        return bool(_OBJECT.match(descr))
    if type(descr) is list:  # structured: [(name, type[, shape]), ...]
        for field in descr:
            if type(field) is not tuple or len(field) not in (2, 3):
                return True
            if _holds_objects(field[1], depth + 1):
                return True
        return False
    return True
