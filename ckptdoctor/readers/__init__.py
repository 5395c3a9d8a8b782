"""Reader dispatch: open a file once, sniff its kind and hand it to the reader for that format."""

from __future__ import annotations

import dataclasses
import io
import os
import stat
from collections.abc import Callable
from typing import BinaryIO

from ckptdoctor.hashing import blake2b
from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import DcpItem, FileFacts, FileKind, PickleFacts, ProblemKind, ReadOutcome, ReadProblem

Reader = Callable[[BinaryIO, int, Limits], ReadOutcome]

# The UNREADABLE message of a file the walk listed that is gone when it is opened: a save or the Trainer's rotation
# (save_total_limit) at work, not a corrupt file. Discovery moves such files out of the checkpoint it reports.
VANISHED = "vanished during the scan: a save or rotation may be in progress"

# O_NONBLOCK: a FIFO swapped in after the stat cannot block the scan. O_NOFOLLOW: discovery resolves links
# itself and passes real paths, so a link appearing here was planted after the walk.
_OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
    | getattr(os, "O_BINARY", 0)
)


def read_file(
    abs_path: str,
    rel_path: str,
    st: os.stat_result,
    limits: Limits = DEFAULT_LIMITS,
    in_dcp_dir: bool = False,
    frameworks: bool = False,
) -> FileFacts:
    """Read one file into ``FileFacts``: never raises, never opens FIFOs, sockets or devices.

    ``abs_path`` is what to open (for a followed link: its resolved target), ``rel_path`` the root-relative
    path to report and ``st`` its stat (links already followed). ``in_dcp_dir`` tells the sniffer the file sits
    in a ``torch.distributed.checkpoint`` folder; ``frameworks`` lets it recognise MindSpore, TensorFlow and HDF5
    files (off until discovery and the rules know those kinds). OS errors become ``UNREADABLE`` problems and any
    unexpected exception in a reader a ``MALFORMED`` problem naming the bug, so one bad file never stops a scan.
    """
    base = FileFacts(path=rel_path, size=st.st_size, mtime=st.st_mtime, kind=FileKind.OTHER)
    special = _special_problem(st.st_mode)
    if special is not None:
        return _with(base, special[0], special[1])
    try:
        fd = os.open(abs_path, _OPEN_FLAGS)
    except FileNotFoundError:  # stat'ed a moment ago
        return _with(base, FileKind.OTHER, ReadProblem(ProblemKind.UNREADABLE, VANISHED))
    except OSError as e:
        return _with(base, FileKind.OTHER, _unreadable(e))
    try:
        with os.fdopen(fd, "rb", buffering=0) as f:  # unbuffered: a 30-byte header read costs 30 bytes
            fst = os.fstat(f.fileno())
            # The file may have been replaced since the walk's stat: trust what is open now.
            base = FileFacts(path=rel_path, size=fst.st_size, mtime=fst.st_mtime, kind=FileKind.OTHER)
            special = _special_problem(fst.st_mode)
            if special is not None:
                return _with(base, special[0], special[1])
            return read_open_file(f, base, limits, in_dcp_dir, frameworks)
    except OSError as e:
        return _with(base, base.kind, _unreadable(e))


def read_open_file(
    f: BinaryIO, base: FileFacts, limits: Limits = DEFAULT_LIMITS, in_dcp_dir: bool = False, frameworks: bool = False
) -> FileFacts:
    """Sniff an already open, seekable binary file and run the reader for its kind; never raises.

    ``base`` carries the path to report, the real size and mtime (kind and content are filled in here). Shared by
    local files and remote objects (``ckptdoctor.sources``), so both are read by exactly the same code.
    ``frameworks`` as for ``read_file``.
    """
    # imported at the first read: a scan that reads no file (a warm rescan takes every file's facts from the cache)
    # loads none of the pickle walker the sniffer imports
    from ckptdoctor.readers.sniff import HEAD_BYTES, TAIL_BYTES, sniff, wants_tail

    try:
        head = f.read(HEAD_BYTES)
        tail = b""
        if frameworks and wants_tail(base.name) and base.size >= TAIL_BYTES:
            f.seek(base.size - TAIL_BYTES)
            tail = f.read(TAIL_BYTES)
        kind = sniff(head, base.name, base.size, in_dcp_dir, frameworks, tail)
        # EMPTY carries no problem: whether zero bytes is broken depends on the name, which rules judge.
        if kind not in _READ_KINDS:
            return FileFacts(base.path, base.size, base.mtime, kind)
        return _run_reader(f, base, kind, limits)
    except OSError as e:
        return _with(base, base.kind, _unreadable(e))
    except Exception as e:  # defence in depth: sniffing must not end the scan either
        return _with(base, base.kind, _bug("sniffer", e))


# Small files whose bytes were read before (in this process) are not parsed again: every checkpoint of a run holds
# the same training_args.bin, config.json, generation_config.json and often the same shard index. A reader's
# outcome is a function of the bytes, the size and the limits only, and outcomes are frozen, so they are shared.
# Keyed by a 256-bit BLAKE2 digest of the bytes the reader then parses (read once, so nothing changes between
# hashing and parsing; a cryptographic digest, so a crafted file cannot pass for one seen before).
_SMALL_FILE = 64 * 1024
_OUTCOMES: dict[tuple[Reader, int, Limits, bytes], ReadOutcome] = {}
_OUTCOMES_ENTRIES = 4096


def _run_reader(f: BinaryIO, base: FileFacts, kind: FileKind, limits: Limits) -> FileFacts:
    """Run the reader for ``kind`` defensively: OS errors are UNREADABLE, anything else a bug (MALFORMED)."""
    try:
        reader = _reader_for(kind)
        f.seek(0)
        key = None
        if base.size <= _SMALL_FILE:
            data = f.read(base.size)
            key = (reader, base.size, limits, blake2b(data, digest_size=32).digest())
            known = _OUTCOMES.get(key)
            if known is not None:
                return _facts(base, kind, known)
            f = io.BytesIO(data)
        outcome = reader(f, base.size, limits)
        if isinstance(outcome, ReadOutcome):
            outcome = _with_nested(outcome, limits)
        if key is not None and isinstance(outcome, ReadOutcome):
            if len(_OUTCOMES) >= _OUTCOMES_ENTRIES:
                _OUTCOMES.clear()
            _OUTCOMES[key] = outcome
    except OSError as e:
        return _with(base, kind, _unreadable(e))
    except Exception as e:  # defence in depth: a reader bug must not end the scan
        return _with(base, kind, _bug(f"{kind.value} reader", e))
    if not isinstance(outcome, ReadOutcome):
        return _with(base, kind, _bug(f"{kind.value} reader", TypeError(f"returned {type(outcome).__name__}")))
    return _facts(base, kind, outcome)


def _with_nested(outcome: ReadOutcome, limits: Limits) -> ReadOutcome:
    """``outcome`` with the pickles nested in its streams' values found (``nested.with_nested``), when it has any
    stream: imported only then."""
    c = outcome.content
    if outcome.alt_pickle is None and getattr(c, "pickle", None) is None and not isinstance(c, PickleFacts):
        return outcome
    from ckptdoctor.readers.nested import with_nested

    return with_nested(outcome, limits)


def _facts(base: FileFacts, kind: FileKind, outcome: ReadOutcome) -> FileFacts:
    return FileFacts(
        base.path, base.size, base.mtime, kind, outcome.content, tuple(outcome.problems), False, outcome.alt_pickle
    )


# Kinds read past the sniff head. OTHER, EMPTY and SPECIAL are described by their stat alone; DCP_DATA (`.distcp`,
# mostly tensor bytes) is read by discovery afterwards, at the items its folder's `.metadata` locates; TF_DATA
# (raw tensor bytes) is checked against its index (`tfbundle.shard_problems`, and `crc_problems` with --deep).
# Each read kind's reader (`module:function` in this package), imported on first use: a kind that no file has costs
# nothing, and a reader module that is missing or broken makes its files MALFORMED instead of breaking every scan.
# SAFETENSORS is read by `_read_safetensors_or_pickle`, below.
_READERS: dict[FileKind, str] = {
    FileKind.TORCH_ZIP: "torchzip:read_torch",
    FileKind.TORCH_LEGACY: "torchzip:read_torch",
    FileKind.PICKLE: "rawpickle:read_raw_pickle",
    FileKind.DCP_METADATA: "dcp:read_dcp_metadata",
    FileKind.JSON: "jsonfiles:read_json",
    FileKind.TEXT: "deepspeed:read_latest",
    FileKind.MINDSPORE: "mindspore:read_mindspore",
    FileKind.TF_INDEX: "tfbundle:read_tf_index",
    FileKind.TF_CHECKPOINT_STATE: "tfbundle:read_tf_checkpoint_state",
    FileKind.HDF5: "hdf5:read_hdf5",
    FileKind.NUMPY: "npy:read_numpy",
    FileKind.ARCHIVE: "torchzip:read_archive",
}
_READ_KINDS = frozenset({FileKind.SAFETENSORS, *_READERS})


def _reader_for(kind: FileKind) -> Reader:
    """The reader for ``kind`` (one of ``_READ_KINDS``), imported on first use (``_READERS``)."""
    if kind is FileKind.SAFETENSORS:
        return _read_safetensors_or_pickle
    where = _READERS.get(kind)
    if where is None:
        raise ValueError(f"no reader for {kind.value} files")
    import importlib

    module, name = where.split(":")
    reader: Reader = getattr(importlib.import_module(f"ckptdoctor.readers.{module}"), name)
    return reader


def _read_safetensors_or_pickle(f: BinaryIO, size: int, limits: Limits) -> ReadOutcome:
    """A safetensors file, and also the pickle a pickle loader reads from it when its first bytes start one.

    The sniffer calls a file safetensors when a JSON header follows its first 8 bytes; those 8 bytes may also open
    a pickle (a polyglot), which ``pickle.load``, ``np.load(allow_pickle=True)`` or a legacy ``torch.load`` would
    run: that reading is judged too (``alt_pickle``).
    """
    from ckptdoctor.readers.rawpickle import read_as_pickle
    from ckptdoctor.readers.safetensors import read_safetensors
    from ckptdoctor.readers.sniff import pickled_head

    outcome = read_safetensors(f, size, limits)
    f.seek(0)
    if not pickled_head(f.read(64)):
        return outcome
    alt, problems = read_as_pickle(f, size, limits)
    if alt is None and not problems:
        return outcome
    if alt is not None and outcome.alt_pickle is not None:  # the `_extra_state` pickles too
        from ckptdoctor.readers.pickle_walk import merge_pickles

        alt = merge_pickles(alt, [outcome.alt_pickle])
    return dataclasses.replace(outcome, problems=(*outcome.problems, *problems), alt_pickle=alt or outcome.alt_pickle)


def _special_problem(mode: int) -> tuple[FileKind, ReadProblem] | None:
    """Kind and problem for anything that is not a regular file; None for regular files."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return FileKind.OTHER, ReadProblem(ProblemKind.UNREADABLE, "is a directory, expected a file")
    if stat.S_ISLNK(mode):
        return FileKind.OTHER, ReadProblem(ProblemKind.UNREADABLE, "symbolic link not followed")
    what = (
        "FIFO"
        if stat.S_ISFIFO(mode)
        else "socket"
        if stat.S_ISSOCK(mode)
        else "device"
        if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
        else "special file"
    )
    return FileKind.SPECIAL, ReadProblem(ProblemKind.SPECIAL_FILE, f"{what}: not a regular file, never opened")


def _unreadable(e: OSError) -> ReadProblem:
    return ReadProblem(ProblemKind.UNREADABLE, f"cannot read: {e.strerror or e}")


def _bug(where: str, e: Exception) -> ReadProblem:
    msg = f"internal error in the {where} (a ckptdoctor bug, please report it): {type(e).__name__}: {e}"
    return ReadProblem(ProblemKind.MALFORMED, msg)


def _with(base: FileFacts, kind: FileKind, problem: ReadProblem) -> FileFacts:
    return FileFacts(base.path, base.size, base.mtime, kind, None, (problem,))


__all__ = ["VANISHED", "read_dcp_items_from", "read_file", "read_open_file"]


def read_dcp_items_of(
    abs_path: str, facts: FileFacts, items: list[DcpItem] | None, limits: Limits
) -> FileFacts:
    """``facts`` of a `.distcp` file completed with the pickles of the blobs at ``items`` (from `.metadata`), or,
    when ``items`` is None (no readable metadata), of every blob found by searching the file (bounded by limits)."""
    try:
        fd = os.open(abs_path, _OPEN_FLAGS)
        with os.fdopen(fd, "rb", buffering=0) as f:
            return read_dcp_items_from(f, facts, items, limits)
    except OSError as e:
        return _with(facts, facts.kind, _unreadable(e))


def read_dcp_items_from(
    f: BinaryIO, facts: FileFacts, items: list[DcpItem] | None, limits: Limits
) -> FileFacts:
    """``read_dcp_items_of`` for an already open `.distcp` file (local or remote); never raises."""
    from ckptdoctor.readers.dcp import read_dcp_data, read_dcp_items

    try:
        if items is None:
            outcome = read_dcp_data(f, facts.size, limits)
        else:
            outcome = read_dcp_items(f, facts.size, items, limits)
        outcome = _with_nested(outcome, limits)
    except OSError as e:
        return _with(facts, facts.kind, _unreadable(e))
    except Exception as e:  # defence in depth, as for every reader
        return _with(facts, facts.kind, _bug("dcp item reader", e))
    return FileFacts(facts.path, facts.size, facts.mtime, facts.kind, outcome.content, tuple(outcome.problems),
                     facts.is_link, facts.alt_pickle)
