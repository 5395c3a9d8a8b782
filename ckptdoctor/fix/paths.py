"""Paths under a root: the fixer's own folder, the quarantine, which paths it may touch, how it opens them."""

from __future__ import annotations

import os
import stat

OWN_DIR = ".ckptdoctor"  # discovery skips it; it never matches checkpoint-N, so the Trainer ignores it too
# The checksum manifest (``scan --deep --checksums write``): the one file of the fixer's own folder a fix changes,
# so that it keeps describing the files the fix moved or rewrote (``plan._manifest_op``).
OWN_MANIFEST = f"{OWN_DIR}/manifest.json"

_CHUNK = 1 << 20

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def quarantine_path(txid: str, rel: str) -> str:
    """Where ``rel`` goes in the quarantine, relative to the root."""
    return f"{OWN_DIR}/quarantine/{txid}/{rel}"


def _abs(root: str, rel: str) -> str:
    return os.path.join(root, *rel.split("/"))


def _parent(rel: str) -> str:
    return rel.rsplit("/", 1)[0] if "/" in rel else "."


def _under(path: str, folder: str) -> bool:
    return folder in ("", ".") or path == folder or path.startswith(folder + "/")


def check_path(abs_root: str, rel: str, *, own_manifest: bool = False) -> tuple[os.stat_result | None, str | None]:
    """``rel``'s lstat when the fixer may touch it: inside the root, not ckptdoctor's own, through no link.

    Returns ``(None, reason)`` when it must not. ``own_manifest`` lets exactly ``OWN_MANIFEST`` through (the
    manifest update the planner adds itself; no rule's plan can name it).
    """
    parts = rel.split("/")
    if not rel or rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return None, f"`{rel}` is not a path inside the root; fix plans never leave it"
    if parts[0] == OWN_DIR and not (own_manifest and rel == OWN_MANIFEST):
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


def _own(abs_root: str, *parts: str) -> str:
    return os.path.join(abs_root, OWN_DIR, *parts)
