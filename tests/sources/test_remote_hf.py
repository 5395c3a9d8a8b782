"""Remote roots at ``hf://``: huggingface_hub's real HfFileSystem against a fake Hub HTTP server on loopback.

The fake serves the Hub endpoints HfFileSystem calls to list and read a model repo (repo info, the paginated
``tree`` listing, ``resolve`` with Range requests) from an in-memory copy of fixtures; the report of the ``hf://``
root must equal the local scan of the same folder, and a scan must cost a few requests per file.
"""

from __future__ import annotations

import json
import socket
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import pytest

from tests.helpers.paths import REPO

pytest.importorskip("fsspec")
hf_fs = pytest.importorskip("huggingface_hub.hf_file_system")

from click.testing import CliRunner  # noqa: E402  (only once the skips above have run)
from huggingface_hub import constants  # noqa: E402

from ckptdoctor.cli import main  # noqa: E402
from ckptdoctor.scanner import scan  # noqa: E402
from tests.helpers.builders import comparable_report  # noqa: E402
from tests.helpers.remote import fsspec_setting  # noqa: E402

FIXTURES = REPO / "fixtures"
REPO = "ckpt/run"
SHA = "0123456789abcdef0123456789abcdef01234567"
LFS_OVER = 64 * 1024  # files above this are "LFS": `resolve` redirects them to a storage URL, as the Hub does
SERVED = ("stub-shadow", "sharded", "fsdp")  # fsdp: `.distcp` files past WHOLE_FILE, read in ranges


@dataclass
class _Hub:
    """The fake Hub's state: one model repo at revision ``main`` (path in repo -> bytes) and its request log."""

    files: dict[str, bytes]
    page_size: int = 1000  # entries per `tree` page (the Hub's own, without `expand`)
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path without the query)
    sent: Counter[str] = field(default_factory=Counter)  # file bytes served, per path in repo
    lock: threading.Lock = field(default_factory=threading.Lock)

    def dirs(self) -> set[str]:
        return {"/".join(p.split("/")[:i]) for p in self.files for i in range(1, p.count("/") + 1)}

    def per_path(self) -> Counter[str]:
        with self.lock:
            return Counter(p for _, p in self.requests)

    def clear(self) -> None:
        with self.lock:
            self.requests.clear()
            self.sent.clear()


class _Handler(BaseHTTPRequestHandler):
    """Hub routes: ``/api/models/{repo}[/revision/{rev}]``, ``/api/models/{repo}/tree/{rev}[/{path}]`` and
    ``/{repo}/resolve/{rev}/{path}`` (GET and HEAD, Range honoured); anything else is a Hub-style 404."""

    protocol_version = "HTTP/1.1"  # keep-alive, as httpx expects from the Hub
    hub: _Hub

    def log_message(self, format: str, *args: Any) -> None:  # one line per request would flood pytest's output
        pass

    def do_HEAD(self) -> None:
        self._route(head=True)

    def do_GET(self) -> None:
        self._route(head=False)

    def _route(self, head: bool) -> None:
        url = urlsplit(self.path)
        with self.hub.lock:
            self.hub.requests.append((self.command, url.path))
        info = f"/api/models/{REPO}"
        if url.path in (info, f"{info}/revision/main"):
            return self._json({"id": REPO, "sha": SHA, "private": False, "siblings": []}, head)
        if url.path.startswith(f"{info}/tree/main"):
            return self._tree(unquote(url.path[len(f"{info}/tree/main") :]).strip("/"), parse_qs(url.query), head)
        resolve = f"/{REPO}/resolve/main/"
        if url.path.startswith(resolve):
            path = unquote(url.path[len(resolve) :])
            if len(self.hub.files.get(path, b"")) > LFS_OVER:  # the client must follow it, Range header and all
                cdn = f"/cdn/{SHA}/{quote(path)}"
                return self._send(302, b"", {"Location": cdn, "X-Repo-Commit": SHA, "X-Linked-Size": "0"}, head)
            return self._file(path, head)
        if url.path.startswith(f"/cdn/{SHA}/"):
            return self._file(unquote(url.path[len(f"/cdn/{SHA}/") :]), head)
        code = "RepoNotFound" if not url.path.startswith((info, f"/{REPO}/")) else "EntryNotFound"
        self._send(404, b'{"error": "not found"}', {"Content-Type": "application/json", "X-Error-Code": code}, head)

    def _tree(self, path: str, query: dict[str, list[str]], head: bool) -> None:
        if path and path not in self.hub.dirs():
            headers = {"Content-Type": "application/json", "X-Error-Code": "EntryNotFound"}
            return self._send(404, b'{"error": "not a folder"}', headers, head)
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        prefix = path + "/" if path else ""
        entries: list[dict[str, Any]] = []
        for d in sorted(self.hub.dirs()):
            if d.startswith(prefix) and (recursive or "/" not in d[len(prefix) :]):
                entries.append({"type": "directory", "oid": "d" * 40, "size": 0, "path": d})
        for p in sorted(self.hub.files):
            if p.startswith(prefix) and (recursive or "/" not in p[len(prefix) :]):
                n = len(self.hub.files[p])
                entry: dict[str, Any] = {"type": "file", "oid": "f" * 40, "size": n, "path": p}
                if n > LFS_OVER:
                    entry["lfs"] = {"oid": "e" * 64, "size": n, "pointerSize": 134}
                entries.append(entry)
        start = int(query.get("cursor", ["0"])[0])
        page = entries[start : start + self.hub.page_size]
        headers = {"Content-Type": "application/json"}
        if start + self.hub.page_size < len(entries):  # cursor pagination, in a GitHub-style Link header
            nxt = dict(query, cursor=[str(start + self.hub.page_size)])
            q = "&".join(f"{k}={quote(v[0])}" for k, v in sorted(nxt.items()))
            headers["Link"] = f'<http://{self.headers["Host"]}{urlsplit(self.path).path}?{q}>; rel="next"'
        self._send(200, json.dumps(page).encode(), headers, head)

    def _file(self, path: str, head: bool) -> None:
        data = self.hub.files.get(path)
        if data is None:
            headers = {"Content-Type": "application/json", "X-Error-Code": "EntryNotFound"}
            return self._send(404, b'{"error": "no such file"}', headers, head)
        headers = {"X-Repo-Commit": SHA, "ETag": f'"{"f" * 40}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        rng = self.headers.get("Range")
        if rng is None:
            with self.hub.lock:
                self.hub.sent[path] += 0 if head else len(data)
            return self._send(200, data, headers, head)
        first, _, last = rng.removeprefix("bytes=").partition("-")
        if first == "":  # a suffix range: the last N bytes
            start, end = max(0, len(data) - int(last)), len(data) - 1
        else:
            start, end = int(first), min(len(data) - 1, int(last)) if last else len(data) - 1
        if start >= len(data) or start > end:
            headers["Content-Range"] = f"bytes */{len(data)}"
            return self._send(416, b"", headers, head)
        headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        with self.hub.lock:
            self.hub.sent[path] += 0 if head else end + 1 - start
        self._send(206, data[start : end + 1], headers, head)

    def _json(self, doc: Any, head: bool) -> None:
        self._send(200, json.dumps(doc).encode(), {"Content-Type": "application/json", "X-Repo-Commit": SHA}, head)

    def _send(self, status: int, body: bytes, headers: dict[str, str], head: bool) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)


_LOOPBACK = ("127.0.0.1", "::1", "localhost")


class _OffLoopback(RuntimeError):
    """A request that would have left the machine; not an OSError, so huggingface_hub fails fast, never retries."""


def _loopback_only(real: Any) -> Any:
    """``socket.getaddrinfo`` refusing any host but loopback: the fake Hub must never be bypassed for the real one."""

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in _LOOPBACK:
            raise _OffLoopback(f"test guard: {host!r} is not loopback")
        return real(host, *args, **kwargs)

    return getaddrinfo


@pytest.fixture(scope="module")
def hub() -> Iterator[_Hub]:
    """The fake Hub on 127.0.0.1 (free port) serving ``SERVED`` fixtures as folders of repo ``ckpt/run``, with
    fsspec's ``hf`` file system pointed at it (no token, online) and every other connection refused."""
    files = {
        f"{name}/{p.relative_to(FIXTURES / name).as_posix()}": p.read_bytes()
        for name in SERVED
        for p in sorted((FIXTURES / name).rglob("*"))
        if p.is_file()
    }
    state = _Hub(files)
    handler = type("Handler", (_Handler,), {"hub": state})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="fake-hub", daemon=True)
    thread.start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    with pytest.MonkeyPatch.context() as mp:
        # HF_ENDPOINT is read once, at import, into these two: set them as it would have (hf_hub_url swaps the
        # `endpoint` it is given in only when the template starts with ENDPOINT, so they must move together).
        mp.setattr(constants, "ENDPOINT", endpoint)
        mp.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        mp.setattr(constants, "HF_HUB_OFFLINE", False)
        mp.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        mp.setattr(socket, "getaddrinfo", _loopback_only(socket.getaddrinfo))
        # How a user points `hf://` elsewhere; token=False: no stored token is ever sent, even to loopback.
        try:
            with fsspec_setting("hf", {"endpoint": endpoint, "token": False}, hf_fs.HfFileSystem):
                yield state
        finally:
            server.shutdown()
            server.server_close()


@pytest.mark.parametrize("name", SERVED)
def test_hf_scan_matches_local(hub: _Hub, name: str) -> None:
    hub.clear()
    remote = scan(f"hf://{REPO}/{name}", jobs=4)
    local = scan(str(FIXTURES / name), jobs=4)
    assert comparable_report(remote) == comparable_report(local)
    assert remote.files == local.files > 0


def test_hf_revision_in_the_url(hub: _Hub) -> None:
    """``hf://repo@main/path``: the revision form a user pins a run with reads the same bytes."""
    remote = scan(f"hf://{REPO}@main/sharded", jobs=2)
    assert comparable_report(remote) == comparable_report(scan(str(FIXTURES / "sharded"), jobs=2))


@pytest.mark.parametrize("name", SERVED)
def test_hf_scan_costs_a_few_requests_per_file(hub: _Hub, name: str) -> None:
    hub.clear()
    remote = scan(f"hf://{REPO}/{name}", jobs=2)
    counts = hub.per_path()
    resolve = {p: n for p, n in counts.items() if "/resolve/" in p}
    cdn = sum(n for p, n in counts.items() if p.startswith("/cdn/"))
    api = sum(n for p, n in counts.items() if p.startswith("/api/"))
    size = sum(len(b) for p, b in hub.files.items() if p.startswith(name + "/"))
    print(f"\n{name}: {remote.files} files, {sum(counts.values())} requests ({sum(resolve.values())} resolve,"
          f" {cdn} redirected, {api} api), {sum(hub.sent.values())} of {size} bytes")
    assert {m for m, _ in hub.requests} <= {"GET", "HEAD"}  # a scan never writes
    assert max(resolve.values()) <= 3  # a few ranged reads per file, never a stream of blocks
    assert len(resolve) <= remote.files
    assert cdn <= sum(resolve.values())  # only redirected reads reach storage
    assert api <= 4  # repo info, one recursive listing and the root's own entry: not one request per folder
    assert sum(counts.values()) <= 2 * remote.files + 4


def test_hf_distcp_prefetch_reads_only_the_items(hub: _Hub) -> None:
    """`.distcp` items are prefetched exactly. fsspec's cat_ranges fallback for a file system without async
    support (HfFileSystem) opens the file per range with the default 5 MiB read-ahead: the 144 KB shard was
    fetched whole (145,536 bytes) where 34,834 do; sources.fsspec._prefetch now reads such spans without read-ahead."""
    hub.clear()
    scan(f"hf://{REPO}/fsdp", jobs=2)
    path = "fsdp/checkpoint-4/optimizer_0/__1_0.distcp"
    assert hub.sent[path] < len(hub.files[path]) // 2


def test_hf_paginated_listing(hub: _Hub, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree longer than a page (Link-header cursors, split into per-folder listings) lists the same files."""
    monkeypatch.setattr(hub, "page_size", 3)
    hub.clear()
    remote = scan(f"hf://{REPO}/sharded", jobs=2)
    assert comparable_report(remote) == comparable_report(scan(str(FIXTURES / "sharded"), jobs=2))
    assert sum(1 for p in hub.per_path() if "/tree/" in p) > 1


def test_hf_cli_json(hub: _Hub) -> None:
    """`ckptdoctor scan --format json hf://...`: the command line reaches the Hub through the same path."""
    result = CliRunner().invoke(main, ["scan", "--format", "json", f"hf://{REPO}/stub-shadow"])
    doc = json.loads(result.stdout)
    local = comparable_report(scan(str(FIXTURES / "stub-shadow")))
    assert result.exit_code == 1  # stub-shadow is broken on purpose (CKD201)
    assert [r["resume_pick"] for r in doc["runs"]] == [r["resume_pick"] for r in local["runs"]]
    assert [(f["rule"], f["path"]) for f in doc["findings"]] == [(f["rule"], f["path"]) for f in local["findings"]]
    assert "CKD201" in {f["rule"] for f in doc["findings"]}


def test_hf_missing_path_is_a_usage_error(hub: _Hub) -> None:
    result = CliRunner().invoke(main, ["scan", f"hf://{REPO}/no-such-run"])
    assert result.exit_code == 2
    assert "no-such-run" in result.output
