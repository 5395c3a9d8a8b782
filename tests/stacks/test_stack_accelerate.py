"""accelerate's own hazards (issue 23, sections 3 and 5), each proved with the real accelerate 1.15: folders
written by ``Accelerator.save_state`` and resumed with ``Accelerator.load_state`` (tests/helpers/accelerate_run.py), one
thing changed, then scanned; the fixes round-tripped (fix -> rescan -> ``load_state()`` works -> undo)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("accelerate")

from ckptdoctor import fix, undo
from ckptdoctor.findings import Finding, Severity
from ckptdoctor.scanner import scan
from tests.helpers.accelerate_run import Program, copy_project, four_saves
from tests.helpers.fixing import age, tree_state


def _findings(root: Path) -> list[Finding]:
    """Every finding above info, plus any info other than CKD401."""
    return [f for f in scan(str(root)).findings if f.severity > Severity.INFO or f.rule != "CKD401"]


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real automatic-naming project (``accelerate_run.four_saves``)."""
    return four_saves(tmp_path_factory.mktemp("acc") / "project")


def test_clean_run_and_its_resume_are_silent(clean: Path, tmp_path: Path) -> None:
    assert sorted(p.name for p in (clean / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2", "checkpoint_3"]
    assert _findings(clean) == []
    assert _findings(clean / "checkpoints") == []  # the checkpoints folder as the root
    assert _findings(clean / "checkpoints" / "checkpoint_3") == []  # one save alone
    root = copy_project(clean, tmp_path)
    assert Program(root, custom=1).resume() == 4  # load_state() takes the highest number, the newest here


def test_interrupted_save_that_load_state_picks(clean: Path, tmp_path: Path) -> None:
    """``save_state`` writes the RNG states after the optimizer and scheduler: cut before them, the folder holds
    the weights only, and ``load_state()`` picks it and raises."""
    root = copy_project(clean, tmp_path)
    cut = root / "checkpoints" / "checkpoint_4"
    shutil.copytree(root / "checkpoints" / "checkpoint_3", cut)
    for name in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl"):
        (cut / name).unlink()
    with pytest.raises(FileNotFoundError, match=r"optimizer\.bin"):
        Program(root, custom=1).resume()
    (hit,) = [f for f in _findings(root) if f.rule == "CKD121"]
    assert hit.path == "checkpoints/checkpoint_4" and hit.severity is Severity.ERROR
    assert hit.message == (
        "`load_state()` picks this interrupted save: no `optimizer.bin`: `load_state()` raises `FileNotFoundError`; "
        "no `scheduler.bin`: `load_state()` raises `FileNotFoundError`; no `random_states_0.pkl`: `load_state()` "
        "restores no RNG state and no `step` (it logs \"Could not load random states\")")
    assert [f.rule for f in _findings(root)] == ["CKD121"]

    age(root)
    before = tree_state(root)
    result = fix(str(root), select=["CKD121"])
    assert result.exit_code() == 0
    assert _findings(root) == []
    assert Program(root, custom=1).resume() == 4  # the last complete save
    undo(str(root))
    assert tree_state(root) == before


def test_truncated_optimizer_in_a_save_by_hand(tmp_path: Path) -> None:
    """The diffusers scripts' layout: ``save_state(output_dir/checkpoint-N)``; a cut ``optimizer.bin`` in the
    highest, which ``--resume_from_checkpoint latest`` passes to ``load_state``."""
    out = tmp_path / "out"
    Program().train(2, folder=out)
    opt = out / "checkpoint-2" / "optimizer.bin"
    opt.write_bytes(opt.read_bytes()[:200])
    with pytest.raises(RuntimeError):
        Program().resume(out / "checkpoint-2")
    hit, damaged = _findings(out)  # the folder's finding, and the file's own (CKD203: a cut zip)
    assert (damaged.rule, damaged.path) == ("CKD203", "checkpoint-2/optimizer.bin")
    assert (hit.rule, hit.path, hit.file, hit.severity) == (
        "CKD121", "checkpoint-2", "checkpoint-2/optimizer.bin", Severity.ERROR)
    assert "`optimizer.bin` is truncated" in hit.message


def test_iteration_restarts_and_load_state_takes_an_older_state(clean: Path, tmp_path: Path) -> None:
    """A resumed program's saves restart at ``checkpoint_0``; rotation deletes by number, so the newest state goes
    first; the next ``load_state()`` resumes an older one."""
    root = copy_project(clean, tmp_path)
    second = Program(root, custom=1)
    assert second.resume() == 4
    second.train(2)  # steps 5 and 6, written as checkpoint_0 then checkpoint_1 (deleting checkpoint_0 for room)
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["checkpoint_1", "checkpoint_2", "checkpoint_3"]
    assert Program(root, custom=1).resume() == 4  # not 6: the state of steps 5 and 6 is silently skipped
    (hit,) = _findings(root)
    assert (hit.rule, hit.path, hit.file, hit.severity) == (
        "CKD430", "checkpoints/checkpoint_3", "checkpoints/checkpoint_3/scheduler.bin", Severity.ERROR)
    assert hit.message.startswith("`load_state()` picks this save, its scheduler at step 4, but `checkpoint_1` "
                                  "holds step 6")


def test_entry_without_a_digit_crashes_load_state(clean: Path, tmp_path: Path) -> None:
    root = copy_project(clean, tmp_path)
    (root / "checkpoints" / "best").mkdir()
    with pytest.raises(IndexError):
        Program(root, custom=1).resume()
    (hit,) = _findings(root)
    assert (hit.rule, hit.path, hit.severity) == ("CKD120", "checkpoints/best", Severity.ERROR)
    assert hit.message == ("`load_state()` sorts `checkpoints` by the number in each entry's name and raises "
                           "`IndexError` on `best`, which has none")
    # from the checkpoints folder itself: still found, but no fix (the quarantine would be such an entry there)
    (inner,) = _findings(root / "checkpoints")
    assert inner.rule == "CKD120" and inner.fix is None

    age(root)
    before = tree_state(root)
    fix(str(root), select=["CKD120"])
    assert _findings(root) == []
    assert Program(root, custom=1).resume() == 4
    undo(str(root))
    assert tree_state(root) == before


def test_custom_checkpoint_gap(tmp_path: Path) -> None:
    """Three registered objects, ``custom_checkpoint_1.pkl`` gone from the save ``load_state()`` picks: it raises
    whatever the resuming program registers."""
    root = tmp_path / "project"
    Program(root, custom=3).train(2)
    (root / "checkpoints" / "checkpoint_1" / "custom_checkpoint_1.pkl").unlink()
    with pytest.raises(FileNotFoundError, match=r"custom_checkpoint_1\.pkl"):
        Program(root, custom=2).resume()
    with pytest.raises(RuntimeError, match="Number of custom checkpoints"):
        Program(root, custom=3).resume()
    (hit,) = _findings(root)
    assert (hit.rule, hit.path, hit.severity) == ("CKD431", "checkpoints/checkpoint_1", Severity.ERROR)
    assert hit.message == ("2 custom checkpoint files but no `custom_checkpoint_1.pkl`: `load_state()` loads them by "
                           "index from 0 and raises `FileNotFoundError`")


def test_custom_checkpoint_counts_differ_within_a_run(tmp_path: Path) -> None:
    """A program registering one object saved twice; another registering two saved next (numbering on): the newest
    save holds two custom files, and the first program's ``load_state()`` raises on it."""
    root = tmp_path / "project"
    Program(root, custom=1).train(2)
    later = Program(root, custom=2)
    later.acc.project_configuration.iteration = 2
    later.train(1)
    with pytest.raises(RuntimeError, match="Number of custom checkpoints"):
        Program(root, custom=1).resume()
    # the later program started afresh, so its save (step 1) is behind checkpoint_1 (step 2) too: CKD430
    older, hit = _findings(root)
    assert older.rule == "CKD430"
    assert (hit.rule, hit.path, hit.severity) == ("CKD431", "checkpoints/checkpoint_2", Severity.WARNING)
    assert hit.message == ("2 custom checkpoint files where the run's other saves hold 1: `load_state()` raises "
                           "`RuntimeError` unless exactly 2 objects are registered with `register_for_checkpointing`")


def test_first_save_cut_short_is_accelerates(tmp_path: Path) -> None:
    """The only save, cut before its RNG state: nothing in the run holds accelerate's signature, but its
    `optimizer.bin`/`scheduler.bin` are names only `save_state` writes: it is an interrupted accelerate save, not a
    folder of unknown make (CKD108) nor an interrupted Trainer save (CKD102)."""
    root = tmp_path / "project"
    Program(root).train(1)
    ck = root / "checkpoints" / "checkpoint_0"
    (ck / "random_states_0.pkl").unlink()
    assert Program(root).resume() == 1  # the RNG state's absence is only logged
    (hit,) = _findings(root)
    assert (hit.rule, hit.path, hit.severity) == ("CKD121", "checkpoints/checkpoint_0", Severity.ERROR)
    assert hit.message.endswith("no `random_states_0.pkl`: `load_state()` restores no RNG state and no `step` (it "
                                "logs \"Could not load random states\")")


def test_no_fix_from_inside_the_checkpoints_folder(clean: Path, tmp_path: Path) -> None:
    """The fixer's own folder at a `checkpoints/` root would be an entry `load_state()` cannot sort: refused."""
    from ckptdoctor.fixer.errors import FixRefused

    root = copy_project(clean, tmp_path)
    ck = root / "checkpoints" / "checkpoint_2"
    (ck / "ema.safetensors").write_bytes((ck / "model.safetensors").read_bytes()[:100])  # CKD202 quarantines it
    age(root)
    with pytest.raises(FixRefused, match="load_state"):
        fix(str(root / "checkpoints"))
    assert not (root / "checkpoints" / ".ckptdoctor").exists()
    assert Program(root, custom=1).resume() == 4


def test_a_resume_that_numbers_on_is_silent(clean: Path, tmp_path: Path) -> None:
    """CKD430's remedy: after ``load_state()``, ``project_configuration.iteration`` set past the highest save."""
    root = copy_project(clean, tmp_path)
    second = Program(root, custom=1)
    second.resume()
    second.acc.project_configuration.iteration = 4
    second.train(2)
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["checkpoint_3", "checkpoint_4", "checkpoint_5"]
    assert _findings(root) == []
    assert Program(root, custom=1).resume() == 6


def test_automatic_saves_show_the_scheduler_step(clean: Path) -> None:
    """`checkpoint_<i>` counts saves (`checkpoint_1` is the second save, after step 2): the step shown is the count
    its `scheduler.bin` holds, which one process steps once per optimizer step."""
    import json

    from ckptdoctor.render.report import render_json, render_text

    report = scan(str(clean))
    (run,) = json.loads(render_json(report))["runs"]
    assert [(c["path"], c["step"]) for c in run["checkpoints"]] == [
        ("checkpoints/checkpoint_1", 2), ("checkpoints/checkpoint_2", 3), ("checkpoints/checkpoint_3", 4)]
    text = render_text(report)
    assert "checkpoint_3  4 " in text and "no step shown" not in text


def test_two_process_saves_show_no_step_and_say_why(tmp_path: Path) -> None:
    """Saved by two gloo processes, 3 optimizer steps put the scheduler at 6: the scheduler's count is not the step,
    so none is shown (JSON null), and the run's header says why."""
    import json
    import subprocess
    import sys

    from ckptdoctor.render.report import render_json, render_text

    script = Path(__file__).with_name("accelerate_ranks.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script),
                           str(tmp_path / "project")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("last_epoch 6") == 2
    assert sorted(p.name for p in (tmp_path / "project" / "checkpoints" / "checkpoint_2").iterdir()) == [
        "model.safetensors", "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"]
    report = scan(str(tmp_path / "project"))
    assert report.findings == ()
    (run,) = json.loads(render_json(report))["runs"]
    assert [c["step"] for c in run["checkpoints"]] == [None, None, None]
    assert ("no step shown for 3 `checkpoint_<i>` saves (the number counts saves, not steps): saved by 2 processes"
            in render_text(report))
