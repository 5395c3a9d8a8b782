"""The verdict cache (issue 27 §2): a rescan reports exactly what a scan without the cache reports, reads only the
files that changed, and never believes an entry it cannot prove its own and current."""

from __future__ import annotations

import json
import marshal
import os
import shutil
import stat
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ckptdoctor.sources.local as local_source
from ckptdoctor.cache import source as cache_source
from ckptdoctor.cache.codec import _indices, _numbers
from ckptdoctor.cache.store import Store, cache_dir, digest
from ckptdoctor.scanner import scan as scan_without_default
from tests.helpers.builders import comparable_report
from tests.helpers.cache_files import cache_document
from tests.helpers.cli import invoke
from tests.helpers.paths import REPO

FIXTURES = REPO / "fixtures"


def scan(*args: Any, cache: bool = True, **kwargs: Any) -> Any:
    """``scanner.scan`` with the cache on unless told (it is off by default: ``--cache``)."""
    return scan_without_default(*args, cache=cache, **kwargs)


@pytest.fixture
def no_racy_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files a test has just written count as settled (the cache otherwise keeps nothing of a file changed in the
    two seconds before the scan: it may still be being written)."""
    monkeypatch.setattr(cache_source, "RACY_NS", -10_000_000_000)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The root-relative paths of the files read from the local disk (headers, or `.distcp` items)."""
    seen: list[str] = []
    real_read, real_items = local_source.read_file, local_source.read_dcp_items_of

    def read_file(abs_path: str, rel: str, *args: Any, **kwargs: Any) -> Any:
        seen.append(rel)
        return real_read(abs_path, rel, *args, **kwargs)

    def read_items(abs_path: str, facts: Any, *args: Any) -> Any:
        seen.append(f"items:{facts.path}")
        return real_items(abs_path, facts, *args)

    monkeypatch.setattr(local_source, "read_file", read_file)
    monkeypatch.setattr(local_source, "read_dcp_items_of", read_items)
    return seen


def _same(a: Any, b: Any) -> None:
    """Two reports of one root are the same, fact for fact (``repr``: 0.0 and -0.0, 1 and True apart)."""
    assert comparable_report(a) == comparable_report(b)
    assert [repr(t) for t in a.trees] == [repr(t) for t in b.trees]


def _cache_files() -> list[Path]:
    return sorted((Path(cache_dir()) / "facts").glob("*.bin"))


def test_a_rescan_reads_nothing_and_reports_the_same(reads: list[str]) -> None:
    """Every fixture (sharded weights, adapters, DCP folders with their `.distcp` items, broken saves): the scan
    without the cache, the first scan with it and the rescan give the same trees and findings."""
    plain = scan(str(FIXTURES), cache=False)
    assert not _cache_files()
    n = len(reads)
    cold = scan(str(FIXTURES))
    assert len(reads) == 2 * n and _cache_files()
    warm = scan(str(FIXTURES))
    assert reads[2 * n :] == []  # nothing opened: the facts and the `.distcp` items came from the cache
    assert any(r.startswith("items:") for r in reads[:n])
    _same(plain, cold)
    _same(plain, warm)
    assert "CKD201" in {f.rule for f in warm.findings}  # the broken fixtures are found from the cache too


def test_by_default_a_file_is_kept_once_a_second_scan_finds_it_unchanged(
    tmp_path: Path, reads: list[str], no_racy_window: None
) -> None:
    """The default (``cache=None``, neither --cache nor --no-cache): the first scan notes each file (a sighting,
    no facts: a one-off scan pays next to nothing), the second reads them again and keeps the facts of those
    unchanged since, the third reads none of those. A file changed between the first two scans is only sighted
    again. Every report is the one without the cache."""
    run = shutil.copytree(FIXTURES / "sharded", tmp_path / "run")
    plain = scan(str(run), cache=False)
    n = len(reads)
    first = scan(str(run), cache=None)
    assert len(reads) == 2 * n and _cache_files()
    assert all("facts" not in e for d in _documents() for e in d["entries"].values())  # sightings only
    index = run / "checkpoint-4" / "model.safetensors.index.json"
    index.write_text(index.read_text().replace('"total_size"', '"total_size" ', 1))
    second = scan(str(run), cache=None)
    assert len(reads) == 3 * n
    third = scan(str(run), cache=None)
    assert reads[3 * n :] == ["checkpoint-4/model.safetensors.index.json"]  # kept now, read from the cache next
    fourth = scan(str(run), cache=None)
    assert reads[3 * n + 1 :] == []
    for report in (first, second, third, fourth):
        _same(scan(str(run), cache=False) if report is not first else plain, report)


def test_one_changed_file_is_the_only_one_read(tmp_path: Path, reads: list[str], no_racy_window: None) -> None:
    run = shutil.copytree(FIXTURES / "sharded", tmp_path / "run")
    scan(str(run))
    index = run / "checkpoint-4" / "model.safetensors.index.json"
    index.write_text(index.read_text().replace('"total_size"', '"total_size" ', 1))
    before = len(reads)
    warm = scan(str(run))
    assert reads[before:] == ["checkpoint-4/model.safetensors.index.json"]
    _same(scan(str(run), cache=False), warm)


def _pickle_pair() -> tuple[bytes, bytes]:
    """A harmless pickle and one that runs `os.system("ls")` on load, of the same length."""
    hostile = b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00ls\x85R."
    text = b"x" * (len(hostile) - 8)
    harmless = b"\x80\x02X" + struct.pack("<I", len(text)) + text + b"."
    assert len(harmless) == len(hostile)
    return harmless, hostile


def test_a_file_rewritten_with_its_old_size_and_time_is_read_again(tmp_path: Path, no_racy_window: None) -> None:
    """The attack on a size + mtime key: the bytes change, `touch -d` puts the time back. The change time (which no
    caller can set) differs, so the entry is not the file's."""
    harmless, hostile = _pickle_pair()
    target = tmp_path / "run" / "checkpoint-1" / "training_args.bin"
    target.parent.mkdir(parents=True)
    target.write_bytes(harmless)
    assert "CKD601" not in {f.rule for f in scan(str(tmp_path / "run")).findings}
    st = target.stat()
    target.write_bytes(hostile)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (target.stat().st_size, target.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert "CKD601" in {f.rule for f in scan(str(tmp_path / "run")).findings}


def test_a_file_changed_just_before_the_scan_is_not_kept(tmp_path: Path, reads: list[str]) -> None:
    """A file whose last change is within the racy window may still be being written: read, never kept."""
    run = shutil.copytree(FIXTURES / "clean-lora", tmp_path / "run")
    scan(str(run))
    before = len(reads)
    scan(str(run))
    assert len(reads) - before == before  # all read again: nothing was settled enough to keep


def _tamper(change: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite every cache file with ``change`` applied to its document, under the cache's own key (as only this
    user's ckptdoctor could): what the decoder and the checks make of a document that is signed but wrong."""
    key = (Path(cache_dir()) / "key").read_bytes()
    for path in _cache_files():
        doc = cache_document(path)
        change(doc)
        body = marshal.dumps(doc, 4)
        path.write_bytes(digest(body, key=key).encode() + b"\n" + body)


def _poison_facts(doc: dict[str, Any]) -> None:
    """Point every entry at the table's first node (a value of another kind than FileFacts)."""
    for entry in doc["entries"].values():
        entry["facts"] = 0


def _forward_node(doc: dict[str, Any]) -> None:
    leaves, groups = doc["table"]
    first = next(g for g in groups if g[0] != "D")
    kids = _numbers(first[-1]).tolist()
    kids[0] = len(leaves) + 10**6  # a child after its parent
    first[-1] = _indices(kids)


def _entry_holding_a_list(doc: dict[str, Any]) -> None:
    entries = next(g for g in doc["table"][1] if g[0] == "D")
    entries[3][0] = [1.0]  # a log entry (an inline dict) holds scalars only


def _code_leaf(doc: dict[str, Any]) -> None:
    doc["table"][0][0] = compile("print(1)", "<cache>", "exec")  # marshal carries code; a table never holds it


def _other_version(doc: dict[str, Any]) -> None:
    doc["version"] = "0.0.0"


def _other_limits(doc: dict[str, Any]) -> None:
    doc["limits"] = "0" * 64


@pytest.mark.parametrize(
    "change", [_poison_facts, _forward_node, _entry_holding_a_list, _code_leaf, _other_version, _other_limits]
)
def test_a_signed_but_wrong_entry_is_not_trusted(
    tmp_path: Path, reads: list[str], no_racy_window: None, change: Callable[[dict[str, Any]], None]
) -> None:
    run = shutil.copytree(FIXTURES / "sharded", tmp_path / "run")
    plain = scan(str(run), cache=False)
    scan(str(run))
    _tamper(change)
    before = len(reads)
    again = scan(str(run))
    assert len(reads) - before == plain.files  # every file read again
    _same(plain, again)


def test_an_entry_not_signed_with_this_users_key_is_not_trusted(
    tmp_path: Path, reads: list[str], no_racy_window: None
) -> None:
    """A cache file edited by hand, or one copied from another machine (signed under another key), is ignored; a
    key file open to other users turns the cache off."""
    run = shutil.copytree(FIXTURES / "sharded", tmp_path / "run")
    plain = scan(str(run), cache=False)
    scan(str(run))
    (path,) = _cache_files()
    mac, _, body = path.read_bytes().partition(b"\n")
    path.write_bytes(mac + b"\n" + body + b" ")  # one byte more: the MAC fails
    before = len(reads)
    _same(plain, scan(str(run)))
    assert len(reads) - before == plain.files
    other = digest(body, key=os.urandom(32)).encode()
    path.write_bytes(other + b"\n" + body)  # signed, by someone else's key
    before = len(reads)
    _same(plain, scan(str(run)))
    assert len(reads) - before == plain.files
    key = Path(cache_dir()) / "key"
    key.chmod(0o644)
    assert isinstance(Store.open(), str)
    before = len(reads)
    _same(plain, scan(str(run)))
    assert len(reads) - before == plain.files


def test_the_cache_folder_must_be_private(tmp_path: Path) -> None:
    folder = Path(cache_dir())
    folder.mkdir(parents=True, mode=0o700)
    folder.chmod(0o770)
    assert "other users" in str(Store.open())
    scan(str(FIXTURES / "sharded"))
    assert not (folder / "facts").exists()
    folder.chmod(0o700)
    link = tmp_path / "linked"
    link.symlink_to(folder)
    assert "link" in str(Store.open(str(link)))


def test_nothing_is_written_into_the_scanned_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = shutil.copytree(FIXTURES / "sharded", tmp_path / "run")
    monkeypatch.setenv("XDG_CACHE_HOME", str(run / ".cache"))
    names = sorted(p.relative_to(run) for p in run.rglob("*"))
    scan(str(run))
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == names


def test_no_cache_leaves_the_cache_alone() -> None:
    scan(str(FIXTURES / "sharded"), cache=False)
    assert not Path(cache_dir()).exists()
    code, out, _ = invoke("scan", "--no-cache", "--format", "json", str(FIXTURES / "sharded"))
    assert code in (0, 1) and json.loads(out)["findings"] is not None
    assert not Path(cache_dir()).exists()


def test_a_verdict_is_kept_and_judged_again_under_other_allowances(tmp_path: Path, no_racy_window: None) -> None:
    """The verdict of a file whose globals the policy settles by name is kept; one judged under other
    allowances is judged again; one that needed an installed package's source is never kept."""
    folder = tmp_path / "run" / "checkpoint-1"
    folder.mkdir(parents=True)
    # a call of `TrainingArguments`, an allowlisted class (so judged by name alone) that the stream calls: unsafe
    # unless the user allows it
    (folder / "training_args.bin").write_bytes(b"\x80\x02ctransformers.training_args\nTrainingArguments\n)R.")
    # `json.decoder.JSONDecoder`: a class only its installed source can prove
    (folder / "rng_state.pth").write_bytes(b"\x80\x02cjson.decoder\nJSONDecoder\nq\x00.")
    root = str(tmp_path / "run")

    def unsafe(**kw: Any) -> set[str]:
        return {f.path for f in scan(root, **kw).findings if f.rule == "CKD601"}

    from ckptdoctor.rules import Selection

    allow = Selection(allow_globals=(("transformers.training_args.TrainingArguments", "--allow-global"),))
    first = unsafe()
    assert "checkpoint-1/training_args.bin" in first
    doc = _documents()[0]
    assert "verdict" in doc["entries"]["checkpoint-1/training_args.bin"]
    assert "verdict" not in doc["entries"]["checkpoint-1/rng_state.pth"]
    assert unsafe() == first  # the kept verdict
    assert "checkpoint-1/training_args.bin" not in unsafe(selection=allow)
    assert unsafe() == first


def _documents() -> list[dict[str, Any]]:
    return [cache_document(p) for p in _cache_files()]


def test_a_run_scanned_alone_or_in_its_folder_uses_one_cache_file(
    tmp_path: Path, reads: list[str], no_racy_window: None
) -> None:
    shutil.copytree(FIXTURES / "sharded", tmp_path / "runs" / "a")
    scan(str(tmp_path / "runs" / "a"))
    before = len(reads)
    scan(str(tmp_path / "runs"))
    assert reads[before:] == []
    assert len(_cache_files()) == 1


def test_writers_at_once_leave_a_whole_file(tmp_path: Path) -> None:
    """Two scans (``scan_many`` workers) writing one cache file at once: each write replaces it whole."""
    store = Store.open()
    assert isinstance(store, Store)
    docs = [{"n": i, "pad": "x" * 200_000} for i in range(8)]
    seen: list[int] = []

    def write(doc: dict[str, Any]) -> None:
        for _ in range(5):
            assert store.write("one", doc)
            got = store.read("one", {})
            assert got is not None
            seen.append(got["n"])

    threads = [threading.Thread(target=write, args=(d,)) for d in docs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(seen) == 40 and set(seen) <= set(range(8))
    assert [p.name for p in (Path(cache_dir()) / "facts").iterdir() if p.name.startswith(".tmp")] == []


def test_cache_info_and_clear() -> None:
    code, out, _ = invoke("cache", "info")
    assert code == 0 and "not created yet" in out
    scan(str(FIXTURES))
    code, out, _ = invoke("cache", "info")
    assert code == 0 and "state: in use" in out and f"folder: {cache_dir()}" in out
    stranger = Path(cache_dir()) / "notes.txt"
    stranger.write_text("mine")
    code, out, _ = invoke("cache", "clear")
    assert code == 0 and "removed" in out
    assert not _cache_files() and not (Path(cache_dir()) / "key").exists()
    assert stranger.read_text() == "mine"  # only the cache's own files go
    assert stat.S_ISDIR(os.lstat(cache_dir()).st_mode)


def test_a_file_no_scan_used_for_a_month_is_pruned_once_a_day(
    monkeypatch: pytest.MonkeyPatch, reads: list[str], no_racy_window: None
) -> None:
    """The cache is on by default, so it is kept from growing for ever: a scan that takes a file marks it used, and
    the first scan of a day removes the files no scan used for ``KEEP_DAYS`` (and temporary files killed writers
    left); a run not scanned for that long is read afresh. Nothing else in the folder is touched."""
    from ckptdoctor.cache import store

    clock = [1_000_000_000.0]
    monkeypatch.setattr(store, "_now", lambda: clock[0])
    run, other = FIXTURES / "clean-full", FIXTURES / "clean-lora"
    scan(str(run))
    scan(str(other))
    files = {p.name: p for p in _cache_files()}
    assert len(files) == 2
    folder = Path(cache_dir())
    stranger = folder / "notes.txt"
    stranger.write_text("mine")
    torn = folder / "facts" / ".tmp-0123456789abcdef"
    torn.write_bytes(b"half")
    for p in [*files.values(), torn]:
        os.utime(p, (clock[0], clock[0]))  # written "now" on the test's clock
    os.utime(folder / "pruned", (clock[0], clock[0]))

    clock[0] += 20 * 86_400  # 20 days on: `run` is scanned (its file taken, so marked used), `other` is not
    reads.clear()
    scan(str(run))
    assert reads == []  # taken from the cache, not pruned: 20 days is under KEEP_DAYS
    assert not torn.exists()  # a day's old temporary file goes with the first scan of the day
    clock[0] += 15 * 86_400  # 35 days after `other` was last used, 15 after `run`
    scan(str(run))
    assert [p.name for p in _cache_files()] == [n for n, p in files.items() if p.exists()]
    assert len(_cache_files()) == 1 and stranger.read_text() == "mine"
    reads.clear()
    scan(str(other))
    assert reads  # pruned: read afresh, as on a first scan

    clock[0] += 3600  # the same day: no second pruning, however old the files
    scan(str(run))
    assert len(_cache_files()) == 2
    assert store.prune(days=0) == 2 and _cache_files() == []  # on demand (`ckptdoctor cache prune --days 0`)


def test_cache_prune_command() -> None:
    scan(str(FIXTURES / "clean-full"))
    code, out, _ = invoke("cache", "prune")
    assert code == 0 and out.startswith("removed 0 files from ") and len(_cache_files()) == 1
    code, out, _ = invoke("cache", "prune", "--days", "0")
    assert code == 0 and out.startswith("removed 1 file from ") and _cache_files() == []
    code, _, err = invoke("cache", "prune", "--days", "-1")
    assert code == 2 and "-1" in err


def test_gate_takes_no_cache() -> None:
    code, out, err = invoke("gate", "--no-cache", str(FIXTURES / "clean-full"))
    assert code == 0, out + err
    assert not Path(cache_dir()).exists()


def _facts_kept() -> bool:
    return any("facts" in e for d in _documents() for e in d["entries"].values())


def test_the_cache_is_on_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """scan and gate (command and API) use the user's cache folder unless --no-cache (``cache=False``) or
    CKPTDOCTOR_CACHE=0: by default a first scan sights the files, --cache (or CKPTDOCTOR_CACHE=1) keeps their facts
    at once; the flag wins over the variable. The scanner's own building block keeps it off unless asked. The
    report is the same every way."""
    import ckptdoctor

    root = str(FIXTURES / "sharded")
    monkeypatch.delenv("CKPTDOCTOR_CACHE", raising=False)  # the developer's own setting
    code, out, _ = invoke("scan", "--no-cache", "--format", "json", root)
    assert code in (0, 1) and not Path(cache_dir()).exists()
    scan_without_default(root)
    ckptdoctor.scan(root, cache=False)
    assert not Path(cache_dir()).exists()
    monkeypatch.setenv("CKPTDOCTOR_CACHE", "0")
    code, with_off, _ = invoke("scan", "--format", "json", root)
    assert code in (0, 1) and not Path(cache_dir()).exists()
    code, with_flag, _ = invoke("scan", "--cache", "--format", "json", root)
    assert code in (0, 1) and _facts_kept()
    shutil.rmtree(cache_dir())
    monkeypatch.setenv("CKPTDOCTOR_CACHE", "1")
    code, with_on, _ = invoke("scan", "--format", "json", root)
    assert code in (0, 1) and _facts_kept()
    monkeypatch.delenv("CKPTDOCTOR_CACHE")
    shutil.rmtree(cache_dir())
    code, by_default, _ = invoke("scan", "--format", "json", root)
    assert code in (0, 1) and _cache_files() and not _facts_kept()
    code, second, _ = invoke("scan", "--format", "json", root)
    assert _facts_kept()
    code, warm, _ = invoke("scan", "--format", "json", root)
    assert all(_masked(x) == _masked(out) for x in (with_off, with_flag, with_on, by_default, second, warm))
    shutil.rmtree(cache_dir())
    ckptdoctor.scan(root)
    assert _cache_files() and not _facts_kept()
    ckptdoctor.scan(root, cache=True)
    assert _facts_kept()
    shutil.rmtree(cache_dir())
    code, _, err = invoke("gate", str(FIXTURES / "clean-full"))
    assert code == 0, err
    assert _cache_files()


def _masked(document: str) -> Any:
    doc = json.loads(document)
    doc.pop("seconds", None)
    doc.get("summary", {}).pop("seconds", None)
    return doc
