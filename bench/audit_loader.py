"""The victim side of the audit-hook soundness run: load a file the way its container's loader does, in a throw-away
process, under ``sys.addaudithook``, and report every event that means code ran or the world changed.

A server process imports what a victim has loaded (torch, numpy, transformers, peft, accelerate,
torch.distributed.checkpoint), warms every loader on a clean file of every container (so their own lazy imports are
done), and then forks one child per case: the child installs the hook, loads the file, and reports; it never
outlives its case. The hook records and *blocks* (raises) ``exec``, ``compile``, ``os.system``, ``subprocess.Popen``,
``os.exec``/``spawn``/``posix_spawn``/``fork``, ``open`` for writing, every ``socket.*`` and ``ctypes.*``
event, filesystem changes (``os.remove``/``rename``/``mkdir``/``chmod``/``truncate``/``symlink``/``link``,
``shutil.*``), environment changes, ``object.__setattr__``/``__delattr__`` on a type (monkeypatching), building
code or functions (``code.__new__``, ``function.__new__``, ``marshal.loads``) and ``webbrowser.open``; it records
(without blocking) every ``import`` of a module not already loaded. Events fired while an import runs the imported
module's own body are tagged ``in-import`` and not blocked (that is what importing is).

    from bench.audit_loader import LoaderServer
    with LoaderServer() as srv:
        result = srv.load("/tmp/case/state.pkl", "pickle")   # {"events": [...], "error": "...", "finds": [...]}

Loaders: ``pickle`` (``pickle.load``), ``torch`` (``torch.load(path, weights_only=False)``), ``numpy``
(``numpy.load(path, allow_pickle=True)``, every array of an ``.npz`` read), ``tar:<member>`` / ``zip:<member>`` /
``gz`` (the member or the decompressed stream unpickled, as whoever unpacks the archive does), ``dcp``
(``FileSystemReader(folder).read_metadata()``, which ``dcp.load`` calls).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

_BLOCK_PREFIXES = ("socket.", "ctypes.", "shutil.", "os.exec", "os.spawn", "os.posix_spawn", "os.fork",
                   "subprocess.", "pty.", "webbrowser.", "winreg.", "_winapi.")  # fmt: skip
_BLOCK = frozenset({"exec", "compile", "os.system", "os.popen", "os.forkpty", "os.remove", "os.rename", "os.rmdir",
                    "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.symlink", "os.link", "os.putenv",
                    "os.unsetenv", "os.kill", "os.killpg", "os.chdir", "os.utime", "os.startfile",
                    "object.__setattr__", "object.__delattr__", "code.__new__", "function.__new__", "marshal.loads",
                    "marshal.load", "builtins.input", "sys.setprofile", "sys.settrace", "cpython.run_command",
                    "cpython.run_file", "glob.glob", "sqlite3.connect", "mmap.__new__", "fcntl.ioctl",
                    "resource.setrlimit", "signal.pthread_kill", "syslog.openlog", "tempfile.mkstemp",
                    "tempfile.mkdtemp", "urllib.Request", "http.client.connect", "ftplib.connect",
                    "smtplib.connect", "imaplib.open", "poplib.connect", "telnetlib.Telnet.open"})  # fmt: skip
# What a victim process has loaded before it loads a checkpoint (a Trainer resuming): their modules are no new import.
VICTIM = ("numpy", "torch", "torch.distributed.checkpoint", "accelerate", "peft", "transformers")
_KEEP = {"effect": 20, "import": 12, "in_import": 4}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _is_hit(event: str, args: tuple[Any, ...]) -> bool:
    if event == "open":
        mode = args[1] if len(args) > 1 else None
        flags = args[2] if len(args) > 2 else 0
        if isinstance(mode, str):
            return any(c in mode for c in "wax+")
        return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)
    return event in _BLOCK or event.startswith(_BLOCK_PREFIXES)


def _in_import() -> bool:
    """Whether the current event happens while an import runs a module's body (importlib's frames on the stack)."""
    f: FrameType | None = sys._getframe(2)
    while f is not None:
        if f.f_code.co_filename.startswith("<frozen importlib"):
            return True
        f = f.f_back
    return False


def _stack() -> list[str]:
    """The innermost Python frames outside this module: where the event came from."""
    out: list[str] = []
    f: FrameType | None = sys._getframe(2)
    while f is not None and len(out) < 10:
        name = f.f_code.co_filename
        if not name.endswith("audit_loader.py"):
            short = name.split("site-packages/")[-1].split("/lib/python3")[-1]
            out.append(f"{short}:{f.f_lineno} {f.f_code.co_name}")
        f = f.f_back
    return out


class _Hook:
    """The audit hook of one child: records hits (blocking them), new imports and the globals the unpickler finds."""

    def __init__(self, allowed: frozenset[tuple[str, tuple[str, ...]]] = frozenset(), collect: bool = False) -> None:
        self.events: list[dict[str, Any]] = []
        self.finds: list[str] = []
        self.busy = False
        self.armed = True
        self.allowed = allowed  # (event, stack) pairs the loader itself raises on a clean file of its container
        self.collect = collect  # record every hit without blocking: how ``allowed`` is learned
        self.counts: dict[str, int] = {}  # events by kind (effect, import, in_import); the first ``_KEEP`` kept

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if self.busy or not self.armed:
            return
        if event == "pickle.find_class":
            if len(self.finds) < 200:
                self.finds.append(f"{args[0]}.{args[1]}")
            return
        is_import = event == "import"
        if is_import:
            if not args or args[0] in sys.modules:
                return
        elif not _is_hit(event, args):
            return
        self.busy = True
        try:
            stack = _stack()
            if (event, tuple(stack)) in self.allowed:
                return
            inside = _in_import()
            try:
                text = repr(args)[:300]
            except Exception:  # a hostile __repr__
                text = "<unrepresentable>"
            quiet = inside and not is_import  # the imported module's own body: kept short
            kind = "in_import" if quiet else "import" if is_import else "effect"
            self.counts[kind] = self.counts.get(kind, 0) + 1
            if self.counts[kind] <= _KEEP[kind]:
                self.events.append({"event": event, "args": args[0] if is_import else text[:100] if quiet else text,
                                    "module": args[0] if is_import else None, "in_import": quiet,
                                    "after": self.finds[-3:], "stack": stack[:3] if quiet else stack})  # fmt: skip
        finally:
            self.busy = False
        if not is_import and not inside and not self.collect:
            raise RuntimeError(f"ckd-audit: {event} blocked")


def _load(path: str, loader: str) -> None:
    import pickle

    if loader == "pickle":
        with open(path, "rb") as f:
            pickle.load(f)
    elif loader == "torch":
        import torch

        torch.load(path, weights_only=False)
    elif loader == "numpy":
        import numpy as np

        got = np.load(path, allow_pickle=True)
        if hasattr(got, "files"):
            for k in got.files:
                got[k]
    elif loader == "gz":
        import gzip

        with gzip.open(path, "rb") as f:
            pickle.load(f)
    elif loader.startswith("tar:"):
        import tarfile

        with tarfile.open(path) as t:
            member = t.extractfile(loader[4:])
            assert member is not None
            pickle.loads(member.read())
    elif loader.startswith("zip:"):
        import zipfile

        with zipfile.ZipFile(path) as z:
            pickle.loads(z.read(loader[4:]))
    elif loader == "dcp":
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        FileSystemReader(os.path.dirname(path)).read_metadata()
    else:
        raise ValueError(f"unknown loader {loader}")


def _child(path: str, loader: str, wfd: int, allowed: frozenset[tuple[str, tuple[str, ...]]], collect: bool) -> None:
    """The forked child: hook, load, report on ``wfd``, exit without running any cleanup of the server."""
    import resource

    result: dict[str, Any] = {}
    try:
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
        resource.setrlimit(resource.RLIMIT_CPU, (20, 20))
        hook = _Hook(allowed, collect)
        sys.addaudithook(hook)
        try:
            _load(path, loader)
            result["error"] = None
        except BaseException as e:  # the load failing is fine: what ran before counts
            result["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        hook.armed = False
        for ev in hook.events:  # an import of a module that is not there ran nothing
            if ev["event"] == "import":
                ev["found"] = ev["module"] in sys.modules
        result["events"] = [ev for ev in hook.events if ev.get("found", True)]
        result["counts"] = hook.counts
        result["finds"] = hook.finds
        os.write(wfd, json.dumps(result).encode())
    finally:
        os._exit(0)


def _warm(folder: Path) -> list[tuple[str, str]]:
    """Load one clean file of every container, so the loaders' own lazy imports happen before any hook; the
    (path, loader) of each, to learn what each loader raises by itself."""
    import pickle

    from bench.audit_soundness import CONTAINERS, pack

    out = []
    clean = [pickle.dumps({"a": [1, 2.5, "x", b"y", None, True], "b": (1,)}, protocol=p) for p in (0, 2, 4)]
    for proto, data in enumerate([*clean, b"\x80\x02(K\x01"]):  # the last one fails: the loader's error paths
        for i, container in enumerate(CONTAINERS):
            case = folder / f"warm{proto}-{i}"
            files, target, loader = pack(data, container)
            case.mkdir()
            for name, raw in files.items():
                (case / name).write_bytes(raw)
            out.append((str(case / target), loader))
            # A raw .pt is no legacy file, a dict no DCP Metadata: the loaders ran all the same.
            with contextlib.suppress(Exception):
                _load(str(case / target), loader)
    return out


def _fork_load(path: str, loader: str, allowed: frozenset[tuple[str, tuple[str, ...]]], collect: bool,
               timeout: float) -> dict[str, Any]:  # fmt: skip
    """Run ``_child`` in a fork; its answer (``error`` says timeout or death)."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(rfd)
        os.chdir(os.path.dirname(path) or "/")
        _child(path, loader, wfd, allowed, collect)
    os.close(wfd)
    deadline = time.monotonic() + timeout
    chunks = []
    timed_out = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([rfd], [], [], left)
        if not ready:
            continue
        chunk = os.read(rfd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    if timed_out:
        os.kill(pid, signal.SIGKILL)
    os.close(rfd)
    _, status = os.waitpid(pid, 0)
    try:
        answer: dict[str, Any] = json.loads(b"".join(chunks)) if chunks else {"events": [], "finds": [], "error": None}
    except ValueError:
        answer = {"events": [], "finds": [], "error": "unreadable answer"}
    if timed_out:
        answer["error"] = "timeout"
    elif not chunks:
        answer["error"] = f"child died (status {status})"
    return answer


def serve() -> None:
    """The server loop: JSON requests on stdin, JSON answers on the real stdout (fd 1 is /dev/null for children)."""
    import tempfile

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    sys.dont_write_bytecode = True
    import importlib

    for module in os.environ.get("CKD_AUDIT_PRELOAD", ",".join(VICTIM)).split(","):
        importlib.import_module(module)
    import torch

    torch.set_num_threads(1)

    allowed: set[tuple[str, tuple[str, ...]]] = set()
    with tempfile.TemporaryDirectory() as tmp:
        for path, loader in _warm(Path(tmp)):
            for e in _fork_load(path, loader, frozenset(), True, 60.0)["events"]:
                allowed.add((e["event"], tuple(e["stack"])))
    frozen = frozenset(allowed)
    out.write(json.dumps({"ready": len(sys.modules), "loader_events": sorted(e for e, _ in frozen)}) + "\n")
    out.flush()
    for line in sys.stdin:
        req = json.loads(line)
        answer = _fork_load(req["path"], req["loader"], frozen, False, req.get("timeout", 30.0))
        out.write(json.dumps(answer) + "\n")
        out.flush()


class LoaderServer:
    """A running server (see the module docstring); a context manager that ends it. ``preload``: the modules the
    victim has imported (the default: a Trainer's; the suite's fast slice takes fewer, as it costs CPU)."""

    def __init__(self, preload: tuple[str, ...] = VICTIM) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1",
               "CKD_AUDIT_PRELOAD": ",".join(preload),
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
        cmd = [sys.executable, "-c", "from bench.audit_loader import serve; serve()"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=ROOT, text=True)
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline()
        if not first:
            raise RuntimeError("the loader server did not start")
        self.info: dict[str, Any] = json.loads(first)

    def load(self, path: str, loader: str, timeout: float = 30.0) -> dict[str, Any]:
        """Load ``path`` with ``loader`` in a fresh child under the hook: its events, the globals found, its error."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        req = {"path": path, "loader": loader, "timeout": timeout}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the loader server died")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        """End the server."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> LoaderServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
