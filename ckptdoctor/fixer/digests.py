"""Digests: what a path holds (type, size, sha256, mode), and whether it still holds it."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ckptdoctor.fixer.paths import CHUNK, CLOEXEC, NOFOLLOW


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
    fd = os.open(path, os.O_RDONLY | NOFOLLOW | CLOEXEC)
    try:
        while chunk := os.read(fd, CHUNK):
            h.update(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return size, h.hexdigest()


def digest(path: str) -> Digest:
    """The digest of a file, folder (recursively, links not followed) or link at ``path``.

    A folder's sha256 hashes one line per entry below it, in walk order (names sorted, each folder followed by its
    own entries), with that entry's digest; its size adds up its entries' sizes. Each file is read once and the
    walk keeps its own stack, so depth is never a recursion error. Every folder still hashes the lines of all
    entries below it (the values older journals recorded), so the cost grows with lines x depth: a chain of 1,000
    folders takes about 0.5 s. The per-folder recursion it replaces took time exponential in the depth.
    """
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        return _leaf(path, st)
    entries = [("", st), *_walk(path)]
    lines: list[bytes] = [b""] * len(entries)  # each entry's line, without its name
    digests: list[Digest | None] = [None] * len(entries)
    ends = _subtree_ends([rel for rel, _ in entries])
    for i in range(len(entries) - 1, -1, -1):  # children before their folder
        rel, est = entries[i]
        if not stat.S_ISDIR(est.st_mode):
            d = _leaf(os.path.join(path, rel), est)
        else:
            h = hashlib.sha256()
            total = 0
            cut = len(rel) + 1 if rel else 0
            for k in range(i + 1, ends[i]):
                h.update(os.fsencode(entries[k][0][cut:]) + lines[k])
                total += digests[k].size  # type: ignore[union-attr]  # set: k > i
            d = Digest("dir", total, h.hexdigest(), stat.S_IMODE(est.st_mode))
        digests[i] = d
        lines[i] = f"\0{d.type}\0{d.mode:o}\0{d.size}\0{d.sha256}\n".encode()
    out = digests[0]
    assert out is not None
    return out


def _leaf(path: str, st: os.stat_result) -> Digest:
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISREG(st.st_mode):
        size, sha = _hash_file(path)
        return Digest("file", size, sha, mode)
    if stat.S_ISLNK(st.st_mode):
        return Digest("link", 0, hashlib.sha256(os.fsencode(os.readlink(path))).hexdigest(), mode)
    return Digest("special", 0, hashlib.sha256(b"").hexdigest(), mode)


def _walk(base: str) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry below ``base`` with its lstat: relative names, sorted, each folder followed by its entries,
    links not followed. An explicit stack, so depth costs no recursion."""
    names = [iter(sorted(os.listdir(base)))]
    prefixes = [""]
    while names:
        name = next(names[-1], None)
        if name is None:
            names.pop()
            prefixes.pop()
            continue
        rel = f"{prefixes[-1]}/{name}" if prefixes[-1] else name
        st = os.lstat(os.path.join(base, rel))
        yield rel, st
        if stat.S_ISDIR(st.st_mode):
            names.append(iter(sorted(os.listdir(os.path.join(base, rel)))))
            prefixes.append(rel)


def _subtree_ends(rels: list[str]) -> list[int]:
    """For each entry of a walk (``rels[0]`` the folder itself, ``""``), the index just past its last entry below."""
    ends = [len(rels)] * len(rels)
    open_: list[int] = []
    for i, rel in enumerate(rels):
        while open_ and rels[open_[-1]] and not rel.startswith(rels[open_[-1]] + "/"):
            ends[open_.pop()] = i
        open_.append(i)
    return ends


def sha256_of(data: bytes) -> str:
    """The hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def still_holds(path: str, d: Digest | None) -> bool:
    """``path`` exists and holds exactly ``d`` (a path removed meanwhile holds nothing)."""
    try:
        return digest(path).same(d)
    except OSError:
        return False


def same_inode(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` are one file (False when either is gone)."""
    try:
        return os.path.samestat(os.lstat(a), os.lstat(b))
    except OSError:
        return False
