"""Where a scan root's files live: the local disk (``sources.local``) or a URL through fsspec (``sources.fsspec``).

``ckptdoctor.discover`` walks every root through the ``Source`` (``sources.interface``) that ``source_for`` picks:
``sources.local`` for a folder or file on disk (``os.scandir``, one stat per entry, links kept inside the root),
``sources.fsspec`` for a URL (``s3://``, ``gs://``, ``hf://``...: one listing of the whole prefix, ranged reads).
This module is stdlib only, so asking ``is_remote`` costs nothing; fsspec is imported for a URL root alone.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ckptdoctor.limits import Limits
    from ckptdoctor.sources.interface import Source

# A URL scheme as fsspec understands it (`s3://`, `gs://`, `hf://`, `file://`, chained `simplecache::s3://`).
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*(::[A-Za-z][A-Za-z0-9+.\-]*)*://")


def is_remote(path: str) -> bool:
    """True for a URL root handled by fsspec (``s3://bucket/run``); a local path that happens to exist stays local."""
    return bool(_URL_RE.match(path)) and not os.path.exists(path)


def source_for(root: str, limits: Limits) -> Source[Any, Any]:
    """The source that reads ``root``: fsspec for a URL (``is_remote``), else the local file system."""
    if is_remote(root):
        from ckptdoctor.sources.fsspec import FsspecSource

        return FsspecSource(root, limits)
    from ckptdoctor.sources.local import LocalSource

    return LocalSource(root, limits)


__all__ = ["is_remote", "source_for"]
