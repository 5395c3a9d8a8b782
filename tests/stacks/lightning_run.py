"""Real PyTorch Lightning 2.6 runs for the tests, run in the Lightning interpreter (``CKPTDOCTOR_LIGHTNING_PYTHON``).

``python tests/stacks/lightning_run.py JOBS.json RESULTS.json``: each job trains a tiny LightningModule on CPU into its
``root`` (``ModelCheckpoint(save_last=True)``, one epoch of 2 steps), optionally with an ``argparse.Namespace``
among the module's init arguments that ``save_hyperparameters()`` records, then resumes for a second epoch with
``Trainer.fit(ckpt_path="last")`` as a user would, and records whether that resume raised (with what) or which
file it loaded. This file is not a test module: the package and the main interpreter never import Lightning.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset


class Tiny(L.LightningModule):
    """A linear model whose ``__init__`` takes the parsed command line (``args``: an ``argparse.Namespace``, or None)
    and records its arguments with ``save_hyperparameters()``: ``hyper_parameters`` then holds ``args`` as it is
    (Lightning turns only a Namespace passed to ``save_hyperparameters`` itself into a dict)."""

    def __init__(self, args: argparse.Namespace | None = None, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)), batch_size=4)


def _trainer(root: str, max_epochs: int) -> L.Trainer:
    ckpt = ModelCheckpoint(dirpath=f"{root}/checkpoints", save_last=True, save_top_k=1)
    return L.Trainer(default_root_dir=root, accelerator="cpu", max_epochs=max_epochs, callbacks=[ckpt],
                     logger=False, enable_progress_bar=False, enable_model_summary=False)


def run(job: dict[str, Any]) -> dict[str, Any]:
    """Train, then resume from `last`; the outcome of the resume (a ``scenario`` job: ``lightning_hazards``)."""
    if job.get("scenario"):
        import lightning_hazards

        return lightning_hazards.run(job)
    torch.manual_seed(0)
    hp = argparse.Namespace(lr=0.1, hidden=4) if job.get("namespace") else None
    _trainer(job["root"], 1).fit(Tiny(hp), _data())
    resumed = _trainer(job["root"], 2)
    try:
        resumed.fit(Tiny(hp), _data(), ckpt_path="last")
    except Exception as e:  # the resume's own failure is the result
        return {"raised": type(e).__name__, "message": str(e)[:2000], "trace": traceback.format_exc()[-2000:]}
    return {"raised": None, "loaded": resumed.ckpt_path}  # the file `ckpt_path="last"` resolved to


def main() -> None:
    with open(sys.argv[1]) as f:
        jobs = json.load(f)
    with open(sys.argv[2], "w") as f:
        json.dump([run(j) for j in jobs], f)


if __name__ == "__main__":
    main()
