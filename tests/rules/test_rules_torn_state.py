"""A trainer_state.json cut short is an interrupted save (CKD102), one complete but wrong is CKD402 alone; and the
discovery rules' messages read right (seconds, singular/plural, one number format on both sides of a comparison).

Built from real transformers Trainer runs (tiny Llama, CPU, 6 steps saved every 2): the Trainer writes
trainer_state.json last, in place, so a kill during the save leaves a prefix of it. The end-to-end test resumes a
run whose last checkpoint holds such a prefix, before and after `ckptdoctor fix`.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptdoctor.facts import versus
from ckptdoctor.findings import Applicability, Finding, Severity
from ckptdoctor.fixer import undo
from ckptdoctor.model import ProblemKind
from ckptdoctor.readers.jsonfiles import read_json
from ckptdoctor.scanner import scan
from tests.helpers.e2e import ckptdoctor_fix, found, tree_digest
from tests.helpers.reference import TOL, max_difference

transformers = pytest.importorskip("transformers")
from tests.helpers.trainer_runs import describe, llama, train  # noqa: E402

STEPS = 6  # checkpoints 2, 4 and 6
LAST = f"checkpoint-{STEPS}"
STATE = "trainer_state.json"


@pytest.fixture(scope="module")
def uncut(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted Trainer run; tests damage copies of it."""
    return train(tmp_path_factory.mktemp("torn") / "run", llama(), max_steps=STEPS)


def damaged(uncut: Path, dest: Path, checkpoint: str, edit: Callable[[bytes], bytes]) -> Path:
    """A copy of ``run`` (file times kept) whose ``checkpoint``'s trainer_state.json is replaced by ``edit(bytes)``."""
    shutil.copytree(uncut, dest)
    state = dest / checkpoint / STATE
    state.write_bytes(edit(state.read_bytes()))
    return dest


def findings(root: Path, rule: str) -> list[Finding]:
    return [f for f in scan(str(root)).findings if f.rule == rule]


def half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def losses(state_file: Path) -> dict[int, float]:
    """Per-step training losses a trainer_state.json logged."""
    history = json.loads(state_file.read_text())["log_history"]
    return {e["step"]: e["loss"] for e in history if "loss" in e}


# ---------------------------------------------------------------------------------------------------------------
# Cut short: CKD102 (error when resume picks it, warning otherwise), next to CKD402


def test_a_cut_trainer_state_in_the_picked_checkpoint_is_an_interrupted_save(uncut: Path, tmp_path: Path) -> None:
    out = damaged(uncut, tmp_path / "cut", LAST, half)
    found = list(scan(str(out)).findings)
    hits = [f for f in found if f.rule == "CKD102"]
    assert [(f.path, f.severity) for f in hits] == [(LAST, Severity.ERROR)], describe(found)
    assert hits[0].message.startswith("resume_from_checkpoint=True picks this interrupted save: ")
    assert re.search(r"`trainer_state\.json` \(the Trainer writes it last\) is cut short: JSON ends mid-document at "
                     r"line \d+ column \d+: Expecting", hits[0].message), hits[0].message
    fix = hits[0].fix
    assert fix is not None and fix.applicability == Applicability.SAFE and fix.title == f"Quarantine `{LAST}`"
    # The JSON itself stays CKD402's to report.
    assert [f.path for f in found if f.rule == "CKD402"] == [f"{LAST}/{STATE}"]


def test_a_cut_trainer_state_in_an_earlier_checkpoint_is_a_warning(uncut: Path, tmp_path: Path) -> None:
    out = damaged(uncut, tmp_path / "cut-earlier", "checkpoint-4", half)
    hits = findings(out, "CKD102")
    assert [(f.path, f.severity) for f in hits] == [("checkpoint-4", Severity.WARNING)]
    assert not hits[0].message.startswith("resume_from_checkpoint=True picks")
    assert hits[0].fix is not None and hits[0].fix.applicability == Applicability.SAFE


def test_a_zero_byte_trainer_state_is_an_interrupted_save(uncut: Path, tmp_path: Path) -> None:
    out = damaged(uncut, tmp_path / "zero", LAST, lambda _: b"")
    hits = findings(out, "CKD102")
    assert [(f.path, f.severity) for f in hits] == [(LAST, Severity.ERROR)]
    assert "`trainer_state.json` is empty (0 bytes)" in hits[0].message


def test_every_prefix_of_a_real_trainer_state_that_fails_to_parse_reads_as_cut_short(uncut: Path) -> None:
    """Cut at each byte: inside strings, numbers, keys, after commas and brackets. The only prefix that parses is
    the one missing just the final newline (and a resume reads it fine)."""
    data = (uncut / LAST / STATE).read_bytes()
    assert data.count(b"\n") > 20 and data.isascii()
    parsed = []
    for n in range(1, len(data)):
        outcome = read_json(io.BytesIO(data[:n]), n)
        if outcome.content is not None:
            parsed.append(n)
        else:
            assert [p.kind for p in outcome.problems] == [ProblemKind.TRUNCATED], (n, outcome.problems)
    assert parsed == [len(data) - 1]


@pytest.mark.parametrize(
    "name, edit",
    [
        ("missing fields", lambda data: b'{"log_history": []}\n'),
        ("not JSON", lambda data: b"this is not JSON\n"),
        ("zero-filled", lambda data: bytes(len(data))),
        ("duplicate key", lambda data: data.replace(b'"global_step"', b'"global_step": 1, "global_step"', 1)),
        ("trailing garbage", lambda data: data + b"}\n"),
        ("bad UTF-8", lambda data: data.replace(b'"log_history"', b'"log_\xffhistory"', 1)),
    ],
)
def test_a_complete_but_wrong_trainer_state_is_ckd402_only(
    uncut: Path, tmp_path: Path, name: str, edit: Callable[[bytes], bytes]
) -> None:
    out = damaged(uncut, tmp_path / "wrong", LAST, edit)
    found = list(scan(str(out)).findings)
    assert [f.path for f in found if f.rule == "CKD402"] == [f"{LAST}/{STATE}"], describe(found)
    assert not [f for f in found if f.rule == "CKD102"], describe(found)


class StepsTrained(transformers.TrainerCallback):  # type: ignore[misc]
    """Records the global step after each optimizer step of a (resumed) run."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.append(state.global_step)


@pytest.mark.slow
def test_fix_makes_the_resume_continue_from_the_previous_checkpoint_with_the_uninterrupted_losses(
    uncut: Path, tmp_path: Path
) -> None:
    out = damaged(uncut, tmp_path / "killed", LAST, half)
    # The real resume picks the cut file and crashes loading it.
    crash = tmp_path / "crash"
    shutil.copytree(out, crash)
    with pytest.raises(json.JSONDecodeError):
        train(crash, llama(), max_steps=STEPS, resume_from_checkpoint=True)
    assert ("CKD102", LAST) in found(out)

    before = tree_digest(out)
    ckptdoctor_fix(out)
    assert not {(rule, path) for rule, path in found(out) if path.startswith(LAST)}
    assert not (out / LAST).exists()
    cured = tmp_path / "cured"
    shutil.copytree(out, cured)
    probe = StepsTrained()
    train(cured, llama(), max_steps=STEPS, resume_from_checkpoint=True, callbacks=[probe])
    assert probe.steps == [5, 6]  # resumed from checkpoint-4
    resumed = {step: loss for step, loss in losses(cured / LAST / STATE).items() if step in probe.steps}
    assert max_difference(losses(uncut / LAST / STATE), resumed) <= TOL
    undo(str(out))  # and `ckptdoctor undo` puts the folder back byte for byte
    assert tree_digest(out) == before


# ---------------------------------------------------------------------------------------------------------------
# Wording


def significant(number: str) -> int:
    """How many significant digits a printed number shows."""
    return len(number.split("e")[0].replace("-", "").replace(".", "").lstrip("0"))


@pytest.mark.parametrize(
    "a, b, text",
    [
        (4.1624, 4.15653, "4.16240 vs 4.15653"),  # the review's example: six significant digits on both sides
        (0.02, 0.05, "0.02 vs 0.05"),
        (1.5, 2, "1.5 vs 2.0"),
        (5e-05, 0.0001, "5e-05 vs 1e-04"),  # one notation for both
        (4.162401, 4.16241, "4.16240 vs 4.16241"),
        (4.1624001, 4.1624049, "4.162400 vs 4.162405"),  # equal at 6 digits: as many as tell them apart
        (10, 12, "10 vs 12"),
        (1234567, 1234568, "1234567 vs 1234568"),  # integers whole, never 1.23457e+06 on both sides
        (float("nan"), 1.0, "nan vs 1"),
    ],
)
def test_compared_numbers_share_one_format(a: float, b: float, text: str) -> None:
    assert versus(a, b) == text


def test_a_stale_checkpoint_message_shows_seconds_and_the_gap_and_a_singular_title(uncut: Path, tmp_path: Path) -> None:
    """Run 1 (6 steps) left checkpoint-6; run 2 (4 steps, another LR, same folder) overwrote checkpoint-2/4."""
    out = tmp_path / "stale"
    shutil.copytree(uncut, out)
    for p in [out / LAST, *(out / LAST).rglob("*")]:  # hours older, as a real first run would be
        st = p.stat()
        os.utime(p, (st.st_atime - 3 * 3600, st.st_mtime - 3 * 3600))
    train(out, llama(), learning_rate=5e-4, max_steps=4)
    hits = findings(out, "CKD101")
    assert [f.path for f in hits] == [LAST], describe(hits)
    msg = hits[0].message
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
    assert re.search(rf"picks `{LAST}` \(written {stamp}\), but the newer checkpoint `checkpoint-4` "
                     rf"\(written {stamp}, 3 h later\) belongs to another run: ", msg), msg
    # The history differs in learning_rate (1e-3 vs 5e-4 schedules); both numbers in one format.
    m = re.search(r"\(learning_rate (\S+) vs (\S+)\)", msg)
    assert m is not None, msg
    assert significant(m[1]) == significant(m[2]), msg
    assert hits[0].fix is not None and hits[0].fix.title == f"Quarantine the stale checkpoint `{LAST}`"
