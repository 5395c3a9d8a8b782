"""The verdict cache's files as tests read them: the document after the MAC line (``ckptdoctor.cache.store``)."""

from __future__ import annotations

import marshal
from pathlib import Path
from typing import Any


def cache_document(path: Path) -> dict[str, Any]:
    """The document of the cache file at ``path`` (its body decoded as ``Store.read`` does, the MAC not checked)."""
    doc: dict[str, Any] = marshal.loads(path.read_bytes().partition(b"\n")[2])
    return doc
