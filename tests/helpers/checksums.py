"""Helpers shared by several test files (moved from tests/deep/test_checksums.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from ckptdoctor.cli import main


def _cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def _write(root: Path) -> str:
    code, _, err = _cli("scan", "--deep", "--checksums", "write", "--fail-on", "never", str(root))
    assert code == 0, err
    return err


def _verify(root: Path) -> list[dict[str, Any]]:
    """The CKD214 findings of a verify scan, as (path, severity, message) dicts."""
    code, out, err = _cli("scan", "--deep", "--checksums", "verify", "--format", "json", "--fail-on", "never",
                          str(root))
    assert code == 0, err
    return [f for f in json.loads(out)["findings"] if f["rule"] == "CKD214"]
