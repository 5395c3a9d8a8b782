"""Check an HDF5 file's structure without h5py: the superblock signature, its version and the end-of-file address.

The superblock (HDF5 File Format Specification 3.0, section II.A) starts with ``\\x89HDF\\r\\n\\x1a\\n`` at byte 0, or
after a user block at 512, 1024, 2048, ... Versions 0 and 1 hold the sizes of offsets and lengths at bytes 13-14
and, after 8 bytes of B-tree parameters and flags (12 in version 1), the base, free-space, end-of-file and driver
addresses; versions 2 and 3 hold the sizes at 9-10, a flags byte, then the base, extension, end-of-file and root
addresses. The end-of-file address is relative to the base address. The HDF5 library refuses a file shorter than
base + end-of-file ("truncated file"), which is what a cut ``tf_model.h5`` is.

With h5py installed (the ``h5`` extra) and a sound superblock, the file is also opened read-only through h5py, from
the same open file object, and every group is walked: each dataset's name, dtype, shape and storage layout is
listed from its object header (no data is read), and the storage of contiguous and chunked datasets is checked to
lie within the file. An object h5py cannot open (a damaged object header, a group whose links cannot be listed) or
storage past the end is a problem of the file: Keras (``keras/src/saving/saving_lib.py``, ``H5IOStore``) and
transformers (``modeling_tf_utils.py``, ``load_tf_weights_from_h5``) read every dataset, so they would fail on it.
h5py is imported here only, on the first ``.h5`` file read.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from types import ModuleType
from typing import Any, BinaryIO

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import Hdf5Dataset, Hdf5Facts, ProblemKind, ReadOutcome, ReadProblem

SIGNATURE = b"\x89HDF\r\n\x1a\n"
_SIZES = (2, 4, 8, 16, 32)  # sizes of offsets and lengths the format allows


def read_hdf5(f: BinaryIO, size: int, limits: Limits = DEFAULT_LIMITS) -> ReadOutcome:
    """Find and check the superblock of the HDF5 file of ``size`` bytes open as ``f``; never raises.

    Problems: EMPTY, TRUNCATED (no room for the superblock, or the end-of-file address past the file's end),
    MALFORMED (no signature, unknown superblock version, impossible sizes of offsets or lengths), UNREADABLE.
    """
    try:
        outcome = _read(f, size)
    except OSError as e:
        return _failed(ProblemKind.UNREADABLE, f"cannot read the file: {e.strerror or e}")
    if outcome.problems or not isinstance(outcome.content, Hdf5Facts):
        return outcome  # a damaged superblock: h5py would refuse the file for the same reason
    h5py = h5py_module()
    if h5py is None:
        return outcome
    facts = outcome.content
    source = _Source(f)
    datasets, problems = _list_datasets(h5py, source, min(size, facts.base_address + facts.eof_address), limits)
    if source.error is not None:  # the disk failed under h5py: not the file's fault
        return _failed(ProblemKind.UNREADABLE, f"cannot read the file: {source.error.strerror or source.error}")
    return ReadOutcome(dataclasses.replace(facts, datasets=datasets), problems)


def _failed(kind: ProblemKind, message: str) -> ReadOutcome:
    return ReadOutcome(None, (ReadProblem(kind, message),))


def superblock_offsets(size: int) -> list[int]:
    """Where the library looks for the signature in a file of ``size`` bytes: 0, then 512 doubling."""
    out = [0]
    at = 512
    while at + len(SIGNATURE) <= size:
        out.append(at)
        at *= 2
    return out


def _read(f: BinaryIO, size: int) -> ReadOutcome:
    if size == 0:
        return _failed(ProblemKind.EMPTY, "file is empty (0 bytes); an HDF5 file starts with its superblock")
    base_at = None
    for at in superblock_offsets(size):
        f.seek(at)
        if f.read(len(SIGNATURE)) == SIGNATURE:
            base_at = at
            break
    if base_at is None:
        if size < len(SIGNATURE):
            return _failed(ProblemKind.TRUNCATED, f"file has {size} bytes, fewer than the 8-byte HDF5 signature")
        return _failed(ProblemKind.MALFORMED, "no HDF5 superblock signature at byte 0, 512, 1024, 2048, ...: "
                       "not an HDF5 file")
    f.seek(base_at)
    head = f.read(min(size - base_at, 128))
    if len(head) < 9:
        return _failed(ProblemKind.TRUNCATED, f"the file ends {len(head)} bytes into the superblock")
    version = head[8]
    if version in (0, 1):
        sizes_at, addresses_at, eof_index = 13, 24 if version == 0 else 28, 2
    elif version in (2, 3):
        sizes_at, addresses_at, eof_index = 9, 12, 2
    else:
        return _failed(ProblemKind.MALFORMED, f"superblock version {version} is unknown (HDF5 writes 0 to 3)")
    if len(head) < sizes_at + 2:
        return _failed(ProblemKind.TRUNCATED, f"the file ends {len(head)} bytes into the version {version} superblock")
    offset_size, length_size = head[sizes_at], head[sizes_at + 1]
    if offset_size not in _SIZES or length_size not in _SIZES:
        return _failed(ProblemKind.MALFORMED, f"superblock gives offsets of {offset_size} and lengths of "
                       f"{length_size} bytes (HDF5 allows {', '.join(map(str, _SIZES))})")
    need = addresses_at + (eof_index + 1) * offset_size
    if len(head) < need:
        return _failed(ProblemKind.TRUNCATED, f"the file ends {len(head)} bytes into the version {version} superblock "
                       f"(its addresses need {need})")

    def address(i: int) -> int:
        start = addresses_at + i * offset_size
        return int.from_bytes(head[start : start + offset_size], "little")

    base, eof = address(0), address(eof_index)
    facts = Hdf5Facts(base_at, version, offset_size, length_size, base, eof)
    undefined = (1 << (8 * offset_size)) - 1
    if eof == undefined:
        return ReadOutcome(facts, (ReadProblem(ProblemKind.MALFORMED, "the end-of-file address is undefined"),))
    if base + eof > size:
        return ReadOutcome(facts, (ReadProblem(ProblemKind.TRUNCATED, f"the superblock says the file ends at byte "
                           f"{base + eof:,} but it has {size:,} ({base + eof - size:,} missing): the file is "
                           "truncated"),))
    return ReadOutcome(facts)


def h5py_module() -> ModuleType | None:
    """h5py, imported on first use, or None when it is not installed (or fails to import)."""
    try:
        return importlib.import_module("h5py")
    except Exception:  # ImportError, or a broken install (a missing libhdf5): read the superblock only
        return None


_LAYOUTS = {0: "compact", 1: "contiguous", 2: "chunked", 3: "virtual"}  # H5D_COMPACT ... H5D_VIRTUAL


def _short(e: Exception) -> str:
    """An h5py error's message without HDF5's error-stack details: what a user would see from Keras."""
    text = str(e) or type(e).__name__
    return text if len(text) <= 200 else text[:200] + "..."


class _Walk:
    """One walk of an open ``h5py.File``: the datasets found and the problems met, within ``limits``."""

    def __init__(self, h5py: ModuleType, end: int, limits: Limits) -> None:
        self.h5py = h5py
        self.end = end  # HDF5 reads no byte past min(file size, base + end-of-file address)
        self.limits = limits
        self.datasets: list[Hdf5Dataset] = []
        self.problems: list[ReadProblem] = []
        self.seen: set[int] = set()  # object header addresses: a hard link to a group visited once
        self.objects = 0

    def problem(self, kind: ProblemKind, message: str) -> None:
        self.problems.append(ReadProblem(kind, message))

    def group(self, group: Any, path: str, depth: int) -> None:
        h5py = self.h5py
        try:
            names = list(group)
        except Exception as e:
            self.problem(ProblemKind.MALFORMED, f"group `{path or '/'}` cannot be listed by h5py: {_short(e)}")
            return
        for name in names:
            if self.objects >= self.limits.hdf5_objects:
                if self.objects == self.limits.hdf5_objects:  # said once, by the first group to meet it
                    self.objects += 1
                    self.problem(ProblemKind.LIMIT, f"more than {self.limits.hdf5_objects:,} objects: "
                                 "the rest were not listed")
                return
            self.objects += 1
            child = f"{path}/{name}" if path else name
            try:
                link = group.get(name, getlink=True)
                if not isinstance(link, h5py.HardLink):
                    continue  # a soft or external link names another object; it holds no data of its own
                obj = group[name]
                addr = h5py.h5o.get_info(obj.id).addr
            except Exception as e:
                self.problem(ProblemKind.MALFORMED, f"object `{child}` cannot be opened by h5py (its object "
                             f"header is damaged or missing): {_short(e)}")
                continue
            if addr in self.seen:
                continue
            self.seen.add(addr)
            if isinstance(obj, h5py.Group):
                if depth >= self.limits.nesting_depth:
                    self.problem(ProblemKind.LIMIT, f"groups nested deeper than "
                                 f"{self.limits.nesting_depth} at `{child}`")
                    continue
                self.group(obj, child, depth + 1)
            elif isinstance(obj, h5py.Dataset):
                try:
                    self.dataset(obj, child)
                except Exception as e:
                    self.problem(ProblemKind.MALFORMED, f"dataset `{child}` cannot be described by h5py: {_short(e)}")

    def dataset(self, ds: Any, name: str) -> None:
        dcpl = ds.id.get_create_plist()
        layout = _LAYOUTS.get(dcpl.get_layout(), f"layout {dcpl.get_layout()}")
        shape = tuple(int(n) for n in ds.shape) if ds.shape is not None else ()
        dtype = str(ds.dtype)
        stored = int(ds.id.get_storage_size())
        offset = None
        what = f"dataset `{name}` ({dtype} {'x'.join(map(str, shape)) or 'scalar'})"
        if dcpl.get_external_count() > 0:
            pass  # its bytes live in other files (never written by Keras or transformers)
        elif layout == "contiguous":
            offset = ds.id.get_offset()
            need = math.prod(shape) * ds.dtype.itemsize
            if offset is not None and offset + stored > self.end:
                self.problem(ProblemKind.TRUNCATED, f"{what} stores its {stored:,} bytes at {offset:,}..."
                             f"{offset + stored:,} but the file ends at byte {self.end:,}")
            elif offset is not None and stored < need:
                self.problem(ProblemKind.MALFORMED, f"{what} has {stored:,} bytes of storage but its dtype and "
                             f"shape need {need:,}")
        elif layout == "chunked":
            self.chunks(ds, what)
        self.datasets.append(Hdf5Dataset(name, dtype, shape, layout, stored, offset))

    def chunks(self, ds: Any, what: str) -> None:
        count = ds.id.get_num_chunks()
        if count > self.limits.hdf5_chunks:
            self.problem(ProblemKind.LIMIT, f"{what} has {count:,} chunks, more than "
                         f"{self.limits.hdf5_chunks:,}: they were not checked")
            return
        for i in range(count):
            info = ds.id.get_chunk_info(i)
            if info.byte_offset is not None and info.byte_offset + info.size > self.end:
                self.problem(ProblemKind.TRUNCATED, f"{what}: chunk {i} at {info.byte_offset:,}..."
                             f"{info.byte_offset + info.size:,} lies past the file's end at byte {self.end:,}")
                return


class _Source:
    """The open file as h5py's file-object driver reads it (``read``, ``readinto``, ``seek``, ``tell``).

    h5py reports every failure, a damaged file's and the disk's alike, as ``OSError``; this wrapper keeps the
    disk's own error so that it stays UNREADABLE instead of becoming a damaged file.
    """

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.error: OSError | None = None

    def _guard(self, e: OSError) -> OSError:
        self.error = self.error or e
        return e

    def read(self, n: int = -1) -> bytes:
        try:
            return self.f.read(n)
        except OSError as e:
            raise self._guard(e) from None

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = 0) -> int:
        try:
            return self.f.seek(offset, whence)
        except OSError as e:
            raise self._guard(e) from None

    def tell(self) -> int:
        return self.f.tell()


def _list_datasets(
    h5py: ModuleType, f: _Source, end: int, limits: Limits
) -> tuple[tuple[Hdf5Dataset, ...], tuple[ReadProblem, ...]]:
    """Open ``f`` read-only through h5py and list its datasets; h5py's own errors become problems."""
    walk = _Walk(h5py, end, limits)
    try:
        f.seek(0)
        h5 = h5py.File(f, "r")
    except Exception as e:
        return (), (ReadProblem(ProblemKind.MALFORMED, f"h5py cannot open the file: {_short(e)}"),)
    try:
        walk.group(h5, "", 0)
    except Exception as e:  # h5py failing outside a single object: the walk so far stands
        walk.problem(ProblemKind.MALFORMED, f"h5py stopped reading the file: {_short(e)}")
    finally:
        try:
            h5.close()
        except Exception as e:
            walk.problem(ProblemKind.MALFORMED, f"h5py cannot close the file: {_short(e)}")
    return tuple(walk.datasets), tuple(walk.problems)
