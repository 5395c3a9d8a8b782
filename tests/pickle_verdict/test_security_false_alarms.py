"""False alarms on files real loaders read cleanly (issue 22, item 6), each built by its real library: a TorchScript
archive (``torch.jit.save``), ``joblib.dump`` of numpy arrays, and a Lightning checkpoint holding an
``argparse.Namespace``; and, next to each, the control one step past it that stays an error."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ckptdoctor.pickle_verdict.judge import judge
from ckptdoctor.readers.pickle_walk import walk_pickle
from ckptdoctor.scanner import scan
from tests.helpers.builders import make_checkpoint
from tests.helpers.paths import TESTS
from tests.helpers.payloads import _g, _p2, _s, _torch_zip

torch = pytest.importorskip("torch")

STACKS = TESTS / "data" / "stacks"
JOBLIB_LAYER = Path("/work/stacks/joblib")  # pip install --no-deps --target /work/stacks/joblib joblib==1.6.0
LIGHTNING_PYTHON = Path("/work/stacks/lightning/bin/python")  # a venv: torch==2.13.0, then lightning==2.6.6


def _security(root: Path) -> list[str]:
    return [f"{f.rule} {f.path}: {f.message}" for f in scan(str(root)).findings if f.rule.startswith("CKD6")]


def _verdict(data: bytes) -> tuple[tuple[str, ...], tuple[str, ...]]:
    facts, problems, _ = walk_pickle(data)
    assert facts is not None and not problems, problems
    v = judge(facts)
    return v.unsafe, v.unknown


# TorchScript ------------------------------------------------------------------------------------------------------


class _Scripted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.sizes = [1, 2, 3]  # a typed list: pickled through torch.jit._pickle.build_intlist

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x) * len(self.sizes)


def _torchscript(path: Path) -> Path:
    torch.jit.save(torch.jit.script(_Scripted()), str(path))
    return path


def test_a_torchscript_archive_in_a_trainer_checkpoint_is_clean(tmp_path: Path) -> None:
    ck = make_checkpoint(tmp_path / "run" / "checkpoint-4")
    path = _torchscript(ck / "model_scripted.pt")
    names = zipfile.ZipFile(path).namelist()
    assert any("/code/" in n and n.endswith(".py") for n in names) and any(n.endswith("constants.pkl") for n in names)
    assert any(i.compress_type != 0 for i in zipfile.ZipFile(path).infolist())  # torch.jit.save deflates code/
    with pytest.warns(UserWarning, match="TorchScript archive dispatching to 'torch.jit.load'"):
        loaded = torch.load(path, weights_only=False)  # the real loader: torch.load hands it to torch.jit.load
    assert isinstance(loaded, torch.jit.ScriptModule)
    assert _security(tmp_path / "run") == []


def test_torchscript_names_are_the_archives_own_only_in_a_torchscript_archive(tmp_path: Path) -> None:
    """The same `__torch__` global in a torch.save zip (no `constants.pkl`: torch.load unpickles it with Python) is
    a name no package proves: CKD601."""
    body = _p2(_g("__torch__.torch.nn.modules.linear", "Linear") + b")\x81}b")
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "model.pt").write_bytes(_torch_zip(body))
    assert any("__torch__.torch.nn.modules.linear.Linear" in f for f in _security(tmp_path / "ck"))


def test_a_payload_in_a_torchscript_archive_is_still_flagged(tmp_path: Path) -> None:
    path = _torchscript(tmp_path / "model.pt")
    with zipfile.ZipFile(path) as z:
        records = {i.filename: z.read(i) for i in z.infolist()}
    prefix = next(iter(records)).split("/", 1)[0]
    records[f"{prefix}/constants.pkl"] = _p2(b"cposix\nsystem\n" + _s("true") + b"\x85R")
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in records.items():
            z.writestr(name, data)
    path.write_bytes(out.getvalue())
    assert any("posix.system" in f and f.startswith("CKD601") for f in _security(tmp_path))


# joblib -----------------------------------------------------------------------------------------------------------

_JOBLIB = TESTS / "data" / "joblib" / "joblib-1.6.0-arrays.joblib"  # joblib.dump by 1.6.0
# of {"w": f32[3,4], "b": i64[3], "step": 4}


def _joblib_stream() -> bytes:
    """The committed joblib file without the array bytes joblib writes after each wrapper's BUILD (a padding length
    byte, that many bytes, then the array): what ``NumpyUnpickler`` reads as data, not opcodes."""
    import struct

    data = _JOBLIB.read_bytes()
    w = struct.pack("<12f", *range(12))
    b = struct.pack("<3q", 7, 8, 9)
    for raw in (w, b):
        at = data.index(raw)
        pad = next(n for n in range(16) if data[at - 1 - n] == n)
        data = data[: at - 1 - pad] + data[at + len(raw) :]
    return data


def test_joblibs_array_wrapper_rebuilt_as_joblib_dump_writes_it_is_data() -> None:
    assert _verdict(_joblib_stream()) == ((), ())


def test_a_real_joblib_file_scans_clean(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "state.joblib").write_bytes(_JOBLIB.read_bytes())
    assert _security(tmp_path / "ck") == []


@pytest.mark.skipif(not JOBLIB_LAYER.is_dir(), reason="the joblib layer is not installed")
def test_the_committed_joblib_file_loads_with_joblib() -> None:
    code = "import joblib, sys; v = joblib.load(sys.argv[1]); print(v['w'].shape, v['b'].tolist(), v['step'])"
    env = {**os.environ, "PYTHONPATH": str(JOBLIB_LAYER)}
    out = subprocess.run([sys.executable, "-c", code, str(_JOBLIB)], capture_output=True, text=True, env=env,
                         check=True, timeout=120)  # fmt: skip
    assert out.stdout.split() == ["(3,", "4)", "[7,", "8,", "9]", "4"]


@pytest.mark.parametrize(
    "body",
    [
        # the wrapper called with an argument
        _g("joblib.numpy_pickle", "NumpyArrayWrapper") + b"(K\x01tR",
        # rebuilt with a subclass joblib hands to numpy's _reconstruct (a call of it)
        _g("joblib.numpy_pickle", "NumpyArrayWrapper") + b")\x81}" + _s("subclass") + _g("collections", "Counter")
        + b"sb",
        # anything else of joblib: joblib.load reads another file
        _g("joblib", "load") + _s("x.pkl") + b"\x85R",
    ],
)  # fmt: skip
def test_the_rest_of_joblib_stays_an_error(body: bytes) -> None:
    assert _verdict(_p2(body))[0]


# Lightning --------------------------------------------------------------------------------------------------------

_LIGHTNING = STACKS / "lightning-2.6.6-namespace-hparams.ckpt"


def test_a_lightning_checkpoint_holding_a_namespace_is_clean(tmp_path: Path) -> None:
    """Lightning 2.6.6, ``save_hyperparameters()`` of a module taking ``args: argparse.Namespace``: the Namespace is
    NEWOBJ of no arguments + BUILD of its attributes. Lightning resumes it with ``weights_only=False``
    (``Trainer.fit(ckpt_path=..., weights_only=False)``); its default ``weights_only=True`` refuses the Namespace."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(_LIGHTNING.read_bytes())
    assert _security(tmp_path) == []


@pytest.mark.parametrize(
    "body",
    [
        _g("argparse", "Namespace") + b"(K\x01tR",  # a call with an argument (REDUCE)
        _g("argparse", "Namespace") + b"(K\x01t\x81",  # NEWOBJ with an argument
        _g("argparse", "ArgumentParser") + b")\x81}b",  # another class of the module, in the same shape
        _g("argparse", "Namespace") + b")\x81" + _s("a") + b"K\x01s",  # filled by SETITEM: a method call
    ],
)
def test_only_the_namespace_attribute_bag_shape_is_admitted(body: bytes) -> None:
    assert _verdict(_p2(body))[0]


# How the committed file was made (run by the Lightning venv): a 2-step fit, then the real loaders read it back.
_LIGHTNING_SCRIPT = r'''
import argparse, sys, os, warnings
warnings.simplefilter("ignore")
import torch
import lightning as L
from torch.utils.data import DataLoader, TensorDataset

class Model(L.LightningModule):
    def __init__(self, args: argparse.Namespace, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()  # every __init__ argument: ``args`` stays a Namespace inside hyper_parameters
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

out = sys.argv[1]
torch.manual_seed(0)
data = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
model = Model(argparse.Namespace(lr=0.1, batch_size=4, name="tiny"), lr=0.1)
trainer = L.Trainer(accelerator="cpu", max_steps=2, default_root_dir=out, logger=False, enable_progress_bar=False,
                    enable_model_summary=False)
trainer.fit(model, data)
path = os.path.join(out, "checkpoints")
ck = os.path.join(path, os.listdir(path)[0])
# the real loader: a resume from this checkpoint, and Lightning's own load_from_checkpoint
trainer2 = L.Trainer(accelerator="cpu", max_steps=3, default_root_dir=out, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False)
args = argparse.Namespace(lr=0.1, batch_size=4, name="tiny")
trainer2.fit(Model(args, lr=0.1), data, ckpt_path=ck, weights_only=False)
m = Model.load_from_checkpoint(ck, weights_only=False)
print("loaded", type(m.hparams), m.hparams)
'''


@pytest.mark.slow
@pytest.mark.skipif(not LIGHTNING_PYTHON.exists(), reason="the Lightning venv is not installed")
def test_lightning_writes_the_namespace_so_and_resumes_from_it(tmp_path: Path) -> None:
    out = subprocess.run([str(LIGHTNING_PYTHON), "-c", _LIGHTNING_SCRIPT, str(tmp_path / "out")], check=True,
                         timeout=600, capture_output=True, text=True)  # fmt: skip
    assert "Namespace(lr=0.1, batch_size=4, name='tiny')" in out.stdout  # resumed, and load_from_checkpoint read it
    assert _security(tmp_path / "out") == []
