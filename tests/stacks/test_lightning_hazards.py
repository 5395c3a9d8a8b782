"""Proof: each PyTorch Lightning 2.6 resume hazard, built and resumed with the real Lightning, is reported at the file
at fault (CKD440-444), and the clean runs built beside them raise no error or warning.

The runs and resumes happen in the Lightning interpreter (``CKPTDOCTOR_LIGHTNING_PYTHON``;
tests/stacks/lightning_hazards.py
through tests/stacks/lightning_run.py, as a subprocess). Each scenario copies the run as training left it to
``<root>.built`` before resuming; the scan judges that copy, the resume's outcome is what Lightning did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckptdoctor.scanner import scan
from tests.helpers.paths import TESTS
from tests.stacks.test_stack_lightning import _lightning, needs_lightning

SCENARIOS = ("stale_last", "stale_link", "dangling_last", "link_clean", "default_logger", "weights_only", "onecycle",
             "loop_counters", "moved_paths", "callback", "planned", "two_runs", "two_runs_overwrite", "tied_last",
             "tied_equal", "onecycle_epoch")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Every scenario built and resumed once: name -> (the run as built, the resume's outcome)."""
    tmp = tmp_path_factory.mktemp("lightning")
    results = _lightning([{"scenario": s, "root": str(tmp / s)} for s in SCENARIOS], tmp)
    return {s: (tmp / f"{s}.built", r) for s, r in zip(SCENARIOS, results, strict=True)}


def _found(root: Path) -> list[tuple[str, str]]:
    return [(f.rule, f.path) for f in scan(str(root)).findings]


@needs_lightning
@pytest.mark.parametrize("name", ["stale_last", "stale_link"])
def test_stale_last_resumes_early(runs: dict[str, tuple[Path, dict[str, Any]]], name: str) -> None:
    """Two ModelCheckpoint callbacks in one dirpath, `last.ckpt` kept by the one saving every 2 epochs (a file, or
    with `save_last="link"` a link to that callback's last file): the real resume started at step 4, where the
    other callback had saved step 6."""
    root, out = runs[name]
    assert out["raised"] is None and out["loaded"].endswith("/last.ckpt") and out["start_step"] == 4
    if name == "stale_link":
        assert out["link"] == "epoch=1-step=4.ckpt"
    (f,) = scan(str(root)).findings
    assert (f.rule, f.path) == ("CKD440", "checkpoints/last.ckpt")
    assert "at step 4" in f.message and "holds step 6" in f.message and "trains 2 steps again" in f.message


@needs_lightning
def test_a_later_fit_in_the_same_dirpath_is_no_stale_last(runs: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    """A new Trainer's fit in a dirpath holding an earlier run's files: "last" resumes the later fit (its
    `last-v1.ckpt`, step 4) although the earlier run's files hold step 10, so no CKD440; CKD447 (an info) says the
    earlier run's `last.ckpt` is a candidate chosen by time only, and passing the earlier run's file continues it."""
    root, out = runs["two_runs"]
    assert out["raised"] is None and out["loaded"].endswith("/last-v1.ckpt") and out["start_step"] == 4
    assert out["newest"]["loaded"].endswith("/epoch=4-step=10.ckpt") and out["newest"]["start_step"] == 10
    (f,) = scan(str(root)).findings
    assert (f.rule, f.severity.value, f.path) == ("CKD447", "info", "checkpoints/last-v1.ckpt")
    assert "loads `last-v1.ckpt` (step 4), saved by a later fit than `last.ckpt` beside it (step 10" in f.message
    gate = _gate(root, max_epochs=3)
    assert not gate.failed and Path(gate.checkpoint).name == "last-v1.ckpt" and gate.start_step == 4


@needs_lightning
def test_a_resume_from_an_earlier_file_leaves_no_stale_last(runs: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    """The folder a real resume left: `planned`'s run (6 steps, `last.ckpt` at 6) resumed from `epoch=1-step=3.ckpt`
    to `max_steps=5` by a Trainer whose `ModelCheckpoint` differs (its state is not restored, so it writes
    `last-v1.ckpt`). "last" now loads the resumed fit's step 5, as it should; CKD440 used to call that a stale
    `last.ckpt` (an error). Only CKD447's info remains."""
    folder = runs["planned"][0].with_name("planned.path_steps")
    assert runs["planned"][1]["path_steps"]["end_step"] == 5
    found = [(f.rule, f.severity.value, f.path) for f in scan(str(folder)).findings]
    assert found == [("CKD447", "info", "checkpoints/last-v1.ckpt")]


@needs_lightning
def test_a_later_fit_overwriting_last_is_clean(runs: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    """With `enable_version_counter=False` the later fit overwrites `last.ckpt`: "last" can load nothing else, and
    the earlier run's `epoch=4-step=10.ckpt` (saved before it) is not its future: no finding."""
    root, out = runs["two_runs_overwrite"]
    assert out["raised"] is None and out["loaded"].endswith("/last.ckpt") and out["start_step"] == 4
    assert (root / "checkpoints" / "epoch=4-step=10.ckpt").exists()
    assert scan(str(root)).findings == ()


@needs_lightning
def test_tied_last_files_are_ambiguous(runs: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    """Two `last*.ckpt` of one modification time holding different steps: fresh processes under different hash
    seeds resumed from different files, at different steps; CKD448 says so in a scan, and CKD440/447 (which need
    the one file loaded) stay silent."""
    root, out = runs["tied_last"]
    assert set(out["picks"]) == {"last.ckpt", "last-v1.ckpt"}
    starts = {Path(r["loaded"]).name: (r["start_step"], r["end_step"]) for r in out["resumes"].values()}
    assert starts == {"last.ckpt": (10, 12), "last-v1.ckpt": (4, 12)}
    (f,) = scan(str(root)).findings
    assert (f.rule, f.severity.value) == ("CKD448", "warning")
    assert "`last-v1.ckpt` (step 4), `last.ckpt` (step 10) share one modification time" in f.message


@needs_lightning
def test_gate_fails_when_last_may_load_files_that_resume_differently(
        runs: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    """The gate claims no one prediction for the tied folder: CKD449 (an error) names each file "last" may load and
    what the planned resume does from it, as the real resumes under two hash seeds did (step 4 then 8 steps, step 10
    then 2)."""
    root, out = runs["tied_last"]
    result = _gate(root, max_epochs=6)
    assert result.failed and result.checkpoint is None and result.start_step is None
    assert [f.rule for f in result.findings] == ["CKD449"]
    real = {Path(r["loaded"]).name: r for r in out["resumes"].values()}
    said = result.findings[0].message
    for name, r in sorted(real.items()):
        trained = r["end_step"] - r["start_step"]
        assert f"`{name}` (resumes at step {r['start_step']}, trains {trained} steps)" in said
    assert said.startswith('`fit(ckpt_path="last")` may load `last-v1.ckpt` (resumes at step 4, trains 8 steps) or '
                           "`last.ckpt` (resumes at step 10, trains 2 steps)")


@needs_lightning
def test_tied_last_files_at_one_step_keep_the_prediction(runs: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    """Two `last*.ckpt` of one modification time holding the same step (two `ModelCheckpoint(save_last=True)` in one
    dirpath): the real resumes under two hash seeds loaded different files and both started at step 4 and ended at
    6; the scan is clean and the gate passes with that prediction."""
    root, out = runs["tied_equal"]
    assert set(out["picks"]) == {"last.ckpt", "last-v1.ckpt"}
    assert {(r["start_step"], r["end_step"], r["raised"]) for r in out["resumes"].values()} == {(4, 6, None)}
    report = scan(str(root))
    assert report.findings == ()
    from ckptdoctor.render.report import render_text

    assert "loads one of `last-v1.ckpt`, `last.ckpt` (one modification time; each at the same step)" in render_text(
        report)
    result = _gate(root, max_epochs=3)
    assert not result.failed and (result.start_step, result.max_steps, result.steps_to_train) == (4, 6, 2)
    assert Path(result.checkpoint).name in out["picks"]


@needs_lightning
def test_dangling_last_trains_from_scratch(runs: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    root, out = runs["dangling_last"]
    assert out["raised"] is None and out["loaded"] is None and out["start_step"] == 0
    assert any("no last checkpoint available" in w for w in out["warnings"])
    assert ("CKD441", "checkpoints/last.ckpt") in _found(root)


@needs_lightning
def test_weights_only_resume_raises_keyerror(runs: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    root, out = runs["weights_only"]
    assert out["raised"] == "KeyError" and "contains only the model" in out["message"]
    assert _found(root) == [("CKD443", "checkpoints/last.ckpt")]


@needs_lightning
def test_loop_counters_win_over_global_step(runs: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    root, out = runs["loop_counters"]
    assert out["raised"] is None and out["start_step"] == 2  # global_step says 0
    (f,) = scan(str(root)).findings
    assert (f.rule, f.path) == ("CKD442", "checkpoints/last.ckpt")
    assert "`global_step` is 0 but the fit loop counts 2 optimizer steps" in f.message


@needs_lightning
def test_callback_paths_outside_dirpath(runs: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    root, out = runs["moved_paths"]
    # the resumed run in b/ tracks a/'s file as its best: `ckpt_path="best"` would load another run's file
    assert out["raised"] is None and "/moved_paths/a/" in out["best_after"]
    assert out["a_after"] == out["a_before"]  # a local file outside dirpath is kept (`_should_remove_checkpoint`)
    assert _found(root) == [("CKD444", "b/checkpoints/epoch=0-step=2.ckpt")]


@needs_lightning
def test_clean_real_runs_raise_nothing(runs: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    """A link `last.ckpt`, the default logger's layout and a finished OneCycleLR run are clean in a scan (the
    version_N and OneCycleLR hazards depend on the planned resume: the gate's)."""
    for name in ("link_clean", "default_logger", "onecycle"):
        root, _ = runs[name]
        assert scan(str(root)).findings == (), name
    assert runs["link_clean"][1]["start_step"] == 4


def test_rules_are_silent_on_committed_runs() -> None:
    data = TESTS / "data" / "lightning-2.6.6"
    assert scan(str(data / "plain")).findings == ()
    assert [f.rule for f in scan(str(data / "namespace")).findings if f.rule.startswith("CKD43")] == []


# ---------------------------------------------------------------------------------------------------------------
# The gate predicts the real resume: the file `fit(ckpt_path="last")` loaded, the steps it trained, what it raised


def _gate(root: Path, **planned: Any) -> Any:
    from ckptdoctor.resume_gate.api import gate

    return gate(root, **planned)


@needs_lightning
@pytest.mark.parametrize(("name", "max_epochs"), [("stale_last", 4), ("stale_link", 4), ("link_clean", 3),
                                                  ("loop_counters", 2)])
def test_gate_predicts_the_real_resume(runs: dict[str, tuple[Path, dict[str, Any]]], name: str,
                                       max_epochs: int) -> None:
    root, out = runs[name]
    result = _gate(root, max_epochs=max_epochs)
    assert Path(result.checkpoint).name == Path(out["loaded"]).name
    assert (result.start_step, result.max_steps) == (out["start_step"], out["end_step"])
    assert result.weights_branch == "lightning"
    assert result.failed is name.startswith("stale_")  # CKD440: the loaded file is older than the newest


@needs_lightning
@pytest.mark.parametrize(("name", "code", "raised"), [
    ("weights_only", "CKD445", "KeyError"), ("onecycle", "CKD445", "ValueError"),
    ("dangling_last", "CKD446", None), ("default_logger", "CKD446", None)])
def test_gate_fails_where_lightning_raises_or_starts_over(runs: dict[str, tuple[Path, dict[str, Any]]], name: str,
                                                          code: str, raised: str | None) -> None:
    root, out = runs[name]
    assert out["raised"] == raised
    if raised is None:  # it warned and trained from scratch
        assert out["loaded"] is None and out["start_step"] == 0
    result = _gate(root, max_epochs=2 if name != "dangling_last" else 3)
    assert result.failed and code in {f.rule for f in result.findings}
    if raised is not None:
        assert f"`{raised}`" in next(f.message for f in result.findings if f.rule == code)


@needs_lightning
def test_gate_tells_an_epoch_interval_onecycle_from_its_count(runs: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    """A OneCycleLR stepped once an epoch (its `last_epoch` 3 = the epochs done, not the 6 optimizer steps), built
    for 5: resumed to 5 epochs it steps twice and trains (the step-interval reading would have said 4 steps, one
    `ValueError`); to 6 epochs it steps three times and raises, as the gate says."""
    root, out = runs["onecycle_epoch"]
    assert out["5"]["raised"] is None and (out["5"]["start_step"], out["5"]["end_step"]) == (6, 10)
    assert out["6"]["raised"] == "ValueError" and "Tried to step 6 times" in out["6"]["message"]
    assert scan(str(root)).findings == ()
    fits = _gate(root, max_epochs=5)
    assert not fits.failed and (fits.start_step, fits.max_steps) == (6, 10)
    raises = _gate(root, max_epochs=6)
    assert raises.failed
    msg = next(f.message for f in raises.findings if f.rule == "CKD445")
    assert "built for 5 steps and has taken 3; the resume steps it 3 more times (once an epoch" in msg


@needs_lightning
def test_gate_logger_version_names_the_folder(runs: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    """With the logger's version fixed at 0 (or a ModelCheckpoint dirpath there), "last" finds version_0's file: the
    real resume under `CSVLogger(version=0)` loaded it and trained from step 2 to 4."""
    root, out = runs["default_logger"]
    real = out["version_0"]
    assert real["raised"] is None and real["loaded"].endswith("version_0/checkpoints/last.ckpt")
    result = _gate(root, max_epochs=2, logger_version=0)
    assert not result.failed and result.checkpoint.endswith("version_0/checkpoints/last.ckpt")
    assert (result.start_step, result.max_steps) == (real["start_step"], real["end_step"]) == (2, 4)


@needs_lightning
def test_gate_cli_stack_option(runs: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    from click.testing import CliRunner

    from ckptdoctor.cli import main

    root, _ = runs["onecycle"]
    res = CliRunner().invoke(main, ["gate", str(root), "--stack", "lightning", "--max-epochs", "2"])
    assert res.exit_code == 1 and "CKD445" in res.output and "OneCycleLR" in res.output


@needs_lightning
def test_gate_callback_in_a_real_fit(runs: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    """The Lightning callback stops the fit that would train from scratch (the default logger's next version) in its
    `setup`, and lets the resumable one run, predicting the steps it trains."""
    _, out = runs["callback"]
    assert out["logged"] == ["CKD446"]
    fixed = out["fixed"]
    assert not fixed["failed"] and (fixed["start"], fixed["end"]) == (fixed["real_start"], fixed["real_end"]) == (2, 4)


@needs_lightning
def test_dangling_last_fix_rescan_undo(runs: dict[str, tuple[Path, dict[str, Any]]], tmp_path: Path) -> None:
    """CKD441's unsafe fix moves the dangling link itself into the quarantine (its target is never followed); the
    rescan has no finding about it, and undo puts the same link back."""
    import os
    import shutil

    import ckptdoctor

    built, _ = runs["dangling_last"]
    root = tmp_path / "run"
    shutil.copytree(built, root, symlinks=True)
    link = root / "checkpoints" / "last.ckpt"
    target = os.readlink(link)
    (f,) = [f for f in scan(str(root)).findings if f.rule == "CKD441"]
    assert f.fix is not None and f.fix.applicability.value == "unsafe"
    assert "the newest checkpoint there is `epoch=0-step=2.ckpt`" in f.message
    assert ckptdoctor.fix(str(root), force=True).exit_code() != 0  # unsafe: not applied by default
    assert os.path.islink(link)
    ckptdoctor.fix(str(root), unsafe=True, force=True)
    assert not os.path.lexists(link)
    assert [x.rule for x in scan(str(root)).findings] == []
    ckptdoctor.undo(str(root))
    assert os.path.islink(link) and os.readlink(link) == target
    assert ("CKD441", "checkpoints/last.ckpt") in _found(root)


@needs_lightning
def test_gate_follows_best_a_path_max_epochs_and_max_steps(runs: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    """`ckpt_path="best"` in a new Trainer raises `ValueError`; a checkpoint whose epoch is above `max_epochs` raises
    `MisconfigurationException`; a path resumes mid-epoch at its loops' step and trains to `max_steps`."""
    root, out = runs["planned"]
    best = _gate(root, ckpt_path="best", max_epochs=4)
    assert out["best"]["raised"] == "ValueError" and best.failed
    assert [f.rule for f in best.findings] == ["CKD445"] and "`ValueError`" in best.findings[0].message
    above = _gate(root, ckpt_path=str(root / "checkpoints" / "epoch=2-step=5.ckpt"), max_epochs=1)
    assert out["epoch_above"]["raised"] == "MisconfigurationException" and above.failed
    assert "`MisconfigurationException`" in next(f.message for f in above.findings if f.rule == "CKD445")
    steps = _gate(root, ckpt_path=str(root / "checkpoints" / "epoch=1-step=3.ckpt"), max_steps=5)
    real = out["path_steps"]
    assert real["raised"] is None and not steps.failed
    assert (steps.start_step, steps.max_steps, steps.steps_to_train) == (real["start_step"], real["end_step"], 2)


DATA = TESTS / "data" / "lightning-2.6.6"


def test_gate_on_the_committed_run_without_lightning(tmp_path: Path) -> None:
    """Without the Lightning interpreter: the committed run is recognised and gated as `fit(ckpt_path=...)`; a path
    outside RUN_DIR is judged where it is, a missing one is `FileNotFoundError`."""
    import shutil

    plain = DATA / "plain"
    result = _gate(plain, max_epochs=3)
    assert (result.weights_branch, Path(result.checkpoint).name, result.start_step, result.max_steps) == (
        "lightning", "last.ckpt", 4, 6)
    assert not result.failed
    elsewhere = tmp_path / "x.ckpt"
    shutil.copy(plain / "checkpoints" / "epoch=1-step=4.ckpt", elsewhere)
    moved = _gate(plain, ckpt_path=str(elsewhere), max_epochs=3)
    assert not moved.failed and moved.checkpoint.endswith("x.ckpt") and moved.start_step == 4
    missing = _gate(plain, ckpt_path=str(tmp_path / "nope.ckpt"))
    assert missing.failed and "`FileNotFoundError`" in missing.findings[0].message
    trainer = _gate(plain, stack="trainer")  # --stack overrides: the Trainer finds no checkpoint-N here
    assert trainer.weights_branch != "lightning" and "CKD413" in {f.rule for f in trainer.findings}


# ---------------------------------------------------------------------------------------------------------------
# The report's step: what the .ckpt "last" loads holds (its loops' count, where the real resume started)


def _shown(root: Path) -> tuple[list[tuple[int | None, int | None]], str]:
    """Each Lightning folder's (step, global_step) in the JSON report, and the text report."""
    from ckptdoctor.render.report import render_text, to_json

    report = scan(str(root))
    rows = [(c["step"], c["global_step"]) for r in to_json(report)["runs"] for c in r["checkpoints"]]
    return rows, render_text(report)


def test_report_shows_the_committed_runs_steps() -> None:
    """Written by Lightning 2.6.6 (tests/data/lightning-2.6.6): `last.ckpt` holds 2 steps in `namespace`, 4 in
    `plain`; the report's step column and JSON show them, read from the pickle (`loops` and `global_step`)."""
    rows, text = _shown(DATA)
    assert rows == [(2, 2), (4, 4)]
    assert ". (model files)  4 " in text


@needs_lightning
@pytest.mark.parametrize(("name", "shown"), [
    ("stale_last", (4, 4)), ("loop_counters", (2, 0)), ("two_runs", (4, 4)), ("tied_last", (None, None)),
    ("dangling_last", (2, 2))])
def test_report_step_is_where_the_real_resume_starts(runs: dict[str, tuple[Path, dict[str, Any]]], name: str,
                                                     shown: tuple[int | None, int | None]) -> None:
    """The step shown is the loops' count of the file `fit(ckpt_path="last")` loaded, which is where the real resume
    started (`global_step` edited to 0 does not move it); none when "last" may load files holding different steps
    (the resume depended on the hash seed); with no `last*.ckpt` to load (a dangling link), the step of the file
    holding the most, which the header names."""
    root, out = runs[name]
    (row,), text = _shown(root)
    assert row == shown
    if name in ("stale_last", "loop_counters", "two_runs"):
        assert out["start_step"] == row[0]
    if name == "tied_last":
        assert "(one modification time; no step shown)" in text
    if name == "dangling_last":
        assert out["start_step"] == 0 and "the step shown is `epoch=0-step=2.ckpt`'s, the most steps here" in text
