"""A fleet in S3 (issue 27, part 4): scan 1,000 runs of 10 Trainer checkpoints in a moto bucket on loopback.

Run by hand, never in CI (tests/test_bench_smoke.py runs it at 2 x 2):

    python bench/fleet_s3.py [--runs 1000] [--checkpoints 10] [--modes serial cache dask stream] [--checkout PATH]
    python bench/fleet_s3.py --runs 20 --checkpoints 10          # a quick check

What it measures, for each mode the checkout offers (a mode it lacks is skipped, with the reason):

* ``serial``: ``ckptdoctor scan --format json s3://fleet/runs/`` in a fresh interpreter (``--no-cache`` when the
  checkout has a verdict cache, so this is the cold scan);
* ``cache``: the same command twice with the cache on (``--cache`` where it is off by default) and an empty
  ``$XDG_CACHE_HOME``: the first scan fills the cache (``cache-fill``), the second is the nightly rescan of an
  unchanged bucket (``cache-warm``);
* ``dask``: ``ckptdoctor.scan_many([root], client=...)`` (one task per run of the root) on a ``LocalCluster`` of
  2 worker processes (1 thread each), started by a fresh interpreter that is the client (and, in a LocalCluster,
  the scheduler);
* ``stream``: the same cluster and client with the streaming form, ``ckptdoctor.iter_scan([root], client=...)``:
  each run handed out and dropped, then ``stream.report`` (the client's memory is the difference to ``dask``).

For each: wall time; requests as the server saw them (LIST, GET, HEAD, other) and the bytes of their response
bodies; peak resident memory of each process (``VmHWM``, read at exit by bench/probe.py in the scan process, in
each Dask worker through ``client.run``, and in the client, which in a LocalCluster is also the scheduler: not
``getrusage``, which for a process this one starts counts this one's size too); CPU time of the scan or client
process, from ``os.wait4`` (comparable on a loaded machine, where wall time is not).

The bucket: the server is moto's ``ThreadedMotoServer`` on 127.0.0.1, in this process, with a WSGI layer that counts
every request and response byte. One run of ``--checkpoints`` Trainer checkpoints is written on disk by
bench/synth.py's builders (real safetensors headers, a torch.save-layout AdamW ``optimizer.pt`` with one record per
state tensor, ``torch.save``'d scheduler / RNG / training arguments, the Trainer's ``trainer_state.json``), for a
model with Llama-2-7B's 32 layers and tensor names but tiny dimensions (a 7B's bytes cannot live in moto, which
keeps every object in memory and copies it on each read): the shard headers, the shard index, the optimizer's pickle
and zip directory are a 7B's in count and close in size; the shards (80 KB) and ``optimizer.pt`` (1 MB) are over the
64 KB under which ckptdoctor fetches an object whole, so they cost a 7B's requests (``trainer_state.json`` passes 64
KB only late in these 5,000-step runs; a long run's is larger). That run's objects are then put under each of the
``--runs`` run prefixes, straight into moto's in-process store (no upload: s3fs would take about an hour for 1,000
runs here, bench/RESULTS.md), sharing one copy of each object's bytes; every object is still listed, fetched and
parsed on its own, as the hard-linked runs of bench/fleet_memory.py are. Objects repeat across runs, so their ETags
do too (real S3 gives equal bytes the same ETag): the cold rows therefore run without a cache.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
BUCKET = "fleet"
PREFIX = "runs"
SAVE_STEPS = 500
WORKERS = 2
# What the scan's subprocesses need to reach the server: dummy credentials, and botocore's endpoint variable.
_AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _synth() -> ModuleType:
    """bench/synth.py (imports torch: only the builder needs it, never the scan or the Dask client)."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import synth

    return synth


# ---------------------------------------------------------------------------------------------------------------
# The run every prefix holds


def fleet_shape() -> Any:
    """Llama-2-7B's layer count, tensor names and head layout at tiny widths (see the module docstring)."""
    return _synth().ModelShape(hidden=16, intermediate=44, layers=32, heads=2, kv_heads=2, vocab=128)


def _shard_size_for(shape: Any, shards: int) -> int:
    """The smallest ``max_shard`` (bytes) for which synth's greedy split gives ``shards`` files, as a 7B has 3."""
    synth = _synth()
    sizes = [synth._numel(s) * 2 for _, s in synth.param_shapes(shape)]

    def count(limit: int) -> int:
        n, at = 1, 0
        for size in sizes:
            if at and at + size > limit:
                n, at = n + 1, 0
            at += size
        return n

    lo, hi = max(sizes), sum(sizes)
    while lo < hi:  # count() falls as the limit grows
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if count(mid) <= shards else (mid + 1, hi)
    return lo


def build_run(folder: Path, checkpoints: int, training_args: bytes | None = None) -> dict[str, bytes]:
    """Write one run of ``checkpoints`` Trainer checkpoints under ``folder``; return each file's bytes by its path.

    The run is half way through training (``max_steps`` is twice the last checkpoint's step), so a scan of a
    healthy fleet reports nothing. ``training_args`` defaults to a real ``TrainingArguments`` (imports transformers).
    """
    synth = _synth()
    shape = fleet_shape()
    args = argparse.Namespace(
        max_shard_gb=_shard_size_for(shape, 3) / 1e9, logging_steps=10, save_steps=SAVE_STEPS, weights_only=False
    )
    targs = synth.training_args_bytes() if training_args is None else training_args
    max_steps = 2 * checkpoints * SAVE_STEPS
    for k in range(1, checkpoints + 1):
        synth.make_checkpoint(folder / f"checkpoint-{k * SAVE_STEPS}", shape, k * SAVE_STEPS, max_steps, args, targs)
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------------------------
# The server, and what it counts


@dataclass
class Counts:
    """Requests the server answered and the bytes of their response bodies, by kind and by object name.

    Kinds: ``list`` (a GET on the bucket itself: ListObjectsV2), ``get`` (a GET of an object, ranged or whole),
    ``head``, ``other`` (PUT, POST, DELETE). By name: object GETs by the key's last part (``optimizer.pt``).
    """

    requests: Counter[str] = field(default_factory=Counter)
    bytes: Counter[str] = field(default_factory=Counter)
    by_name: Counter[str] = field(default_factory=Counter)
    bytes_by_name: Counter[str] = field(default_factory=Counter)
    cpu: Counter[str] = field(default_factory=Counter)  # the server's CPU seconds answering them, by kind

    def total(self) -> int:
        """Every request."""
        return sum(self.requests.values())

    def copy(self) -> Counts:
        """An independent copy."""
        return Counts(Counter(self.requests), Counter(self.bytes), Counter(self.by_name), Counter(self.bytes_by_name),
                      Counter(self.cpu))  # fmt: skip

    def minus(self, before: Counts) -> Counts:
        """What was counted since ``before`` (counts only grow)."""
        return Counts(self.requests - before.requests, self.bytes - before.bytes, self.by_name - before.by_name,
                      self.bytes_by_name - before.bytes_by_name, self.cpu - before.cpu)  # fmt: skip


@dataclass
class _Counter:
    """A WSGI layer over moto's application: one count per request, by kind, and its response bytes."""

    app: Callable[..., Iterable[bytes]]
    counts: Counts = field(default_factory=Counts)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes]:
        method = environ["REQUEST_METHOD"]
        path = environ.get("PATH_INFO", "").strip("/")
        on_bucket = "/" not in path  # path-style addressing: /bucket or /bucket/key
        kind = {"GET": "list" if on_bucket else "get", "HEAD": "head"}.get(method, "other")
        # The werkzeug server answers each request in a thread of its own: its CPU time is this request's.
        started = time.thread_time()
        body = self.app(environ, start_response)
        sent = 0
        try:
            for chunk in body:
                sent += len(chunk)
                yield chunk
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()
            spent = time.thread_time() - started
            with self.lock:
                self.counts.cpu[kind] += spent
                self.counts.requests[kind] += 1
                self.counts.bytes[kind] += sent
                if kind == "get":
                    name = path.rsplit("/", 1)[-1]
                    self.counts.by_name[name] += 1
                    self.counts.bytes_by_name[name] += sent

    def snapshot(self) -> Counts:
        """The counts so far (a copy)."""
        with self.lock:
            return self.counts.copy()


@dataclass
class Server:
    """A running moto S3 server on loopback, its request counter, and moto's in-process store behind it."""

    url: str
    counter: _Counter
    backend: Any

    def env(self) -> dict[str, str]:
        """What a process needs to reach this server through botocore and s3fs."""
        return {**_AWS, "AWS_ENDPOINT_URL": self.url}


@contextmanager
def moto_server() -> Iterator[Server]:
    """moto's ThreadedMotoServer on 127.0.0.1 (a free port) with the bucket made and every request counted."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends
    from moto.server import ThreadedMotoServer

    werkzeug = logging.getLogger("werkzeug")
    level = werkzeug.level
    werkzeug.setLevel(logging.WARNING)  # no log line per request (the counter counts them)
    srv = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    srv.start()
    backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
    try:
        # ThreadedMotoServer builds its app inside its thread; the werkzeug server calls `server.app` per request.
        wsgi = srv._server
        assert wsgi is not None
        # Every request here is S3's: hand it to moto's S3 application directly. moto's dispatcher (werkzeug_app.py,
        # DomainDispatcherApplication.get_application) looks for the service behind each request again, stat()ing
        # its modules: 40% of the server's CPU per GET, measured (bench/RESULTS.md, "A fleet in S3").
        dispatcher = wsgi.app
        counter = _Counter(dispatcher.app_instances.get("s3") or dispatcher.create_app("s3"))
        wsgi.app = counter
        host, port = srv.get_host_and_port()
        if BUCKET not in backend.buckets:
            backend.create_bucket(BUCKET, "us-east-1")
        yield Server(f"http://{host}:{port}", counter, backend)
    finally:
        srv.stop()
        werkzeug.setLevel(level)
        # moto's store is per process: leave no bucket behind for another server in it (the test suite's).
        if BUCKET in backend.buckets:
            backend.buckets[BUCKET].keys.clear()
            backend.delete_bucket(BUCKET)


def fill(server: Server, runs: int, files: dict[str, bytes]) -> int:
    """Put ``files`` under each of ``runs`` run prefixes, straight into moto's store; return the objects made.

    Each key's value is a BytesIO over the one bytes object of its file (CPython shares the initial bytes until
    written to), with the ETag computed once per file: 10,000 checkpoints cost one run's bytes.
    """
    etags = {name: hashlib.md5(data).hexdigest() for name, data in files.items()}
    made = 0
    for r in range(runs):
        for name, data in files.items():
            key = server.backend.put_object(BUCKET, f"{PREFIX}/run-{r:04d}/{name}", b"", etag=etags[name],
                                            disable_notification=True)  # fmt: skip
            key._value_buffer = io.BytesIO(data)
            key.contentsize = len(data)
            made += 1
    return made


def root_url() -> str:
    """The URL every mode scans: the prefix holding the runs."""
    return f"s3://{BUCKET}/{PREFIX}/"


# ---------------------------------------------------------------------------------------------------------------
# Modes


@dataclass
class Result:
    """One mode's figures."""

    mode: str
    wall_s: float
    counts: Counts
    peak_rss_mb: dict[str, float]  # process -> peak resident MB
    cpu_s: float  # the scan's (or Dask client's) own user + system time; workers' not included
    exit_code: int
    summary: dict[str, Any]  # the report's summary (files, findings by severity), to compare modes
    note: str = ""

    def row(self, runs: int, checkpoints: int) -> dict[str, Any]:
        """The figures as one JSON-able record, with requests and bytes per run and per checkpoint."""
        c, n = self.counts, runs * checkpoints
        return {
            "mode": self.mode,
            "runs": runs,
            "checkpoints": n,
            "wall_s": round(self.wall_s, 2),
            "cpu_s": round(self.cpu_s, 2),
            "requests": c.total(),
            **{k: c.requests[k] for k in ("list", "get", "head", "other")},
            "requests_per_run": round(c.total() / runs, 2),
            "requests_per_checkpoint": round(c.total() / n, 2),
            "get_mb": round(c.bytes["get"] / 1e6, 2),
            "list_mb": round(c.bytes["list"] / 1e6, 2),
            "get_kb_per_checkpoint": round(c.bytes["get"] / 1e3 / n, 1),
            "gets_per_checkpoint_by_name": {k: round(v / n, 2) for k, v in sorted(c.by_name.items())},
            "get_kb_per_checkpoint_by_name": {k: round(v / 1e3 / n, 1) for k, v in sorted(c.bytes_by_name.items())},
            "server_cpu_s": {k: round(v, 1) for k, v in sorted(c.cpu.items())},
            "peak_rss_mb": {k: round(v, 1) for k, v in self.peak_rss_mb.items()},
            "exit": self.exit_code,
            "summary": self.summary,
            "note": self.note,
        }


def _checkout_env(server: Server, checkout: Path, cache_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # as after pip install
    env.update(server.env())
    env["PYTHONPATH"] = os.pathsep.join([str(checkout), str(HERE)])
    env["XDG_CACHE_HOME"] = str(cache_home)
    return env


def capabilities(checkout: Path) -> dict[str, bool]:
    """Which of issue 27's interfaces ``checkout`` has: ``scan --no-cache``, ``scan --dask``, ``scan_many``."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    helptext = subprocess.run([sys.executable, "-m", "ckptdoctor", "scan", "--help"], env=env, cwd=checkout,
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    has_many = subprocess.run([sys.executable, "-c", "import ckptdoctor; assert callable(ckptdoctor.scan_many)"],
                              env=env, cwd=checkout, capture_output=True, check=False).returncode == 0  # fmt: skip
    has_iter = subprocess.run([sys.executable, "-c", "import ckptdoctor; assert callable(ckptdoctor.iter_scan)"],
                              env=env, cwd=checkout, capture_output=True, check=False).returncode == 0  # fmt: skip
    # "--cache" of its own (``--cache / --no-cache``): the cache is off unless asked for; else it is on by default
    opt_in = "--cache" in helptext.replace("--no-cache", "")
    return {"no_cache": "--no-cache" in helptext, "opt_in": opt_in, "dask_cli": "--dask" in helptext,
            "scan_many": has_many, "iter_scan": has_iter}  # fmt: skip


# Seconds between the progress lines a running mode prints to stderr (a 1,000 x 10 scan takes an hour here).
PROGRESS_EVERY = 60.0


def _wait(proc: subprocess.Popen[bytes], server: Server, mode: str) -> tuple[int, resource.struct_rusage]:
    """Wait for ``proc``; meanwhile print, every ``PROGRESS_EVERY`` seconds, what the server has answered since
    it started (a mode stopped early still says how far it got: ``config.json`` GETs count checkpoints read)."""
    before, start, done = server.counter.snapshot(), time.perf_counter(), threading.Event()

    def report() -> None:
        while not done.wait(PROGRESS_EVERY):
            c = server.counter.snapshot().minus(before)
            line = {"progress": mode, "wall_s": round(time.perf_counter() - start), "requests": c.total(),
                    "list": c.requests["list"], "checkpoints_read": c.by_name["config.json"],
                    "server_cpu_s": round(sum(c.cpu.values()), 1)}  # fmt: skip
            print(json.dumps(line), file=sys.stderr, flush=True)

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        done.set()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, usage


def run_scan(server: Server, checkout: Path, cache_home: Path, mode: str, *extra: str) -> Result:
    """``ckptdoctor scan --format json [extra] ROOT`` in a fresh interpreter: its requests, memory and time."""
    with tempfile.TemporaryDirectory() as tmp:
        out, probe = Path(tmp) / "report.json", Path(tmp) / "probe.json"
        cmd = [sys.executable, str(HERE / "probe.py"), "module", "ckptdoctor", "scan", "--format", "json",
               "-o", str(out), *extra, root_url()]  # fmt: skip
        env = {**_checkout_env(server, checkout, cache_home), "PROBE_OUT": str(probe)}
        before = server.counter.snapshot()
        start = time.perf_counter()
        code, usage = _wait(subprocess.Popen(cmd, env=env, cwd=checkout, stdout=subprocess.DEVNULL), server, mode)
        wall = time.perf_counter() - start
        counts = server.counter.snapshot().minus(before)
        summary = json.loads(out.read_text())["summary"] if out.exists() else {}
        peak = json.loads(probe.read_text())["vmhwm_mb"] if probe.exists() else float("nan")
    return Result(mode, wall, counts, {"scan": peak}, usage.ru_utime + usage.ru_stime, code, summary,
                  " ".join(extra))  # fmt: skip


def run_dask(server: Server, checkout: Path, cache_home: Path, mode: str = "dask") -> Result:
    """``scan_many`` (``mode`` dask) or ``iter_scan`` (``mode`` stream) on a 2-worker LocalCluster, driven by a
    fresh interpreter (this file with ``--dask-child``)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--dask-child", out.name, root_url(), mode]
        before = server.counter.snapshot()
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, env=_checkout_env(server, checkout, cache_home), cwd=checkout)
        code, usage = _wait(proc, server, mode)
        wall = time.perf_counter() - start
        counts = server.counter.snapshot().minus(before)
        text = Path(out.name).read_text()
    child = json.loads(text) if text else {"peak_rss_mb": {}, "summary": {}, "note": "the client wrote nothing"}
    return Result(mode, wall, counts, child["peak_rss_mb"], usage.ru_utime + usage.ru_stime, code,
                  child["summary"], child.get("note", ""))  # fmt: skip


def _dask_child(out: str, root: str, mode: str = "dask") -> None:
    """In the client process: start the cluster, scan, and write the workers' and scheduler's peaks to ``out``."""
    from dask.distributed import Client, LocalCluster
    from probe import vmhwm_mb  # bench/ is on PYTHONPATH (run_dask): the workers import it by name too

    import ckptdoctor

    with LocalCluster(n_workers=WORKERS, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:  # fmt: skip
        start = time.perf_counter()
        parts = 0
        if mode == "stream":  # each run handed out and let go, as a platform's loop would after storing it
            with ckptdoctor.iter_scan([root], client=client) as stream:
                for _ in stream:
                    parts += 1
            report = stream.report
        else:
            report = ckptdoctor.scan_many([root], client=client)
        seconds = time.perf_counter() - start
        workers = client.run(vmhwm_mb)
    # A LocalCluster's scheduler runs in this process: one peak covers the client and the scheduler.
    peaks = {"client+scheduler": vmhwm_mb()}
    peaks.update({f"worker-{i}": mb for i, (_, mb) in enumerate(sorted(workers.items()))})
    # The serial rows' summary fields: files and findings by severity (a Report, or one per root).
    reports = report if isinstance(report, (list, tuple)) else [report]
    summary: dict[str, Any] = {"error": 0, "warning": 0, "info": 0, f"{mode}_seconds": round(seconds, 2)}
    if mode == "stream":
        summary["parts"] = parts
    summary["files"] = sum(getattr(r, "files", 0) for r in reports)
    for f in (f for r in reports for f in getattr(r, "findings", ())):
        sev = str(getattr(f.severity, "value", f.severity))
        summary[sev] = summary.get(sev, 0) + 1
    Path(out).write_text(json.dumps({"peak_rss_mb": peaks, "summary": summary}))


def measure(server: Server, checkout: Path, modes: list[str], work: Path) -> Iterator[Result | str]:
    """Run each asked mode the checkout offers, yielding each result as it is measured, or why a mode is skipped."""
    caps = capabilities(checkout)
    if "serial" in modes:
        extra = ("--no-cache",) if caps["no_cache"] else ()
        yield run_scan(server, checkout, work / "cache-serial", "serial", *extra)
    if "cache" in modes:
        if caps["no_cache"]:
            home = work / "cache-warm"
            on = ("--cache",) if caps["opt_in"] else ()
            yield run_scan(server, checkout, home, "cache-fill", *on)
            yield run_scan(server, checkout, home, "cache-warm", *on)
        else:
            yield "cache: skipped, this ckptdoctor has no verdict cache (`scan --no-cache` is unknown)"
    if "dask" in modes:
        if caps["scan_many"]:
            yield run_dask(server, checkout, work / "cache-dask")
        else:
            yield "dask: skipped, this ckptdoctor has no `ckptdoctor.scan_many`"
    if "stream" in modes:
        if caps["iter_scan"]:
            yield run_dask(server, checkout, work / "cache-stream", "stream")
        else:
            yield "stream: skipped, this ckptdoctor has no `ckptdoctor.iter_scan`"


# ---------------------------------------------------------------------------------------------------------------


def build_fleet(server: Server, runs: int, checkpoints: int, work: Path) -> dict[str, Any]:
    """Build one run on disk, fill the bucket with ``runs`` copies; return what it cost."""
    start = time.perf_counter()
    files = build_run(work / "run", checkpoints)
    built = time.perf_counter()
    objects = fill(server, runs, files)
    filled = time.perf_counter()
    return {
        "objects": objects,
        "objects_per_checkpoint": len(files) // checkpoints,
        "bytes_per_run": sum(len(b) for b in files.values()),
        "largest_objects": {n.rsplit("/", 1)[-1]: len(b) for n, b in files.items() if n.startswith("checkpoint-500/")},
        "build_run_s": round(built - start, 2),
        "fill_s": round(filled - built, 2),
    }


def main() -> None:
    """Parse the options, build the bucket, run the modes, print one JSON line per mode (and per skip)."""
    if sys.argv[1:2] == ["--dask-child"]:
        _dask_child(*sys.argv[2:5])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--checkpoints", type=int, default=10, help="checkpoints per run")
    ap.add_argument("--modes", nargs="+", choices=["serial", "cache", "dask", "stream"],
                    default=["serial", "cache", "dask", "stream"])  # fmt: skip
    ap.add_argument("--checkout", type=Path, default=HERE.parent, help="the ckptdoctor checkout to measure")
    args = ap.parse_args()
    checkout = args.checkout.resolve()
    with tempfile.TemporaryDirectory(prefix="fleet-s3-") as tmp, moto_server() as server:
        work = Path(tmp)
        built = build_fleet(server, args.runs, args.checkpoints, work)
        print(json.dumps({"build": built, "runs": args.runs, "checkpoints": args.checkpoints}), flush=True)
        for r in measure(server, checkout, args.modes, work):
            line = {"skipped": r} if isinstance(r, str) else r.row(args.runs, args.checkpoints)
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
