"""Real PyTorch Lightning 2.6 runs that end in each Lightning resume hazard, and their real resumes.

Run by tests/stacks/lightning_run.py for a job with a ``scenario`` key, in the Lightning interpreter; each scenario
trains a
tiny LightningModule on CPU (8 samples, batch 4: 2 optimizer steps an epoch) into ``root``, then resumes it as a user
would, and returns what the resume did: the file it loaded, the step it started at, what it raised and the warnings
it gave. The test (tests/stacks/test_lightning_hazards.py) scans the same folder and compares. Not a test module.
"""

from __future__ import annotations

import os
import shutil
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning_run import _data


class Module(L.LightningModule):
    """A linear model; ``onecycle``: a OneCycleLR stepped at ``interval``, built for ``total`` of its steps (None:
    the Trainer's planned optimizer steps)."""

    def __init__(self, onecycle: bool = False, interval: str = "step", total: int | None = None) -> None:
        super().__init__()
        self.onecycle, self.interval, self.total = onecycle, interval, total
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        if not self.onecycle:
            return opt
        total = self.total if self.total is not None else int(self.trainer.estimated_stepping_batches)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.interval}}


class StartStep(Callback):
    """Records the step and epoch the (resumed) fit starts at."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.epoch: int | None = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.step, self.epoch = trainer.global_step, trainer.current_epoch


def _trainer(root: str, callbacks: list[Callback], logger: bool = False, **kw: Any) -> L.Trainer:
    return L.Trainer(default_root_dir=root, accelerator="cpu", callbacks=callbacks, logger=logger,
                     enable_progress_bar=False, enable_model_summary=False, **kw)


def _built(root: str) -> None:
    """Copy the run as training left it to ``<root>.built`` (links kept as links): the test scans that copy, since
    the resume writes into ``root``."""
    shutil.copytree(root, f"{root}.built", symlinks=True)


def _resume(trainer: L.Trainer, start: StartStep, ckpt_path: str, onecycle: bool = False,
            module: L.LightningModule | None = None) -> dict[str, Any]:
    """``trainer.fit(ckpt_path=ckpt_path)``: what it loaded, where it started, what it raised and warned."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module or Module(onecycle), _data(), ckpt_path=ckpt_path)
        except Exception as e:  # the resume's own failure is the result
            return {"raised": type(e).__name__, "message": str(e)[:2000], "loaded": trainer.ckpt_path,
                    "warnings": [str(w.message) for w in caught]}
    return {"raised": None, "loaded": trainer.ckpt_path, "start_step": start.step, "start_epoch": start.epoch,
            "end_step": trainer.global_step, "warnings": [str(w.message) for w in caught]}


def stale_last(root: str) -> dict[str, Any]:
    """Two ModelCheckpoint callbacks in one dirpath: one keeps `last.ckpt` only when it saves its own top-k file
    (every 2 epochs), the other saves every step. After 3 epochs `last.ckpt` holds step 4, the newest file step 6."""
    ck = f"{root}/checkpoints"
    _trainer(root, [ModelCheckpoint(dirpath=ck, save_last=True, every_n_epochs=2),
                    ModelCheckpoint(dirpath=ck, every_n_train_steps=1, save_top_k=-1, filename="{epoch}-{step}-s")],
             max_epochs=3).fit(Module(), _data())
    _built(root)
    start = StartStep()
    return _resume(_trainer(root, [ModelCheckpoint(dirpath=ck, save_last=True), start], max_epochs=4), start, "last")


def stale_link(root: str) -> dict[str, Any]:
    """``save_last="link"`` on a ModelCheckpoint saving every 2 epochs, beside one saving every step in the same
    dirpath: `last.ckpt` links to the last file its own callback saved (step 4) while the other saved step 6."""
    ck = f"{root}/checkpoints"
    _trainer(root, [ModelCheckpoint(dirpath=ck, save_last="link", every_n_epochs=2),
                    ModelCheckpoint(dirpath=ck, every_n_train_steps=1, save_top_k=-1, filename="{epoch}-{step}-s")],
             max_epochs=3).fit(Module(), _data())
    _built(root)
    start = StartStep()
    out = _resume(_trainer(root, [ModelCheckpoint(dirpath=ck, save_last="link"), start], max_epochs=4), start, "last")
    out["link"] = os.readlink(f"{root}.built/checkpoints/last.ckpt")
    return out


def dangling_last(root: str) -> dict[str, Any]:
    """``save_last="link"``: `last.ckpt` is a link to the newest top-k file; that file is gone (cleaned up by hand,
    or a copy that kept links), so the link dangles while an older checkpoint is still there."""
    ck = f"{root}/checkpoints"
    _trainer(root, [ModelCheckpoint(dirpath=ck, save_last="link", save_top_k=-1)], max_epochs=2).fit(Module(), _data())
    target = os.path.join(ck, os.readlink(f"{ck}/last.ckpt"))
    os.remove(target)
    _built(root)
    start = StartStep()
    return _resume(_trainer(root, [ModelCheckpoint(dirpath=ck, save_last="link"), start], max_epochs=3), start,
                   "last")


def link_clean(root: str) -> dict[str, Any]:
    """``save_last="link"`` as Lightning leaves it: resumes from the file the link names."""
    ck = f"{root}/checkpoints"
    _trainer(root, [ModelCheckpoint(dirpath=ck, save_last="link", save_top_k=1)], max_epochs=2).fit(Module(), _data())
    _built(root)
    start = StartStep()
    return _resume(_trainer(root, [ModelCheckpoint(dirpath=ck, save_last="link"), start], max_epochs=3), start,
                   "last")


def default_logger(root: str) -> dict[str, Any]:
    """The default logger and a ModelCheckpoint without dirpath: checkpoints go to
    `lightning_logs/version_0/checkpoints`; a new Trainer's logger takes `version_1`, where "last" looks. Resumed
    again, from its own copy, by a Trainer whose logger is given ``version=0`` (``version_0``: "last" finds the run)."""
    from lightning.pytorch.loggers import CSVLogger

    _trainer(root, [ModelCheckpoint(save_last=True)], logger=True, max_epochs=1).fit(Module(), _data())
    _built(root)
    copy = f"{root}.version_0"
    shutil.copytree(f"{root}.built", copy, symlinks=True)
    start = StartStep()
    out = _resume(_trainer(root, [ModelCheckpoint(save_last=True), start], logger=True, max_epochs=2), start, "last")
    start = StartStep()
    out["version_0"] = _resume(_trainer(copy, [ModelCheckpoint(save_last=True), start],
                                        logger=CSVLogger(copy, name="lightning_logs", version=0), max_epochs=2),
                               start, "last")
    return out


def weights_only(root: str) -> dict[str, Any]:
    """``ModelCheckpoint(save_weights_only=True)``: no optimizer, scheduler or loop state."""
    ck = f"{root}/checkpoints"
    _trainer(root, [ModelCheckpoint(dirpath=ck, save_last=True, save_weights_only=True)],
             max_epochs=1).fit(Module(), _data())
    _built(root)
    start = StartStep()
    return _resume(_trainer(root, [ModelCheckpoint(dirpath=ck, save_last=True), start], max_epochs=2), start, "last")


def onecycle(root: str) -> dict[str, Any]:
    """A per-step OneCycleLR over the whole planned run (1 epoch: 2 steps), finished, resumed for 2 epochs."""
    ck = f"{root}/checkpoints"
    _trainer(root, [ModelCheckpoint(dirpath=ck, save_last=True)], max_epochs=1).fit(Module(True), _data())
    _built(root)
    start = StartStep()
    return _resume(_trainer(root, [ModelCheckpoint(dirpath=ck, save_last=True), start], max_epochs=2), start, "last",
                   onecycle=True)


def _two_fits(root: str, **kw: Any) -> str:
    """A fit of 5 epochs (10 steps) into ``root/checkpoints``, then a new Trainer's fit of 2 epochs (4 steps) from
    scratch into the same ``dirpath`` (``kw``: the ModelCheckpoint's other arguments)."""
    ck = f"{root}/checkpoints"
    for epochs in (5, 2):
        _trainer(root, [ModelCheckpoint(dirpath=ck, save_last=True, save_top_k=-1, **kw)],
                 max_epochs=epochs).fit(Module(), _data())
    return ck


def two_runs(root: str) -> dict[str, Any]:
    """Two fits in one dirpath (the default version counter: the second writes `last-v1.ckpt` beside the first's
    `last.ckpt`), resumed with ``ckpt_path="last"``, and, from its own copy, with the first run's newest file."""
    ck = _two_fits(root)
    _built(root)
    shutil.copytree(f"{root}.built", f"{root}.newest", symlinks=True)
    start = StartStep()
    out = _resume(_trainer(root, [ModelCheckpoint(dirpath=ck, save_last=True), start], max_epochs=3), start, "last")
    start = StartStep()
    out["newest"] = _resume(_trainer(f"{root}.newest", [ModelCheckpoint(dirpath=f"{root}.newest/checkpoints",
                                                                        save_last=True), start], max_epochs=6),
                            start, f"{root}.newest/checkpoints/epoch=4-step=10.ckpt")
    return out


def two_runs_overwrite(root: str) -> dict[str, Any]:
    """Two fits in one dirpath with ``enable_version_counter=False``: the second overwrites `last.ckpt` and the
    files of its own steps; the first run's later files stay."""
    ck = _two_fits(root, enable_version_counter=False)
    _built(root)
    start = StartStep()
    return _resume(_trainer(root, [ModelCheckpoint(dirpath=ck, save_last=True, enable_version_counter=False), start],
                            max_epochs=3), start, "last")


def resume_last(root: str, max_epochs: int) -> dict[str, Any]:
    """``fit(ckpt_path="last")`` of ``root`` (a ``ModelCheckpoint`` folder ``root/checkpoints``) by a new Trainer: its
    outcome (``_resume``). Called in a fresh process by ``_seeded_resumes``."""
    start = StartStep()
    return _resume(_trainer(root, [ModelCheckpoint(dirpath=f"{root}/checkpoints", save_last=True), start],
                            max_epochs=max_epochs), start, "last")


def _seeded_resumes(root: str, max_epochs: int) -> dict[str, Any]:
    """The real resume of ``<root>.built`` with ``fit(ckpt_path="last")`` in fresh processes under different
    ``PYTHONHASHSEED`` values (each from its own copy, modification times kept), until two loaded different files:
    ``picks`` (the file each loaded) and ``resumes`` (each outcome, by seed)."""
    import json
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import lightning_hazards as h; "
            "print(json.dumps(h.resume_last(sys.argv[2], int(sys.argv[3]))))")
    picks: list[str] = []
    resumes: dict[str, Any] = {}
    for seed in range(16):  # each seed orders the set of candidates its own way
        copy = f"{root}.seed{seed}"
        shutil.copytree(f"{root}.built", copy, symlinks=True)  # copy2: the tied modification times stay
        env = {**os.environ, "PYTHONHASHSEED": str(seed)}
        done = subprocess.run([sys.executable, "-c", code, here, copy, str(max_epochs)], env=env,
                              capture_output=True, text=True, check=True)
        out = json.loads(done.stdout.strip().splitlines()[-1])
        resumes[str(seed)] = out
        picks.append(os.path.basename(out["loaded"]))
        if len(set(picks)) > 1:
            break
    return {"picks": picks, "resumes": resumes}


def tied_last(root: str) -> dict[str, Any]:
    """``two_runs``'s folder with both `last*.ckpt` at one modification time (as an archive keeping whole seconds
    leaves them): `last.ckpt` at step 10, `last-v1.ckpt` at step 4. Resumed with ``ckpt_path="last"`` and
    ``max_epochs=6`` in fresh processes under different hash seeds (``_seeded_resumes``)."""
    ck = _two_fits(root)
    for name in ("last.ckpt", "last-v1.ckpt"):
        os.utime(f"{ck}/{name}", (1_700_000_000, 1_700_000_000))
    _built(root)
    return _seeded_resumes(root, 6)


def tied_equal(root: str) -> dict[str, Any]:
    """Two ``ModelCheckpoint(save_last=True)`` callbacks in one dirpath (the second, keeping the best train loss,
    writes `last-v1.ckpt`), both at step 4 after 2 epochs, then given one modification time: whichever "last"
    loads, the resume (``max_epochs=3``) starts at step 4."""
    ck = f"{root}/checkpoints"
    _trainer(root, [ModelCheckpoint(dirpath=ck, save_last=True),
                    ModelCheckpoint(dirpath=ck, save_last=True, monitor="train_loss", filename="{epoch}-{step}-b")],
             max_epochs=2).fit(Module(), _data())
    for name in ("last.ckpt", "last-v1.ckpt"):
        os.utime(f"{ck}/{name}", (1_700_000_000, 1_700_000_000))
    _built(root)
    return _seeded_resumes(root, 3)


def onecycle_epoch(root: str) -> dict[str, Any]:
    """A OneCycleLR stepped once an epoch (``interval="epoch"``), built for 5 epochs, after 3 epochs (6 optimizer
    steps), resumed from its own copy for 5 epochs (2 more scheduler steps: within its 5) and for 6 (3 more: one
    too many)."""
    ck = f"{root}/checkpoints"
    _trainer(root, [ModelCheckpoint(dirpath=ck, save_last=True)], max_epochs=3).fit(Module(True, "epoch", 5), _data())
    _built(root)
    out: dict[str, Any] = {}
    for epochs in (5, 6):
        copy = f"{root}.{epochs}"
        shutil.copytree(f"{root}.built", copy, symlinks=True)
        start = StartStep()
        out[str(epochs)] = _resume(_trainer(copy, [ModelCheckpoint(dirpath=f"{copy}/checkpoints", save_last=True),
                                                   start], max_epochs=epochs), start, "last",
                                   module=Module(True, "epoch", 5))
    return out


def _edit(path: str, change: Any) -> None:
    """Rewrite one real checkpoint as a user's script does: ``torch.load``, change, ``torch.save``; mtime kept."""
    st = os.stat(path)
    ckpt = torch.load(path, weights_only=False)
    change(ckpt)
    torch.save(ckpt, path)
    os.utime(path, (st.st_atime, st.st_mtime))


def loop_counters(root: str) -> dict[str, Any]:
    """A real checkpoint whose top-level ``global_step`` a script set back to 0 (a "fresh schedule" edit) while its
    ``loops`` still count 2 optimizer steps: the resume counts from the loops."""
    ck = f"{root}/checkpoints"
    _trainer(root, [ModelCheckpoint(dirpath=ck, save_last=True, save_top_k=0)], max_epochs=1).fit(Module(), _data())

    def reset(c: dict[str, Any]) -> None:
        c["global_step"] = 0
    _edit(f"{ck}/last.ckpt", reset)
    _built(root)
    start = StartStep()
    return _resume(_trainer(root, [ModelCheckpoint(dirpath=ck, save_last=True), start], max_epochs=2), start, "last")


def moved_paths(root: str) -> dict[str, Any]:
    """A run copied from ``root/a`` to ``root/b`` and relocated by a script that rewrote ``dirpath`` in the
    ModelCheckpoint state but not ``best_k_models``: resuming in `b` with top-k 1 deletes the file in `a`."""
    a, b = f"{root}/a/checkpoints", f"{root}/b/checkpoints"
    cb = ModelCheckpoint(dirpath=a, save_top_k=1, monitor="train_loss", mode="max", every_n_train_steps=1)
    _trainer(f"{root}/a", [cb], max_epochs=1).fit(Module(), _data())
    shutil.copytree(f"{root}/a", f"{root}/b")
    (name,) = os.listdir(b)

    def relocate(c: dict[str, Any]) -> None:
        for key, state in c["callbacks"].items():
            if key.startswith("ModelCheckpoint"):
                state["dirpath"] = os.path.realpath(b)
    _edit(f"{b}/{name}", relocate)
    before = sorted(os.listdir(a))
    _built(root)
    start = StartStep()
    cb2 = ModelCheckpoint(dirpath=os.path.realpath(b), save_top_k=1, monitor="train_loss", mode="max",
                          every_n_train_steps=1)
    out = _resume(_trainer(f"{root}/b", [cb2, start], max_epochs=3), start, f"{b}/{name}")
    out.update(a_before=before, a_after=sorted(os.listdir(a)), best_after=cb2.best_model_path,
               best_k_after=sorted(cb2.best_k_models))
    return out


def planned(root: str) -> dict[str, Any]:
    """One run saving every step for 3 epochs (6 steps), resumed three ways, each from its own copy:
    ``ckpt_path="best"`` in a new Trainer, the file at step 5 (epoch 2, mid-epoch) with ``max_epochs=1``, and the
    file at step 3 (mid-epoch 1) with ``max_steps=5``."""
    ck = f"{root}/checkpoints"
    _trainer(root, [ModelCheckpoint(dirpath=ck, every_n_train_steps=1, save_top_k=-1, save_last=True)],
             max_epochs=3).fit(Module(), _data())
    _built(root)
    out: dict[str, Any] = {}
    for name, ckpt, kw in (("best", "best", {"max_epochs": 4}),
                           ("epoch_above", "epoch=2-step=5.ckpt", {"max_epochs": 1}),
                           ("path_steps", "epoch=1-step=3.ckpt", {"max_steps": 5})):
        copy = f"{root}.{name}"
        shutil.copytree(f"{root}.built", copy, symlinks=True)
        start = StartStep()
        path = ckpt if ckpt == "best" else f"{copy}/checkpoints/{ckpt}"
        out[name] = _resume(_trainer(copy, [ModelCheckpoint(dirpath=f"{copy}/checkpoints", save_last=True), start],
                                     **kw), start, path)
    return out


def callback(root: str) -> dict[str, Any]:
    """``ckptdoctor.integrations.lightning.gate_callback`` in a real fit: the default logger's run resumed by a new
    Trainer (it would train from scratch: the callback stops it before anything loads), and a run with a fixed
    ``dirpath`` (it passes, and the fit resumes)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's ckptdoctor (run by path)
    from ckptdoctor.integrations.lightning import ResumeGateError, gate_callback

    out: dict[str, Any] = {}
    logged = f"{root}/logged"
    _trainer(logged, [ModelCheckpoint(save_last=True)], logger=True, max_epochs=1).fit(Module(), _data())
    gated = gate_callback(ckpt_path="last")
    try:
        _trainer(logged, [ModelCheckpoint(save_last=True), gated], logger=True, max_epochs=2).fit(
            Module(), _data(), ckpt_path="last")
        out["logged"] = None
    except ResumeGateError as e:
        out["logged"] = [f.rule for f in e.result.findings]
    fixed = f"{root}/fixed/checkpoints"
    _trainer(f"{root}/fixed", [ModelCheckpoint(dirpath=fixed, save_last=True)], max_epochs=1).fit(Module(), _data())
    gated, start = gate_callback(ckpt_path="last"), StartStep()
    trainer = _trainer(f"{root}/fixed", [ModelCheckpoint(dirpath=fixed, save_last=True), gated, start], max_epochs=2)
    trainer.fit(Module(), _data(), ckpt_path="last")
    result = gated.result
    out["fixed"] = {"failed": result.failed, "start": result.start_step, "end": result.max_steps,
                    "real_start": start.step, "real_end": trainer.global_step}
    return out


SCENARIOS = {f.__name__: f for f in (stale_last, stale_link, dangling_last, link_clean, default_logger, weights_only,
                                     onecycle, loop_counters, moved_paths, callback, planned, two_runs,
                                     two_runs_overwrite, tied_last, tied_equal, onecycle_epoch)}


def run(job: dict[str, Any]) -> dict[str, Any]:
    """Build and resume the scenario ``job["scenario"]`` under ``job["root"]``."""
    torch.manual_seed(0)
    out = SCENARIOS[job["scenario"]](job["root"])
    out["warnings"] = [w for w in out.get("warnings", []) if "ckpt_path" in w or "no last" in w or "dirpath" in w]
    return out
