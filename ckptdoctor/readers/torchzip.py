"""Readers for ``torch.save`` files (zip and legacy formats) and raw pickles, by static walk only."""

from __future__ import annotations

import io
from dataclasses import replace
from typing import BinaryIO

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import (
    ArchiveFacts,
    NpyArray,
    PickleFacts,
    ProblemKind,
    ReadOutcome,
    ReadProblem,
    TorchFacts,
    ZipMember,
)
from ckptdoctor.readers.extra_state import StorageReader, extra_state_pickles, has_extra_state
from ckptdoctor.readers.lightning import lightning_facts
from ckptdoctor.readers.pickle_walk import merge_pickles, walk_pickle
from ckptdoctor.readers.seen import Seen
from ckptdoctor.readers.sniff import (
    NPY_MAGIC,
    TAR_BLOCK,
    compression,
    looks_like_tar,
    pickled_head,
    shifted_head,
)
from ckptdoctor.readers.torchlegacy import read_legacy
from ckptdoctor.readers.torchstore import STORAGE_DTYPES, Storages, storage_tensors
from ckptdoctor.readers.zipdir import (
    ZIP_EOCD,
    ZIP_LOCAL,
    Directory,
    Window,
    data_start,
    is_storage,
    listed_names,
    local_mismatches,
    member_bytes,
    member_head,
    name_escapes,
    read_at,
    read_directory,
    read_problem,
    relative_name,
)

__all__ = ["STORAGE_DTYPES", "Window", "read_archive", "read_torch", "read_zip_at"]


# Readers


def read_torch(f: BinaryIO, size: int, limits: Limits = DEFAULT_LIMITS) -> ReadOutcome:
    """Read a ``torch.save`` file, zip, tar or magic-number format, without executing its pickles.

    The format is chosen as ``torch.load`` chooses it (torch/serialization.py ``load``, ``_legacy_load``): a zip
    by its first four bytes, else a tar when ``tarfile`` accepts its first block, else the magic-number streams.
    A tar is also read the other way (a plain ``pickle.load`` reads its first bytes as a pickle).
    """
    if size == 0:
        return ReadOutcome(None, (read_problem(ProblemKind.EMPTY, "file is empty"),))
    try:
        head = read_at(f, 0, TAR_BLOCK)
        if head[:4] in (ZIP_LOCAL, ZIP_EOCD):
            return _read_zip(f, size, limits)
        if looks_like_tar(head):
            from ckptdoctor.readers.torchtar import read_tar

            outcome = read_tar(f, size, limits, read_torch)
            other = read_legacy(f, size, limits)
            alt = other.content.pickle if isinstance(other.content, TorchFacts) else other.alt_pickle
            return replace(outcome, alt_pickle=alt) if alt is not None and (alt.globals or alt.calls) else outcome
        return read_legacy(f, size, limits)
    except OSError as exc:
        return ReadOutcome(None, (read_problem(ProblemKind.UNREADABLE, f"I/O error: {exc}"),))


def read_archive(f: BinaryIO, size: int, limits: Limits = DEFAULT_LIMITS) -> ReadOutcome:
    """Read a tar of any name or a gzip/bz2/xz stream (``readers/archive.py``), torch files inside by ``read_torch``."""
    from ckptdoctor.readers import archive

    return archive.read_archive(f, size, limits, read_torch)


def _read_zip(f: BinaryIO, size: int, limits: Limits, depth: int = 0, root: str = "") -> ReadOutcome:
    """``read_torch`` of a zip; ``root`` names the saved value where a caller knows it (a DCP item's fqn): the
    path its tensors have in the state dict a module loads (an `_extra_state` tensor saved alone)."""
    d, problems = read_directory(f, size, limits)
    if d is None:
        return ReadOutcome(None, tuple(problems))
    members, cd_offset = d.members, d.cd_offset
    if not members:
        return ReadOutcome(
            TorchFacts("zip", "", (), None, ()), (read_problem(ProblemKind.MALFORMED, "zip archive has no records"),)
        )
    layout = _layout_of(members, cd_offset)
    first, prefix, by_name = members[0].name, layout.prefix, layout.by_name
    compressed, beyond, inconsistent = layout.compressed, layout.beyond, layout.inconsistent
    # torch.load hands an archive holding `constants.pkl` to torch.jit.load (torch/serialization.py
    # ``_is_torchscript_zip``), which compiles `code/` records as TorchScript source (torch.jit.save deflates them)
    torchscript = bool(prefix) and f"{prefix}/constants.pkl" in by_name
    if torchscript and compressed:
        compressed = [n for n in compressed if not n.startswith(f"{prefix}/code/")]
    problems.extend(_layout_problems(f, size, d, layout, compressed, limits.zip_data_local_headers))
    if inconsistent:
        problems.append(
            read_problem(
                ProblemKind.MALFORMED,
                f"stored record(s) whose size differs from their stored bytes: {listed_names(inconsistent)}",
            )
        )
    if beyond:
        overlap = f"record(s) overlap the central directory: {listed_names(beyond)}"
        problems.append(read_problem(ProblemKind.MALFORMED, overlap))
    main = by_name.get(f"{prefix}/data.pkl") if prefix else None
    if main is None and prefix:
        # miniz (torch's zip reader) finds a record case-insensitively when no name matches exactly.
        wanted = f"{prefix}/data.pkl".lower()
        main = next((m for m in members if m.name.lower() == wanted), None)
    # Every other record holding a pickle (a second data.pkl, `constants.pkl`, `x/evil.pkl`, a pickle under any
    # name) and every zip inside the zip is walked too: some loader may read it, and a scanner that looks only at
    # data.pkl is what such layouts are built to fool.
    extra, extra_problems = _extra_pickles(f, d, main, layout, limits, depth, torchscript)
    problems.extend(extra_problems)
    if not prefix:
        problems.append(read_problem(ProblemKind.MALFORMED, f"first record `{first}` is not inside a folder"))
        merged = merge_pickles(None, extra)
        return ReadOutcome(TorchFacts("zip", "", tuple(members), merged, ()), tuple(problems))
    byteorder = "little"
    bo = by_name.get(f"{prefix}/byteorder")
    if bo is not None:
        raw, p = member_bytes(f, bo, cd_offset, 16)
        if p is not None:
            problems.append(p)
        elif raw in (b"little", b"big"):
            byteorder = raw.decode()
        else:
            problems.append(read_problem(ProblemKind.MALFORMED, f"`{prefix}/byteorder` holds {raw!r}"))
    if main is None:
        problems.append(read_problem(ProblemKind.MALFORMED, f"missing record `{prefix}/data.pkl`"))
        merged = merge_pickles(None, extra)
        facts_ = TorchFacts("zip", prefix, tuple(members), merged, (), byteorder, torchscript)
        return ReadOutcome(facts_, tuple(problems))
    data, p = member_bytes(f, main, cd_offset, limits.pickle_bytes)
    if data is None:
        problems.append(p)  # type: ignore[arg-type]  # member_bytes returns a problem whenever data is None
        merged = merge_pickles(None, extra)
        facts_ = TorchFacts("zip", prefix, tuple(members), merged, (), byteorder, torchscript)
        return ReadOutcome(facts_, tuple(problems))
    data_prefix = f"{prefix}/data/"
    storages = Storages(layout.record_sizes, legacy=False)
    facts, walk_problems, _ = walk_pickle(data, limits=limits, persistent_load=storages)
    problems.extend(walk_problems)
    problems.extend(storages.problems)
    tensors, tensor_problems = storage_tensors(facts.value) if facts is not None else ((), [])
    problems.extend(tensor_problems)
    named = tuple((f"{root}.{p}" if p else root, t) for p, t in tensors) if root else tensors
    if has_extra_state(named):
        read = _storage_reader(f, by_name, data_prefix, d, limits)
        inner, inner_problems = extra_state_pickles(named, read, limits)
        extra.extend(inner)
        problems.extend(inner_problems)
    merged = merge_pickles(facts, extra)
    return ReadOutcome(TorchFacts("zip", prefix, tuple(members), merged, tensors, byteorder, torchscript,
                                  lightning_facts(facts)),
                       tuple(problems))  # fmt: skip


def _storage_reader(
    f: BinaryIO, by_name: dict[str, ZipMember], data_prefix: str, d: Directory, limits: Limits
) -> StorageReader:
    """Ranged reads of the storage records ``data/<key>`` of a torch zip (a stored record read in place)."""

    def read(key: str, start: int, n: int) -> bytes | None:
        m = by_name.get(data_prefix + key)
        if m is None or start < 0 or start + n > m.size:
            return None
        if m.method == 0:
            at = data_start(f, m)
            return None if at is None else read_at(f, at + start, n)
        data, _ = member_bytes(f, m, d.cd_offset, limits.pickle_bytes)
        return None if data is None else data[start : start + n]

    return read


# Records torch.save writes besides data.pkl and data/<key> (caffe2/serialize/inline_container.cc, serialization.py).
_TORCH_RECORDS = frozenset({".format_version", ".storage_alignment", "byteorder", "version", ".data/version",
                            ".data/serialization_id"})  # fmt: skip
_MAX_EXTRA_PICKLES = 64  # extra pickle records walked per archive; more is itself the finding
_MAX_ZIP_DEPTH = 2  # zips inside zips followed this deep
_HEAD = TAR_BLOCK  # bytes of a record read to tell a pickle (any protocol), a zip, a .npy or a tar


class _Layout:
    """What a torch zip's central directory says by its records' names, sizes and offsets alone (no byte of a
    record read): the archive folder, the records by name, the layout faults found in them, which records hold raw
    tensor bytes, and the storage records' sizes. Read-only once made, and shared: every checkpoint of a training
    run lists the same records at the same offsets (``zipdir._MEMBERS`` makes them the same objects), so from the
    second optimizer.pt on the per-record loops (a 7B optimizer has 879 records) are a list comparison."""

    __slots__ = ("beyond", "by_name", "candidates", "compressed", "dupes", "inconsistent", "members", "not_storage",
                 "outside", "prefix", "record_sizes")  # fmt: skip

    def __init__(self, members: list[ZipMember], cd_offset: int) -> None:
        self.members = list(members)
        first = members[0].name
        prefix = first.split("/", 1)[0] if "/" in first else ""
        self.prefix = prefix
        by_name: dict[str, ZipMember] = {}
        dupes: list[str] = []
        compressed: list[str] = []
        beyond: list[str] = []
        inconsistent: list[str] = []
        for m in members:
            if m.name in by_name:
                dupes.append(m.name)
            else:
                by_name[m.name] = m
            if m.method != 0:
                compressed.append(m.name)
            elif m.size != m.compressed_size:
                inconsistent.append(m.name)
            # The data can only start after a 30-byte local header and the name.
            if m.offset + 30 + len(m.name.encode()) + m.compressed_size > cd_offset:
                beyond.append(m.name)
        self.by_name, self.dupes, self.compressed, self.beyond, self.inconsistent = (
            by_name, dupes, compressed, beyond, inconsistent
        )  # fmt: skip
        folder = f"{prefix}/" if prefix else ""
        self.outside = (
            [m.name for m in members if not m.name.startswith(folder) or name_escapes(m.name)] if prefix else []
        )
        # Records that are not storage bytes (their local headers are checked), and of those the ones that are not
        # torch's own small records either (looked into for a pickle), with their names inside the folder.
        self.not_storage: list[int] = []
        self.candidates: list[tuple[int, str]] = []
        for i, m in enumerate(members):
            rel = relative_name(m.name, folder)
            if is_storage(rel, m.name):
                continue
            self.not_storage.append(i)
            if rel not in _TORCH_RECORDS:
                self.candidates.append((i, rel))
        data_prefix = f"{prefix}/data/"
        self.record_sizes = {  # read-only: handed to every Storages of a file with this layout
            name[len(data_prefix) :]: m.size for name, m in by_name.items() if name.startswith(data_prefix)
        }


# Layouts already made, by (central directory offset, record count); a hit is used only when its records are equal
# (the same objects, for a run's checkpoints). Shared by threads
# and bounded (``Seen``).
_LAYOUTS: Seen[tuple[int, int], _Layout] = Seen(64)


def _layout_of(members: list[ZipMember], cd_offset: int) -> _Layout:
    """``_Layout`` of these records (made once per distinct directory)."""
    key = (cd_offset, len(members))
    known = _LAYOUTS.get(key)
    if known is not None and known.members == members:
        return known
    layout = _Layout(members, cd_offset)
    _LAYOUTS.put(key, layout)
    return layout


def _layout_problems(
    f: BinaryIO,
    size: int,
    d: Directory,
    layout: _Layout,
    compressed: list[str],
    check_storages: bool = True,
) -> list[ReadProblem]:
    """Zip tricks: layouts torch.save never writes that make two readers see two different archives.

    ``check_storages`` False leaves the local headers of storage records unchecked (``Limits.zip_data_local_headers``).
    """
    out: list[ReadProblem] = []
    prefix, dupes = layout.prefix, layout.dupes

    def add(message: str) -> None:
        out.append(read_problem(ProblemKind.SUSPICIOUS_ARCHIVE, message))

    if dupes:
        add(f"duplicate zip records {listed_names(dupes)}: zip readers disagree on which copy they load")
    if prefix:
        outside = layout.outside
        if outside:
            add(f"record(s) outside the archive folder `{prefix}/`: {listed_names(outside)}")
    if compressed:
        add(
            f"{len(compressed)} compressed record(s) ({listed_names(compressed)}): torch.save stores records "
            "uncompressed, and torch.load(mmap=True) cannot read compressed ones"
        )
    if d.base > 0:
        add(f"{d.base} bytes before the zip archive: data hidden in front of it is read by other tools")
    if d.end < size:
        add(f"{size - d.end} bytes after the zip end record: data hidden behind the archive")
    mismatched = local_mismatches(f, d, checked=None if check_storages else layout.not_storage)
    if mismatched:
        add(
            f"local header(s) disagree with the central directory: {listed_names(mismatched)}: streaming readers and "
            "torch.load would see different records"
        )
    return out




# Records torch.jit.save writes besides data.pkl: TorchScript's own pickles, read by torch.jit.load's unpickler
# (torch/csrc/jit/serialization/import.cpp): walked and judged like any pickle, but no evasion layout.
_TORCHSCRIPT_PICKLES = ("constants.pkl",)


def _extra_pickles(
    f: BinaryIO,
    d: Directory,
    main: ZipMember | None,
    layout: _Layout,
    limits: Limits,
    depth: int,
    torchscript: bool = False,
) -> tuple[list[PickleFacts], list[ReadProblem]]:
    """Walk every record other than ``main`` that holds a pickle or a nested zip (bounded in number and depth). In a
    TorchScript archive, `code/**.py` records are TorchScript source, not pickles, and its own pickles
    (`constants.pkl`, `code/**.debug_pkl`) are walked without being an evasion layout."""
    found: list[PickleFacts] = []
    problems: list[ReadProblem] = []
    names: list[str] = []
    owned: list[str] = []  # a TorchScript archive's own pickles
    members = d.members
    # By position: entries are interned (``_MEMBERS``), so a second entry identical to data.pkl's is the same object.
    main_at = next((i for i, m in enumerate(members) if m is main), -1)
    main_folded = main.name.lower() if main is not None else None
    # Not torch's own small records, nor storage bytes (any byte pattern is valid tensor data): ``_Layout``.
    for i, rel in layout.candidates:
        if i == main_at:
            continue
        m = members[i]
        own = torchscript and (rel in _TORCHSCRIPT_PICKLES or (rel.startswith("code/") and rel.endswith(".debug_pkl")))
        if torchscript and rel.startswith("code/") and rel.endswith(".py"):
            continue  # TorchScript source: torch.jit.load compiles it, nothing unpickles it
        folded = m.name.lower()
        if folded == main_folded and main is not None and m.name != main.name:
            # torch finds records with miniz's case-insensitive lookup: either may be the data.pkl it loads.
            problems.append(read_problem(ProblemKind.SUSPICIOUS_ARCHIVE, f"record `{m.name}` differs from "
                                     f"`{main.name}` only in case: torch may load either"))  # fmt: skip
        named = folded.endswith((".pkl", ".pickle"))
        head = member_head(f, m, _HEAD)
        nested_zip = head[:4] == ZIP_LOCAL
        if head[:6] == NPY_MAGIC:
            # np.load reads any zip as an .npz, and unpickles the body of an object array.
            facts = _npy_pickle(f, d, m, head, limits, problems)
            if facts is not None:
                found.append(facts)
                names.append(m.name)
            continue
        archive = looks_like_tar(head) or compression(head) is not None
        shifted = not (named or nested_zip or archive) and shifted_head(head)
        pickled = named or pickled_head(head)
        if not (pickled or nested_zip or archive or shifted):
            continue
        if len(names) + len(owned) >= _MAX_EXTRA_PICKLES:
            problems.append(read_problem(ProblemKind.LIMIT, f"more than {_MAX_EXTRA_PICKLES} extra pickle records"))
            break
        (owned if own else names).append(m.name)
        data, p = member_bytes(f, m, d.cd_offset, limits.pickle_bytes)
        if data is None:
            if p is not None:
                problems.append(p)
            continue
        if nested_zip:
            if depth >= _MAX_ZIP_DEPTH:
                problems.append(read_problem(ProblemKind.LIMIT, f"zip record `{m.name}` nests zips too deep"))
                continue
            inner = _read_zip(io.BytesIO(data), len(data), limits, depth + 1)
            if isinstance(inner.content, TorchFacts) and inner.content.pickle is not None:
                found.append(inner.content.pickle)
            problems.extend(ReadProblem(q.kind, f"in zip record `{m.name}`: {q.message}") for q in inner.problems)
            continue
        if archive or shifted:
            outcome = _archive_or_shifted(data, archive, limits)
            if isinstance(outcome.content, ArchiveFacts) and outcome.content.pickle is not None:
                found.append(outcome.content.pickle)
            problems.extend(ReadProblem(q.kind, f"in record `{m.name}`: {q.message}") for q in outcome.problems)
            continue
        facts, walk_problems, _ = walk_pickle(data, limits=limits)
        if facts is not None:
            found.append(facts)
        problems.extend(ReadProblem(q.kind, f"in record `{m.name}`: {q.message}") for q in walk_problems)
    if names:
        problems.append(
            read_problem(
                ProblemKind.SUSPICIOUS_ARCHIVE,
                f"pickle or zip record(s) besides the one data.pkl torch.load reads: {listed_names(names)}",
            )
        )
    return found, problems



def _archive_or_shifted(data: bytes, archive: bool, limits: Limits) -> ReadOutcome:
    """A record holding a tar or compressed stream, read as ``readers/archive.py`` reads one; or a record whose first
    byte is no opcode and whose next bytes are a pickle that imports or calls (``archive.shifted_pickle``)."""
    from ckptdoctor.readers.archive import SHIFTED, shifted_pickle

    if archive:
        return read_archive(io.BytesIO(data), len(data), limits)
    facts = shifted_pickle(data, limits)
    if facts is None:
        return ReadOutcome(None)
    return ReadOutcome(ArchiveFacts("", 0, facts), (read_problem(ProblemKind.SUSPICIOUS_ARCHIVE, SHIFTED),))


def _npy_pickle(
    f: BinaryIO, d: Directory, m: ZipMember, head: bytes, limits: Limits, problems: list[ReadProblem]
) -> PickleFacts | None:
    """The pickle of a `.npy` record holding an object array (None for any other array)."""
    from ckptdoctor.readers.npy import read_npy_record

    array, _, probs = read_npy_record(head, m.name, limits)
    if array is None and len(head) < m.size and any(p.kind == ProblemKind.TRUNCATED for p in probs):
        array = NpyArray(m.name, (0, 0), "", False, (), True)  # a header longer than the head: read it all
    if array is None:
        problems.extend(probs)
        return None
    if not array.pickled:
        return None
    data, p = member_bytes(f, m, d.cd_offset, limits.pickle_bytes)
    if data is None:
        if p is not None:
            problems.append(p)
        return None
    _, facts, probs = read_npy_record(data, m.name, limits)
    problems.extend(probs)
    return facts


def read_zip_at(
    f: BinaryIO, start: int, length: int, limits: Limits = DEFAULT_LIMITS, root: str = ""
) -> ReadOutcome:
    """Read the torch zip blob occupying ``length`` bytes of ``f`` from ``start`` (a `.distcp` item; ``root``: its
    fqn, for an `_extra_state` tensor)."""
    if start < 0 or length <= 0:
        return ReadOutcome(None, (read_problem(ProblemKind.TRUNCATED, f"empty zip blob at byte {start}"),))
    view = io.BufferedReader(Window(f, start, length))
    return _read_zip(view, length, limits, root=root)
