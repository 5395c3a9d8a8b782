"""Checksum manifests (`scan --deep --checksums write`): written atomically under the root lock."""

from __future__ import annotations

import json
import os
import stat
from typing import Any

from ckptdoctor.fixer.calls import atomic_write
from ckptdoctor.fixer.errors import FixRefused
from ckptdoctor.fixer.guard import RootLock, read_only_fd
from ckptdoctor.fixer.paths import OWN_DIR, own_path

MANIFEST_NAME = "manifest.json"


def manifest_refusal(root: str) -> str | None:
    """Why a manifest cannot be written at ``root`` (a sentence), or None: checked before a long ``--deep`` scan."""
    from ckptdoctor.sources import is_remote

    if is_remote(root):
        return f"{root}: writing a manifest to a remote root is not supported"
    if not os.path.isdir(root):
        return f"{root} is not a folder: a manifest is written at the root of a folder"
    abs_root = os.path.realpath(root)
    own = own_path(abs_root)
    for rel, path in ((OWN_DIR, own), (f"{OWN_DIR}/{MANIFEST_NAME}", own_path(abs_root, MANIFEST_NAME))):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        except OSError as e:
            return f"`{rel}` under {root} cannot be used: {e.strerror or e}"
        if not (stat.S_ISDIR(st.st_mode) if path == own else stat.S_ISREG(st.st_mode)):  # lstat: a link is neither
            kind = "folder" if path == own else "file"
            return f"`{rel}` under {root} is not a plain {kind} (ckptdoctor never writes through links)"
    if read_only_fd(own if os.path.isdir(own) else abs_root):
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
    target = own_path(abs_root, MANIFEST_NAME)
    data = (json.dumps(manifest, indent=2, ensure_ascii=False, allow_nan=False) + "\n").encode("utf-8")
    with RootLock(abs_root):
        try:
            atomic_write(target, data)
        except OSError as e:
            raise FixRefused(f"cannot write {target}: {e.strerror or e}; the previous manifest is unchanged") from None
    return target
