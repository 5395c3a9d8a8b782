"""docs/api.md stays true: its Python examples run one after another in one folder, as a user runs them from the
repository's root, each prints exactly the output shown under it, and none changes the shipped fixtures; every API
name has its section; the README points there."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
from pathlib import Path

import ckptdoctor
from tests.helpers.console import HANG_GUARD, environ
from tests.helpers.docs import _age
from tests.helpers.paths import REPO

API_DOC = REPO / "docs" / "api.md"


def _examples() -> list[tuple[str, str]]:
    """(code, expected output) of each ```python block followed by a ```text block."""
    text = API_DOC.read_text(encoding="utf-8")
    return re.findall(r"```python\n(.*?)```\s*```text\n(.*?)```", text, re.S)


def test_every_api_name_has_a_section_with_an_example() -> None:
    text = API_DOC.read_text(encoding="utf-8")
    headings = re.findall(r"^## (.+)$", text, re.M)
    for name in sorted(set(ckptdoctor.__all__) - {"__version__"}):
        assert any(f"`{name}`" in h or f"`ckptdoctor.{name}(" in h for h in headings), name
    for fn in ("scan", "gate", "fix", "undo"):  # one example per function
        assert any(f"ckptdoctor.{fn}(" in code for code, _ in _examples()), fn
    assert len(_examples()) >= 7


def _snapshot(root: Path) -> dict[str, tuple[int, str]]:
    """Every entry under ``root``: its mode and, for a file, a digest of its bytes."""
    out: dict[str, tuple[int, str]] = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else ""
        out[p.relative_to(root).as_posix()] = (st.st_mode, digest)
    return out


def test_api_examples_run_in_order_and_leave_the_fixtures_as_shipped(tmp_path: Path) -> None:
    """Issue 26: run in order in one folder, the undo example printed `False undone 1` (the fix example had already
    fixed the fixture it fixed again) and the fix examples left `.ckptdoctor/` inside `fixtures/`."""
    checkout = tmp_path / "checkout"  # stands for the repository's root, where a reader runs the examples
    shutil.copytree(REPO / "fixtures", checkout / "fixtures", copy_function=shutil.copy2, symlinks=True)
    _age(checkout / "fixtures")  # as on a user's disk: `fix` refuses a run written in the last 60 seconds
    shipped = _snapshot(checkout / "fixtures")
    for i, (code, expected) in enumerate(_examples(), 1):
        proc = subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True, text=True,
                              timeout=HANG_GUARD, env=environ())  # fmt: skip
        assert proc.returncode == 0, (i, proc.stderr)
        assert proc.stdout.rstrip("\n") == expected.rstrip("\n"), (i, code)
    assert sorted(p.name for p in checkout.iterdir()) == ["fixtures"]  # nothing new beside it either
    assert _snapshot(checkout / "fixtures") == shipped


def test_readme_points_to_the_api_doc() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Python API", 1)[1].split("\n## ", 1)[0]
    assert "docs/api.md" in section and "ckptdoctor.scan(" in section
