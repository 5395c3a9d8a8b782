"""Helpers shared by several test files (moved from tests/test_docs.py)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path


def _normalize(text: str) -> str:
    # what differs between two runs of the same command: how long a scan took, and the transformers installed
    # beside ckptdoctor (whose resume path the gate follows)
    text = re.sub(r"(  transformers +)\S+ \(installed\)", r"\1X (installed)", text)
    return re.sub(r"\(\d+\.\d+ s\)", "(N s)", text).rstrip("\n")


def _age(root: Path, seconds: float = 3600.0) -> None:
    """Move every time under ``root`` back by ``seconds`` when it is recent, keeping the gaps between them.

    A fresh clone stamps the shipped fixtures with the clone's time, and `fix` refuses a run written in the last
    60 seconds: the examples show finished runs, as they are on a user's disk.
    """
    paths = [root, *root.rglob("*")]
    if max(p.lstat().st_mtime for p in paths) < time.time() - 120:
        return
    for p in paths:
        st = p.lstat()
        os.utime(p, (st.st_atime - seconds, st.st_mtime - seconds), follow_symlinks=False)
