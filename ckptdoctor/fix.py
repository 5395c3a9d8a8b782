"""The fixer, the only code in ckptdoctor that writes: plan fixes, journal them, apply them atomically, undo them.

Every change is one operation of a transaction ``<txid>`` under a scan root:

* ``quarantine``: ``os.rename`` the file or folder to ``<root>/.ckptdoctor/quarantine/<txid>/<same relative path>``
  (same filesystem, so the move is atomic; nothing is ever deleted);
* ``rewrite-json`` / ``rewrite-text``: write the new text to a temp file beside the target, fsync it, keep the
  original in the quarantine (a hard link, else a copy), then swap the temp file and the target atomically
  (Linux ``renameat2(RENAME_EXCHANGE)``); the original comes out at the temp path and becomes the quarantined one.
  Where there is no exchange (not Linux, a kernel before 3.15, a filesystem answering EINVAL) the temp file is
  ``os.replace``d over the target instead.

Before the first change the write-ahead journal ``<root>/.ckptdoctor/journal/<txid>.json`` records every
operation with the before/after size and sha256 (and the new text of rewrites) and is fsynced; each operation is
marked done as it completes. Whatever point a crash or an I/O error interrupts, the on-disk state of each
operation can be recognised from the hashes, so ``undo`` rolls the transaction back and ``fix`` rolls it forward.

A concurrent writer is met by checking again at the act: a rewrite re-hashes its target before the swap and then
hashes what the exchange took out (not the original: a writer got in, and its file is swapped back while the
target is still the fixer's), a move re-hashes what arrived in the quarantine. A change aborts the operation,
leaves the writer's bytes where it wrote them and rolls the transaction back (``ConcurrentChange``). Without the
exchange one window remains: a rename over the target (or, with no hard links, an in-place write) between the last
hash and the ``os.replace`` is lost.

Test hooks (never set in normal use): ``CKPTDOCTOR_TEST_CRASH=<point>`` or ``CKPTDOCTOR_TEST_CRASH_AFTER_OP=<k>``
kill the process with SIGKILL at a named point (see ``crash_points``); ``CALLS`` is the one indirection through
which every write system call goes, so a test can make call k fail with ``ENOSPC`` or ``EIO``.
"""

from __future__ import annotations

import contextlib
import ctypes
import difflib
import errno
import hashlib
import json
import os
import secrets
import signal
import socket
import stat
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import click

from ckptdoctor.cli import ScanRoot  # lets URL roots through to `_check_roots`, which refuses them clearly
from ckptdoctor.findings import Applicability, Finding, OpKind
from ckptdoctor.model import Tree

JOURNAL_SCHEMA = "ckptdoctor.journal/1"
FIX_SCHEMA = "ckptdoctor.fix/1"
OWN_DIR = ".ckptdoctor"  # discovery skips it; it never matches checkpoint-N, so the Trainer ignores it too
BUSY_SECONDS = 60.0  # a checkpoint touched more recently than this may still be being written
REWRITE_MAX_BYTES = 64 * 1024 * 1024  # rewrites are for JSON indexes, trainer states and `latest`, never weights
CRASH_ENV = "CKPTDOCTOR_TEST_CRASH"
CRASH_AFTER_OP_ENV = "CKPTDOCTOR_TEST_CRASH_AFTER_OP"
_CHUNK = 1 << 20
# First bytes of formats the fixer must never rewrite: pickles (protocol 2+) and zip archives (torch.save).
_BINARY_MAGIC = (b"\x80", b"PK\x03\x04", b"PK\x05\x06")
_BINARY_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".safetensors", ".distcp", ".metadata")
# errnos meaning "this filesystem has no hard links here": fall back to copying the original into the quarantine.
_NO_LINK = {errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class FixRefused(click.ClickException):
    """The fixer will not (or could not) act: printed without a traceback, exit code 2 like a usage error."""

    exit_code = 2


class ConcurrentChange(FixRefused):
    """Another process wrote a path while the fixer was changing it; the fixer left that process's bytes alone."""


# ---------------------------------------------------------------------------------------------------------------
# The write calls (the fault-injection seam)


def _link(src: str, dst: str) -> None:
    os.link(src, dst, follow_symlinks=False)


def _utime(path: str, times_ns: tuple[int, int]) -> None:
    os.utime(path, ns=times_ns, follow_symlinks=False)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# errnos meaning "no atomic exchange here" (a kernel before 3.15, a filesystem without it): fall back to replacing.
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP}


def _load_renameat2() -> Any:
    """Linux's ``renameat2`` from the C library, or None (another system, or a C library without it)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _load_renameat2()


def _exchange(a: str, b: str) -> None:
    """Swap the names ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``): both must exist.

    Raises ``OSError(ENOSYS)`` where the call does not exist and whatever the kernel returns otherwise (``EINVAL``
    from a filesystem that cannot exchange); the caller falls back to ``os.replace`` for ``_NO_EXCHANGE``.
    """
    if _RENAMEAT2 is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available", a, None, b)
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), a, None, b)


@dataclass
class WriteCalls:
    """Every system call through which the fixer changes the disk (reads go straight to ``os``).

    Tests replace the module's ``CALLS`` with an instance whose functions fail with ``ENOSPC``/``EIO`` at the
    k-th call, and check the tree is left as before or as planned, and that ``undo`` still works.
    """

    open: Callable[[str, int, int], int] = os.open
    write: Callable[[int, bytes], int] = os.write
    fsync: Callable[[int], None] = os.fsync
    fchmod: Callable[[int, int], None] = os.fchmod
    replace: Callable[[str, str], None] = os.replace
    rename: Callable[[str, str], None] = os.rename
    link: Callable[[str, str], None] = _link
    mkdir: Callable[[str, int], None] = os.mkdir
    unlink: Callable[[str], None] = os.unlink
    rmdir: Callable[[str], None] = os.rmdir
    utime: Callable[[str, tuple[int, int]], None] = _utime
    exchange: Callable[[str, str], None] = _exchange

    NAMES = (
        "open", "write", "fsync", "fchmod", "replace", "rename", "link", "mkdir", "unlink", "rmdir", "utime", "exchange"
    )  # fmt: skip


CALLS = WriteCalls()
_HELD: set[str] = set()  # lock files this process holds (a lock with our pid that is not here is stale)


def crash_points(kinds: Sequence[OpKind]) -> list[str]:
    """Every point where ``CKPTDOCTOR_TEST_CRASH`` can kill a fix whose operations have these kinds, in order.

    A rewrite also has ``op:<k>:exchanged`` (after the atomic exchange, before its check), reached only where the
    exchange is available, so it is not listed here.
    """
    points = ["journal"]
    for k, kind in enumerate(kinds, 1):
        if kind != OpKind.QUARANTINE:
            points += [f"op:{k}:temp", f"op:{k}:saved"]
        points += [f"op:{k}:moved", f"op:{k}"]
    return points


def _crash_point(name: str) -> None:
    """Test hook: die here, as a SIGKILL would, when the environment names this point."""
    if os.environ.get(CRASH_ENV) == name or (
        name.startswith("op:") and name.count(":") == 1 and os.environ.get(CRASH_AFTER_OP_ENV) == name[3:]
    ):
        os.kill(os.getpid(), signal.SIGKILL)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = CALLS.write(fd, bytes(view[:_CHUNK]))
        view = view[n:]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC)
    try:
        CALLS.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: str, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` through a fsynced temp file and ``os.replace``; the folder is fsynced too."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = CALLS.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)
    try:
        try:
            _write_all(fd, data)
            CALLS.fsync(fd)
        finally:
            os.close(fd)
        CALLS.replace(tmp, path)
    except OSError:
        _quietly(CALLS.unlink, tmp)
        raise
    _fsync_dir(os.path.dirname(path))


def _quietly(fn: Callable[[str], None], path: str) -> None:
    """Best-effort cleanup of the fixer's own temp files and empty folders."""
    with contextlib.suppress(OSError):
        fn(path)


# ---------------------------------------------------------------------------------------------------------------
# Digests


@dataclass(frozen=True, slots=True)
class Digest:
    """What a path held: its type (``file``/``dir``/``link``/``special``), total bytes, sha256 and mode.

    For a folder the sha256 covers a manifest of every entry below it (relative name, type, mode, size and content
    hash), so any change inside shows.
    """

    type: str
    size: int
    sha256: str
    mode: int

    def same(self, other: Digest | None) -> bool:
        """Same content (type, size and hash; the mode is recorded, not compared)."""
        return other is not None and (self.type, self.size, self.sha256) == (other.type, other.size, other.sha256)

    def to_json(self) -> dict[str, Any]:
        return {"type": self.type, "size": self.size, "sha256": self.sha256, "mode": f"{self.mode:o}"}

    @staticmethod
    def from_json(d: Any) -> Digest:
        return Digest(str(d["type"]), int(d["size"]), str(d["sha256"]), int(str(d["mode"]), 8))


def _hash_file(path: str) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    try:
        while chunk := os.read(fd, _CHUNK):
            h.update(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return size, h.hexdigest()


def digest(path: str) -> Digest:
    """The digest of a file, folder (recursively, links not followed) or link at ``path``."""
    st = os.lstat(path)
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISREG(st.st_mode):
        size, sha = _hash_file(path)
        return Digest("file", size, sha, mode)
    if stat.S_ISLNK(st.st_mode):
        return Digest("link", 0, hashlib.sha256(os.fsencode(os.readlink(path))).hexdigest(), mode)
    if not stat.S_ISDIR(st.st_mode):
        return Digest("special", 0, hashlib.sha256(b"").hexdigest(), mode)
    h = hashlib.sha256()
    total = 0
    for rel in _walk(path, ""):
        d = digest(os.path.join(path, rel))
        total += d.size
        h.update(os.fsencode(rel) + f"\0{d.type}\0{d.mode:o}\0{d.size}\0{d.sha256}\n".encode())
    return Digest("dir", total, h.hexdigest(), mode)


def _walk(base: str, prefix: str) -> Iterator[str]:
    """Every entry below ``base`` (relative names, sorted, links not followed)."""
    for name in sorted(os.listdir(os.path.join(base, prefix) if prefix else base)):
        rel = f"{prefix}/{name}" if prefix else name
        yield rel
        if stat.S_ISDIR(os.lstat(os.path.join(base, rel)).st_mode):
            yield from _walk(base, rel)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True, slots=True)
class PlannedOp:
    """One operation the fixer will perform, checked against the disk: what it changes and (rewrites) the diff."""

    kind: OpKind
    path: str
    rules: tuple[str, ...]
    title: str
    content: str | None = None
    is_dir: bool = False
    change: str = ""  # "1 entry changed", "`global_step9` -> `global_step8`"
    diff: str = ""  # unified diff of a rewrite
    before_sha256: str | None = None  # rewrites: the bytes the plan was computed against

    def describe(self, txid: str = "<txid>") -> str:
        """``move `a` to `.ckptdoctor/quarantine/<txid>/a` `` or ``rewrite `x.json`: 1 entry changed``."""
        if self.kind == OpKind.QUARANTINE:
            slash = "/" if self.is_dir else ""
            return f"move `{self.path}{slash}` to `{quarantine_path(txid, self.path)}{slash}`"
        return f"rewrite `{self.path}`: {self.change}"


@dataclass(frozen=True, slots=True)
class Skipped:
    """A finding with a fix plan the fixer does not apply, and why."""

    finding: Finding
    reason: str


@dataclass(frozen=True, slots=True)
class RootPlan:
    """What ``fix`` would do under one root: the operations, the findings they fix, what it leaves and why."""

    root: str  # as the user gave it
    abs_root: str  # resolved once; every path the fixer touches is below it
    tree: Tree
    ops: tuple[PlannedOp, ...]
    planned: tuple[Finding, ...]
    skipped: tuple[Skipped, ...] = ()
    manual: tuple[Finding, ...] = ()
    interrupted: tuple[str, ...] = ()  # transactions a crash left half-applied (fix completes them first)


def quarantine_path(txid: str, rel: str) -> str:
    """Where ``rel`` goes in the quarantine, relative to the root."""
    return f"{OWN_DIR}/quarantine/{txid}/{rel}"


def _abs(root: str, rel: str) -> str:
    return os.path.join(root, *rel.split("/"))


def _parent(rel: str) -> str:
    return rel.rsplit("/", 1)[0] if "/" in rel else "."


def _under(path: str, folder: str) -> bool:
    return folder in ("", ".") or path == folder or path.startswith(folder + "/")


def check_path(abs_root: str, rel: str) -> tuple[os.stat_result | None, str | None]:
    """``rel``'s lstat when the fixer may touch it: inside the root, not ckptdoctor's own, through no link.

    Returns ``(None, reason)`` when it must not.
    """
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return None, f"`{rel}` is not a path inside the root; fix plans never leave it"
    if parts[0] == OWN_DIR:
        return None, f"`{rel}` is inside ckptdoctor's own `{OWN_DIR}/` folder"
    cur = abs_root
    st: os.stat_result | None = None
    for i, part in enumerate(parts):
        cur = os.path.join(cur, part)
        try:
            st = os.lstat(cur)
        except OSError as e:
            return None, f"`{'/'.join(parts[: i + 1])}` cannot be used: {e.strerror or e}"
        if stat.S_ISLNK(st.st_mode):
            return None, f"`{'/'.join(parts[: i + 1])}` is a symbolic link; the fixer never writes through one"
        if i < len(parts) - 1 and not stat.S_ISDIR(st.st_mode):
            return None, f"`{'/'.join(parts[: i + 1])}` is not a folder"
    return st, None


def _flatten(value: Any, prefix: str, out: dict[str, str]) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, list) and value:
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}[{i}]", out)
    else:
        out[prefix] = json.dumps(value, sort_keys=True)


def _json_change(old: str, new: str) -> str:
    a: dict[str, str] = {}
    b: dict[str, str] = {}
    try:
        _flatten(json.loads(old), "", a)
    except ValueError:
        return "replaces a file that is not valid JSON"
    _flatten(json.loads(new), "", b)
    n = sum(1 for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    return f"{n} entr{'y' if n == 1 else 'ies'} changed" if n else "formatting only"


def _unified(path: str, old: str, new: str, limit: int = 80) -> str:
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    lines = list(difflib.unified_diff(a, b, f"a/{path}", f"b/{path}", n=2))
    lines = [ln if ln.endswith("\n") else ln + "\n\\ No newline at end of file\n" for ln in lines]
    if len(lines) > limit:
        lines = [*lines[:limit], f"... ({len(lines) - limit} more diff lines)\n"]
    return "".join(lines)


def _plan_op(abs_root: str, kind: OpKind, rel: str, content: str | None, rule: str, title: str) -> PlannedOp | str:
    """One fix operation checked against the disk, or the reason it is rejected."""
    st, why = check_path(abs_root, rel)
    if st is None:
        return why or f"`{rel}` cannot be used"
    if kind == OpKind.QUARANTINE:
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            return f"`{rel}` is not a regular file or folder"
        return PlannedOp(kind, rel, (rule,), title, is_dir=stat.S_ISDIR(st.st_mode))
    if content is None:
        return f"the plan to rewrite `{rel}` carries no new text"
    if not stat.S_ISREG(st.st_mode):
        return f"`{rel}` is not a regular file"
    name = rel.rsplit("/", 1)[-1].lower()
    if name.endswith(_BINARY_SUFFIXES) or (kind == OpKind.REWRITE_JSON and not name.endswith(".json")):
        return f"`{rel}` is not a text file the fixer rewrites (pickles and weights are never rewritten)"
    if st.st_size > REWRITE_MAX_BYTES:
        return f"`{rel}` is {st.st_size:,} bytes, more than a JSON or text file the fixer rewrites"
    try:
        fd = os.open(_abs(abs_root, rel), os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
        try:
            raw = os.read(fd, REWRITE_MAX_BYTES + 1)
        finally:
            os.close(fd)
        old = raw.decode("utf-8")
    except OSError as e:
        return f"`{rel}` cannot be read: {e.strerror or e}"
    except UnicodeDecodeError:
        return f"`{rel}` is not UTF-8 text; never rewritten"
    if raw.startswith(_BINARY_MAGIC) or "\0" in old:
        return f"`{rel}` holds binary data (a pickle or an archive); never rewritten"
    if kind == OpKind.REWRITE_JSON:
        try:
            json.loads(content)
        except ValueError as e:
            return f"the new text for `{rel}` is not valid JSON ({e})"
    if content == old:
        return f"`{rel}` already holds the planned text"
    change = _json_change(old, content) if kind == OpKind.REWRITE_JSON else f"`{old.strip()}` -> `{content.strip()}`"
    return PlannedOp(kind, rel, (rule,), title, content, False, change, _unified(rel, old, content), _sha(raw))


def plan_root(tree: Tree, findings: Sequence[Finding], *, unsafe: bool = False, root: str | None = None) -> RootPlan:
    """Turn the findings' fix plans into checked operations for one root.

    Safe plans are taken; unsafe ones only with ``unsafe``; manual ones are listed. A plan is taken whole or not at
    all: one operation outside the root, through a link, on a binary file or in conflict with another plan rejects
    it. Operations inside a folder that is quarantined anyway are dropped (the move covers them).
    """
    given = tree.root if root is None else root
    abs_root = os.path.realpath(given)
    skipped: list[Skipped] = []
    manual: list[Finding] = []
    taken: list[tuple[Finding, list[PlannedOp]]] = []
    for f in findings:
        if f.fix is None:
            continue
        if f.fix.applicability == Applicability.MANUAL or not f.fix.ops:
            manual.append(f)
            continue
        if f.fix.applicability == Applicability.UNSAFE and not unsafe:
            skipped.append(Skipped(f, "unsafe fix: applied only with --unsafe-fixes"))
            continue
        ops: list[PlannedOp] = []
        reason: str | None = None
        for op in f.fix.ops:
            planned = _plan_op(abs_root, op.kind, op.path, op.content, f.rule, f.fix.title)
            if isinstance(planned, str):
                reason = planned
                break
            ops.append(planned)
        if reason is not None:
            skipped.append(Skipped(f, reason))
        else:
            taken.append((f, ops))

    by_path: dict[str, PlannedOp] = {}
    planned_findings: list[Finding] = []
    for f, ops in taken:
        clash = next(
            (
                o.path
                for o in ops
                if o.path in by_path and (by_path[o.path].kind, by_path[o.path].content) != (o.kind, o.content)
            ),
            None,
        )
        if clash is not None:
            skipped.append(Skipped(f, f"another fix changes `{clash}` differently; run `ckptdoctor fix` again after"))
            continue
        for o in ops:
            old = by_path.get(o.path)
            by_path[o.path] = o if old is None else _with_rule(old, o.rules)
        planned_findings.append(f)
    folders = [p for p, o in by_path.items() if o.kind == OpKind.QUARANTINE and o.is_dir]
    final = [o for p, o in sorted(by_path.items()) if not any(p != d and _under(p, d) for d in folders)]
    return RootPlan(given, abs_root, tree, tuple(final), tuple(planned_findings), tuple(skipped), tuple(manual))


def _with_rule(op: PlannedOp, rules: tuple[str, ...]) -> PlannedOp:
    merged = tuple(dict.fromkeys(op.rules + rules))
    return PlannedOp(op.kind, op.path, merged, op.title, op.content, op.is_dir, op.change, op.diff, op.before_sha256)


# ---------------------------------------------------------------------------------------------------------------
# The journal


@dataclass
class JournalOp:
    """One operation as the journal records it (mutable: its status advances as the transaction runs)."""

    index: int
    kind: OpKind
    path: str
    rules: list[str]
    title: str
    before: Digest
    after: Digest | None  # None: nothing is left at `path` (it moved to the quarantine)
    content: str | None = None
    times: tuple[int, int] | None = None  # a moved folder's own (atime_ns, mtime_ns), kept across the move
    status: str = "pending"  # pending | done | undone

    def quarantine(self, txid: str) -> str:
        return quarantine_path(txid, self.path)

    def temp(self, txid: str) -> str:
        """The rewrite's temp file, beside the target (same folder, so ``os.replace`` is atomic)."""
        parent, name = _parent(self.path), self.path.rsplit("/", 1)[-1]
        tmp = f".{name}.ckptdoctor-{txid}.tmp"
        return tmp if parent == "." else f"{parent}/{tmp}"

    def to_json(self, txid: str) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind.value,
            "path": self.path,
            "rules": self.rules,
            "title": self.title,
            "before": self.before.to_json(),
            "after": None if self.after is None else self.after.to_json(),
            "quarantine": self.quarantine(txid),
            "temp": None if self.kind == OpKind.QUARANTINE else self.temp(txid),
            "content": self.content,
            "times_ns": None if self.times is None else list(self.times),
            "status": self.status,
        }

    @staticmethod
    def from_json(d: Any) -> JournalOp:
        times = d.get("times_ns")
        return JournalOp(
            index=int(d["index"]),
            kind=OpKind(d["kind"]),
            path=str(d["path"]),
            rules=[str(r) for r in d.get("rules", [])],
            title=str(d.get("title", "")),
            before=Digest.from_json(d["before"]),
            after=None if d.get("after") is None else Digest.from_json(d["after"]),
            content=d.get("content"),
            times=None if times is None else (int(times[0]), int(times[1])),
            status=str(d.get("status", "pending")),
        )


@dataclass
class Journal:
    """One fix transaction: ``state`` is applying | applied | undoing | undone | rolled-back."""

    txid: str
    root: str
    created: float
    state: str
    ops: list[JournalOp]
    dir_times: dict[str, tuple[int, int]] = field(default_factory=dict)  # folders whose mtime the fix keeps

    def to_json(self) -> dict[str, Any]:
        from ckptdoctor import __version__

        return {
            "schema": JOURNAL_SCHEMA,
            "version": __version__,
            "txid": self.txid,
            "root": self.root,
            "created": self.created,
            "state": self.state,
            "dir_times_ns": {k: list(v) for k, v in sorted(self.dir_times.items())},
            "ops": [op.to_json(self.txid) for op in self.ops],
        }

    @staticmethod
    def from_json(d: Any) -> Journal:
        if not isinstance(d, dict) or d.get("schema") != JOURNAL_SCHEMA:
            raise ValueError(f"not a {JOURNAL_SCHEMA} document")
        return Journal(
            txid=str(d["txid"]),
            root=str(d["root"]),
            created=float(d["created"]),
            state=str(d["state"]),
            ops=[JournalOp.from_json(o) for o in d["ops"]],
            dir_times={str(k): (int(v[0]), int(v[1])) for k, v in d.get("dir_times_ns", {}).items()},
        )

    @property
    def rules(self) -> list[str]:
        return sorted({r for op in self.ops for r in op.rules})


def _own(abs_root: str, *parts: str) -> str:
    return os.path.join(abs_root, OWN_DIR, *parts)


def load_journals(path: str) -> list[Journal]:
    """Every transaction recorded under root ``path``, oldest first. Reads only; a missing folder means none."""
    folder = _own(os.path.realpath(path), "journal")
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json") and not n.startswith("."))
    except FileNotFoundError:
        return []
    except OSError as e:
        raise FixRefused(f"cannot read the journal folder {folder}: {e.strerror or e}") from None
    out: list[Journal] = []
    for name in names:
        full = os.path.join(folder, name)
        try:
            with open(full, encoding="utf-8") as fh:
                out.append(Journal.from_json(json.load(fh)))
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            raise FixRefused(f"journal {full} cannot be read ({e}); move it away to continue") from None
    return sorted(out, key=lambda j: (j.created, j.txid))


def _save(abs_root: str, j: Journal) -> None:
    data = (json.dumps(j.to_json(), indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    _atomic_write(_own(abs_root, "journal", f"{j.txid}.json"), data)


def _save_quietly(abs_root: str, j: Journal) -> None:
    """Journal updates during a rollback after a fault: the state on disk is recognised from the hashes anyway."""
    with contextlib.suppress(OSError):
        _save(abs_root, j)


def _ensure_dir(abs_root: str, rel: str) -> None:
    """Create ``rel`` (and its parents) below the root; an existing link or file in the way is a refusal."""
    cur = abs_root
    for part in rel.split("/"):
        cur = os.path.join(cur, part)
        try:
            CALLS.mkdir(cur, 0o755)
        except FileExistsError:
            st = os.lstat(cur)
            if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
                raise FixRefused(f"{cur} is not a plain folder; the fixer never writes through links") from None


def _new_txid() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


# ---------------------------------------------------------------------------------------------------------------
# The lock


class RootLock:
    """``<root>/.ckptdoctor/lock``, created with O_CREAT|O_EXCL and holding ``pid host time``: one fixer per root.

    A lock whose process is gone (same host, pid not alive) is stale and is taken over; a lock from another host
    is never judged stale (remove it by hand when you know no fixer runs there).
    """

    def __init__(self, abs_root: str) -> None:
        self.abs_root = abs_root
        self.path = _own(abs_root, "lock")
        self.held = False
        self.created: tuple[int, int] | None = None  # the root's times, when this lock creates `.ckptdoctor/`

    def __enter__(self) -> RootLock:
        try:
            if not os.path.lexists(_own(self.abs_root)):
                st = os.lstat(self.abs_root)
                self.created = (st.st_atime_ns, st.st_mtime_ns)
            _ensure_dir(self.abs_root, OWN_DIR)
            for _ in range(3):
                try:
                    fd = CALLS.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o644)
                except FileExistsError:
                    self._take_over_stale()
                    continue
                self.held = True
                _HELD.add(self.path)
                try:
                    _write_all(fd, f"{os.getpid()} {socket.gethostname()} {time.time():.0f}\n".encode())
                    CALLS.fsync(fd)
                finally:
                    os.close(fd)
                return self
        except OSError as e:
            self.__exit__()
            raise FixRefused(f"cannot lock {self.abs_root}: {e.strerror or e}; nothing was changed") from None
        raise FixRefused(f"cannot lock {self.abs_root}: the lock keeps changing hands; nothing was changed")

    def __exit__(self, *exc: object) -> None:
        if self.held:
            self.held = False
            _HELD.discard(self.path)
            _quietly(CALLS.unlink, self.path)
        if self.created is not None:
            # A refusal leaves no trace: the folder goes when empty, and the root keeps its mtime either way.
            _quietly(CALLS.rmdir, _own(self.abs_root, "journal"))
            _quietly(CALLS.rmdir, _own(self.abs_root))
            with contextlib.suppress(OSError):
                CALLS.utime(self.abs_root, self.created)
            self.created = None

    def _holder(self, path: str) -> tuple[int, str] | None:
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                pid, host = fh.read(200).split()[:2]
            return int(pid), host
        except (OSError, ValueError):
            return None

    def _take_over_stale(self) -> None:
        holder = self._holder(self.path)
        if holder is None:
            try:
                age = time.time() - os.lstat(self.path).st_mtime
            except FileNotFoundError:
                return
            if age < BUSY_SECONDS:  # being written by a starting fixer
                raise FixRefused(f"another ckptdoctor is starting on {self.abs_root} ({self.path}); try again")
        else:
            pid, host = holder
            mine = pid == os.getpid() and self.path not in _HELD  # left by an earlier call in this process
            if host != socket.gethostname() or (_alive(pid) and not mine):
                raise FixRefused(
                    f"another ckptdoctor (pid {pid} on {host}) is working on {self.abs_root}; if it is not, "
                    f"remove {self.path}"
                )
        # Move the stale lock aside under a name of our own, then check it is still the one we judged stale.
        aside = f"{self.path}.stale-{os.getpid()}-{secrets.token_hex(3)}"
        try:
            CALLS.rename(self.path, aside)
        except FileNotFoundError:
            return
        if self._holder(aside) != holder:  # a live fixer replaced it meanwhile: give it back
            with contextlib.suppress(OSError):
                CALLS.link(aside, self.path)
            _quietly(CALLS.unlink, aside)
            raise FixRefused(f"another ckptdoctor took the lock on {self.abs_root}; try again")
        _quietly(CALLS.unlink, aside)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------------------------------------------------
# Operations: apply, recognise, roll back


def _save_original(abs_root: str, txid: str, op: JournalOp) -> None:
    """Keep the original of a rewrite in the quarantine: a hard link (same inode, mode and times), else a copy."""
    target, keep = _abs(abs_root, op.path), _abs(abs_root, op.quarantine(txid))
    if os.path.lexists(keep):
        if digest(keep).same(op.before):
            return  # a previous, interrupted attempt already kept it
        raise FixRefused(f"`{op.quarantine(txid)}` exists and is not the original of `{op.path}`")
    _ensure_dir(abs_root, _parent(op.quarantine(txid)))
    try:
        CALLS.link(target, keep)
    except OSError as e:
        if e.errno not in _NO_LINK:
            raise
        _copy_file(target, keep)
        if not digest(keep).same(op.before):  # a writer changed the file while it was copied
            CALLS.unlink(keep)
            raise ConcurrentChange(_changed_msg(op.path)) from None
    _fsync_dir(os.path.dirname(keep))


def _copy_file(src: str, dst: str) -> None:
    st = os.lstat(src)
    tmp = dst + ".partial"
    if os.path.lexists(tmp):
        CALLS.unlink(tmp)
    rfd = os.open(src, os.O_RDONLY | _NOFOLLOW | _CLOEXEC)
    try:
        wfd = CALLS.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
        try:
            while chunk := os.read(rfd, _CHUNK):
                _write_all(wfd, chunk)
            CALLS.fchmod(wfd, stat.S_IMODE(st.st_mode))
            CALLS.fsync(wfd)
        finally:
            os.close(wfd)
    finally:
        os.close(rfd)
    CALLS.utime(tmp, (st.st_atime_ns, st.st_mtime_ns))
    CALLS.rename(tmp, dst)


def _apply_rewrite(abs_root: str, txid: str, op: JournalOp, k: int) -> None:
    target, tmp = _abs(abs_root, op.path), _abs(abs_root, op.temp(txid))
    assert op.content is not None
    st = os.lstat(target)
    if os.path.lexists(tmp):
        CALLS.unlink(tmp)  # our own temp file from an interrupted attempt
    fd = CALLS.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
    try:
        _write_all(fd, op.content.encode("utf-8"))
        CALLS.fchmod(fd, stat.S_IMODE(st.st_mode))
        if os.geteuid() == 0:  # keep the owner when root rewrites another user's file
            os.fchown(fd, st.st_uid, st.st_gid)
        CALLS.fsync(fd)
    finally:
        os.close(fd)
    # The new file keeps the original's mtime: rotation and stale-run detection order checkpoints by time.
    CALLS.utime(tmp, (st.st_atime_ns, st.st_mtime_ns))
    _crash_point(f"op:{k}:temp")
    keep = _abs(abs_root, op.quarantine(txid))
    try:
        _save_original(abs_root, txid, op)
        # Re-hash right before the replace: a writer since the journaled hash keeps its bytes and the op aborts.
        if not _holds(target, op.before):
            # The kept name is ours: another name of the writer's inode, or an original the writer replaced.
            _quietly(CALLS.unlink, keep)
            raise ConcurrentChange(_changed_msg(op.path))
    except ConcurrentChange:
        _quietly(CALLS.unlink, tmp)
        raise
    _crash_point(f"op:{k}:saved")
    ours = os.lstat(tmp)
    try:
        # Swap the new file and the target in one step, then judge what came out: no write can fall between a
        # check and the act, since the check is made on what the act took away.
        CALLS.exchange(tmp, target)
    except OSError as e:
        if e.errno == errno.ENOENT and os.path.lexists(tmp) and not os.path.lexists(target):
            _quietly(CALLS.unlink, keep)  # removed by another process since the check: the removal stands
            _quietly(CALLS.unlink, tmp)
            raise ConcurrentChange(_changed_msg(op.path)) from None
        if e.errno not in _NO_EXCHANGE:
            raise
        _replace_checked(abs_root, txid, op)  # no atomic exchange here: check, then replace
        return
    _fsync_dir(os.path.dirname(target))
    _crash_point(f"op:{k}:exchanged")
    if _holds(tmp, op.before):
        _keep_original(tmp, keep)
        return
    raise ConcurrentChange(_give_back(abs_root, txid, op, ours))


def _keep_original(tmp: str, keep: str) -> None:
    """The original came out at the temp path after the exchange: it becomes the quarantined original (its own
    inode, so a process still writing through an open descriptor writes there); when the quarantine already holds
    that inode (a hard link) the extra name goes. Another filesystem (no link, no rename) keeps the verified copy."""
    if _same_inode(tmp, keep):
        CALLS.unlink(tmp)
    else:
        try:
            CALLS.replace(tmp, keep)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            CALLS.unlink(tmp)
        _fsync_dir(os.path.dirname(keep))
    _fsync_dir(os.path.dirname(tmp))


def _give_back(abs_root: str, txid: str, op: JournalOp, ours: os.stat_result | None) -> str:
    """A writer got to the target before the exchange, so its bytes came out at the temp path: swap them back
    while the target is still the fixer's file (``ours``: its inode; None when recovering after a crash), drop the
    fixer's files, and return the message. Bytes written again meanwhile are set aside, never removed."""
    target, tmp, keep = _abs(abs_root, op.path), _abs(abs_root, op.temp(txid)), _abs(abs_root, op.quarantine(txid))

    def is_ours(path: str) -> bool:
        if ours is not None and not _same_inode_as(path, ours):
            return False
        return _holds(path, op.after)

    if is_ours(target):
        CALLS.exchange(tmp, target)
        _fsync_dir(os.path.dirname(target))
    # The kept original is the fixer's: another name of the writer's inode, or an original the writer replaced.
    _quietly(CALLS.unlink, keep)
    if is_ours(tmp):
        CALLS.unlink(tmp)
        return _changed_msg(op.path)
    # Written twice (or the target changed again before the swap back): both writes are kept as written.
    aside = f"{op.quarantine(txid)}.written-during-fix"
    CALLS.rename(tmp, _abs(abs_root, aside))
    _fsync_dir(os.path.dirname(_abs(abs_root, aside)))
    _fsync_dir(os.path.dirname(tmp))
    return (
        f"`{op.path}` was written by another process more than once during the fix; it is left as last written "
        f"and the bytes written before are in `{aside}`"
    )


def _same_inode_as(path: str, st: os.stat_result) -> bool:
    try:
        return os.path.samestat(os.lstat(path), st)
    except OSError:
        return False


def _replace_checked(abs_root: str, txid: str, op: JournalOp) -> None:
    """The fallback where ``renameat2(RENAME_EXCHANGE)`` is missing (not Linux, a kernel before 3.15, a filesystem
    answering EINVAL): ``os.replace`` right after the last hash check, then a check of the kept original.

    The window it leaves: a writer that renames a new file over the target (or, without hard links, writes in
    place) between that last check and the replace loses its bytes.
    """
    target, tmp, keep = _abs(abs_root, op.path), _abs(abs_root, op.temp(txid)), _abs(abs_root, op.quarantine(txid))
    linked = _same_inode(keep, target)
    CALLS.replace(tmp, target)
    _fsync_dir(os.path.dirname(target))
    if linked and not _holds(keep, op.before):
        # A writer got into the original's inode in the instant before the replace (or writes through an open
        # descriptor): its bytes are in the kept original. Put that inode back unless someone wrote ours too.
        if _holds(target, op.after):
            CALLS.replace(keep, target)
            _fsync_dir(os.path.dirname(target))
            raise ConcurrentChange(_changed_msg(op.path))
        raise ConcurrentChange(
            f"`{op.path}` and its original in `{op.quarantine(txid)}` were both written by another process during "
            "the fix; both are kept as written"
        )


def _holds(path: str, d: Digest | None) -> bool:
    """``path`` exists and holds exactly ``d`` (a path removed meanwhile holds nothing)."""
    try:
        return digest(path).same(d)
    except OSError:
        return False


def _same_inode(a: str, b: str) -> bool:
    try:
        return os.path.samestat(os.lstat(a), os.lstat(b))
    except OSError:
        return False


def _changed_msg(rel: str) -> str:
    return f"`{rel}` was written by another process during the fix; it is left as that process wrote it"


def _move(abs_root: str, src_rel: str, dst_rel: str, times: tuple[int, int] | None) -> None:
    src, dst = _abs(abs_root, src_rel), _abs(abs_root, dst_rel)
    CALLS.rename(src, dst)
    _fsync_dir(os.path.dirname(dst))
    if os.path.dirname(dst) != os.path.dirname(src):
        _fsync_dir(os.path.dirname(src))
    if times is not None:
        CALLS.utime(dst, times)


def _apply_op(abs_root: str, txid: str, op: JournalOp, k: int) -> None:
    if op.kind == OpKind.QUARANTINE:
        _ensure_dir(abs_root, _parent(op.quarantine(txid)))
        _move(abs_root, op.path, op.quarantine(txid), op.times)
        if not _holds(_abs(abs_root, op.quarantine(txid)), op.before):
            # Written since it was journaled (the rename keeps every byte): give it back to its writer.
            if os.path.lexists(_abs(abs_root, op.path)):
                raise ConcurrentChange(
                    f"`{op.path}` was written by another process while it moved to `{op.quarantine(txid)}`, and "
                    f"`{op.path}` was created again; both are kept as written"
                )
            _move(abs_root, op.quarantine(txid), op.path, op.times)
            raise ConcurrentChange(_changed_msg(op.path))
    else:
        _apply_rewrite(abs_root, txid, op, k)


def _op_state(abs_root: str, txid: str, op: JournalOp) -> tuple[str, str]:
    """Recognise an operation's state on disk: ``applied``, ``pending``, ``both`` (quarantined, and the path
    exists again), ``untouched`` (a rewrite another process got to first), ``raced`` (killed after exchanging a
    target another process had just written: its bytes are at the temp path) or ``conflict``, with a reason."""
    here = _abs(abs_root, op.path)
    if op.kind == OpKind.QUARANTINE:
        p, q = os.path.lexists(here), os.path.lexists(_abs(abs_root, op.quarantine(txid)))
        if p and q:
            return "both", f"`{op.path}` exists again (created after the fix)"
        if q:
            return "applied", ""
        if p:
            return "pending", ""
        return "conflict", f"`{op.path}` is neither in place nor in the quarantine"
    if op.status != "done" and not _holds(here, op.after) and not _holds(here, op.before):
        keep = _abs(abs_root, op.quarantine(txid))
        if not os.path.lexists(keep) or _same_inode(keep, here) or _holds(_abs(abs_root, op.temp(txid)), op.after):
            # The replace (or exchange) always follows keeping the original under a name of its own, and the
            # fixer's text is still (or again) at the temp path, so it is not at `path`: another process wrote it.
            # Nothing of the fixer's is there to undo.
            return "untouched", f"`{op.path}` was written by another process before the fix reached it"
    if not os.path.lexists(here):
        return "conflict", f"`{op.path}` was removed after the fix"
    now = digest(here)
    if now.same(op.after):
        tmp = _abs(abs_root, op.temp(txid))
        if op.status != "done" and os.path.lexists(tmp) and not _holds(tmp, op.before) and not _holds(tmp, op.after):
            # Killed between the exchange and its check: what came out is another process's write, not the original.
            return "raced", f"`{op.path}` was written by another process while the fix exchanged it"
        return "applied", ""
    if now.same(op.before):
        return "pending", ""
    return "conflict", f"`{op.path}` changed after the fix ({now.size:,} bytes, sha256 {now.sha256[:12]}…)"


def _check_undo(abs_root: str, j: Journal) -> list[str]:
    """Each operation's state, checked so the whole undo can succeed; a refusal lists every obstacle."""
    states: list[str] = []
    problems: list[str] = []
    for op in j.ops:
        state, why = _op_state(abs_root, j.txid, op)
        if state in ("both", "conflict"):
            problems.append(why)
        elif state == "applied":
            kept = _abs(abs_root, op.quarantine(j.txid))
            if not os.path.lexists(kept):
                problems.append(f"the original of `{op.path}` is missing from `{op.quarantine(j.txid)}`")
            elif not (now := digest(kept)).same(op.before):
                problems.append(
                    f"`{op.quarantine(j.txid)}` (the original of `{op.path}`) changed after the fix, so it is no "
                    f"longer what the fix moved there ({now.size:,} bytes, sha256 {now.sha256[:12]}…; a process may "
                    "still have it open); it stays there as written"
                )
            parent = _abs(abs_root, _parent(op.path))
            if not os.path.isdir(parent) or os.path.islink(parent):
                problems.append(f"`{_parent(op.path)}` (where `{op.path}` goes back) is gone")
        states.append(state)
    if problems:
        raise FixRefused(f"cannot undo transaction {j.txid}: " + "; ".join(problems) + ". Nothing was changed.")
    return states


def _check_redo(abs_root: str, j: Journal) -> list[str]:
    states: list[str] = []
    problems: list[str] = []
    for op in j.ops:
        state, why = _op_state(abs_root, j.txid, op)
        if state in ("conflict", "untouched"):
            problems.append(why)
        elif state == "raced":
            problems.append(f"{why} (`ckptdoctor undo` puts its bytes back)")
        elif (
            state == "pending" and op.kind == OpKind.QUARANTINE and not digest(_abs(abs_root, op.path)).same(op.before)
        ):
            problems.append(f"`{op.path}` changed after the fix was planned")
        states.append("applied" if state == "both" else state)
    if problems:
        raise FixRefused(
            f"cannot complete interrupted transaction {j.txid}: "
            + "; ".join(problems)
            + f". Run `ckptdoctor undo --txid {j.txid}` to roll it back."
        )
    return states


def _undo_op(abs_root: str, txid: str, op: JournalOp, state: str) -> None:
    if state == "raced":
        _give_back(abs_root, txid, op, None)
    elif state == "applied":
        if op.kind == OpKind.QUARANTINE:
            _move(abs_root, op.quarantine(txid), op.path, op.times)
        else:
            if not _holds(_abs(abs_root, op.path), op.after):  # written since the undo checked it: keep those bytes
                raise ConcurrentChange(f"{_changed_msg(op.path)}; run `ckptdoctor undo` again to see what is left")
            _settle_temp(abs_root, txid, op)
            CALLS.replace(_abs(abs_root, op.quarantine(txid)), _abs(abs_root, op.path))
            _fsync_dir(os.path.dirname(_abs(abs_root, op.path)))
    elif op.kind != OpKind.QUARANTINE:
        # Not applied: only the fixer's own temp file and the kept copy of the (still present) original remain.
        for rel in (op.temp(txid), op.quarantine(txid)):
            if os.path.lexists(_abs(abs_root, rel)):
                CALLS.unlink(_abs(abs_root, rel))


def _settle_temp(abs_root: str, txid: str, op: JournalOp) -> None:
    """An applied rewrite's leftover temp file (a kill came after the exchange): the original that came out there
    is kept in the quarantine, the fixer's own text is dropped, anything else stays (``_op_state`` reports it)."""
    tmp = _abs(abs_root, op.temp(txid))
    if not os.path.lexists(tmp):
        return
    if _holds(tmp, op.before):
        _keep_original(tmp, _abs(abs_root, op.quarantine(txid)))
    elif _holds(tmp, op.after):
        CALLS.unlink(tmp)


def _restore_times(abs_root: str, j: Journal) -> None:
    """Give the touched folders back their mtimes: the Trainer's rotation orders checkpoints by folder mtime."""
    for rel, times in sorted(j.dir_times.items(), key=lambda kv: -kv[0].count("/")):
        path = _abs(abs_root, rel) if rel != "." else abs_root
        if os.path.isdir(path) and not os.path.islink(path):
            CALLS.utime(path, times)


def _forward(abs_root: str, j: Journal, states: list[str]) -> None:
    """Apply every operation not yet applied, marking each done in the journal as it completes."""
    for k, (op, state) in enumerate(zip(j.ops, states, strict=True), 1):
        if op.status == "done":
            continue
        if state == "pending":
            _apply_op(abs_root, j.txid, op, k)
        elif op.kind != OpKind.QUARANTINE:
            _settle_temp(abs_root, j.txid, op)
        _crash_point(f"op:{k}:moved")
        op.status = "done"
        _save(abs_root, j)
        _crash_point(f"op:{k}")
    _restore_times(abs_root, j)
    j.state = "applied"
    _save(abs_root, j)


def _backward(abs_root: str, j: Journal, *, final: str, strict: bool) -> int:
    """Roll every applied operation back, newest first. ``strict`` journal writes (undo) or best effort
    (rollback after a fault). Returns the number of operations restored."""
    states = _check_undo(abs_root, j)
    save = _save if strict else _save_quietly
    j.state = "undoing"
    save(abs_root, j)
    _crash_point("undo:journal")
    restored = 0
    for k in range(len(j.ops), 0, -1):
        op, state = j.ops[k - 1], states[k - 1]
        _undo_op(abs_root, j.txid, op, state)
        restored += state == "applied"
        op.status = "undone"
        save(abs_root, j)
        _crash_point(f"undo:{k}")
    _restore_times(abs_root, j)
    _prune_quarantine(abs_root, j.txid)
    j.state = final
    save(abs_root, j)
    return restored


def _prune_quarantine(abs_root: str, txid: str) -> None:
    """Remove the transaction's quarantine folders once empty (they held only what went back)."""
    top = _own(abs_root, "quarantine", txid)
    if not os.path.isdir(top):
        return
    for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda t: -len(t[0])):
        _quietly(CALLS.rmdir, dirpath)


# ---------------------------------------------------------------------------------------------------------------
# Preflight: refuse before anything is written


def _read_only(path: str) -> bool:
    """True for a folder or file nobody may write: a read-only mount, no access, or no write bit at all (the
    last one matters when running as root, which the permission bits do not stop)."""
    try:
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return True
        st = os.stat(path)
    except OSError:
        return True
    need = os.W_OK | (os.X_OK if stat.S_ISDIR(st.st_mode) else 0)
    return not os.access(path, need) or not st.st_mode & 0o222


def preflight(plan: RootPlan, *, force: bool = False, now: float | None = None) -> None:
    """Refuse (``FixRefused``) a read-only tree or, unless ``force``, a run written in the last 60 seconds."""
    root = plan.abs_root
    places = {"."} | {_parent(op.path) for op in plan.ops}
    places |= {op.path for op in plan.ops if op.is_dir or op.kind != OpKind.QUARANTINE}
    if os.path.isdir(_own(root)):
        places.add(OWN_DIR)
    locked = sorted(p for p in places if _read_only(_abs(root, p) if p != "." else root))
    if locked:
        shown = ", ".join(f"`{p}`" for p in locked[:5])
        raise FixRefused(f"{plan.root} is read-only ({shown} cannot be written); nothing was changed")
    if force:
        return
    now = time.time() if now is None else now
    fresh: list[str] = []
    for run in plan.tree.runs:
        if not any(_under(op.path, run.path) or _under(run.path, op.path) for op in plan.ops):
            continue
        for ck in run.checkpoints:
            try:
                mtime = max(ck.mtime, os.lstat(_abs(root, ck.path) if ck.path != "." else root).st_mtime)
            except OSError:
                mtime = ck.mtime
            if now - mtime < BUSY_SECONDS:
                fresh.append(f"`{ck.path}` ({max(0.0, now - mtime):.0f} s ago)")
    if fresh:
        raise FixRefused(
            f"{plan.root} looks like a run being written: {', '.join(fresh[:5])} modified within the last "
            f"{BUSY_SECONDS:.0f} s. Wait for the save to finish, or pass --force; nothing was changed"
        )


# ---------------------------------------------------------------------------------------------------------------
# Transactions


def apply_plan(plan: RootPlan, *, force: bool = False) -> Journal | None:
    """Apply one root's plan as a transaction and return its journal (None when there is nothing to do).

    Raises ``FixRefused`` for a refusal (nothing written) or a failure; after a failure the transaction is rolled
    back when possible, else the message says to run ``ckptdoctor undo`` or ``ckptdoctor fix``.
    """
    if not plan.ops:
        return None
    preflight(plan, force=force)
    root = plan.abs_root
    dir_times: dict[str, tuple[int, int]] = {}
    for rel in {"."} | {_parent(op.path) for op in plan.ops}:
        st = os.lstat(_abs(root, rel) if rel != "." else root)
        dir_times[rel] = (st.st_atime_ns, st.st_mtime_ns)
    with RootLock(root):
        ops: list[JournalOp] = []
        for i, p in enumerate(plan.ops):
            now_st, why = check_path(root, p.path)
            if now_st is None:
                raise FixRefused(f"{why}; nothing was changed")
            before = digest(_abs(root, p.path))
            if p.before_sha256 is not None and before.sha256 != p.before_sha256:
                raise FixRefused(f"`{p.path}` changed while the fix was planned; nothing was changed")
            after = None
            if p.content is not None:
                data = p.content.encode("utf-8")
                after = Digest("file", len(data), _sha(data), before.mode)
            times = (now_st.st_atime_ns, now_st.st_mtime_ns) if p.is_dir else None
            ops.append(JournalOp(i + 1, p.kind, p.path, list(p.rules), p.title, before, after, p.content, times))
        j = Journal(_new_txid(), root, time.time(), "applying", ops, dir_times)
        written = False
        try:
            _ensure_dir(root, f"{OWN_DIR}/journal")
            _save(root, j)
            written = True
            _crash_point("journal")
            _forward(root, j, ["pending"] * len(ops))
        except (OSError, FixRefused) as e:
            written = written or os.path.lexists(_own(root, "journal", f"{j.txid}.json"))  # saved, not yet synced
            raise FixRefused(_after_fault(plan.root, root, j, e, written)) from None
    return j


def _after_fault(shown: str, root: str, j: Journal, e: Exception, written: bool) -> str:
    what = e.message if isinstance(e, click.ClickException) else f"{e.strerror or e}" if isinstance(e, OSError) else e
    if not written:
        return f"fix of {shown} failed before any change ({what}); nothing was changed"
    try:
        _backward(root, j, final="rolled-back", strict=False)
    except (OSError, FixRefused) as e2:
        why = e2.message if isinstance(e2, click.ClickException) else e2
        return (
            f"fix of {shown} failed ({what}) and could not be rolled back ({why}). Transaction {j.txid} is recorded "
            f"in the journal: run `ckptdoctor undo {shown}` to restore the tree, or `ckptdoctor fix {shown}` to "
            "complete it"
        )
    return f"fix of {shown} failed ({what}); transaction {j.txid} was rolled back and the tree is as before"


def complete_interrupted(path: str) -> list[str]:
    """Roll forward every transaction a crash left in the ``applying`` state; returns their txids."""
    root = os.path.realpath(path)
    pending = [j for j in load_journals(root) if j.state in ("applying", "undoing")]
    if not pending:
        return []
    undoing = [j.txid for j in pending if j.state == "undoing"]
    if undoing:
        raise FixRefused(
            f"an undo of transaction {undoing[0]} in {path} was interrupted; run `ckptdoctor undo {path}` to finish it"
        )
    done: list[str] = []
    with RootLock(root):
        for j in pending:
            try:
                _forward(root, j, _check_redo(root, j))
            except OSError as e:
                raise FixRefused(
                    f"cannot complete interrupted transaction {j.txid}: {e.strerror or e}; run `ckptdoctor fix "
                    f"{path}` again or `ckptdoctor undo {path}`"
                ) from None
            done.append(j.txid)
    return done


def undo(path: str, txid: str | None = None) -> tuple[Journal, int]:
    """Restore the last (or the named) transaction under root ``path`` byte for byte; returns it and the number
    of operations restored. Refuses, changing nothing, when a file changed since the fix."""
    root = os.path.realpath(path)
    if not os.path.isdir(root):
        raise FixRefused(f"{path} is not a folder")
    with RootLock(root):
        journals = load_journals(root)
        if txid is not None:
            found = [j for j in journals if j.txid == txid]
            if not found:
                raise FixRefused(f"no transaction {txid} under {path} (see `ckptdoctor undo --list {path}`)")
            j = found[0]
            if j.state in ("undone", "rolled-back"):
                raise FixRefused(f"transaction {txid} was already {j.state.replace('-', ' ')}")
        else:
            live = [j for j in journals if j.state in ("applied", "applying", "undoing")]
            if not live:
                raise FixRefused(f"no fix transaction to undo under {path}")
            j = live[-1]
        try:
            restored = _backward(root, j, final="undone", strict=True)
        except OSError as e:
            raise FixRefused(
                f"undo of {j.txid} failed: {e.strerror or e}; run `ckptdoctor undo {path}` again to finish it"
            ) from None
    return j, restored


# ---------------------------------------------------------------------------------------------------------------
# Checksum manifests (`scan --deep --checksums write`)

MANIFEST_NAME = "manifest.json"


def manifest_refusal(root: str) -> str | None:
    """Why a manifest cannot be written at ``root`` (a sentence), or None: checked before a long ``--deep`` scan."""
    if "://" in root:
        return f"{root}: writing a manifest to a remote root is not supported"
    if not os.path.isdir(root):
        return f"{root} is not a folder: a manifest is written at the root of a folder"
    abs_root = os.path.realpath(root)
    own = _own(abs_root)
    for rel, path in ((OWN_DIR, own), (f"{OWN_DIR}/{MANIFEST_NAME}", _own(abs_root, MANIFEST_NAME))):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        except OSError as e:
            return f"`{rel}` under {root} cannot be used: {e.strerror or e}"
        if not (stat.S_ISDIR(st.st_mode) if path == own else stat.S_ISREG(st.st_mode)):  # lstat: a link is neither
            kind = "folder" if path == own else "file"
            return f"`{rel}` under {root} is not a plain {kind} (ckptdoctor never writes through links)"
    if _read_only(own if os.path.isdir(own) else abs_root):
        return f"{root} is read-only"
    return None


def write_manifest(root: str, manifest: dict[str, Any]) -> str:
    """Write ``manifest`` (a ``ckptdoctor.manifest/1`` document) atomically to ``<root>/.ckptdoctor/manifest.json``.

    Returns the path written. Raises ``FixRefused`` (nothing written) for what ``manifest_refusal`` names: a
    remote root, a root that is not a folder, a read-only root, a link or non-file in the way. Runs under the root
    lock, so never beside a running fix; the root keeps its times when ``.ckptdoctor/`` is created.
    """
    why = manifest_refusal(root)
    if why is not None:
        raise FixRefused(f"{why}; nothing was written")
    abs_root = os.path.realpath(root)
    target = _own(abs_root, MANIFEST_NAME)
    data = (json.dumps(manifest, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
    with RootLock(abs_root):
        try:
            _atomic_write(target, data)
        except OSError as e:
            raise FixRefused(f"cannot write {target}: {e.strerror or e}; the previous manifest is unchanged") from None
    return target


# ---------------------------------------------------------------------------------------------------------------
# The fix run (API and command)


@dataclass(frozen=True, slots=True)
class FixResult:
    """One ``fix`` over several roots: the plans, the transactions applied, and the rescan."""

    plans: tuple[RootPlan, ...]
    txids: tuple[str | None, ...]
    dry_run: bool
    fixed: int = 0
    remaining: tuple[Finding, ...] = ()
    failed_on: bool = False  # a remaining finding is at or above --fail-on

    @property
    def would_change(self) -> bool:
        return any(p.ops or p.interrupted for p in self.plans)

    def exit_code(self) -> int:
        if self.dry_run:
            return 1 if self.would_change else 0
        return 1 if self.failed_on else 0


def _check_roots(paths: Sequence[str]) -> None:
    from ckptdoctor.remote import is_remote

    reals: list[tuple[str, str]] = []
    for p in paths:
        if is_remote(p):
            raise FixRefused(
                f"{p}: `ckptdoctor fix` refuses remote roots: object storage has no atomic rename, lock or fsync, "
                f"so it cannot keep its guarantees (journal, undo byte for byte) there. Nothing was changed. "
                f"`ckptdoctor scan {p}` reads it; fix a local copy and upload that."
            )
        if not os.path.isdir(p):
            raise FixRefused(f"{p} is not a folder; `ckptdoctor fix` works on a run, checkpoint or model folder")
        reals.append((p, os.path.realpath(p)))
    for a, ra in reals:
        for b, rb in reals:
            if a != b and (ra == rb or rb.startswith(ra.rstrip(os.sep) + os.sep)):
                raise FixRefused(f"{b} is inside {a}: give each folder once")


def fix(
    paths: Sequence[str] | str,
    *,
    selection: Any = None,
    unsafe: bool = False,
    dry_run: bool = False,
    force: bool = False,
    fail_on: str = "error",
) -> FixResult:
    """Plan and (unless ``dry_run``) apply the fixes for each root, then rescan.

    ``selection`` is a ``ckptdoctor.rules.Selection``. Interrupted transactions are completed first (a dry run
    only reports them). A dry run writes nothing at all: no journal, no lock, no ``.ckptdoctor`` folder.
    """
    from ckptdoctor.scanner import scan

    roots = [paths] if isinstance(paths, str) else list(paths)
    _check_roots(roots)
    plans: list[RootPlan] = []
    txids: list[str | None] = []
    for root in roots:
        if dry_run:
            interrupted = tuple(j.txid for j in load_journals(root) if j.state in ("applying", "undoing"))
        else:
            interrupted = tuple(complete_interrupted(root))
        report = scan(root, selection=selection)
        (tree,) = report.trees
        plan = plan_root(tree, report.findings, unsafe=unsafe, root=root)
        plan = RootPlan(plan.root, plan.abs_root, tree, plan.ops, plan.planned, plan.skipped, plan.manual, interrupted)
        plans.append(plan)
        if dry_run:
            txids.append(None)
            continue
        j = apply_plan(plan, force=force)
        txids.append(None if j is None else j.txid)
    if dry_run:
        return FixResult(tuple(plans), tuple(txids), True)
    after = scan(roots, selection=selection)
    left = {(f.root, f.rule, f.path) for f in after.findings}
    fixed = sum(
        1
        for plan, tx in zip(plans, txids, strict=True)
        if tx is not None
        for f in plan.planned
        if (f.root, f.rule, f.path) not in left
    )
    return FixResult(tuple(plans), tuple(txids), False, fixed, after.findings, after.failed(fail_on))


def render_fix_text(result: FixResult) -> str:
    """The plan (every operation, diffs of rewrites), what is skipped and why, then the summary lines."""
    from ckptdoctor.report import display_path, plural

    out: list[str] = []
    verb = "would " if result.dry_run else ""
    for plan, tx in zip(result.plans, result.txids, strict=True):
        out.append(f"{plan.root}:")
        for t in plan.interrupted:
            out.append(f"  {'would complete' if result.dry_run else 'completed'} interrupted transaction {t}")
        if not plan.ops:
            out.append("  nothing to fix")
        for op in plan.ops:
            out.append(f"  [{','.join(op.rules)}] {op.title}")
            out.append(f"    {verb}{op.describe(tx or '<txid>')}")
            out.extend("    " + ln for ln in op.diff.rstrip("\n").splitlines())
        for s in plan.skipped:
            out.append(f"  skipped [{s.finding.rule}] {s.finding.fix.title if s.finding.fix else ''}: {s.reason}")
        for f in plan.manual:
            out.append(f"  manual [{f.rule}] {f.fix.title if f.fix else f.message}")
    out.append("")
    n_ops = sum(len(p.ops) for p in result.plans)
    n_planned = sum(len(p.planned) for p in result.plans)
    if result.dry_run:
        if result.would_change:
            out.append(
                f"Would fix {plural(n_planned, 'problem')} with {plural(n_ops, 'operation')}; "
                "run without --dry-run to apply."
            )
        else:
            out.append("Nothing to fix.")
        return "\n".join(out)
    for f in result.remaining:
        out.append(f"{display_path(f.root, f.path)}: {f.rule} [{f.severity.value}] {f.message}")
    for plan, tx in zip(result.plans, result.txids, strict=True):
        if tx is not None:
            out.append(f"Transaction {tx} applied to {plan.root}; `ckptdoctor undo {plan.root}` restores it.")
    n_left = len(result.remaining)
    out.append(f"Fixed {plural(result.fixed, 'problem')}, {n_left:,} remain{'s' if n_left == 1 else ''}.")
    return "\n".join(out)


def fix_json(result: FixResult) -> dict[str, Any]:
    """The ``ckptdoctor.fix/1`` document."""
    from ckptdoctor import __version__
    from ckptdoctor.report import to_json
    from ckptdoctor.scanner import Report

    roots = []
    for plan, tx in zip(result.plans, result.txids, strict=True):
        roots.append(
            {
                "root": plan.root,
                "txid": tx,
                "interrupted": list(plan.interrupted),
                "operations": [
                    {
                        "rules": list(op.rules),
                        "title": op.title,
                        "kind": op.kind.value,
                        "path": op.path,
                        "is_dir": op.is_dir,
                        "quarantine": quarantine_path(tx or "<txid>", op.path),
                        "change": op.change or None,
                        "diff": op.diff or None,
                    }
                    for op in plan.ops
                ],
                "skipped": [{"rule": s.finding.rule, "path": s.finding.path, "reason": s.reason} for s in plan.skipped],
                "manual": [{"rule": f.rule, "path": f.path} for f in plan.manual],
            }
        )
    remaining = to_json(Report((), result.remaining, 0.0))["findings"]
    return {
        "schema": FIX_SCHEMA,
        "version": __version__,
        "dry_run": result.dry_run,
        "roots": roots,
        "summary": {
            "operations": sum(len(p.ops) for p in result.plans),
            "fixed": result.fixed,
            "remain": None if result.dry_run else len(result.remaining),
        },
        "remaining": None if result.dry_run else remaining,
    }


_EPILOG_FIX = """\b
Examples:
  ckptdoctor fix --dry-run runs/my-run/        # show every operation and diff; exit 1 if it would change
  ckptdoctor fix runs/my-run/                  # apply the safe fixes, rescan, report what is left
  ckptdoctor fix --unsafe-fixes --select CKD101 runs/my-run/
  ckptdoctor undo runs/my-run/                 # restore the last fix byte for byte

\b
Nothing is deleted: files and folders move to <root>/.ckptdoctor/quarantine/<txid>/ and rewritten files keep
their original there. Exit codes: 0 nothing left at or above --fail-on (dry run: nothing to fix), 1 findings
remain (dry run: it would change something), 2 usage error or refusal (read-only, busy, locked, changed files).
"""


@click.command("fix", epilog=_EPILOG_FIX)
@click.argument("paths", nargs=-1, required=True, type=ScanRoot(exists=True, file_okay=True, dir_okay=True))
@click.option("--dry-run", is_flag=True, help="Print the plan and write nothing at all.")
@click.option("--unsafe-fixes", is_flag=True, help="Also apply fixes marked unsafe (e.g. quarantining stale runs).")
@click.option(
    "--select", multiple=True, metavar="CODES", help="Only these rules (codes or prefixes, e.g. CKD2,CKD601)."
)
@click.option("--ignore", multiple=True, metavar="CODES", help="Skip these rules (codes or prefixes).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option(
    "--fail-on",
    type=click.Choice(["error", "warning", "info", "never"]),
    default=None,
    help="Exit 1 when a finding this severe remains after the fix.  [default: error]",
)
@click.option("--force", is_flag=True, help="Act even on a run written in the last 60 seconds.")
@click.option("--no-config", is_flag=True, help="Ignore [tool.ckptdoctor] / .ckptdoctor.toml settings.")
def fix_command(
    paths: tuple[str, ...],
    dry_run: bool,
    unsafe_fixes: bool,
    select: tuple[str, ...],
    ignore: tuple[str, ...],
    fmt: str,
    fail_on: str | None,
    force: bool,
    no_config: bool,
) -> None:
    """Repair what the scan finds, safely: plan, journal, apply atomically; undo restores byte for byte.

    Safe fixes are applied; unsafe ones only with --unsafe-fixes; manual ones are only described.
    """
    from ckptdoctor.cli import resolve_selection

    selection, cfg_fail_on = resolve_selection(paths, select, ignore, no_config)
    result = fix(
        list(paths),
        selection=selection,
        unsafe=unsafe_fixes,
        dry_run=dry_run,
        force=force,
        fail_on=fail_on or cfg_fail_on or "error",
    )
    if fmt == "json":
        click.echo(json.dumps(fix_json(result), indent=2, allow_nan=False))
    else:
        click.echo(render_fix_text(result))
    sys.exit(result.exit_code())


@click.command("undo")
@click.argument("path", type=click.Path(exists=True, file_okay=False, dir_okay=True))
@click.option("--list", "list_", is_flag=True, help="List the fix transactions recorded under PATH.")
@click.option("--txid", default=None, metavar="ID", help="Undo this transaction instead of the last one.")
def undo_command(path: str, list_: bool, txid: str | None) -> None:
    """Restore the last (or the named) fix transaction under PATH byte for byte, modes included.

    Refuses, changing nothing, when a file changed since the fix.
    """
    if list_:
        from tabulate import tabulate

        rows = [
            [
                j.txid,
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.created)),
                j.state,
                len(j.ops),
                ",".join(j.rules),
            ]
            for j in load_journals(path)
        ]
        if not rows:
            click.echo(f"No fix transactions under {path}.")
            return
        click.echo(tabulate(rows, headers=["txid", "created", "state", "ops", "rules"], tablefmt="simple"))
        return
    from ckptdoctor.report import plural

    j, restored = undo(path, txid)
    click.echo(f"Undid transaction {j.txid}: restored {plural(restored, 'operation')} under {path}.")
