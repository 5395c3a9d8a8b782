"""Equal values the pickle walks of a run's checkpoints rebuild are handed out as one object (``pickle_values.shared``,
the walk's tensors, ``torchstore.storage_tensors`` by parts), and sharing never changes what is read."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ckptdoctor.model import FileFacts, Opaque, TensorRef
from ckptdoctor.readers import pickle_values, pickle_walk, read_file, torchstore
from ckptdoctor.readers.pickle_values import shared
from ckptdoctor.readers.torchstore import storage_tensors

torch = pytest.importorskip("torch")


def _forget() -> None:
    """Empty the memos that make objects shared (as a fresh process starts)."""
    for memo in (pickle_values._SHARED, pickle_walk._TENSORS, torchstore._PARTS):
        memo.clear()


def _checkpoints(tmp_path: Path) -> list[Path]:
    """A real AdamW state saved after each of four steps, with the learning rate changed between them (as a
    schedule does): the state's bytes repeat, the param_groups differ."""
    params = [torch.nn.Parameter(torch.randn(8, 8)) for _ in range(5)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    out = []
    for step in range(4):
        torch.stack([p.sum() for p in params]).sum().backward()
        opt.step()
        for group in opt.param_groups:
            group["lr"] = 1e-3 / (step + 2)
        path = tmp_path / f"checkpoint-{step}" / "optimizer.pt"
        path.parent.mkdir()
        torch.save(opt.state_dict(), path)
        out.append(path)
    return out


def _read(path: Path) -> FileFacts:
    return read_file(str(path), f"{path.parent.name}/{path.name}", os.stat(path))


def test_a_runs_optimizer_states_share_their_state_and_tensor_listing(tmp_path: Path) -> None:
    paths = _checkpoints(tmp_path)
    _forget()
    facts = [_read(p) for p in paths]
    # the first stream of its kind registers nothing (nothing before it shares its values); the second does
    _, first, *later = (f.content for f in facts)
    for other in later:
        assert other.pickle.value["state"] is first.pickle.value["state"]
        assert other.pickle.value["param_groups"] != first.pickle.value["param_groups"]  # the learning rate
        assert all(a is b for a, b in zip(other.tensors, first.tensors, strict=True))
    # and each is what a fresh process reads
    for path, f in zip(paths, facts, strict=True):
        _forget()
        assert _read(path) == f


def _tensor(key: str, numel: int = 4, shape: tuple[int, ...] = (4,), offset: int = 0) -> TensorRef:
    return TensorRef("F32", shape, (1,) * len(shape), offset, key, numel, "cpu", numel * 4)


def _values() -> list[Any]:
    t0, t1, past = _tensor("0"), _tensor("1"), _tensor("2", numel=2, shape=(4,))
    inner = {"exp_avg": t0, "exp_avg_sq": t1}
    both = [inner, {"w": past}]
    return [
        {"state": {0: inner, 1: {"exp_avg": t1}}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
        {"a": both, "b": both},  # one container under two items: listed under the first only
        {"a": [inner], "b": {"x": inner}},  # a shared inner dict
        {"model": {"w": t0}, "optimizer": {"state": {0: {"m": t1, "bad": past}}}},
        {"w": t0, "b": t1},  # a flat state dict
        {"x": Opaque(None, (t0,), {"y": past})},
        {1: {"w": t0}, 2.5: [t1], None: (past,)},
        {f"k{i}": [past] for i in range(12)},  # more problems than are listed
        {"empty": {}, "scalars": [1, 2.0, "three"]},
    ]


@pytest.mark.parametrize("value", _values(), ids=range(len(_values())))
def test_the_listing_by_parts_is_the_whole_walks(value: Any) -> None:
    _forget()
    whole = torchstore._listed(value, "", None)
    assert storage_tensors(value) == whole
    again = storage_tensors(value)  # from the memo
    assert again == whole


def test_shared_containers_hold_the_same_objects_never_merely_equal_ones() -> None:
    _forget()
    a, b = {"k": 1}, {"k": True}
    assert shared(a, dict) is a
    assert shared(b, dict) is b  # 1 == True, yet another value
    z, nz = {0.0: "x"}, {-0.0: "x"}
    assert shared(z, dict) is z and shared(nz, dict) is nz  # float keys are never shared
    t = _tensor("0")
    first = [t, "".join(["a", "b"])]
    assert shared(first, list) is first
    assert shared([t, first[1]], list) is first  # the same objects
    other = [t, "".join(["a", "b"])]
    assert shared(other, list) is other  # an equal string, not the same one
    assert shared(tuple(first), tuple) is not first
