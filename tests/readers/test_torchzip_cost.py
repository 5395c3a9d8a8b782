"""What the torch zip reader costs in reads (one per local header; none per tensor when asked), and that the
cheaper checks decide exactly as before, on files torch.save really wrote."""

from __future__ import annotations

import dataclasses
import io
import random
import struct
import zipfile
from pathlib import Path
from typing import Any, BinaryIO

import pytest

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import ProblemKind, ReadOutcome, TorchFacts
from ckptdoctor.readers import zipdir
from ckptdoctor.readers.torchzip import read_torch
from ckptdoctor.scanner import scan
from ckptdoctor.sources.fsspec import remote_limits

torch = pytest.importorskip("torch")

NO_STORAGE_HEADERS = Limits(zip_data_local_headers=False)  # the default
ALL_HEADERS = Limits(zip_data_local_headers=True)  # what --deep uses
LIE = "local header(s) disagree with the central directory"


class CountingFile:
    """A file that records every read as (offset, bytes asked, bytes got)."""

    def __init__(self, data: bytes) -> None:
        self._f = io.BytesIO(data)
        self.reads: list[tuple[int, int, int]] = []

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def read(self, n: int = -1) -> bytes:
        at = self._f.tell()
        out = self._f.read(n)
        self.reads.append((at, n, len(out)))
        return out


def _optimizer_bytes(folder: Path, n_params: int) -> bytes:
    """A real AdamW state (``3 * n_params`` tensors: step, exp_avg, exp_avg_sq) as torch.save writes it, in the
    archive folder `archive/` (torch names it after the file)."""
    params = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(n_params)]  # 16 KB: past the 64 KB tail
    opt = torch.optim.AdamW(params)
    torch.stack([p.sum() for p in params]).sum().backward()
    opt.step()
    path = folder / f"state-{n_params}" / "archive.pt"
    path.parent.mkdir()
    torch.save(opt.state_dict(), path)
    return path.read_bytes()


@pytest.fixture(scope="module")
def optim(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return _optimizer_bytes(tmp_path_factory.mktemp("optim"), 40)


def _read(data: bytes, limits: Limits = DEFAULT_LIMITS) -> tuple[ReadOutcome, CountingFile]:
    f = CountingFile(data)
    return read_torch(f, len(data), limits), f  # type: ignore[arg-type]  # a duck-typed binary file


def _lies(outcome: ReadOutcome) -> list[str]:
    return [p.message for p in outcome.problems if p.kind == ProblemKind.SUSPICIOUS_ARCHIVE and LIE in p.message]


def _records(data: bytes) -> list[zipfile.ZipInfo]:
    return zipfile.ZipFile(io.BytesIO(data)).infolist()


def _storage(name: str) -> bool:
    return name.split("/", 1)[1].startswith("data/")


def _local_header_name(data: bytes, member: str, new: str) -> bytes:
    """``data`` with ``member``'s local header naming ``new``; the record's bytes stay where they were (torch's
    ``FB`` padding extra field absorbs the change of name length), so only a reader of local headers sees it."""
    info = zipfile.ZipFile(io.BytesIO(data)).getinfo(member)
    at = info.header_offset
    name_len, extra_len = struct.unpack_from("<HH", data, at + 26)
    raw = new.encode()
    new_extra = name_len + extra_len - len(raw)
    assert new_extra >= 4
    head = bytearray(data[at : at + 26]) + struct.pack("<HH", len(raw), new_extra)
    extra = b"FB" + struct.pack("<H", new_extra - 4) + b"Z" * (new_extra - 4)
    return b"".join((data[:at], head, raw, extra, data[at + 30 + name_len + extra_len :]))


# ---------------------------------------------------------------------------------------------------------------
# Reads


def test_each_local_header_costs_one_read(optim: bytes) -> None:
    outcome, f = _read(optim, ALL_HEADERS)
    assert outcome.problems == () and isinstance(outcome.content, TorchFacts)
    assert len(outcome.content.tensors) == 120
    records = _records(optim)
    reads = f.reads[1:]  # after the 4-byte format sniff
    at_header = {r.header_offset: [n for off, n, _ in reads if off == r.header_offset] for r in records}
    for r in records:
        # The header and its name in one read; data.pkl and byteorder are read again, for their bytes.
        again = [30] if r.filename in ("archive/data.pkl", "archive/byteorder") else []
        assert at_header[r.header_offset] == [30 + len(r.filename), *again], r.filename
    assert len(f.reads) <= len(records) + 8  # plus the end records, the directory and data.pkl's content


def test_storage_headers_are_not_read_when_asked(tmp_path: Path, optim: bytes) -> None:
    small = _optimizer_bytes(tmp_path, 3)
    counts = []
    for data in (small, optim):
        on, _ = _read(data, ALL_HEADERS)
        off, f = _read(data)
        assert off == on  # a healthy file reads the same either way
        spans = [(r.header_offset, r.header_offset + 30 + len(r.filename)) for r in _records(data)
                 if _storage(r.filename)]  # fmt: skip
        assert spans
        tail = min(len(data), 22 + 65535)  # the window searched for the end record
        reads = [(at, n) for at, n, _ in f.reads if (at, n) != (len(data) - tail, tail)]
        assert not [(at, n) for at, n in reads for lo, hi in spans if at < hi and at + n > lo]
        counts.append(len(f.reads))
    # 9 tensors or 120, the same reads: the sniff, the end records, the headers of torch's 7 other records, and
    # byteorder's and data.pkl's headers and bytes.
    assert counts[0] == counts[1] <= 15, counts


def test_the_directory_comes_from_the_tail_already_read(optim: bytes) -> None:
    """A directory inside the 64 KB tail window is sliced from it, not read a second time."""
    _, f = _read(optim)
    cd_offset = struct.unpack_from("<Q", optim, len(optim) - 22 - 20 - 56 + 48)[0]
    assert not [r for r in f.reads if r[0] == cd_offset]


# ---------------------------------------------------------------------------------------------------------------
# Lying local headers: still found where a loader parses the record


@pytest.mark.parametrize("check", [True, False])
def test_storage_record_under_a_lying_local_header(optim: bytes, check: bool, tmp_path: Path) -> None:
    """A tensor record whose local header says `archive/data.pkl`: torch (central directory) loads the file as
    before; only the full check (--deep) reports it."""
    storage = next(r.filename for r in _records(optim) if _storage(r.filename) and r.file_size > 4)
    crafted = _local_header_name(optim, storage, "archive/data.pkl")
    path = tmp_path / "optimizer.pt"
    path.write_bytes(crafted)
    assert torch.load(path, weights_only=True)["state"].keys() == torch.load(io.BytesIO(optim))["state"].keys()
    limits = ALL_HEADERS if check else NO_STORAGE_HEADERS
    outcome, _ = _read(crafted, limits)
    assert _lies(outcome) == ([f"{LIE}: `{storage}`: streaming readers and torch.load would see different "
                               "records"] if check else [])  # fmt: skip
    assert dataclasses.replace(outcome, problems=()) == _read(optim)[0]


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize(
    ("member", "local_name"),
    [
        ("archive/data.pkl", "archive/data/0.p"),
        ("archive/byteorder", "archive/data.pkl"),
        ("archive/version", "archive/data.pkl"),
        ("archive/.format_version", "archive/data.pkl"),
        ("archive/.data/serialization_id", "archive/data.pkl"),
        ("archive/.data/serialization_id", "archive/.data/serialization_iD"),
    ],
)
def test_parsed_record_under_a_lying_local_header(
    tmp_path: Path, optim: bytes, member: str, local_name: str, check: bool
) -> None:
    """Every record a loader parses keeps its local header check, with or without the storage records' check:
    a pickle smuggled in under another record's local header is CKD605 on a remote root too."""
    crafted = _local_header_name(optim, member, local_name)
    limits = ALL_HEADERS if check else NO_STORAGE_HEADERS
    outcome, _ = _read(crafted, limits)
    assert [m for m in _lies(outcome) if f"`{member}`" in m], outcome.problems
    run = tmp_path / "run" / "checkpoint-1"
    run.mkdir(parents=True)
    (run / "optimizer.pt").write_bytes(crafted)
    report = scan(str(run / "optimizer.pt"), limits=limits)
    assert "CKD605" in {f.rule for f in report.findings}


def test_remote_limits_turn_off_only_the_storage_check() -> None:
    limits = Limits(zip_entries=7)
    assert remote_limits(limits) == dataclasses.replace(limits, zip_data_local_headers=False)
    assert not DEFAULT_LIMITS.zip_data_local_headers  # a scan's cost must not grow with the tensor count


def test_deep_scans_check_the_storage_records_local_headers(optim: bytes, tmp_path: Path) -> None:
    """--deep reads every tensor record anyway: there the lying storage header is CKD605; a plain scan skips it."""
    storage = next(r.filename for r in _records(optim) if _storage(r.filename) and r.file_size > 4)
    run = tmp_path / "run" / "checkpoint-1"
    run.mkdir(parents=True)
    (run / "optimizer.pt").write_bytes(_local_header_name(optim, storage, "archive/data.pkl"))
    assert "CKD605" not in {f.rule for f in scan(str(run)).findings}
    assert "CKD605" in {f.rule for f in scan(str(run), deep=True).findings}


# ---------------------------------------------------------------------------------------------------------------
# Same verdicts as the two-read check it replaced


def _oracle_local_mismatches(f: BinaryIO, members: list[Any]) -> list[str]:
    """The local header check before it got cheaper: the 30-byte header, then the name, decoded and compared."""
    out: list[str] = []
    for m in members:
        f.seek(m.offset)
        head = f.read(30)
        if len(head) != 30 or head[:4] != b"PK\x03\x04":
            continue
        fields = struct.unpack("<4s5H3L2H", head)
        flags, method, csize, usize, name_len = fields[2], fields[3], fields[7], fields[8], fields[9]
        f.seek(m.offset + 30)
        name = f.read(name_len).decode("utf-8" if flags & 0x800 else "cp437", "replace")
        sizes_ok = bool(flags & 0x08) or 0xFFFFFFFF in (csize, usize) or (csize, usize) == (m.compressed_size, m.size)
        if name != m.name or method != m.method or not sizes_ok:
            out.append(m.name)
    return out


def test_local_check_decides_as_the_two_read_check(tmp_path: Path) -> None:
    """Random damage to the local headers of a real file (names, their length and encoding flag, method, sizes,
    a cut): the one-read check names exactly the records the two-read check named."""
    base = _optimizer_bytes(tmp_path, 2)
    d, problems = zipdir.read_directory(io.BytesIO(base), len(base), DEFAULT_LIMITS)
    assert d is not None and problems == []
    rng = random.Random(605)
    fields = [6, 7, 8, 9, 18, 19, 22, 23, 26, 27]  # flags, method, sizes and name length, byte by byte
    flagged = 0
    for _ in range(3000):
        data = bytearray(base)
        for _ in range(rng.choice((1, 2, 3))):
            m = rng.choice(d.members)
            pos = m.offset + rng.choice([*fields, 30 + rng.randrange(len(m.name) + 8)])
            data[pos] = rng.choice((0, 0xFF, 0x08, 0x80, rng.randrange(256), data[pos] ^ (1 << rng.randrange(8))))
        if rng.random() < 0.05:
            del data[rng.randrange(d.members[-1].offset, len(data)) :]
        blob = bytes(data)
        got = zipdir.local_mismatches(io.BytesIO(blob), d)
        assert got == _oracle_local_mismatches(io.BytesIO(blob), d.members)
        flagged += bool(got)
    assert flagged > 1000


def test_zip64_offsets_parse_as_before(optim: bytes) -> None:
    """Past 4 GB torch moves each local header offset to a zip64 extra field: the same bytes with every offset
    moved there read as the original does."""
    converted = _with_zip64_offsets(optim)
    assert converted != optim
    assert zipfile.ZipFile(io.BytesIO(converted)).infolist()[5].header_offset == _records(optim)[5].header_offset
    assert _read(converted)[0] == _read(optim)[0]


def _with_zip64_offsets(data: bytes) -> bytes:
    """``data`` (a torch.save file, which always ends with zip64 end records) with every central entry's local
    header offset set to 0xFFFFFFFF and given as a zip64 extra field, as torch writes it past 4 GB."""
    loc_at = len(data) - 22 - 20
    rec_at = struct.unpack_from("<Q", data, loc_at + 8)[0]
    count, _, cd_offset = struct.unpack_from("<QQQ", data, rec_at + 32)
    cd = bytearray()
    pos = cd_offset
    for _ in range(count):
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, pos + 28)
        local = struct.unpack_from("<L", data, pos + 42)[0]
        entry = bytearray(data[pos : pos + 46 + name_len])
        struct.pack_into("<H", entry, 30, extra_len + 12)
        struct.pack_into("<L", entry, 42, 0xFFFFFFFF)
        cd += entry + struct.pack("<HHQ", 1, 8, local) + data[pos + 46 + name_len : pos + 46 + name_len + extra_len]
        pos += 46 + name_len + extra_len + comment_len
    rec = bytearray(data[rec_at : rec_at + 56])
    struct.pack_into("<Q", rec, 40, len(cd))
    loc = bytearray(data[loc_at : loc_at + 20])
    struct.pack_into("<Q", loc, 8, cd_offset + len(cd))
    eocd = bytearray(data[len(data) - 22 :])
    return data[:cd_offset] + bytes(cd) + bytes(rec) + bytes(loc) + bytes(eocd)


# ---------------------------------------------------------------------------------------------------------------
# Central directory entries are interned across files


def _with_entry_twice(data: bytes, member: str) -> bytes:
    """``data`` (a torch.save file) with ``member``'s central entry listed a second time, at the end: two entries
    equal in every field, naming the same local header."""
    loc_at = len(data) - 22 - 20
    rec_at = struct.unpack_from("<Q", data, loc_at + 8)[0]
    count, cd_size, cd_offset = struct.unpack_from("<QQQ", data, rec_at + 32)
    pos, entry = cd_offset, b""
    for _ in range(count):
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, pos + 28)
        end = pos + 46 + name_len + extra_len + comment_len
        if data[pos + 46 : pos + 46 + name_len] == member.encode():
            entry = data[pos:end]
        pos = end
    assert entry
    rec = bytearray(data[rec_at : rec_at + 56])
    struct.pack_into("<QQQ", rec, 24, count + 1, count + 1, cd_size + len(entry))
    loc = bytearray(data[loc_at : loc_at + 20])
    struct.pack_into("<Q", loc, 8, rec_at + len(entry))
    return data[: cd_offset + cd_size] + entry + bytes(rec) + bytes(loc) + data[len(data) - 22 :]


def test_entries_are_shared_between_files(optim: bytes) -> None:
    first, second = _read(optim)[0].content, _read(optim)[0].content
    assert isinstance(first, TorchFacts) and isinstance(second, TorchFacts)
    assert all(a is b for a, b in zip(first.members, second.members, strict=True))


def test_an_entry_listed_twice_is_still_walked_as_a_second_pickle(optim: bytes) -> None:
    """Interned, the two entries are one object: the reader tells data.pkl from its copy by position."""
    data = _with_entry_twice(optim, "archive/data.pkl")
    out, _ = _read(data)
    assert isinstance(out.content, TorchFacts)
    assert out.content.members[-1] is next(m for m in out.content.members if m.name == "archive/data.pkl")
    messages = [p.message for p in out.problems]
    assert any("duplicate zip records" in m for m in messages)
    assert any("besides the one data.pkl" in m and "`archive/data.pkl`" in m for m in messages), messages
