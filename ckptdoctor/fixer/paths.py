"""Paths under a root: the fixer's own folder, the quarantine, which paths it may touch, how it opens them."""

from __future__ import annotations

import os
import stat

OWN_DIR = ".ckptdoctor"  # discovery skips it; it never matches checkpoint-N, so the Trainer ignores it too
# The checksum manifest (``scan --deep --checksums write``): the one file of the fixer's own folder a fix changes,
# so that it keeps describing the files the fix moved or rewrote (``plan._manifest_op``).
OWN_MANIFEST = f"{OWN_DIR}/manifest.json"

CHUNK = 1 << 20

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def quarantine_path(txid: str, rel: str) -> str:
    """Where ``rel`` goes in the quarantine, relative to the root."""
    return f"{OWN_DIR}/quarantine/{txid}/{rel}"


def abs_path(root: str, rel: str) -> str:
    """The absolute path of the root-relative, ``/``-separated ``rel``."""
    return os.path.join(root, *rel.split("/"))


def parent_rel(rel: str) -> str:
    """The root-relative folder holding ``rel`` (``.`` for the root)."""
    return rel.rsplit("/", 1)[0] if "/" in rel else "."


def is_under(path: str, folder: str) -> bool:
    """Whether the root-relative ``path`` is ``folder`` or inside it (everything is under the root)."""
    return folder in ("", ".") or path == folder or path.startswith(folder + "/")


def rel_problem(rel: str, *, own_manifest: bool = False) -> str | None:
    """Why ``rel`` is not a path the fixer may name (outside the root, or ckptdoctor's own), or None.

    Only the text is judged (plans and journals alike: a journal may come with a downloaded folder).
    """
    parts = rel.split("/")
    if not rel or rel.startswith("/") or "\0" in rel or any(p in ("", ".", "..") for p in parts):
        return f"`{rel}` is not a path inside the root; fix plans never leave it"
    if parts[0] == OWN_DIR and not (own_manifest and rel == OWN_MANIFEST):
        return f"`{rel}` is inside ckptdoctor's own `{OWN_DIR}/` folder"
    return None


def link_on_the_way(abs_root: str, rel: str, *, last: bool = False, missing_ok: bool = True) -> str | None:
    """Why reaching ``rel`` below the root would go through a link or a non-folder, or None.

    Checks every folder on the way (and ``rel`` itself when ``last``). With ``missing_ok`` it stops at the first
    one missing: whatever the fixer creates there it creates itself (``calls.ensure_dir`` refuses links).
    """
    parts = rel.split("/")
    cur = abs_root
    for i, part in enumerate(parts if last else parts[:-1]):
        cur = os.path.join(cur, part)
        shown = "/".join(parts[: i + 1])
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            if missing_ok:
                return None
            return f"`{shown}` cannot be used: No such file or directory"
        except OSError as e:
            return f"`{shown}` cannot be used: {e.strerror or e}"
        if stat.S_ISLNK(st.st_mode):
            return f"`{shown}` is a symbolic link; the fixer never writes through one"
        if not stat.S_ISDIR(st.st_mode):
            return f"`{shown}` is not a folder"
    return None


def check_path(
    abs_root: str, rel: str, *, own_manifest: bool = False, link_ok: bool = False
) -> tuple[os.stat_result | None, str | None]:
    """``rel``'s lstat when the fixer may touch it: inside the root, not ckptdoctor's own, through no link.

    Returns ``(None, reason)`` when it must not. ``own_manifest`` lets exactly ``OWN_MANIFEST`` through (the
    manifest update the planner adds itself; no rule's plan can name it). ``link_ok``: ``rel`` itself may be a
    symbolic link (a quarantine moves the link, never what it points at; no folder on the way may be one).
    """
    why = rel_problem(rel, own_manifest=own_manifest) or link_on_the_way(abs_root, rel, missing_ok=False)
    if why is not None:
        return None, why
    try:
        st = os.lstat(abs_path(abs_root, rel))
    except OSError as e:
        return None, f"`{rel}` cannot be used: {e.strerror or e}"
    if stat.S_ISLNK(st.st_mode) and not link_ok:
        return None, f"`{rel}` is a symbolic link; the fixer never writes through one"
    return st, None


def own_path(abs_root: str, *parts: str) -> str:
    """A path inside ckptdoctor's own folder at the root."""
    return os.path.join(abs_root, OWN_DIR, *parts)
