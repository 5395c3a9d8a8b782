"""The reference trainer's documents stay true: every `$ python -m ckptdoctor.reference ...` session in the README
and docs/reference.md runs, command after command in one folder per document, as a reader runs them, and prints
what is shown; so does docs/reference.md's Python example."""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.console import HANG_GUARD, environ
from tests.helpers.docs import _normalize
from tests.helpers.paths import REPO

DOCS = [REPO / "README.md", REPO / "docs" / "reference.md"]
PROGRAMS = {"python": [sys.executable], "ckptdoctor": [sys.executable, "-m", "ckptdoctor"]}

pytestmark = pytest.mark.slow  # each document trains a few tiny runs


def _blocks(doc: Path) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, fences paired in order (a regex across fences can pair a closing
    fence with the next opening one)."""
    blocks: list[tuple[str, str]] = []
    lang: str | None = None
    body: list[str] = []
    for line in doc.read_text(encoding="utf-8").splitlines(keepends=True):
        if line.startswith("```"):
            if lang is None:
                lang, body = line[3:].strip(), []
            else:
                blocks.append((lang, "".join(body)))
                lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def _commands(doc: Path) -> list[tuple[str, str]]:
    """(command, expected output) of every `$ ...` line of the blocks that start with the reference trainer."""
    out: list[tuple[str, str]] = []
    for lang, block in _blocks(doc):
        if lang or not block.startswith("$ python -m ckptdoctor.reference "):
            continue
        for part in re.split(r"^(?=\$ )", block, flags=re.M):
            if part:
                command, _, shown = part.partition("\n")
                out.append((command[2:], shown))
    return out


def _python_examples(doc: Path) -> list[tuple[str, str]]:
    """(code, expected output) of each ```python block whose next block is ```text."""
    pairs = itertools.pairwise(_blocks(doc))
    return [(code, shown) for (lang, code), (after, shown) in pairs if lang == "python" and after == "text"]


def test_the_readme_and_the_page_show_the_reference_trainer() -> None:
    readme = DOCS[0].read_text(encoding="utf-8")
    section = readme.split("## Make broken runs of your own", 1)[1].split("\n## ", 1)[0]
    assert "docs/reference.md" in section and _commands(DOCS[0])
    page = _commands(DOCS[1])
    for sub in ("list", "scenario", "train"):  # every subcommand of `python -m ckptdoctor.reference`
        assert any(c.startswith(f"python -m ckptdoctor.reference {sub}") for c, _ in page), sub
    assert _python_examples(DOCS[1])


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_reference_sessions_run_in_order_as_shown(doc: Path, tmp_path: Path) -> None:
    for command, shown in _commands(doc):
        program, *args = shlex.split(command)
        proc = subprocess.run([*PROGRAMS[program], *args], cwd=tmp_path, env=environ(), capture_output=True,
                              text=True, timeout=HANG_GUARD)  # fmt: skip
        assert proc.returncode in (0, 1), (command, proc.stderr)
        assert _normalize(proc.stdout) == _normalize(shown), f"{doc.name}: `{command}` prints something else now"
    for code, shown in _python_examples(doc):
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=environ(), capture_output=True,
                              text=True, timeout=HANG_GUARD)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.rstrip("\n") == shown.rstrip("\n")


def test_a_scenario_never_writes_over_a_folder_that_holds_something(tmp_path: Path) -> None:
    (tmp_path / "runs" / "mine").mkdir(parents=True)
    (tmp_path / "runs" / "mine" / "notes.txt").write_text("mine\n")
    proc = subprocess.run([sys.executable, "-m", "ckptdoctor.reference", "scenario", "stub-shadow", "runs/mine"],
                          cwd=tmp_path, env=environ(), capture_output=True, text=True, timeout=HANG_GUARD)
    assert proc.returncode == 2 and "runs/mine is not empty" in proc.stderr, proc.stderr
    assert [p.name for p in (tmp_path / "runs" / "mine").iterdir()] == ["notes.txt"]
