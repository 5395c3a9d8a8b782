"""Remote roots whose endpoint cannot be reached fail in seconds with one line; slow or refusing servers still answer.

Every endpoint is on loopback: a closed port (connection refused), a port whose accept queue is full (connection
attempts are dropped, as behind a firewall: they time out), and a small HTTP server that answers late or with 403.
What is bounded is counted, never timed (a loaded machine breaks timings): the connection attempts each scan makes
and, where the socket shows it, the timeout each attempt was given. The run-time targets are in
ckptdoctor/sources/fsspec.py; a scan that never ends is what would still fail here.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from unittest import mock

import pytest
from click.testing import CliRunner, Result

fsspec = pytest.importorskip("fsspec")

from ckptdoctor.cli import main  # noqa: E402  (only once fsspec is known to be there)
from ckptdoctor.sources.fsspec import CONNECT_ATTEMPTS, CONNECT_TIMEOUT  # noqa: E402

_LOOPBACK = ("127.0.0.1", "::1", "localhost")


class _OffLoopback(RuntimeError):
    """A connection that would have left the machine (not an OSError: no backend retries it)."""


@pytest.fixture(autouse=True)
def _loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """No backend may look anywhere but loopback (credential lookups, a default endpoint): fail loudly instead."""
    real = socket.getaddrinfo

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host not in _LOOPBACK:
            raise _OffLoopback(f"test guard: {host!r} is not loopback")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    for name in ("CKPTDOCTOR_CONNECT_TIMEOUT", "CKPTDOCTOR_CONNECT_ATTEMPTS", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def closed_port() -> int:
    """A loopback port nothing listens on: connecting is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def black_hole() -> Iterator[int]:
    """A loopback port that drops connection attempts: it listens, but its accept queue is already full, so the
    kernel ignores new SYNs and a client's connect times out (what a firewall that drops packets looks like)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = int(server.getsockname()[1])
    fillers = []
    for _ in range(3):  # more than the queue holds, whatever the kernel rounds a backlog of 0 to
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", port))
        fillers.append(c)
    time.sleep(0.1)
    probe = socket.socket()
    probe.settimeout(0.2)
    try:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            pytest.skip("this kernel accepts past a full listen queue; no black hole to test with")
    except TimeoutError:
        pass
    finally:
        probe.close()
    try:
        yield port
    finally:
        for c in fillers:
            c.close()
        server.close()


class _Stub(BaseHTTPRequestHandler):
    """Answers every request with ``status`` after ``delay`` seconds, in the error shape of the backend asking
    (S3 XML when the request is signed by botocore, else Google's JSON)."""

    protocol_version = "HTTP/1.1"
    status = 404
    delay = 0.0

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        self._answer(head=True)

    def do_GET(self) -> None:
        self._answer(head=False)

    def _answer(self, head: bool) -> None:
        time.sleep(self.delay)
        code, text = ("NoSuchBucket", "no such bucket") if self.status == 404 else ("AccessDenied", "Access Denied")
        if "x-amz-date" in {k.lower() for k in self.headers}:
            body = f"<Error><Code>{code}</Code><Message>{text}</Message></Error>".encode()
            ctype = "application/xml"
        else:  # gcsfs reads error.message; the second line shows how its messages are folded onto one
            message = f"{text}\ncaller lacks storage.objects.list"
            body = json.dumps({"error": {"code": self.status, "message": message}}).encode()
            ctype = "application/json"
        self.send_response(self.status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)


@pytest.fixture
def stubs() -> Iterator[Callable[[int, float], int]]:
    """Start stub servers on loopback: ``stub(status, delay)`` gives the port of one."""
    servers: list[ThreadingHTTPServer] = []

    def start(status: int, delay: float) -> int:
        handler = type("Stub", (_Stub,), {"status": status, "delay": delay})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return int(server.server_address[1])

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


# Per backend: point it at http://127.0.0.1:<port> (as a user would, through its own variables or fsspec's settings)
# and give a URL to scan there. Each skips when its package is missing.


def _s3(monkeypatch: pytest.MonkeyPatch, port: int) -> str:
    s3fs = pytest.importorskip("s3fs")
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delitem(fsspec.config.conf, "s3", raising=False)
    # fsspec keeps file systems per options: one from another test would still hold its old endpoint.
    s3fs.S3FileSystem.clear_instance_cache()
    return "s3://bucket/run/"


def _gs(monkeypatch: pytest.MonkeyPatch, port: int) -> str:
    gcsfs = pytest.importorskip("gcsfs")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{port}")
    monkeypatch.delitem(fsspec.config.conf, "gcs", raising=False)
    monkeypatch.setitem(fsspec.config.conf, "gs", {"token": "anon"})  # no credential lookup (metadata server)
    gcsfs.GCSFileSystem.clear_instance_cache()
    return "gs://bucket/run/"


def _hf(monkeypatch: pytest.MonkeyPatch, port: int) -> str:
    hf_fs = pytest.importorskip("huggingface_hub.hf_file_system")
    from huggingface_hub import constants

    endpoint = f"http://127.0.0.1:{port}"
    # HF_ENDPOINT is read once, at import: set what it sets (see tests/sources/test_remote_hf.py).
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setitem(fsspec.config.conf, "hf", {"endpoint": endpoint, "token": False})
    hf_fs.HfFileSystem.clear_instance_cache()
    # huggingface_hub 2.x asks the endpoint for its registry of agent harnesses once per process (for its
    # User-Agent; `utils/_detect_agent.py` `_get_registry`, cached a day in ~/.cache/huggingface), with a timeout of
    # its own: whether this scan made that request depended on what ran before it in the process. Pinned empty, the
    # attempts counted are the scan's.
    detect: Any = None
    with contextlib.suppress(ImportError):
        import huggingface_hub.utils._detect_agent as detect
    if detect is not None and hasattr(detect, "_EMPTY_REGISTRY"):
        monkeypatch.setattr(detect, "_registry", detect._EMPTY_REGISTRY)
    return "hf://ckpt/run/run"


BACKENDS: dict[str, Callable[[pytest.MonkeyPatch, int], str]] = {"s3": _s3, "gs": _gs, "hf": _hf}


def _scan(url: str) -> tuple[Result, list[float | None]]:
    """Scan ``url``; also each connection attempt it made, as the timeout its socket had (None: blocking; 0.0: a
    non-blocking socket whose wait asyncio bounds, as aiohttp's under s3fs)."""
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    attempts: list[float | None] = []

    def connect(self: socket.socket, address: Any) -> None:
        attempts.append(self.gettimeout())
        real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        attempts.append(self.gettimeout())
        return real_connect_ex(self, address)

    with mock.patch.object(socket.socket, "connect", connect), mock.patch.object(socket.socket, "connect_ex",
                                                                                  connect_ex):
        result = CliRunner().invoke(main, ["scan", url])
    return result, attempts


def _one_error_line(result: Result, url: str) -> str:
    """The single ``Error: <url>: ...`` line of a usage error (exit 2), with no traceback anywhere."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit)  # click's exit, not an exception that escaped
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"Error: {url}: "), lines
    return lines[0]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_refused_connection_fails_fast(backend: str, closed_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    url = BACKENDS[backend](monkeypatch, closed_port)
    result, attempts = _scan(url)
    line = _one_error_line(result, url)
    assert "refused" in line.lower() or "could not connect" in line.lower(), line
    if backend != "hf":  # huggingface_hub's message names no endpoint (the URL root does)
        assert f"127.0.0.1:{closed_port}" in line, line
    # botocore's legacy retries (5 attempts with backoff) took 8 s here, gcsfs's 35 s; now at most the few attempts
    assert 1 <= len(attempts) <= CONNECT_ATTEMPTS, attempts


@pytest.mark.parametrize("backend", ["s3", "gs"])
def test_connect_timeout_is_bounded_and_overridable(
    backend: str, black_hole: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dropped connection attempts: each attempt gives up after CKPTDOCTOR_CONNECT_TIMEOUT, after
    CKPTDOCTOR_CONNECT_ATTEMPTS of them the scan does (gcsfs: more than 5 minutes before; botocore 36 s)."""
    url = BACKENDS[backend](monkeypatch, black_hole)
    monkeypatch.setenv("CKPTDOCTOR_CONNECT_TIMEOUT", "0.5")
    monkeypatch.setenv("CKPTDOCTOR_CONNECT_ATTEMPTS", "2")
    result, attempts = _scan(url)
    line = _one_error_line(result, url)
    assert "timed out" in line.lower() or "timeout" in line.lower(), line
    assert f"127.0.0.1:{black_hole}" in line, line
    assert len(attempts) == 2, attempts  # the defaults would be 3 x 3 s
    # a blocking attempt carries its timeout (the gs:// probe); s3fs's are non-blocking, bounded by botocore's config
    assert all(t is not None and t <= 0.5 for t in attempts), attempts
    assert CONNECT_TIMEOUT * CONNECT_ATTEMPTS <= 10  # the defaults stay near the ~10 s promised in sources/fsspec.py


def test_hf_connect_timeout_is_huggingface_hubs(black_hole: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """hf:// tries once and stops at HF_HUB_ETAG_TIMEOUT (10 s by default); the failure is one line too."""
    url = _hf(monkeypatch, black_hole)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_ETAG_TIMEOUT", 1)
    result, attempts = _scan(url)
    assert "timeout" in _one_error_line(result, url).lower()
    assert attempts == [1], attempts


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_access_denied_is_one_line(backend: str, stubs: Callable[[int, float], int],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A 403 is reported as such: not as "no such object" (hf:// answered that before) and on one line (gcsfs put
    the server's message on a second)."""
    url = BACKENDS[backend](monkeypatch, stubs(403, 0.0))
    result, attempts = _scan(url)
    line = _one_error_line(result, url)
    assert "no such object" not in line
    assert "403" in line or "forbidden" in line.lower(), line
    assert 1 <= len(attempts) <= CONNECT_ATTEMPTS, attempts  # an answer is not retried as a lost connection


def test_a_slow_server_still_answers(stubs: Callable[[int, float], int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Only connecting is bounded: a server that connects at once and answers after more than the connect timeout
    is waited for (here its answer is "no such bucket"). S3 only: gs:// adds a probe that just connects, and gcsfs's
    gRPC bucket-layout lookup would wait 60 s on a stub that speaks HTTP/1 alone."""
    url = _s3(monkeypatch, stubs(404, 0.4))
    monkeypatch.setenv("CKPTDOCTOR_CONNECT_TIMEOUT", "0.1")
    result, _ = _scan(url)
    assert _one_error_line(result, url) == f"Error: {url}: no such object or prefix"


def test_a_bad_setting_names_the_variable(closed_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    url = _gs(monkeypatch, closed_port)
    monkeypatch.setenv("CKPTDOCTOR_CONNECT_TIMEOUT", "3s")
    result, _ = _scan(url)
    assert _one_error_line(result, url) == f"Error: {url}: CKPTDOCTOR_CONNECT_TIMEOUT='3s': want seconds above 0"


def test_settings_the_user_chose_win(monkeypatch: pytest.MonkeyPatch) -> None:
    """fsspec's own settings (FSSPEC_S3=...) and botocore's variables keep their say over ckptdoctor's defaults."""
    pytest.importorskip("s3fs")
    from ckptdoctor.sources.fsspec import _storage_options

    monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": {"connect_timeout": 20, "region_name": "x"}})
    opts = _storage_options("s3://bucket/run", 3.0, 3)
    assert opts == {"s3": {"config_kwargs": {"connect_timeout": 20, "region_name": "x",
                                             "retries": {"mode": "standard", "total_max_attempts": 3}}}}
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "10")
    assert "retries" not in _storage_options("simplecache::s3://bucket/run", 3.0, 3)["s3"]["config_kwargs"]
    assert _storage_options("gs://bucket/run", 3.0, 3) == {}
