"""Remote roots through fsspec, against a real S3-compatible server (moto's server mode) on loopback.

The same trees are scanned locally and at ``s3://``: the reports must agree, and a scan must cost headers plus a
little per file (counted at the fsspec file's ``_fetch_range`` and in the server's request log).
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import os
import pickle
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tests.helpers.paths import REPO

pytest.importorskip("moto.server")
pytest.importorskip("s3fs")

import fsspec  # only once the skips above have passed (ruff: E402 is not selected)
import s3fs
import s3fs.core
import torch
from moto.server import ThreadedMotoServer
from safetensors.torch import save_file

from ckptdoctor.cli import main
from ckptdoctor.fixer import FixRefused, fix
from ckptdoctor.limits import Limits
from ckptdoctor.scanner import scan
from ckptdoctor.sources import is_remote
from ckptdoctor.sources.fsspec import READAHEAD, WHOLE_FILE, FsspecSource, _entry
from ckptdoctor.sources.interface import Entry
from tests.helpers.builders import comparable_report, trainer_state
from tests.helpers.remote import fsspec_setting

FIXTURES = REPO / "fixtures"
BUCKET = "ckpts"


class _RequestLog(logging.Handler):
    """The HTTP requests moto's server logs (through werkzeug), as "METHOD /path?query"."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        plain = re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage())  # werkzeug colours some lines
        m = re.search(r"\b(GET|HEAD|PUT|POST|DELETE) (\S+) HTTP/1", plain)
        if m:
            self.lines.append(f"{m.group(1)} {m.group(2)}")


@pytest.fixture(scope="module")
def s3_server() -> Iterator[tuple[str, _RequestLog]]:
    """A moto S3 server on 127.0.0.1 (free port), with dummy credentials and fsspec pointed at it."""
    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    host, port = srv.get_host_and_port()
    url = f"http://{host}:{port}"
    log = _RequestLog()
    werkzeug = logging.getLogger("werkzeug")
    werkzeug.addHandler(log)
    werkzeug.setLevel(logging.INFO)
    werkzeug.propagate = False  # keep pytest's output free of one line per request
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": url}
    old_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with fsspec_setting("s3", {"client_kwargs": {"endpoint_url": url}}, s3fs.S3FileSystem):
            fs = fsspec.filesystem("s3")
            fs.mkdir(BUCKET)
            yield url, log
    finally:
        werkzeug.removeHandler(log)
        werkzeug.propagate = True
        srv.stop()
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _upload(local: Path, key: str) -> str:
    fs = fsspec.filesystem("s3")
    fs.put(str(local) + "/", f"{BUCKET}/{key}/", recursive=True)
    fs.invalidate_cache()
    return f"s3://{BUCKET}/{key}/"




@pytest.fixture(scope="module")
def fixtures_url(s3_server: tuple[str, _RequestLog], tmp_path_factory: pytest.TempPathFactory) -> str:
    return _upload(FIXTURES, "fixtures")


# Findings that compare file times: an object's time is when it was uploaded, not when the trainer wrote it.
_TIME_FIXTURES = {"stale-higher"}


@pytest.mark.parametrize(
    "name", sorted(p.name for p in FIXTURES.iterdir() if p.is_dir() and p.name not in _TIME_FIXTURES)
)
def test_remote_scan_matches_local(fixtures_url: str, name: str) -> None:
    remote = scan(fixtures_url + name + "/", jobs=4)
    local = scan(str(FIXTURES / name), jobs=4)
    assert comparable_report(remote) == comparable_report(local)
    assert remote.files == local.files > 0


def test_remote_scan_of_every_fixture_at_once(s3_server: tuple[str, _RequestLog], fixtures_url: str) -> None:
    """Runs below the root, DCP folders (their `.distcp` items read in the second pass), loose files."""
    log = s3_server[1]
    before = len(log.lines)
    remote = scan(fixtures_url, jobs=2)
    requests = log.lines[before:]
    local = scan(str(FIXTURES), jobs=2)
    a, b = comparable_report(remote), comparable_report(local)
    assert [r["path"] for r in a["runs"]] == [r["path"] for r in b["runs"]]
    assert [r["resume_pick"] for r in a["runs"]] == [r["resume_pick"] for r in b["runs"]]
    time_paths = tuple(f"{n}/" for n in _TIME_FIXTURES)
    keep = [f for f in a["findings"] if not f["path"].startswith(time_paths)]
    assert keep == [f for f in b["findings"] if not f["path"].startswith(time_paths)]
    assert {f["rule"] for f in keep} >= {"CKD201"}  # the broken fixtures are found remotely too
    assert remote.files == local.files
    # One ranged GET per object (small ones whole), plus the listing and the `.distcp` items (spans merged).
    assert all(r.startswith("GET /") for r in requests)
    assert len(requests) <= 1 + remote.files + 4  # the two fsdp optimizers' items: one merged span each
    total = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
    print(f"\nremote scan of fixtures/: {len(requests)} requests for {remote.files} files ({total} bytes)")


def test_single_object_root(fixtures_url: str) -> None:
    rel = "sharded/checkpoint-4/model-00001-of-00005.safetensors"
    remote, local = scan(fixtures_url + rel), scan(str(FIXTURES / rel))
    (rf,), (lf,) = remote.trees[0].loose_files, local.trees[0].loose_files
    assert (rf.path, rf.size, rf.kind, rf.content, rf.problems) == (lf.path, lf.size, lf.kind, lf.content, lf.problems)


def test_prefixes_are_folders_for_the_resume_pick(s3_server: tuple[str, _RequestLog], tmp_path: Path) -> None:
    """get_last_checkpoint lists folders: an empty `checkpoint-12/` marker and a prefix holding only a stray file
    both count, as the folders they stand for would on a mounted bucket."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "sharded", run)
    url = _upload(run, "pick")
    fs = fsspec.filesystem("s3")
    fs.pipe(f"{BUCKET}/pick/checkpoint-10/notes.txt", b"hello")
    fs.invalidate_cache()
    assert scan(url).trees[0].runs[0].resume_pick == "checkpoint-10"
    fs.touch(f"{BUCKET}/pick/checkpoint-12/")  # a folder marker object, as consoles create for "new folder"
    fs.invalidate_cache()
    tree = scan(url).trees[0]
    assert tree.runs[0].resume_pick == "checkpoint-12"
    (local_dir := run / "checkpoint-12").mkdir()
    (run / "checkpoint-10").mkdir()
    (run / "checkpoint-10" / "notes.txt").write_text("hello")
    assert local_dir.is_dir()
    assert scan(str(run)).trees[0].runs[0].resume_pick == "checkpoint-12"


def _big_sharded(folder: Path) -> dict[str, int]:
    """A real 4-shard checkpoint with 8 MB of weights and AdamW state (torch.save); returns each file's header size
    (safetensors: 8 + JSON header)."""
    folder.mkdir(parents=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(2048, 256), torch.nn.Linear(256, 2048), torch.nn.Linear(2048, 256))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 2048, (4,))).sum().backward()
    opt.step()
    state = model.state_dict()
    names = list(state)
    weight_map: dict[str, str] = {}
    headers: dict[str, int] = {}
    shards = [names[i::4] for i in range(4)]
    for i, keys in enumerate(shards, 1):
        fn = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: state[k].contiguous() for k in keys}, str(folder / fn), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, fn))
        headers[fn] = 8 + int.from_bytes((folder / fn).read_bytes()[:8], "little")
    total = sum(v.numel() * v.element_size() for v in state.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps(trainer_state(4, 8)))
    (folder / "config.json").write_text(json.dumps({"hidden_size": 256}))
    return headers


def _count_fetches(monkeypatch: pytest.MonkeyPatch, level: int) -> dict[str, list[int]]:
    """The size of every ranged GET from now on, keyed by the object key's ``level``-th part from the end."""
    fetched: dict[str, list[int]] = {}
    orig = s3fs.core.S3File._fetch_range

    def counting(self: Any, start: int, end: int) -> bytes:
        data: bytes = orig(self, start, end)
        fetched.setdefault(self.path.rsplit("/", level)[-level], []).append(len(data))
        return data

    monkeypatch.setattr(s3fs.core.S3File, "_fetch_range", counting)
    return fetched


def test_remote_scan_reads_headers_only(
    s3_server: tuple[str, _RequestLog], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = tmp_path / "run"
    headers = _big_sharded(run / "checkpoint-4")
    url = _upload(run, "big")
    sizes = {p.name: p.stat().st_size for p in (run / "checkpoint-4").iterdir()}
    fetched = _count_fetches(monkeypatch, 1)
    log = s3_server[1]
    before = len(log.lines)
    report = scan(url, jobs=4)
    requests = log.lines[before:]
    local = scan(str(run), jobs=4)
    assert comparable_report(report) == comparable_report(local)

    total = sum(sizes.values())
    got = sum(sum(v) for v in fetched.values())
    assert total > 16_000_000
    assert got < total / 100  # headers, not tensors
    for name, header in headers.items():  # safetensors: the header plus at most a few KB, in at most 2 requests
        small = sizes[name] <= WHOLE_FILE  # small objects are fetched whole, in one request
        assert sum(fetched[name]) <= (sizes[name] if small else header + 256 + 2 * READAHEAD), (name, fetched[name])
        assert len(fetched[name]) <= (1 if small else 2)
    assert sum(sizes[n] > WHOLE_FILE for n in headers) >= 3
    # optimizer.pt: the zip end (torchzip reads a 64 KB window for the end record), the local headers of the
    # records a loader parses, and data.pkl; never a tensor, nor a tensor record's local header.
    assert sum(fetched["optimizer.pt"]) <= 65_557 + 64 * 1024
    # No HEAD per file (sizes come from the listing): one listing, and only ranged GETs afterwards.
    assert [r for r in requests if not r.startswith("GET /")] == []
    listings = [r for r in requests if "list-type=2" in r]
    assert len(listings) == 1
    assert len(requests) == sum(len(v) for v in fetched.values()) + len(listings)
    print(f"\nremote scan: {len(requests)} requests, {got} bytes fetched of {total} ({len(sizes)} files)")
    for name in sorted(sizes):
        print(f"  {name}: {len(fetched.get(name, []))} requests, {sum(fetched.get(name, []))} of {sizes[name]} bytes")


def test_remote_torch_zip_costs_requests_independent_of_its_tensors(
    s3_server: tuple[str, _RequestLog], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An optimizer.pt's tensor records are never fetched, not even their local headers (a request each): a state
    of 600 tensors costs the end, the directory and the records a loader parses, like a state of 150."""
    fetched = _count_fetches(monkeypatch, 3)  # per run folder
    for n_params in (50, 200):
        run = tmp_path / f"tensors{n_params}"
        (run / "checkpoint-4").mkdir(parents=True)
        # 4 KB per tensor: each record's local header would be a request of its own (READAHEAD is 1 KB).
        params = [torch.nn.Parameter(torch.zeros(16, 64)) for _ in range(n_params)]
        opt = torch.optim.AdamW(params)
        torch.stack([p.sum() for p in params]).sum().backward()
        opt.step()
        torch.save(opt.state_dict(), run / "checkpoint-4" / "optimizer.pt")
        assert (run / "checkpoint-4" / "optimizer.pt").stat().st_size > WHOLE_FILE  # read in ranges, not whole
        assert comparable_report(scan(_upload(run, run.name))) == comparable_report(scan(str(run)))
    requests = {n: len(fetched[f"tensors{n}"]) for n in (50, 200)}
    assert requests[50] == requests[200] <= 8, requests  # the sniff, the end, then a few headers and data.pkl
    assert sum(fetched["tensors200"]) < 65_557 + 64 * 1024


def test_remote_scan_fetches_no_byte_twice(
    s3_server: tuple[str, _RequestLog], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Readers return to bytes they read before (the sniff's head, a zip's end window): those are served from what
    the open object kept, so a shard whose header is longer than the sniff's first read costs two requests (the
    head, then the rest of the header), not three, and no byte of any object is fetched twice."""
    ckpt = tmp_path / "run" / "checkpoint-4"
    ckpt.mkdir(parents=True)
    # 300 tensors a shard: a 7B shard's header length (~20 KB), well past the sniff's first 1.5 KB.
    for i in (1, 2):
        tensors = {f"model.layers.{k}.mlp.weight": torch.zeros(16, 16) for k in range(300)}
        save_file(tensors, str(ckpt / f"model-0000{i}-of-00002.safetensors"), metadata={"format": "pt"})
    params = [torch.nn.Parameter(torch.zeros(16, 64)) for _ in range(100)]
    opt = torch.optim.AdamW(params)
    torch.stack([p.sum() for p in params]).sum().backward()
    opt.step()
    torch.save(opt.state_dict(), ckpt / "optimizer.pt")
    (ckpt / "trainer_state.json").write_text(json.dumps(trainer_state(4, 8)))
    sizes = {p.name: p.stat().st_size for p in ckpt.iterdir()}
    assert all(sizes[n] > WHOLE_FILE for n in sizes if n.endswith((".safetensors", ".pt")))
    url = _upload(tmp_path / "run", "no-byte-twice")
    ranges: dict[str, list[tuple[int, int]]] = {}
    orig = s3fs.core.S3File._fetch_range

    def recording(self: Any, start: int, end: int) -> bytes:
        data: bytes = orig(self, start, end)
        ranges.setdefault(self.path.rsplit("/", 1)[-1], []).append((start, start + len(data)))
        return data

    monkeypatch.setattr(s3fs.core.S3File, "_fetch_range", recording)
    log = s3_server[1]
    before = len(log.lines)
    report = scan(url, jobs=2)
    gets = [r for r in log.lines[before:] if r.startswith("GET /") and "list-type=2" not in r]
    assert comparable_report(report) == comparable_report(scan(str(tmp_path / "run"), jobs=2))
    assert len(gets) == sum(len(v) for v in ranges.values())  # every GET of an object was seen by the recorder
    for name, spans in ranges.items():
        covered = sorted(spans)
        for (_, end), (start, _) in itertools.pairwise(covered):
            assert end <= start, (name, spans)  # no byte fetched twice
    for i in (1, 2):
        name = f"model-0000{i}-of-00002.safetensors"
        header = 8 + int.from_bytes((ckpt / name).read_bytes()[:8], "little")
        assert len(ranges[name]) == 2 and ranges[name][-1][1] >= header, ranges[name]  # was 3 (the head again)
    assert len(ranges["optimizer.pt"]) <= 5, ranges["optimizer.pt"]  # was 8: the head twice, the end window once
    assert len(ranges["trainer_state.json"]) == 1


def test_a_source_shipped_to_a_worker_reads_without_a_head_per_object(
    s3_server: tuple[str, _RequestLog], fixtures_url: str
) -> None:
    """A Dask task gets the source pickled: its file system's listings cache is empty there, and s3fs asks for an
    object's details (its ETag) at the first read. The listing's entry is passed on instead of a HEAD per object
    (was 88 HEADs for 88 objects in bench/fleet_s3.py's dask row)."""
    limits = Limits()
    source = FsspecSource(fixtures_url + "sharded", limits)
    assert isinstance(source.root([]), Entry)
    shipped = pickle.loads(pickle.dumps(source))
    shipped._fs.invalidate_cache()  # as in a fresh worker process, whatever fsspec's instance cache shares here
    files = [
        (name, _entry(where, name, full, info)[1])  # the entry as the walk hands it to read()
        for where, folder in shipped._folders.items()
        for name, full, info in folder.files
    ]
    log = s3_server[1]
    before = len(log.lines)
    for name, info in files:
        facts = shipped.read(Entry(name, info["name"], False, 0.0, info["name"], info), name, False)
        assert facts.problems == ()
    requests = log.lines[before:]
    assert len(files) >= 4
    assert [r for r in requests if not r.startswith("GET /")] == []
    assert all("list-type=2" not in r for r in requests)


def test_cli_scan_of_a_remote_root(fixtures_url: str) -> None:
    runner = CliRunner()
    remote = runner.invoke(main, ["scan", "--format", "json", fixtures_url + "stub-shadow/"])
    local = runner.invoke(main, ["scan", "--format", "json", str(FIXTURES / "stub-shadow")])
    assert remote.exit_code == local.exit_code == 1, remote.output
    a, b = json.loads(remote.output), json.loads(local.output)
    assert a["roots"] == [fixtures_url + "stub-shadow/"]
    assert [(f["rule"], f["path"], f["message"]) for f in a["findings"]] == [
        (f["rule"], f["path"], f["message"]) for f in b["findings"]
    ]
    text = runner.invoke(main, ["scan", fixtures_url + "stub-shadow/"])
    assert f"{fixtures_url}stub-shadow/checkpoint-8" in text.output


def test_cli_missing_remote_root_is_a_usage_error(fixtures_url: str) -> None:
    result = CliRunner().invoke(main, ["scan", f"s3://{BUCKET}/no-such-run/"])
    assert result.exit_code == 2
    assert "no such object or prefix" in result.output


def test_cli_deep_refuses_remote_roots(fixtures_url: str) -> None:
    result = CliRunner().invoke(main, ["scan", "--deep", fixtures_url + "sharded/"])
    assert result.exit_code == 2
    assert "local files only" in result.output


def test_fix_refuses_remote_roots(fixtures_url: str) -> None:
    fs = fsspec.filesystem("s3")
    before = fs.find(f"{BUCKET}/fixtures/stub-shadow", detail=True)
    result = CliRunner().invoke(main, ["fix", fixtures_url + "stub-shadow/"])
    assert result.exit_code == 2
    assert "refuses remote roots" in result.output and "Nothing was changed" in result.output
    with pytest.raises(FixRefused, match="refuses remote roots"):
        fix(fixtures_url + "stub-shadow/", dry_run=True)
    fs.invalidate_cache()
    assert fs.find(f"{BUCKET}/fixtures/stub-shadow", detail=True) == before


def test_is_remote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert is_remote("s3://b/run") and is_remote("gs://b/x") and is_remote("hf://datasets/a/b")
    assert is_remote("simplecache::s3://b/run")
    assert not is_remote("runs/a") and not is_remote("/abs/s3:/x") and not is_remote("C:\\runs")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s3:").mkdir()
    (tmp_path / "s3:" / "b").mkdir()
    assert not is_remote("s3://b")  # an existing local folder of that name stays local


def test_local_scans_never_import_fsspec() -> None:
    code = (
        "import sys; from ckptdoctor.scanner import scan; scan(sys.argv[1]); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('fsspec', 's3fs', 'botocore', 'aiobotocore')))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(FIXTURES / "sharded")], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_api_deep_refuses_remote_roots(fixtures_url: str) -> None:
    from ckptdoctor.deep import DeepUnavailable

    with pytest.raises(DeepUnavailable, match="local files only"):
        scan(fixtures_url + "sharded/", deep=True)


def test_remote_errors_are_values(fixtures_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bucket that does not exist, or an object that fails mid-read, is a problem in the report, not a crash."""
    (tree,) = scan("s3://no-such-bucket-ckd/run/").trees
    assert [p.problem.kind.value for p in tree.path_problems] == ["unreadable"]
    orig = s3fs.core.S3File._fetch_range

    def failing(self: Any, start: int, end: int) -> bytes:
        if self.path.endswith("trainer_state.json"):
            raise PermissionError(13, "Access Denied")
        data: bytes = orig(self, start, end)
        return data

    monkeypatch.setattr(s3fs.core.S3File, "_fetch_range", failing)
    report = scan(fixtures_url + "sharded/")
    states = [f for r in report.trees[0].runs for c in r.checkpoints for f in c.files if f.name == "trainer_state.json"]
    assert len(states) == 2
    assert all(any("Access Denied" in p.message for p in f.problems) for f in states)


@pytest.mark.slow
def test_gate_of_an_s3_run_matches_the_local_gate_and_the_resume(
    s3_server: tuple[str, _RequestLog], tmp_path: Path
) -> None:
    """`ckptdoctor gate` of a run in object storage predicts what it predicts locally, which is what the real
    Trainer's resume does."""
    pytest.importorskip("transformers")
    from ckptdoctor.resume_gate import gate
    from tests.helpers.gate_runs import ALL, assert_predicted, train

    out = tmp_path / "out"
    train(out)
    url = _upload(out, "gate-run")
    remote = gate(url, num_train_epochs=3, lr_steps=ALL)
    local = gate(out, num_train_epochs=3, lr_steps=ALL)
    assert remote.checkpoint is not None and remote.checkpoint.endswith("gate-run/checkpoint-8")
    fields = ("weights_branch", "start_step", "max_steps", "steps_to_train", "lr", "verdict", "base_lr")
    assert {k: getattr(remote, k) for k in fields} == {k: getattr(local, k) for k in fields}
    assert [(f.rule, f.message) for f in remote.findings] == [(f.rule, f.message) for f in local.findings]
    cli = CliRunner().invoke(main, ["gate", url, "--checkpoint", "checkpoint-4", "--format", "json"])
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.stdout)["start_step"] == 4
    assert CliRunner().invoke(main, ["gate", url.rstrip("/") + "-nothing/"]).exit_code == 2
    assert_predicted(local, train(out, resume=True, num_train_epochs=3))


def test_a_rescan_of_a_bucket_from_the_cache_lists_and_reads_nothing_else(
    s3_server: tuple[str, _RequestLog], tmp_path: Path
) -> None:
    """The verdict cache on an S3 root: the rescan is the listing alone and reports what a scan without the cache
    reports; an object replaced by other bytes of the same size (a new ETag and time) is the one object read."""
    log = s3_server[1]
    url = _upload(FIXTURES, "cached")
    plain = scan(url, jobs=2, cache=False)
    scan(url, jobs=2, cache=True)
    before = len(log.lines)
    warm = scan(url, jobs=2, cache=True)
    objects = [r for r in log.lines[before:] if r.startswith(f"GET /{BUCKET}/")]
    assert objects == []  # listing requests only (`GET /ckpts?list-type=2...`)
    assert comparable_report(warm) == comparable_report(plain)
    assert [repr(t) for t in warm.trees] == [repr(t) for t in plain.trees]
    fs = fsspec.filesystem("s3")
    key = f"{BUCKET}/cached/sharded/checkpoint-4/config.json"
    old = fs.cat(key)
    fs.pipe(key, b"{" + b" " * (len(old) - 2) + b"}")
    fs.invalidate_cache()
    before = len(log.lines)
    changed = scan(url, jobs=2, cache=True)
    objects = [r for r in log.lines[before:] if r.startswith(f"GET /{BUCKET}/")]
    assert objects == ["GET /ckpts/cached/sharded/checkpoint-4/config.json"]
    assert comparable_report(changed) == comparable_report(scan(url, jobs=2, cache=False))


def _sockets_alive_at_each_part(url: str) -> list[int]:
    """The socket objects alive (closed or not) at each part of a scan of ``url``, read one object at a time, beyond
    those alive before it."""
    import gc
    import socket

    from ckptdoctor.api import scan_roots
    from ckptdoctor.roots import Roots
    from ckptdoctor.settings.selection import Options

    def sockets() -> int:
        return sum(type(o) is socket.socket for o in gc.get_objects())

    seen: list[int] = []
    gc.collect()
    before = sockets()  # other tests' in this process (a pooled connection, a server's)

    def count(index: int, tree: object, findings: object) -> None:
        seen.append(sockets() - before)

    scan_roots(Roots.of([url]), Options.build(no_config=True), on_part=count, jobs=1)
    return seen


def test_a_remote_scan_keeps_no_request_garbage(fixtures_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each request through aiobotocore and aiohttp leaves its socket, transport, protocol and parsers in reference
    cycles; the scan pauses the cyclic collector, so without ``_collect_cycles`` they stayed to the scan's end (24-38
    KB of resident memory a checkpoint of an S3 fleet, bench/RESULTS.md). The remote source collects them every
    ``COLLECT_EVERY`` objects it closes (all of them every ``COLLECT_ALL_EVERY`` of those: a connection still pooled
    at a young collection dies later): what is alive stays bounded by that, not by the requests made so far."""
    import ckptdoctor.sources.fsspec as remote

    monkeypatch.setattr(remote, "COLLECT_EVERY", 10**9)  # never: what the scan kept before
    kept = _sockets_alive_at_each_part(fixtures_url)
    monkeypatch.setattr(remote, "COLLECT_EVERY", 4)
    monkeypatch.setattr(remote, "COLLECT_ALL_EVERY", 4)
    collected = _sockets_alive_at_each_part(fixtures_url)
    assert len(kept) == len(collected) > 10
    assert kept[-1] - kept[0] > 100  # one socket per request, growing with the scan
    assert max(collected) <= 25  # a few objects' requests, whatever was read before (607 at the end without)


def _walked_listing(source: FsspecSource) -> dict[str, tuple[list[str], list[tuple[str, dict[str, Any]]]]]:
    """Every folder of ``source``'s root as the walk lists it (name order, each folder once, told when left): its
    subfolders' names and its files' paths and entries, by folder path."""
    out: dict[str, tuple[list[str], list[tuple[str, dict[str, Any]]]]] = {}
    top = source.root([])
    assert isinstance(top, Entry)

    def walk(folder: Entry[dict[str, Any]]) -> None:
        listed = source.listdir(folder, "", [])
        assert listed is not None
        listed.sort(key=lambda e: e.name)
        out[folder.path] = ([e.name for e in listed if e.is_dir], [(e.path, e.meta) for e in listed if not e.is_dir])
        for sub in listed:
            if sub.is_dir:
                walk(sub)
        source.walked(folder.path)

    walk(top)
    return out


def test_the_cut_listing_indexes_as_finds_entries(
    s3_server: tuple[str, _RequestLog], fixtures_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An S3 root is listed page by page, each object's entry cut to what the scan reads (``_S3Stream``, ``_Cut``:
    1.35 KB an object was held as s3fs builds it): the folders, files and the entries the walk hands out are those
    of ``fs.find``'s listing (a key ending in `/` included), and reading them needs no request more."""
    import ckptdoctor.sources.fsspec as remote

    fs = fsspec.filesystem("s3")
    fs.pipe(f"{BUCKET}/fixtures/clean-full/placeholder/", b"")  # a console's "folder": a key ending in /
    fs.invalidate_cache()

    kinds: list[set[type]] = []
    real_take = remote.FsspecSource._take

    def take(self: FsspecSource, full: str, info: Any) -> bool:
        if not isinstance(info, dict) or info.get("type") != "directory":
            kinds[-1].add(type(info))
        return real_take(self, full, info)

    monkeypatch.setattr(remote.FsspecSource, "_take", take)

    def index(url: str) -> dict[str, tuple[list[str], list[tuple[str, dict[str, Any]]]]]:
        kinds.append(set())
        return _walked_listing(FsspecSource(url, Limits()))

    try:
        cut = index(fixtures_url)
        monkeypatch.setattr(remote._S3Stream, "open", classmethod(lambda cls, fs, path: None))  # find's, whole
        whole = index(fixtures_url)
    finally:  # by its key: fs.rm takes the `/` off and would leave the marker to the tests after this one
        fs.call_s3("delete_object", Bucket=BUCKET, Key="fixtures/clean-full/placeholder/")
        fs.invalidate_cache()
        assert not any(k.endswith("/") for k in fs.find(f"{BUCKET}/fixtures"))
    assert kinds == [{remote._Cut}, {dict}]
    assert cut.keys() == whole.keys()
    assert any(full.endswith("/placeholder/") for _, files in cut.values() for full, _ in files)
    for where in whole:
        dirs, files = whole[where]
        assert cut[where][0] == dirs
        assert [full for full, _ in cut[where][1]] == [full for full, _ in files]
        for (_, mine), (_, theirs) in zip(cut[where][1], files, strict=True):
            assert mine == {k: theirs[k] for k in mine if k != "mtime"} | {"mtime": remote._mtime(theirs)}
            assert {"name", "size", "type", "ETag"} <= mine.keys()


def _held_at_each_part(url: str, jobs: int, log: _RequestLog) -> tuple[list[int], Any, list[str]]:
    """The listing entries an S3 source's index holds at each part of a scan of ``url`` (``_Folder.size``: its
    files and itself), the report, and the requests made."""
    import ckptdoctor.sources.fsspec as remote
    from ckptdoctor.api import scan_roots
    from ckptdoctor.roots import Roots
    from ckptdoctor.settings.selection import Options

    sources: list[FsspecSource] = []
    real_root = remote.FsspecSource.root

    def root(self: FsspecSource, problems: list[Any]) -> Any:
        sources.append(self)
        return real_root(self, problems)

    held: list[int] = []

    def count(index: int, tree: object, findings: object) -> None:
        (source,) = sources
        now = sum(f.size() for f in source._folders.values())
        assert source._stream is None or source._held == now
        held.append(now)

    before = len(log.lines)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(remote.FsspecSource, "root", root)
        report = scan_roots(Roots.of([url]), Options.build(no_config=True), on_part=count, jobs=jobs, cache=False)
    return held, report, log.lines[before:]


@pytest.mark.parametrize("jobs", [1, 2])
def test_an_s3_walk_holds_one_run_of_the_listing_at_a_time(
    s3_server: tuple[str, _RequestLog], fixtures_url: str, monkeypatch: pytest.MonkeyPatch, jobs: int
) -> None:
    """The index of an S3 root is read page by page as the walk asks for each folder, and each folder leaves it
    when listed (``_S3Stream``, ``FsspecSource._walk_to`` and ``walked``): what it holds at each part is bounded by
    ``HELD_ENTRIES`` and a page (``PULL``) and the run being walked, not by the objects under the root. With both
    tiny here, the root and the larger runs are listed a level at a time too. The report, and each `.distcp` item
    read without a HEAD request, are those of the index read whole (s3fs's ``find``)."""
    import ckptdoctor.sources.fsspec as remote

    whole_held, whole, whole_requests = _held_at_each_part(fixtures_url, jobs, s3_server[1])
    monkeypatch.setattr(remote, "HELD_ENTRIES", 16)
    monkeypatch.setattr(remote, "PULL", 7)
    held, streamed, requests = _held_at_each_part(fixtures_url, jobs, s3_server[1])
    monkeypatch.setattr(remote._S3Stream, "open", classmethod(lambda cls, fs, path: None))
    found_held, found, found_requests = _held_at_each_part(fixtures_url, jobs, s3_server[1])

    assert comparable_report(streamed) == comparable_report(whole) == comparable_report(found)
    assert [repr(t) for t in streamed.trees] == [repr(t) for t in whole.trees] == [repr(t) for t in found.trees]
    # A run's objects come in key order, after those of a sibling whose name is the run's name and a character
    # before `/` (`sharded-wrong-index/` before `sharded/`), which the index holds until the walk gets to them.
    runs = {d.name: sum(1 for p in d.rglob("*") if p.is_file()) for d in FIXTURES.iterdir() if d.is_dir()}
    ahead = max(n + sum(runs[o] for o in runs if o.startswith(r) and o[len(r) :] < "/") for r, n in runs.items())
    assert len(held) == len(whole_held) > 15  # a part per run, and the rest
    assert max(held) <= 16 + 7 + ahead + 1 < streamed.files / 2  # what the walk is at, not the root's listing
    assert sorted(held)[len(held) // 2] <= 16 + 7 + max(runs.values()) + 1
    assert whole_held[0] > 0.8 * streamed.files  # the default holds a root this small whole, and releases it
    assert whole_held[-1] < 0.3 * streamed.files < min(found_held)  # find's index is held to the end
    for made in (requests, whole_requests, found_requests):
        assert [r for r in made if not r.startswith("GET /")] == []  # no HEAD: `.distcp` items read with entries
    objects = sorted(r for r in requests if "list-type=2" not in r)  # (pooled reads: in any order)
    assert objects == sorted(r for r in whole_requests if "list-type=2" not in r)
    lists = [r for r in whole_requests if "list-type=2" in r]
    assert len(lists) == 1 == len([r for r in found_requests if "list-type=2" in r])  # one page: no request more


def test_an_s3_listing_keeps_no_page_between_requests(
    s3_server: tuple[str, _RequestLog], fixtures_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An S3 root's listing asks for ``PULL`` keys a request and keeps only where the next page starts between two
    of them (``_S3Stream``): s3fs's ``_iterdir`` generator, which it read through before, held each page's entries
    (botocore's dicts, about 1 KB an object) until the next page had been fetched, so a fleet's scan held two pages
    at once where a root of one page held one (bench/RESULTS.md, "An S3 scan's memory from 10 to 1,000 runs"). Each
    object comes once, in key order, cut."""
    import ckptdoctor.sources.fsspec as remote

    monkeypatch.setattr(remote, "PULL", 5)
    fs, path = remote._filesystem(fixtures_url)
    log = s3_server[1]
    before = len(log.lines)
    stream = remote._S3Stream.open(fs, path.rstrip("/"))
    assert stream is not None
    keys: list[str] = []
    while page := stream.page():
        assert len(page) <= 5
        assert all(isinstance(entry, remote._Cut) for _, entry in page)
        keys.extend(full for full, _ in page)
        held = {k: v for k, v in vars(stream).items() if k != "fs"}
        assert held["_first"] is None
        assert not any(isinstance(v, (list, dict)) or inspect.isasyncgen(v) for v in held.values())  # no page
        assert held["_token"] is None or isinstance(held["_token"], str)
    lists = [r for r in log.lines[before:] if "list-type=2" in r]
    assert len(lists) == -(-len(keys) // 5) > 10  # a request a page, each of PULL keys
    assert all("max-keys=5" in r for r in lists)
    assert keys == sorted(fs.find(path.rstrip("/")))
