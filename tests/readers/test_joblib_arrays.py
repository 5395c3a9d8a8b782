"""``joblib.dump`` writes each numpy array's bytes inside the pickle stream, right after the BUILD of its
``NumpyArrayWrapper`` (joblib/numpy_pickle.py, ``NumpyArrayWrapper.write_array`` / ``read_array``): the walker reads
them as ``joblib.load`` does (data, or a nested pickle for an object array), so real joblib files scan clean, while
a payload in an object array's nested pickle, or in array bytes that ``pickle.load`` reads as opcodes, stays
flagged (issue 22, item 6)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptdoctor.readers.pickle_walk import walk_pickle
from ckptdoctor.scanner import scan

JOBLIB_LAYER = Path("/work/stacks/joblib")  # pip install --no-deps --target /work/stacks/joblib joblib==1.6.0

pytestmark = pytest.mark.skipif(not (JOBLIB_LAYER / "joblib").is_dir(), reason="the joblib layer is not installed")


def _env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(JOBLIB_LAYER), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def _run(code: str, *args: str) -> None:
    subprocess.run([sys.executable, "-c", code, *args], check=True, env=_env(), timeout=120, capture_output=True)


def _security(root: Path) -> list[str]:
    return [f"{f.rule} {f.path}: {f.message}" for f in scan(str(root)).findings if f.rule.startswith("CKD6")]


# Arrays of every layout read_array takes: numeric (C and Fortran order, empty, 0-d, bool, complex), flexible
# (unicode, bytes, structured, datetime) and object (a nested pickle).
_DUMP = r"""
import sys, joblib, numpy as np
arrays = {
    "w": np.arange(12, dtype="f4").reshape(3, 4), "i": np.array([7, 8, 9]), "f": np.asfortranarray(np.ones((2, 3))),
    "e": np.zeros((0, 3)), "s": np.array(3.5), "b": np.array([True, False]), "c": np.array([1 + 2j]),
    "u": np.array(["ab", "c"]), "y": np.array([b"xyz"]), "r": np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")]),
    "t": np.array(["2020-01-01"], dtype="M8[D]"), "o": np.array(["a", 1, None, (2, 3), {"k": [1.5]}], dtype=object),
    "step": 4,
}
for name, compress in [("plain.joblib", 0), ("z.joblib", 3), ("default.pkl.z", True), ("lz.joblib", ("lzma", 3))]:
    joblib.dump(arrays, sys.argv[1] + "/" + name, compress=compress)
    back = joblib.load(sys.argv[1] + "/" + name)
    assert back["w"].tolist() == arrays["w"].tolist() and back["o"][4] == {"k": [1.5]}
"""


def test_real_joblib_dumps_of_numeric_and_object_arrays_scan_clean(tmp_path: Path) -> None:
    ck = tmp_path / "run" / "checkpoint-1"
    ck.mkdir(parents=True)
    _run(_DUMP, str(ck))
    assert len(list(ck.iterdir())) == 4
    assert _security(tmp_path / "run") == []


# A payload inside an object array: joblib pickles the array with pickle.dump(protocol=5) after its wrapper, and
# joblib.load unpickles that nested stream (``read_array``), running the call.
_EVIL_OBJECTS = r"""
import os, sys, joblib, numpy as np
class Touch:
    def __reduce__(self):
        return os.system, ("touch " + sys.argv[2],)
joblib.dump({"w": np.ones(3), "o": np.array(["x", Touch()], dtype=object)}, sys.argv[1])  # zlib, joblib's default
"""

_LOAD = "import sys, joblib; joblib.load(sys.argv[1])"


def test_a_payload_in_an_object_arrays_nested_pickle_is_live_and_flagged(tmp_path: Path) -> None:
    ck = tmp_path / "run" / "checkpoint-1"
    ck.mkdir(parents=True)
    path, canary = ck / "model.joblib", tmp_path / "canary"
    _run(_EVIL_OBJECTS + "\nimport os; assert not os.path.exists(sys.argv[2])", str(path), str(canary))
    # compress=3: joblib's default codec (zlib) since dump was called with a compress level
    _run(_EVIL_OBJECTS.replace("sys.argv[1])", "sys.argv[1], compress=3)"), str(ck / "z.joblib"), str(canary))
    found = _security(tmp_path / "run")
    assert len([f for f in found if f.startswith("CKD601") and "system" in f]) == 2, found
    assert not canary.exists()  # the scan never ran it
    _run(_LOAD, str(ck / "z.joblib"))
    assert canary.exists()  # joblib.load does


def _wrapper(shape: int, alignment: bytes, dtype: bytes = b"U\x02u1") -> bytes:
    """A protocol 2 stream's head: a NumpyArrayWrapper NEWOBJ'd and BUILT as ``joblib.dump`` writes it (unframed)."""
    flags = b"K?" if dtype.endswith(b"O8") else b"K\x00"
    return (
        b"\x80\x02cjoblib.numpy_pickle\nNumpyArrayWrapper\n)\x81}(U\x08subclasscnumpy\nndarray\n"
        b"U\x05shapeK" + bytes([shape]) + b"\x85U\x05orderU\x01CU\x05dtypecnumpy\ndtype\n" + dtype
        + b"\x89\x88\x87R(K\x03U\x01|NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xff" + flags + b"tbU\nallow_mmap\x89"
        + alignment + b"ub"
    )  # fmt: skip


def _touch(canary: Path) -> bytes:
    return b"cos\nsystem\n(S'touch " + str(canary).encode() + b"'\ntR."


def test_array_bytes_pickle_load_reads_as_opcodes_stay_flagged(tmp_path: Path) -> None:
    """Without an alignment (``numpy_array_alignment_bytes`` absent) no padding byte precedes the array: a uint8 array
    whose bytes are a call is data for joblib.load, and that call for pickle.load, which reads the same file."""
    canary = tmp_path / "canary"
    payload = _touch(canary)
    data = _wrapper(len(payload), b"") + payload + b"."
    facts, problems, _ = walk_pickle(data, joblib=True)
    assert facts is not None and problems == () and all(g.name != "system" for g in facts.globals)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "state.pkl").write_bytes(data)
    found = _security(tmp_path / "ck")
    assert any(f.startswith("CKD601") and "system" in f for f in found), found
    assert not canary.exists()
    _run("import pickle, sys; pickle.load(open(sys.argv[1], 'rb'))", str(tmp_path / "ck" / "state.pkl"))
    assert canary.exists()


def test_the_array_bytes_are_read_within_bounds_or_the_walk_says_so() -> None:
    padded = b"U\x1bnumpy_array_alignment_bytesK\x10"
    ok = _wrapper(3, padded) + b"\x02\xff\xff" + b"abc" + b"."
    assert walk_pickle(ok, joblib=True)[1] == ()
    in_frame = _wrapper(3, b"")[2:] + b"NNN."  # joblib.load reads the array from the file past the frame
    for bad in (
        b"\x80\x04\x95" + len(in_frame).to_bytes(8, "little") + in_frame,
        _wrapper(200, padded) + b"\x02\xff\xff" + b"abc" + b".",  # the array runs past the end
        _wrapper(3, padded, b"U\x02q9") + b"\x02\xff\xff" + b"abc" + b".",  # a type numpy has not
        # objects, yet mmap allowed: joblib.load(mmap_mode="r") maps 8 bytes where the default load unpickles
        _wrapper(1, b"U\nallow_mmap\x88", b"U\x02O8") + b"\x80\x05N." + b"\x00" * 8 + b".",
    ):
        assert walk_pickle(bad, joblib=True)[1], bad
    # an object dtype: the nested pickle is walked, and what it calls counts for the stream
    nested = _wrapper(1, padded, b"U\x02O8") + b"\x80\x05cos\nsystem\nX\x01\x00\x00\x00x\x85R." + b"."
    facts, problems, _ = walk_pickle(nested, joblib=True)
    assert problems == () and facts is not None and any(g.name == "system" for g in facts.calls)
