"""Where the verdict cache lives and how its files are kept: the user's cache folder, never the scanned tree.

The folder is ``$XDG_CACHE_HOME/ckptdoctor`` (an absolute ``XDG_CACHE_HOME``, as the XDG Base Directory
specification asks), else ``~/.cache/ckptdoctor``. It is used only when it is a real folder (not a link) owned by
this user and closed to everyone else (mode 0700, made so when created), holding a secret key of the same kind
(``key``, 32 random bytes, 0600). Each cache file is one document (``marshal``'s encoding of a dict of plain
values, never code: ``cache.codec`` checks every part of what it decodes) after one line: its MAC under that key
(keyed BLAKE2b, RFC 7693's MAC mode; ``digest``), checked before a byte of it is decoded. A file is trusted only
when the MAC matches and the document is one this code wrote, for the same question (``Store.read`` checks
``expect``); anything else is ignored, and overwritten by the next write. So a file planted by another user or
process, copied from another machine or a backup, torn by a crash or written by another version of ckptdoctor is
never believed.

Files are written whole, to a temporary file beside the target, then renamed over it (``os.replace``): a reader in
another process (``scan_many`` on Dask workers, two scans at once) sees the old file or the new one, never a mix;
the last writer wins, and both wrote the truth. Nothing is synced to disk: a file lost in a crash is a miss.

The cache is on by default, so it must not grow for ever: a file is kept while it is used. Reading a trusted file
marks it used (its modification time set to now, at most once a day), and once a day the first scan to open the
cache removes the files no scan used for ``KEEP_DAYS`` days, and the temporary files killed writers left (``prune``;
``ckptdoctor cache prune`` does it on demand). A run not scanned for that long is read afresh, as on a first scan.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from typing import Any

from ckptdoctor.model import frozen

__all__ = ["KEEP_DAYS", "CacheInfo", "Store", "cache_dir", "clear", "digest", "info", "prune"]

_KEY = "key"
_FILES = "facts"  # the cache files, one per folder cached (``ckptdoctor.cache.source``)
_KEY_BYTES = 32
# A cache file larger than this is not read (a run's file is a few MB: one 100-checkpoint 7B run is 1.2 MB).
MAX_FILE_BYTES = 1 << 30
KEEP_DAYS = 30  # a cache file no scan used for this long is removed (``prune``)
_DAY = 86_400.0
_PRUNED = "pruned"  # in the cache folder: its modification time is when the cache was last pruned
_SUFFIX = ".bin"  # a cache file's; formats before 4 were JSON documents, ``.json`` (pruned, cleared, never read)
_MAC_HEX = 64  # the MAC's hex digits (32 bytes), on the file's first line
_MARSHAL = 4  # marshal's format version 4 (Python 3.4 on): every later Python reads it


def cache_dir() -> str:
    """The cache folder: ``$XDG_CACHE_HOME/ckptdoctor`` when that variable holds an absolute path, else
    ``~/.cache/ckptdoctor``."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ckptdoctor")


class Store:
    """An open cache folder: its key, and the files in it read and written by name."""

    def __init__(self, folder: str, key: bytes) -> None:
        self.folder = folder
        self._key = key
        self._files = os.path.join(folder, _FILES)

    @classmethod
    def open(cls, folder: str | None = None) -> Store | str:
        """The cache at ``folder`` (default ``cache_dir()``), created if missing; or why it cannot be used (a
        folder owned by someone else or open to others, a key that is not ours, an OS error)."""
        folder = folder or cache_dir()
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            why = _private(folder, stat.S_ISDIR)
            if why is not None:
                return why
            files = os.path.join(folder, _FILES)
            with contextlib.suppress(FileExistsError):
                os.mkdir(files, 0o700)
            why = _private(files, stat.S_ISDIR)
            if why is not None:
                return why
            key = _key(folder)
        except OSError as e:
            return f"{folder}: {e.strerror or e}"
        if isinstance(key, str):
            return key
        _prune_daily(folder)
        return cls(folder, key)

    def path(self, name: str) -> str:
        """Where the cache file for ``name`` (any string: a folder's identity) lives."""
        name_digest = digest(name.encode("utf-8", "surrogatepass"), size=20)
        return os.path.join(self._files, f"{name_digest}{_SUFFIX}")

    def read(self, name: str, expect: dict[str, Any]) -> dict[str, Any] | None:
        """The document stored for ``name``, when its MAC is ours and it holds every item of ``expect`` as given
        (the format, version and settings it was written under, and ``name`` itself); else None."""
        try:
            path = self.path(name)
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            return None
        try:
            with os.fdopen(fd, "rb") as fh:
                st = os.fstat(fh.fileno())
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size > MAX_FILE_BYTES:
                    return None
                data = fh.read(st.st_size + 1)  # what it holds (grown since, it fails the MAC below)
        except OSError:
            return None
        import marshal
        from _operator import _compare_digest  # hmac.compare_digest itself (importing hmac loads OpenSSL)

        # the body seen in place, not copied (a run's file is a megabyte)
        mac, sep, body = data[:_MAC_HEX], data[_MAC_HEX : _MAC_HEX + 1], memoryview(data)[_MAC_HEX + 1 :]
        if sep != b"\n" or not _compare_digest(mac, self._mac(body)):
            return None
        try:
            doc = marshal.loads(body)
        except (ValueError, EOFError, TypeError):
            return None
        if type(doc) is not dict or doc.get("name") != name:
            return None
        if any(doc.get(k) != v for k, v in expect.items()):
            return None
        now = _now()
        if now - st.st_mtime > _DAY:  # used: ``prune`` keeps it (a day's precision is enough)
            with contextlib.suppress(OSError):
                os.utime(path, (now, now), follow_symlinks=False)
        return doc

    def write(self, name: str, doc: dict[str, Any]) -> bool:
        """Store ``doc`` (with ``name`` in it) for ``name``, atomically; False when it could not be written."""
        import marshal

        try:
            body = marshal.dumps({**doc, "name": name}, _MARSHAL)
        except ValueError:  # a value marshal does not carry: nothing is written
            return False
        target = self.path(name)
        try:
            fd, tmp = _temporary(self._files)
        except OSError:
            return False
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(self._mac(body) + b"\n")
                fh.write(body)
            os.replace(tmp, target)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return False
        return True

    def _mac(self, body: bytes | memoryview) -> bytes:
        return digest(body, key=self._key).encode("ascii")


def digest(data: bytes | memoryview, key: bytes = b"", size: int = 32) -> str:
    """The hex BLAKE2b digest of ``data`` (keyed: a MAC), through ``ckptdoctor.hashing`` (``hmac`` and ``hashlib``
    load OpenSSL when imported)."""
    from ckptdoctor.hashing import blake2b

    return blake2b(data, key=key, digest_size=size).hexdigest()


def _temporary(folder: str, prefix: str = ".tmp-") -> tuple[int, str]:
    """A new file (0600, never an existing one or a link) in ``folder``, open for writing: its descriptor and path.
    (``tempfile.mkstemp`` does the same, at the cost of importing ``random`` and ``shutil`` at every scan.)"""
    for _ in range(100):
        path = os.path.join(folder, prefix + os.urandom(8).hex())
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
            return os.open(path, flags, 0o600), path
        except FileExistsError:
            continue
    raise FileExistsError(f"{folder}: no free temporary name")


def _private(path: str, is_kind: Any) -> str | None:
    """Why ``path`` may not hold the cache (not of the expected kind, a link, not ours, open to others), or None."""
    st = os.lstat(path)
    if not is_kind(st.st_mode):
        return f"{path}: not a {'folder' if is_kind is stat.S_ISDIR else 'regular file'} (a link?); the cache is off"
    if st.st_uid != os.getuid():
        return f"{path}: owned by another user; the cache is off"
    if st.st_mode & 0o077:
        return f"{path}: other users may read or write it (mode {stat.S_IMODE(st.st_mode):o}); the cache is off"
    return None


def _key(folder: str) -> bytes | str:
    """The cache's secret key, made on first use (written beside, then linked into place: two processes making it
    at once end with one key, and nobody reads a half-written one)."""
    path = os.path.join(folder, _KEY)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            fd = -1
        if fd >= 0:
            with os.fdopen(fd, "rb") as fh:
                why = _private(path, stat.S_ISREG)
                st = os.fstat(fh.fileno())
                if why is None and (st.st_uid != os.getuid() or st.st_mode & 0o077):
                    why = f"{path}: not this user's private key; the cache is off"
                key = fh.read(_KEY_BYTES + 1)
            if why is not None:
                return why
            if len(key) != _KEY_BYTES:
                return f"{path}: not a key ckptdoctor wrote (remove it, or run `ckptdoctor cache clear`)"
            return key
        tmp_fd, tmp = _temporary(folder, ".tmp-key-")
        try:
            with os.fdopen(tmp_fd, "wb") as fh:
                fh.write(os.urandom(_KEY_BYTES))
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    return f"{path}: could not be made"


@frozen
class CacheInfo:
    """What ``ckptdoctor cache info`` shows: the folder, whether it can be used (else why not), its files and
    their bytes."""

    folder: str
    problem: str | None
    files: int
    bytes: int


def info(folder: str | None = None) -> CacheInfo:
    """The cache folder, whether it is usable, and how much it holds (nothing is created)."""
    folder = folder or cache_dir()
    files = total = 0
    for path in _cache_files(folder):
        with contextlib.suppress(OSError):
            total += os.lstat(path).st_size
            files += 1
    problem = None
    try:
        problem = _private(folder, stat.S_ISDIR)
    except FileNotFoundError:
        problem = "not created yet (the first scan makes it)"
    except OSError as e:
        problem = f"{folder}: {e.strerror or e}"
    return CacheInfo(folder, problem, files, total)


def clear(folder: str | None = None) -> int:
    """Remove the cache folder's own files (its cache files and key) and the folder itself when that leaves it
    empty; nothing else, and nothing when the folder is a link or another user's. Returns the files removed."""
    folder = folder or cache_dir()
    try:
        if _private(folder, stat.S_ISDIR) is not None and os.lstat(folder).st_uid != os.getuid():
            return 0
        if not stat.S_ISDIR(os.lstat(folder).st_mode):
            return 0
    except OSError:
        return 0
    removed = 0
    for path in [*_cache_files(folder), os.path.join(folder, _KEY), os.path.join(folder, _PRUNED)]:
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            continue
    for path in (os.path.join(folder, _FILES), folder):
        try:
            os.rmdir(path)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
                break
    return removed


def prune(folder: str | None = None, days: float = KEEP_DAYS) -> int:
    """Remove the cache files no scan used for ``days`` days (``Store.read`` marks a file used), and temporary files
    a killed writer left over a day ago; nothing when the folder is not this user's private cache folder. Returns
    the files removed. A scan running meanwhile loses at most a file it was about to take: it reads that one again."""
    folder = folder or cache_dir()
    try:
        if _private(folder, stat.S_ISDIR) is not None:
            return 0
    except OSError:
        return 0
    now = _now()
    removed = 0
    for path in _cache_files(folder):
        try:
            st = os.lstat(path)
            age = now - st.st_mtime
            torn = os.path.basename(path).startswith(".tmp-")  # a live writer's is seconds old: kept
            old = age > _DAY if torn else days <= 0 or age > days * _DAY
            if old and stat.S_ISREG(st.st_mode):
                os.unlink(path)
                removed += 1
        except OSError:
            continue
    return removed


def _prune_daily(folder: str) -> None:
    """``prune`` the cache at ``folder`` when it was not pruned in the last day (the marker file ``pruned`` says
    when; it is touched first, so scans starting together do not all prune)."""
    marker = os.path.join(folder, _PRUNED)
    now = _now()
    try:
        if now - os.lstat(marker).st_mtime <= _DAY:
            return
        os.utime(marker, (now, now), follow_symlinks=False)
    except FileNotFoundError:
        try:
            fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        except OSError:
            return  # another scan made it just now, or the folder refuses it: that scan prunes, or none does
        os.close(fd)
        os.utime(marker, (now, now), follow_symlinks=False)
    except OSError:
        return
    prune(folder)


def _now() -> float:
    """The wall clock, as file times are kept (a test moves it)."""
    import time

    return time.time()


def _cache_files(folder: str) -> Iterator[str]:
    """The files in the cache's files folder (its documents and any temporary file a killed writer left)."""
    files = os.path.join(folder, _FILES)
    try:
        names = os.listdir(files)
    except OSError:
        return
    for name in names:
        if name.endswith((_SUFFIX, ".json")) or name.startswith(".tmp-"):
            yield os.path.join(files, name)
