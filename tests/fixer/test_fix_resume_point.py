"""After `fix` quarantines an interrupted save, it says where `resume_from_checkpoint=True` picks up now, in text
and JSON, and a dry run says where it would; the real run's answer is the gate's own pick after the fix."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import ckptdoctor
from tests.helpers import console
from tests.helpers.paths import REPO


def cli(*args: str) -> tuple[int, str]:
    p = console.run(*args)
    return p.returncode, p.stdout


def _aged_copy(name: str, dest: Path) -> Path:
    """A fixture copied and dated an hour back: fix refuses a run written in the last minute."""
    root = shutil.copytree(REPO / "fixtures" / name, dest / name)
    old = time.time() - 3600
    for dirpath, _, files in os.walk(root):
        for n in [*files, "."]:
            os.utime(os.path.join(dirpath, n), (old, old))
    return Path(root)


def test_fix_says_where_the_resume_picks_up_after_quarantining_an_interrupted_save(tmp_path: Path) -> None:
    run = _aged_copy("interrupted-save", tmp_path)
    code, out = cli("fix", "--dry-run", str(run))
    assert code == 1 and "would pick up from `checkpoint-4` instead of `checkpoint-8`" in out
    code, out = cli("fix", "--dry-run", "--format", "json", str(run))
    assert json.loads(out)["roots"][0]["resume"] == [{"run": ".", "before": "checkpoint-8", "after": "checkpoint-4"}]
    code, out = cli("fix", str(run))
    assert code == 0 and "resume_from_checkpoint=True now picks up from `checkpoint-4` instead of `checkpoint-8`" in out
    assert ckptdoctor.gate(run).checkpoint == str(run / "checkpoint-4")  # what the gate loads now
    assert cli("undo", str(run))[0] == 0
    code, out = cli("fix", "--format", "json", str(run))
    assert json.loads(out)["roots"][0]["resume"] == [{"run": ".", "before": "checkpoint-8", "after": "checkpoint-4"}]


def test_a_fix_that_leaves_the_pick_alone_says_nothing_about_it(tmp_path: Path) -> None:
    run = _aged_copy("stub-shadow", tmp_path)
    code, out = cli("fix", str(run))
    assert code == 0 and "picks up" not in out
    code, out = cli("fix", "--dry-run", "--format", "json", str(run))
    assert json.loads(out)["roots"][0]["resume"] == [{"run": ".", "before": "checkpoint-8", "after": "checkpoint-8"}]


def test_a_run_left_without_a_checkpoint_is_said(tmp_path: Path) -> None:
    run = _aged_copy("interrupted-save", tmp_path)
    shutil.rmtree(run / "checkpoint-4")
    _, out = cli("fix", "--dry-run", str(run))
    assert "resume_from_checkpoint=True would find no checkpoint: train() raises (start afresh)" in out
    result = ckptdoctor.fix(run, dry_run=True)
    assert [(p.before, p.after, p.moved) for p in result.resume_points] == [("checkpoint-8", None, True)]
