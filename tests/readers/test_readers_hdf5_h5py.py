"""The `.h5` dataset check through h5py (the ``h5`` extra), on the real Keras / TFTrainer samples in tests/data/tf
and damaged copies of them. Skipped when h5py is not installed; without it the superblock check alone runs
(tests/readers/test_readers_mindspore_tf.py)."""

from __future__ import annotations

import io
import json
import math
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptdoctor.cli import main
from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import Hdf5Dataset, Hdf5Facts, ProblemKind, ReadOutcome
from ckptdoctor.readers.hdf5 import read_hdf5
from tests.helpers.paths import REPO, TESTS

h5py = pytest.importorskip("h5py", reason="h5py is not installed (pip install 'ckptdoctor[h5]')")

TF = TESTS / "data" / "tf"
TF_MODEL = TF / "tf-trainer" / "tf_model.h5"  # transformers' TFTrainer-era save (Keras 3, model_weights/...)
KERAS = TF / "keras-weights" / "model.weights.h5"  # Keras 3 `save_weights` (layers/<name>/vars/<i>)


def _read(data: bytes, limits: Limits = DEFAULT_LIMITS) -> ReadOutcome:
    return read_hdf5(io.BytesIO(data), len(data), limits)


def _datasets(path: Path) -> tuple[Hdf5Dataset, ...]:
    outcome = _read(path.read_bytes())
    assert outcome.problems == ()
    assert isinstance(outcome.content, Hdf5Facts) and outcome.content.datasets is not None
    return outcome.content.datasets


@pytest.mark.parametrize("path", [TF_MODEL, KERAS], ids=["tf", "keras"])
def test_datasets_of_the_real_samples_match_h5py(path: Path) -> None:
    with h5py.File(path, "r") as h5:  # the library's own view, data never read
        names: list[str] = []
        h5.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
        want = {n: (str(h5[n].dtype), h5[n].shape, h5[n].id.get_offset()) for n in names}
    got = {d.name: (d.dtype, d.shape, d.offset) for d in _datasets(path)}
    assert got == want and len(got) == 4
    assert {d.name: d.shape for d in _datasets(KERAS)}["layers/dense/vars/0"] == (8, 16)
    assert all(d.layout == "contiguous" and d.storage_bytes == 4 * math.prod(d.shape) for d in _datasets(TF_MODEL))


def _eof(data: bytearray, size: int) -> None:
    data[40:48] = size.to_bytes(8, "little")  # version 0 superblock: the end-of-file address


def test_bytes_cut_inside_the_datasets_while_the_eof_address_matches() -> None:
    for path in (TF_MODEL, KERAS):
        data = path.read_bytes()
        last = max((d.offset or 0) + d.storage_bytes for d in _datasets(path))
        cut = bytearray(data[: last - 8])
        _eof(cut, len(cut))  # the superblock now agrees with the file: only the h5py walk sees the damage
        outcome = _read(bytes(cut))
        assert outcome.problems and all(p.kind is ProblemKind.MALFORMED for p in outcome.problems), outcome
        assert "cannot" in outcome.problems[0].message


def test_corrupt_object_header_names_the_dataset() -> None:
    data = bytearray(KERAS.read_bytes())
    with h5py.File(KERAS, "r") as h5:
        at = h5py.h5o.get_info(h5["layers/dense/vars/0"].id).addr
    data[at] = 7  # object header version 1 -> 7
    outcome = _read(bytes(data))
    (p,) = outcome.problems
    assert "`layers/dense/vars/0`" in p.message and "object header" in p.message
    assert isinstance(outcome.content, Hdf5Facts) and outcome.content.datasets is not None
    assert len(outcome.content.datasets) == 3  # the other datasets are still listed


def test_layout_address_past_the_end() -> None:
    data = bytearray(TF_MODEL.read_bytes())
    layout = struct.pack("<QQ", 10304, 512)  # the kernel's contiguous layout message: address, size
    assert data.count(layout) == 1
    at = data.find(layout)
    data[at : at + 8] = struct.pack("<Q", len(data) - 100)
    (p,) = _read(bytes(data)).problems
    assert "model_weights/dense/sequential/dense/kernel" in p.message


def test_object_limit() -> None:
    outcome = _read(KERAS.read_bytes(), Limits(hdf5_objects=2))
    assert [p.kind for p in outcome.problems] == [ProblemKind.LIMIT]


def _scan(root: Path) -> tuple[int, dict[str, Any]]:
    result = CliRunner().invoke(main, ["scan", str(root), "--format", "json", "--no-config"])
    return result.exit_code, json.loads(result.output)


def test_scan_reports_a_damaged_dataset_at_the_file(tmp_path: Path) -> None:
    root = tmp_path / "tf-trainer"
    shutil.copytree(TF / "tf-trainer", root)
    assert _scan(root)[0] == 0
    h5 = root / "tf_model.h5"
    data = bytearray(h5.read_bytes())
    with h5py.File(TF_MODEL, "r") as f:
        at = h5py.h5o.get_info(f["model_weights/dense/sequential/dense/kernel"].id).addr
    data[at] = 7
    h5.write_bytes(bytes(data))
    code, doc = _scan(root)
    hits = [(f["rule"], f["path"]) for f in doc["findings"] if f["severity"] != "info"]
    assert code == 1 and hits == [("CKD215", "tf_model.h5")]
    assert "model_weights/dense/sequential/dense/kernel" in doc["findings"][0]["message"]


def test_inspect_lists_the_datasets() -> None:
    result = CliRunner().invoke(main, ["inspect", str(KERAS)])
    assert result.exit_code == 0
    assert "layers/dense/vars/0" in result.output and "float32" in result.output and "8x16" in result.output
    doc = json.loads(CliRunner().invoke(main, ["inspect", str(KERAS), "--format", "json"]).output)
    assert {t["name"] for t in doc["tensors"]} == {"layers/dense/vars/0", "layers/dense/vars/1",
                                                   "layers/dense_1/vars/0", "layers/dense_1/vars/1"}


def test_h5py_only_for_h5_files() -> None:
    code = (
        "import sys; from ckptdoctor.cli import main\n"
        "try: main(['scan', sys.argv[1], '--no-config'])\n"
        "except SystemExit: pass\n"
        "assert 'h5py' not in sys.modules and 'numpy' not in sys.modules, 'imported'\n"
    )
    other = REPO / "fixtures" / "stub-shadow"
    run = subprocess.run([sys.executable, "-c", code, str(other)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(flips=st.lists(st.tuples(st.integers(0, 17207), st.integers(0, 255)), min_size=1, max_size=4))
def test_never_raises_on_flipped_bytes(flips: list[tuple[int, int]]) -> None:
    data = bytearray(TF_MODEL.read_bytes())
    for at, value in flips:
        data[max(at, 96)] = value  # past the superblock, so that h5py opens the file
    outcome = _read(bytes(data))
    assert outcome.content is not None or outcome.problems
