"""``ckptdoctor gate`` on accelerate runs (issue 23, section 4): what ``Accelerator.load_state()`` picks, restores,
and where it raises or goes back, checked against the real accelerate 1.15 resume of the same folders; and
``ckptdoctor.integrations.accelerate.check_load_state`` with a real ``Accelerator``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("accelerate")

from ckptdoctor import gate
from ckptdoctor.integrations.accelerate import ResumeGateError, check_load_state
from tests.helpers.accelerate_run import Program, copy_project, four_saves
from tests.helpers.fixing import run_cli


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real automatic-naming project (``accelerate_run.four_saves``)."""
    return four_saves(tmp_path_factory.mktemp("gate-acc") / "project")


def test_clean_run_passes_with_what_load_state_restores(clean: Path) -> None:
    r = gate(clean, max_steps=10)
    assert (r.stack, r.verdict, r.findings) == ("accelerate", "pass", ())
    assert r.checkpoint is not None and r.checkpoint.endswith("checkpoints/checkpoint_3")
    assert r.restores == ("model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
                          "custom_checkpoint_0.pkl")
    assert (r.start_step, r.max_steps, r.steps_to_train) == (4, 10, 6)
    assert Program(clean, custom=1).resume() == r.start_step  # what the real resume restores
    code, out = run_cli("gate", "--max-steps", "10", str(clean))
    assert code == 0, out
    assert "restores         model.safetensors, optimizer.bin" in out and "step 4" in out and "trains 6" in out
    code, out = run_cli("gate", "--format", "json", str(clean / "checkpoints"))
    doc = json.loads(out)
    assert (doc["stack"], doc["verdict"], doc["start_step"]) == ("accelerate", "pass", 4)


def test_interrupted_pick_fails_with_load_states_error_not_the_trainers(clean: Path, tmp_path: Path) -> None:
    root = copy_project(clean, tmp_path)
    cut = root / "checkpoints" / "checkpoint_4"
    shutil.copytree(root / "checkpoints" / "checkpoint_3", cut)
    for name in ("optimizer.bin", "scheduler.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl"):
        (cut / name).unlink()
    with pytest.raises(FileNotFoundError):
        Program(root, custom=1).resume()
    r = gate(root)
    assert r.verdict == "fail" and {f.rule for f in r.findings} == {"CKD432"}
    assert [f.message for f in r.findings] == [
        "no `optimizer.bin`: `load_state()` raises `FileNotFoundError`",
        "no `scheduler.bin`: `load_state()` raises `FileNotFoundError`"]
    assert all(f.path == "checkpoints/checkpoint_4" for f in r.findings)


def test_older_state_fails(clean: Path, tmp_path: Path) -> None:
    root = copy_project(clean, tmp_path)
    second = Program(root, custom=1)
    second.resume()
    second.train(2)
    r = gate(root)
    assert r.verdict == "fail" and [f.rule for f in r.findings] == ["CKD430"]
    assert r.start_step == Program(root, custom=1).resume() == 4  # the older state the real resume takes


def test_entry_without_digit_fails(clean: Path, tmp_path: Path) -> None:
    root = copy_project(clean, tmp_path)
    (root / "checkpoints" / "notes.txt").write_text("best so far: 3\n")
    with pytest.raises(IndexError):
        Program(root, custom=1).resume()
    r = gate(root)
    assert r.verdict == "fail" and r.checkpoint is None
    assert sorted(f.rule for f in r.findings) == ["CKD120", "CKD432"]


def test_stack_option(clean: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    r = gate(empty, stack="accelerate")
    assert (r.stack, r.verdict, [f.rule for f in r.findings]) == ("accelerate", "fail", ["CKD432"])
    assert gate(empty, stack="accelerate", allow_empty=True).verdict == "pass"
    assert gate(empty).stack == "trainer"  # nothing recognised: the Trainer's resume, CKD413
    code, out = run_cli("gate", "--stack", "keras", str(clean))
    assert code == 2 and "--stack" in out


def test_check_load_state_with_the_programs_accelerator(clean: Path, tmp_path: Path) -> None:
    root = copy_project(clean, tmp_path)
    program = Program(root, custom=1)
    result = check_load_state(program.acc, max_steps=8)
    assert (result.start_step, result.steps_to_train) == (4, 4)
    program.acc.load_state()  # passes, as the gate said

    two = Program(root, custom=2)  # one more object registered than the saves hold
    with pytest.raises(ResumeGateError) as info:
        check_load_state(two.acc)
    assert [f.rule for f in info.value.result.findings] == ["CKD432"]
    assert "1 `custom_checkpoint_<i>.pkl` files for 2 registered objects" in info.value.result.findings[0].message
    with pytest.raises(RuntimeError, match="Number of custom checkpoints"):
        two.acc.load_state()

    named = Program(root, custom=1)
    assert check_load_state(named.acc, root / "checkpoints" / "checkpoint_2").start_step == 3
    assert named.resume(root / "checkpoints" / "checkpoint_2") == 3


def test_saves_by_hand_and_a_folder_named(tmp_path: Path) -> None:
    """The diffusers scripts' layout (``save_state(output_dir/checkpoint-N)``): the gate takes the highest
    ``checkpoint-N`` (what ``--resume_from_checkpoint latest`` passes to ``load_state``), or the folder named."""
    out = tmp_path / "out"
    Program().train(4, folder=out)
    r = gate(out, max_steps=6)
    assert (r.stack, r.verdict, r.start_step, r.steps_to_train) == ("accelerate", "pass", 4, 2)
    assert r.checkpoint is not None and r.checkpoint.endswith("checkpoint-4")
    named = gate(out, checkpoint="checkpoint-2")
    assert (named.stack, named.verdict, named.start_step) == ("accelerate", "pass", 2)
    assert Program().resume(out / "checkpoint-2") == 2


def test_an_entry_with_a_higher_number_than_every_save(clean: Path, tmp_path: Path) -> None:
    """A TensorBoard file in `checkpoints/`: its first digit run sorts above every save, so `load_state()` takes
    the file as the folder to load, and raises."""
    root = copy_project(clean, tmp_path)
    (root / "checkpoints" / "events.out.tfevents.1764201600.host").write_bytes(b"")
    with pytest.raises(OSError):
        Program(root, custom=1).resume()
    r = gate(root)
    assert r.verdict == "fail" and sorted(f.rule for f in r.findings) == ["CKD120", "CKD432"]
    said = {f.rule: f.message for f in r.findings}
    assert said["CKD432"] == ("`load_state()` picks `events.out.tfevents.1764201600.host` (the highest number "
                                     "in `checkpoints`), which is no save folder")
    assert said["CKD120"] == ("`load_state()` sorts `checkpoints` by the number in each entry's name and takes "
                                     "`events.out.tfevents.1764201600.host`, the highest, as the save to load: it is "
                                     "none")
