"""Tar archives (plain, compressed, nested, in a zip) and compressed streams: every member a loader could unpickle is
judged by content whatever its name, nothing is extracted, and every bound (members, depth, decompressed bytes,
header bodies) ends the read with a finding instead of a hang."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import pickle
import subprocess
import sys
import tarfile
from pathlib import Path
from unittest import mock

import pytest
import torch

from bench.peer_corpus import _tar, _zip
from ckptdoctor.inspection import inspect_file
from ckptdoctor.limits import Limits
from ckptdoctor.model import ArchiveFacts, FileKind, ProblemKind
from ckptdoctor.readers import archive
from ckptdoctor.readers.archive import ArchiveScan, FileReader
from ckptdoctor.readers.sniff import sniff
from ckptdoctor.readers.torchzip import read_archive, read_torch
from ckptdoctor.scanner import scan

SECURITY = ("CKD601", "CKD603", "CKD605")


class _Payload:
    def __init__(self, canary: str) -> None:
        self.canary = canary

    def __reduce__(self) -> tuple[object, ...]:
        return (subprocess.call, (["touch", self.canary],))


def _errors(path: Path) -> list[tuple[str, str]]:
    return [(f.rule, f.message) for f in scan(str(path)).findings if f.rule in SECURITY and f.severity.value == "error"]


def _payloads(canary: Path) -> dict[str, bytes]:
    """file name -> bytes, one per container, each holding the same live payload under a name that says nothing."""
    evil = pickle.dumps(_Payload(str(canary)), protocol=2)
    tar = _tar({"notes/readme.txt": b"hello", "weights.dat": evil})
    return {
        "plain.tar": tar,
        "model.tgz": _tar({"a/b/x.anything": evil}, "w:gz"),
        "model.tar.bz2": _tar({"x": evil}, "w:bz2"),
        "model.tar.xz": _tar({"x": evil}, "w:xz"),
        "nested.tar.gz": _tar({"inner.tar": _tar({"deeper.tar.xz": _tar({"m.pkl": evil}, "w:xz")})}, "w:gz"),
        "in.zip": _zip({"archive.tar": tar}),
        "state.pkl.gz": gzip.compress(evil),
        "longname.tar": _tar({"d/" * 80 + "m.bin": evil}, fmt=tarfile.GNU_FORMAT),
        "pax.tar": _tar({"é" * 120 + ".pkl": evil}),
    }


def test_every_container_is_a_security_error_and_nothing_runs(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    for name, data in _payloads(canary).items():
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        (folder / name).write_bytes(data)
        errors = _errors(folder)
        assert any(rule == "CKD601" and "subprocess.call" in msg for rule, msg in errors), (name, errors)
    assert not canary.exists()


_LOAD = """
import io, pickle, sys, tarfile
with tarfile.open(sys.argv[1]) as t:  # what a user unpacking the archive, then unpickling a member, does
    for m in t.getmembers():
        if m.isfile() and m.name.endswith('x.anything'):
            pickle.load(t.extractfile(m))
"""


def test_a_compressed_tar_member_payload_is_live(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    path = tmp_path / "model.tgz"
    path.write_bytes(_payloads(canary)["model.tgz"])
    subprocess.run([sys.executable, "-c", _LOAD, str(path)], cwd=tmp_path, capture_output=True, timeout=60, check=False)
    assert canary.exists()


def test_clean_archives_of_real_saves_raise_nothing(tmp_path: Path) -> None:
    """torch.save files, data pickles and text packed by tarfile and gzip: no security finding."""
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(3), "step": 7}, buf)
    data = pickle.dumps({"lr": [0.1, 0.01], "name": "run", "shape": (3, 4)}, protocol=4)
    members = {"ckpt/model.pt": buf.getvalue(), "ckpt/state.pkl": data, "ckpt/README.md": b"# notes\nimport os\n"}
    (tmp_path / "run.tar.gz").write_bytes(_tar(members, "w:gz"))
    (tmp_path / "run.tar").write_bytes(_tar(members))
    (tmp_path / "state.pkl.xz").write_bytes(lzma.compress(data))
    (tmp_path / "log.txt.bz2").write_bytes(bz2.compress(b"step 1 loss 0.5\n" * 100))
    assert _errors(tmp_path) == []
    packed = _tar(members, "w:gz")
    facts = read_archive(io.BytesIO(packed), len(packed), Limits())
    assert isinstance(facts.content, ArchiveFacts)
    assert facts.content.fmt == "tar.gz" and facts.content.members == 3 and facts.problems == ()
    shown = inspect_file(str(tmp_path / "run.tar.gz"))
    assert (shown["kind"], shown["format"], shown["members"]) == ("archive", "tar.gz", 3)


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_members_are_listed_as_tarfile_lists_them(fmt: int) -> None:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as t:
        for name, size in [("a", 3), ("p/" * 60 + "long.pkl", 600), ("dir", -1), ("z" * 99, 0), ("lnk", -2)]:
            info = tarfile.TarInfo(name)
            if size == -1:
                info.type = tarfile.DIRTYPE
            elif size == -2:
                info.type, info.linkname = tarfile.SYMTYPE, "a"
            else:
                info.size = size
            t.addfile(info, io.BytesIO(b"\x01" * max(size, 0)))
    raw = out.getvalue()
    with tarfile.open(fileobj=io.BytesIO(raw)) as t:
        expected = [(m.name, m.size) for m in t.getmembers() if m.isreg()]
    s = ArchiveScan(Limits(), read_torch)
    assert [(m.name, m.size) for m, _ in s.tar(FileReader(io.BytesIO(raw), 0, len(raw)), "")] == expected


def _pax_bomb(declared: int) -> bytes:
    """A PAX extended header whose declared body is ``declared`` bytes (tarfile would read it all into memory)."""
    info = tarfile.TarInfo("././@PaxHeader")
    info.type = tarfile.XHDTYPE
    info.size = declared
    return info.tobuf(tarfile.GNU_FORMAT) + b"\0" * 1024


def test_header_bodies_are_bounded() -> None:
    out = read_archive(io.BytesIO(_pax_bomb(10**12)), 10**4, Limits())
    assert [p.kind for p in out.problems] == [ProblemKind.SUSPICIOUS_ARCHIVE]
    assert "header body" in out.problems[0].message


def test_a_decompression_bomb_is_a_finding_not_a_hang() -> None:
    bomb = gzip.compress(_tar({"zeros.bin": b"\0" * 50_000_000, "late.pkl": pickle.dumps(1)}), 9)
    assert len(bomb) < 100_000
    inflated = 0
    real_read = archive._Inflating.read

    def counting_read(self: archive._Inflating, n: int) -> bytes:
        nonlocal inflated
        part = real_read(self, n)
        inflated += len(part)
        return part

    with mock.patch.object(archive._Inflating, "read", counting_read):
        out = read_archive(io.BytesIO(bomb), len(bomb), Limits(archive_decompressed_bytes=5_000_000))
    assert inflated <= 5_000_000 + archive._CHUNK  # the work stops at the budget, not at the bomb's 50 MB
    assert [p.kind for p in out.problems] == [ProblemKind.SUSPICIOUS_ARCHIVE]
    assert "decompresses to more than 5000000 bytes" in out.problems[0].message



def test_a_big_archive_past_the_budget_is_unchecked_not_malicious(tmp_path: Path) -> None:
    """An archive that outgrows the decompression budget at a ratio no bomb has (tensors compress by little) is a
    resource limit, CKD001's warning that the rest is not checked, never CKD605's error: archived checkpoints live in
    output folders."""
    import os

    from ckptdoctor.scanner import scan

    big = gzip.compress(_tar({"weights.bin": os.urandom(3_000_000), "late.pkl": pickle.dumps(1)}), 1)
    out = read_archive(io.BytesIO(big), len(big), Limits(archive_decompressed_bytes=1_000_000))
    assert [p.kind for p in out.problems] == [ProblemKind.LIMIT]
    assert "not checked" in out.problems[0].message
    (tmp_path / "checkpoint-8.tar.gz").write_bytes(big)
    report = scan(str(tmp_path), limits=Limits(archive_decompressed_bytes=1_000_000))
    assert [(f.rule, f.severity.value) for f in report.findings] == [("CKD001", "warning")]

def test_member_count_and_nesting_are_bounded() -> None:
    many = _tar({f"m{i}": b"x" for i in range(30)})
    out = read_archive(io.BytesIO(many), len(many), Limits(archive_members=10))
    assert "more than 10 tar members" in out.problems[0].message
    deep = pickle.dumps(1)
    for _ in range(6):
        deep = _tar({"inner.tar": deep})
    out = read_archive(io.BytesIO(deep), len(deep), Limits(archive_depth=3))
    assert "nested more than 3 deep" in out.problems[0].message


def test_sniffing_leaves_torch_names_and_text_alone() -> None:
    tar = _tar({"x.pkl": pickle.dumps(1)})
    assert sniff(tar[:512], "archive.anything", len(tar)) is FileKind.ARCHIVE
    assert sniff(gzip.compress(b"{}")[:512], "config.json.gz", 30) is FileKind.ARCHIVE
    assert sniff(tar[:512], "model.pt", len(tar)) is FileKind.TORCH_ZIP  # torch.load's own tar reading
    assert sniff(b"BZh9 is text", "notes.txt", 12) is FileKind.OTHER


def test_a_torch_legacy_tar_with_another_pickle_member_is_an_error(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    evil = pickle.dumps(_Payload(str(canary)), protocol=2)
    empty = pickle.dumps(0, protocol=2)
    (tmp_path / "model.pth").write_bytes(
        _tar({"storages": empty, "tensors": empty, "pickle": pickle.dumps({}, protocol=2), "extra.dat": evil})
    )
    assert any(rule == "CKD601" for rule, _ in _errors(tmp_path))


def test_junk_byte_before_a_calling_pickle_in_a_zip(tmp_path: Path) -> None:
    """ModelAudit's '#'-prefixed protocol-0 payload: dead for pickle.load, reported as CKD601 and CKD605. Records
    of text that start with '#' (a script, Markdown, a shell comment) raise nothing."""
    proto0 = b'cos\nsystem\n(S"true"\ntR.'
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "payload.zip").write_bytes(_zip({"payload.txt": b"#" + proto0}))
    rules = {rule for rule, _ in _errors(tmp_path / "a")}
    assert {"CKD601", "CKD605"} <= rules
    texts = {
        "run.py": b"#!/usr/bin/env python\nimport os\nos.system('ls')\n",
        "README.md": b"# Title\n\n(c) 2024 cos\nsystem\n",
        "cfg.sh": b"#(S'x'\ntR.\n",  # opcodes with no global: data, not a call
        "data.pkl": b"#" + pickle.dumps({"a": 1}, protocol=0),
    }
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "texts.zip").write_bytes(_zip(texts))
    assert [r for r in _errors(tmp_path / "b") if r[0] == "CKD601"] == []


def test_a_corrupt_nested_stream_does_not_hide_the_members_after_it(tmp_path: Path) -> None:
    """A broken .xz member ends that member only (tarfile lists and extracts the rest): the payload after it is
    found, in a tar of any name and in a torch legacy tar (found by bench/fuzz_readers.py: the torch reader raised)."""
    canary = tmp_path / "canary"
    evil = pickle.dumps(_Payload(str(canary)), protocol=2)
    broken = bytearray(_tar({"m": b"x" * 4000}, "w:xz"))
    broken[60:80] = b"\xff" * 20
    empty = pickle.dumps(0, protocol=2)
    files = {
        "a.tar": _tar({"first.tar.xz": bytes(broken), "later.bin": evil}),
        "model.pth": _tar({"storages": empty, "tensors": empty, "pickle": empty, "x.xz": bytes(broken), "y": evil}),
    }
    for name, data in files.items():
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        (folder / name).write_bytes(data)
        assert any(rule == "CKD601" for rule, _ in _errors(folder)), name
    assert not canary.exists()


def _found(folder: Path, limits: Limits | None = None) -> list[tuple[str, str, str, str]]:
    report = scan(str(folder), limits=limits) if limits is not None else scan(str(folder))
    return [(f.rule, f.severity.value, f.path, f.message) for f in report.findings]


def test_a_pickle_member_over_the_per_member_limit_is_ckd001(tmp_path: Path) -> None:
    """A member too big to walk is never silent: CKD001's warning names it, in a tar, a nested compressed tar and a
    compressed stream alike (the rest of the archive is still judged)."""
    big = pickle.dumps({"x": b"a" * 5000}, protocol=4)
    files = {
        "run.tar": _tar({"state.pkl": big, "small.pkl": pickle.dumps(1)}),
        "outer.tar": _tar({"inner.tar.gz": _tar({"s.pkl": big}, "w:gz")}),
        "state.pkl.gz": gzip.compress(big),
    }
    for name, data in files.items():
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        (folder / name).write_bytes(data)
        found = _found(folder, Limits(pickle_bytes=1000))
        assert [(r, s, p) for r, s, p, _ in found] == [("CKD001", "warning", name)], found
        assert "more than 1000 bytes: not walked" in found[0][3]


def test_a_malformed_archive_is_reported_by_family(tmp_path: Path) -> None:
    """An invalid tar header after the first ends the listing (``tarfile`` stops there without an error), and a
    corrupt compressed member cannot be read: the members past that point are unchecked. In a tar of any name that
    is CKD216's note; in a file named as a torch file, torch's own reading fails, so it is CKD203's error."""
    tar = bytearray(_tar({"a.pkl": pickle.dumps([1, 2]), "b.pkl": pickle.dumps([3])}))
    tar[1024 + 148 : 1024 + 156] = b"9999999\0"  # the second member's header checksum
    with tarfile.open(fileobj=io.BytesIO(bytes(tar))) as t:
        assert t.getnames() == ["a.pkl"]  # what every tar reader lists
    truncated = _tar({"s.pkl": pickle.dumps([1] * 2000)}, "w:gz")[:80]
    cases = {
        "data.tar": (bytes(tar), "CKD216", "info", "invalid tar header"),
        "run.tar": (_tar({"inner.tar.gz": truncated}), "CKD216", "info", "compressed stream is unreadable"),
        "model.bin": (bytes(tar), "CKD203", "error", "invalid tar header"),
    }
    for name, (data, rule, severity, text) in cases.items():
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        (folder / name).write_bytes(data)
        found = _found(folder)
        assert any((r, s, p) == (rule, severity, name) and text in m for r, s, p, m in found), found
    clean = tmp_path / "clean"
    clean.mkdir()
    (clean / "data.tar").write_bytes(_tar({"a.pkl": pickle.dumps([1, 2])}))
    assert _found(clean) == []
