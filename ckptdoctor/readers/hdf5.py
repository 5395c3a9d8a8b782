"""Check an HDF5 file's structure without h5py: the superblock signature, its version and the end-of-file address.

The superblock (HDF5 File Format Specification 3.0, section II.A) starts with ``\\x89HDF\\r\\n\\x1a\\n`` at byte 0, or
after a user block at 512, 1024, 2048, ... Versions 0 and 1 hold the sizes of offsets and lengths at bytes 13-14
and, after 8 bytes of B-tree parameters and flags (12 in version 1), the base, free-space, end-of-file and driver
addresses; versions 2 and 3 hold the sizes at 9-10, a flags byte, then the base, extension, end-of-file and root
addresses. The end-of-file address is relative to the base address. The HDF5 library refuses a file shorter than
base + end-of-file ("truncated file"), which is what a cut ``tf_model.h5`` is.
"""

from __future__ import annotations

from typing import BinaryIO

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import Hdf5Facts, ProblemKind, ReadOutcome, ReadProblem

SIGNATURE = b"\x89HDF\r\n\x1a\n"
_SIZES = (2, 4, 8, 16, 32)  # sizes of offsets and lengths the format allows


def read_hdf5(f: BinaryIO, size: int, limits: Limits = DEFAULT_LIMITS) -> ReadOutcome:
    """Find and check the superblock of the HDF5 file of ``size`` bytes open as ``f``; never raises.

    Problems: EMPTY, TRUNCATED (no room for the superblock, or the end-of-file address past the file's end),
    MALFORMED (no signature, unknown superblock version, impossible sizes of offsets or lengths), UNREADABLE.
    """
    try:
        return _read(f, size)
    except OSError as e:
        return _failed(ProblemKind.UNREADABLE, f"cannot read the file: {e.strerror or e}")


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
