"""docs/api.md stays true: each of its Python examples runs, in a folder of fresh copies of the fixtures it names,
and prints exactly the output shown under it; every API name has its section; the README points there."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ckptdoctor
from tests.test_docs import _age

REPO = Path(__file__).resolve().parent.parent
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


@pytest.mark.parametrize(("code", "expected"), _examples(), ids=lambda v: v.strip().splitlines()[-1][:50])
def test_api_example_prints_what_is_shown(code: str, expected: str, tmp_path: Path) -> None:
    for name in sorted(set(re.findall(r"fixtures/[a-z0-9-]+", code))):
        shutil.copytree(REPO / name, tmp_path / name, copy_function=shutil.copy2)
        _age(tmp_path / name)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.rstrip("\n") == expected.rstrip("\n")


def test_readme_points_to_the_api_doc() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Python API", 1)[1].split("\n## ", 1)[0]
    assert "docs/api.md" in section and "ckptdoctor.scan(" in section
