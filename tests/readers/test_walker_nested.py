"""Pickles inside pickles (issue 25 section 2, issue 22 item 5): found by the readers when a file is read, in the
values of every stream a loader unpickles from it, legacy ``torch.save`` blobs read with all five streams, and judged
without walking anything again; every bound is a finding.

Each payload is proved live under its real loader (``torch.load(weights_only=False)``, what
``torch.storage._load_from_bytes`` does, or ``pickle.loads`` of an ``_extra_state`` tensor's bytes as
TransformerEngine's ``set_extra_state`` does) in a subprocess, with a canary file."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptdoctor.model import PickleFacts, TorchFacts
from ckptdoctor.pickle_verdict.judge import file_pickle, judge
from ckptdoctor.readers import read_file
from ckptdoctor.readers.pickle_walk import BYTES_LOADER, walk_pickle
from ckptdoctor.scanner import scan

torch = pytest.importorskip("torch")

_MAGIC = 0x1950A86A20F9469CFC6C  # torch/serialization.py MAGIC_NUMBER


class _Touch:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {self.path}",)


class _LoadFromBytes:
    """Pickles as ``torch.storage._load_from_bytes(blob)``, as a plain ``pickle.dumps`` of a tensor writes it."""

    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    def __reduce__(self) -> tuple[Any, ...]:
        return torch.storage._load_from_bytes, (self.blob,)


def _legacy_with_payload(canary: Path, stream: int) -> bytes:
    """A legacy ``torch.save`` whose stream number ``stream`` (2: sys_info, 4: the storage keys) is a payload; the
    streams before it are genuine."""
    buf = io.BytesIO()
    torch.save(torch.ones(2), buf, _use_new_zipfile_serialization=False)
    genuine = buf.getvalue()
    streams = []
    pos = 0
    for _ in range(5):
        _, _, end = walk_pickle(genuine, start=pos)
        streams.append(genuine[pos:end])
        pos = end
    streams[stream] = pickle.dumps(_Touch(canary), protocol=2)
    return b"".join(streams) + genuine[pos:]


def _live(code: str, *args: str) -> None:
    subprocess.run([sys.executable, "-c", code, *args], timeout=120, capture_output=True)


def _unsafe(data: bytes) -> tuple[str, ...]:
    facts, _, _ = walk_pickle(data)
    assert facts is not None
    return judge(facts).unsafe


def _security(root: Path) -> list[str]:
    return [f"{f.rule} {f.path}: {f.message}" for f in scan(str(root)).findings if f.rule.startswith("CKD6")]


@pytest.mark.parametrize("stream", [2, 4])
def test_a_legacy_torch_blob_in_bytes_is_read_with_all_five_streams(tmp_path: Path, stream: int) -> None:
    canary = tmp_path / "canary"
    blob = _legacy_with_payload(canary, stream)
    _live("import sys, torch; torch.storage._load_from_bytes(open(sys.argv[1], 'rb').read())", _write(tmp_path, blob))
    assert canary.exists()  # torch.load runs every stream it reads, the later ones included
    assert any("system" in u for u in _unsafe(pickle.dumps({"blob": blob}, protocol=4)))
    assert any("system" in u for u in _unsafe(pickle.dumps(_LoadFromBytes(blob), protocol=4)))


def _write(tmp_path: Path, blob: bytes) -> str:
    path = tmp_path / "blob.bin"
    path.write_bytes(blob)
    return str(path)


def test_a_plainly_pickled_tensor_is_clean_and_its_storage_bytes_are_judged() -> None:
    """``pickle.dumps(tensor)`` hands each storage to ``_load_from_bytes`` as a legacy torch.save in literal bytes."""
    data = pickle.dumps({"scale": torch.ones(3), "history": torch.zeros(4, 2)})
    facts, _, _ = walk_pickle(data)
    assert facts is not None and BYTES_LOADER in facts.calls and len(facts.loads) == 2
    v = judge(facts)
    assert v.unsafe == () and v.nested == 2
    assert any(g == BYTES_LOADER.dotted for g, _ in v.admitted)


def test_load_from_bytes_is_admitted_only_where_its_bytes_were_read_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptdoctor.readers.nested as nested

    not_torch = pickle.dumps(_LoadFromBytes(b"\x80\x02K\x01." + b"\x00" * 8), protocol=4)
    assert any("_load_from_bytes" in u for u in _unsafe(not_torch))
    # handed something computed at load time (not literal bytes): what it loads is unknown
    computed = (b"\x80\x02ctorch.storage\n_load_from_bytes\nc_codecs\nencode\nX\x01\x00\x00\x00x"
                b"X\x06\x00\x00\x00latin1\x86R\x85R.")  # fmt: skip
    assert any("_load_from_bytes" in u for u in _unsafe(computed))
    # handed to another call: the callee may call it with anything
    handed = b"\x80\x02cbuiltins\nlist\nctorch.storage\n_load_from_bytes\n\x85\x85R."
    assert any("_load_from_bytes" in u for u in _unsafe(handed))
    # past the nested search's bound: the bytes are not read, the call is an error and the bound a finding
    monkeypatch.setattr(nested, "MAX_NESTED", 0)
    unsafe = _unsafe(pickle.dumps(torch.ones(3)))
    assert any("_load_from_bytes" in u for u in unsafe) and any("past the first 0" in u for u in unsafe)


def _save_extra_state(path: Path, inner: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = torch.frombuffer(bytearray(inner), dtype=torch.uint8)
    torch.save({"linear.weight": torch.zeros(2, 2), "linear._extra_state": extra}, path)


def test_pickles_nested_in_an_extra_state_streams_values_are_judged(tmp_path: Path) -> None:
    """The `_extra_state` pickle is another stream of the file: its values are searched too (they were not: only the
    main stream's value was)."""
    canary = tmp_path / "canary"
    inner = pickle.dumps({"extra_fp8_variables": {"blob": pickle.dumps(_Touch(canary))}})
    _save_extra_state(tmp_path / "run" / "checkpoint-1" / "model.pt", inner)
    _live("import pickle, sys; pickle.loads(pickle.loads(open(sys.argv[1], 'rb').read())['extra_fp8_variables']"
          "['blob'])", _write(tmp_path, inner))  # fmt: skip
    assert canary.exists()
    assert any(f.startswith("CKD601") and "system" in f for f in _security(tmp_path / "run"))


def test_a_class_handed_to_a_call_in_an_extra_stream_is_judged_by_that_streams_values(tmp_path: Path) -> None:
    """A dict key is hashed while the dict is built (a call of its type's ``__hash__``): a class proved by its source
    only is admitted when named, not when handed so, in whichever stream."""
    from torch.utils.benchmark import Timer

    _save_extra_state(tmp_path / "run" / "checkpoint-1" / "model.pt", pickle.dumps({Timer: 1}))
    assert any(f.startswith("CKD601") and "Timer" in f for f in _security(tmp_path / "run"))


def test_nested_pickles_are_found_when_the_file_is_read_and_not_walked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptdoctor.readers.nested as nested

    path = tmp_path / "state.pt"
    torch.save({"w": torch.zeros(1), "blob": pickle.dumps(_Touch(tmp_path / "canary"))}, path)
    facts = read_file(str(path), "state.pt", os.stat(path))
    assert isinstance(facts.content, TorchFacts) and facts.content.pickle is not None
    assert facts.content.pickle.nested is not None and len(facts.content.pickle.nested) == 1

    def no_walk(*_: object) -> None:
        raise AssertionError("the judge walked a nested pickle again")

    monkeypatch.setattr(nested, "_read_blob", no_walk)
    pf = file_pickle(facts)
    assert isinstance(pf, PickleFacts)
    v = judge(pf)
    assert v.nested == 1 and any("system" in u for u in v.unsafe)


def _bytes_tensor(data: bytes) -> Any:
    """What TransformerEngine's get_extra_state returns: the pickle's bytes as a uint8 tensor."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _save_format(fmt: str, folder: Path, state: dict[str, Any]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(state, folder / "model.safetensors")
    else:
        import warnings

        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # one process, no process group
            dcp.save(state, checkpoint_id=folder / "dcp")


# How each library hands the `_extra_state` record to set_extra_state, which unpickles its bytes.
_LOAD_EXTRA = {
    "safetensors": "from safetensors.torch import load_file; sd = load_file(sys.argv[1] + '/model.safetensors')",
    "dcp": "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
    "dcp_to_torch_save(sys.argv[1] + '/dcp', sys.argv[1] + '/sd.pt'); sd = torch.load(sys.argv[1] + '/sd.pt')",
}


@pytest.mark.parametrize("fmt", ["safetensors", "dcp"])
def test_an_extra_state_pickle_in_safetensors_and_dcp_data_is_judged(tmp_path: Path, fmt: str) -> None:
    """safetensors and `torch.distributed.checkpoint` hold an `_extra_state` uint8 tensor as any tensor; a module's
    ``load_state_dict`` hands it to ``set_extra_state``, which unpickles its bytes (TransformerEngine)."""
    canary = tmp_path / "canary"
    bad = tmp_path / "bad" / "checkpoint-1"
    payload = pickle.dumps({"recipe": None, "x": _Touch(canary)})
    _save_format(fmt, bad, {"linear.weight": torch.zeros(2, 2), "linear._extra_state": _bytes_tensor(payload)})
    _live(f"import pickle, sys, torch; {_LOAD_EXTRA[fmt]}; pickle.loads(sd['linear._extra_state'].numpy().tobytes())",
          str(bad))  # fmt: skip
    assert canary.exists()
    assert any(f.startswith("CKD601") and "system" in f for f in _security(tmp_path / "bad"))
    good = tmp_path / "good" / "checkpoint-1"
    clean = pickle.dumps({"scale_fwd": torch.ones(3), "extra_fp8_variables": {"num_gemms": 1}})
    _save_format(fmt, good, {"linear.weight": torch.zeros(2, 2), "linear._extra_state": _bytes_tensor(clean)})
    assert _security(tmp_path / "good") == []


def test_only_the_head_of_an_extra_state_record_is_read_unless_it_holds_a_pickle(tmp_path: Path) -> None:
    """A large `_extra_state` tensor that is no pickle is passed over on its head (no limit reached); a pickle past
    ``Limits.pickle_bytes`` is reported as not judged."""
    from safetensors.torch import save_file

    from ckptdoctor.limits import Limits

    small = Limits(pickle_bytes=4096)
    path = tmp_path / "model.safetensors"
    save_file({"a._extra_state": torch.zeros(1 << 20, dtype=torch.uint8)}, path)
    facts = read_file(str(path), path.name, os.stat(path), small)
    assert facts.problems == () and facts.alt_pickle is None
    big = pickle.dumps({"blob": b"x" * 10_000}, protocol=4)
    save_file({"a._extra_state": torch.frombuffer(bytearray(big), dtype=torch.uint8)}, path)
    facts = read_file(str(path), path.name, os.stat(path), small)
    assert any("not judged" in p.message for p in facts.problems)
