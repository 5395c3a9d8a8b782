"""Digests: what a path holds (type, size, sha256, mode), and whether it still holds it."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckptdoctor.fix.paths import _CHUNK, _CLOEXEC, _NOFOLLOW


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
