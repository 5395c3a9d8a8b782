"""The pickle walker's tensor fast path gives exactly what the generic opcode loop gives, on real torch.save files
and on every truncation, byte change and limit around its runs."""

from __future__ import annotations

import os
import struct
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import GlobalRef, Opaque, TensorRef
from ckptdoctor.readers import pickle_runs, pickle_walk, read_file


@contextmanager
def _fast_path(on: bool) -> Iterator[None]:
    saved = pickle_walk._FAST_PATH
    pickle_walk._FAST_PATH = on
    try:
        yield
    finally:
        pickle_walk._FAST_PATH = saved


class _Loads:
    """A persistent_load that records every pid it is given, in order, and answers like torchzip's storages."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def __call__(self, pid: Any) -> Any:
        self.seen.append(pid)
        if type(pid) is tuple and len(pid) == 5 and type(pid[4]) is int and type(pid[2]) is str:
            return TensorRef("F32", (pid[4],), (1,), 0, pid[2], pid[4], str(pid[3]), None)
        return Opaque(None, (pid,))


def _walk(data: bytes, fast: bool, limits: Limits = DEFAULT_LIMITS, with_loads: bool = True) -> tuple[str, ...]:
    """Everything a walk shows (facts, problems, end offset, persistent_load's calls) as comparable text.

    repr, not ==: it also compares dict order, and NaN floats a byte change may create compare equal in it.
    """
    loads = _Loads() if with_loads else None
    with _fast_path(fast):
        facts, problems, end = pickle_walk.walk_pickle(data, limits=limits, persistent_load=loads)
    return repr(facts), repr(problems), str(end), repr(loads.seen if loads else None)


def _same(data: bytes, limits: Limits = DEFAULT_LIMITS, with_loads: bool = True) -> tuple[str, ...]:
    fast = _walk(data, True, limits, with_loads)
    generic = _walk(data, False, limits, with_loads)
    assert fast == generic
    return fast


@contextmanager
def _counting_runs() -> Iterator[list[int]]:
    """Counts the tensor runs the fast path took (so a test knows it exercised it)."""
    taken: list[int] = []
    real = pickle_walk.parse_run

    def spy(*args: Any) -> Any:
        run = real(*args)
        if run is not None:
            taken.append(args[1])
        return run

    pickle_walk.parse_run = spy  # type: ignore[assignment]
    try:
        yield taken
    finally:
        pickle_walk.parse_run = real  # type: ignore[assignment]


def _saved(obj: Any, path: Path) -> bytes:
    """torch.save ``obj`` to ``path`` and return its data.pkl."""
    torch.save(obj, path)
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def _adamw_state(n_params: int) -> dict[str, Any]:
    params = [torch.nn.Parameter(torch.randn(1)) for _ in range(n_params)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    sum(p.sum() for p in params).backward()  # type: ignore[union-attr]
    opt.step()
    return opt.state_dict()


def _sgd_state(model: torch.nn.Module) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return opt.state_dict()


def _memo_top(data: bytes) -> int:
    """The largest LONG_BINPUT index in a torch stream (they are written in increasing order: the last one)."""
    at = data.rfind(b"r", 0, len(data) - 8)
    while at > 0:
        if data[at - 1] in (0x52, 0x74, 0x51, 0x86, 0x85, 0x87, 0x29):
            return int(struct.unpack_from("<I", data, at + 1)[0])
        at = data.rfind(b"r", 0, at)
    return 0


# ---------------------------------------------------------------------------------------------------------------
# Real files


@pytest.fixture(scope="module")
def big_adamw(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """An AdamW state dict with memo indices past 65,535 (3 tensors and ~22 stores per parameter)."""
    return _saved(_adamw_state(3400), tmp_path_factory.mktemp("adamw") / "optimizer.pt")


def test_big_adamw_state_dict(big_adamw: bytes) -> None:
    assert _memo_top(big_adamw) > 65_535
    with _counting_runs() as taken:
        _same(big_adamw)
    assert len(taken) >= 3 * 3400 - 2  # all but the first tensor of each storage type


def test_sgd_momentum_state_dict(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    data = _saved(_sgd_state(model), tmp_path / "optimizer.pt")
    with _counting_runs() as taken:
        _same(data)
        _same(data, with_loads=False)
    assert taken


def _every_dtype() -> dict[str, torch.Tensor]:
    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.uint16, torch.uint32,
              torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2]  # fmt: skip
    out: dict[str, torch.Tensor] = {}
    for dt in dtypes:
        for i in range(3):  # the 2nd and 3rd of a dtype read their storage class from the memo
            out[f"{dt}.{i}"] = torch.zeros(2, 3).to(dt)
    return out


def test_model_state_dicts_every_dtype_and_layout(tmp_path: Path) -> None:
    base = torch.arange(240, dtype=torch.float32)
    sd: dict[str, Any] = dict(_every_dtype())
    for d in range(7):  # 0-d ... 6-d
        sd[f"dim{d}"] = base[: 2 ** d].reshape((2,) * d) if d else base[0].clone()
    big = base.reshape(4, 5, 12)
    sd.update({
        "transposed": big.transpose(0, 2), "permuted": big.permute(2, 0, 1), "sliced": big[1:, 2:, ::3],
        "offset": base[7:19], "strided": base[::5], "shared_a": big[0], "shared_b": big[2, 1:],
        "expanded": torch.ones(1, 3).expand(4, 3), "grad": torch.ones(3, requires_grad=True),
        "param": torch.nn.Parameter(torch.ones(2, 2)), "frozen_param": torch.nn.Parameter(torch.ones(2), False),
        "empty": torch.zeros(0, 3), "big_dim": torch.zeros(70000), "neg_free": torch.zeros(300, 300)[:, 299],
    })  # fmt: skip
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))
    sd["model"] = model.state_dict()  # an OrderedDict with _metadata (BUILD)
    data = _saved(sd, tmp_path / "model.pt")
    with _counting_runs() as taken:
        fast = _same(data)
        _same(data, with_loads=False)
    assert len(taken) > 40
    assert "_rebuild_parameter" in fast[0] and "_rebuild_tensor_v3" in fast[0]


def test_reader_outcome_identical(tmp_path: Path) -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(60)])  # memo past 255
    path = tmp_path / "optimizer.pt"
    torch.save(_sgd_state(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))), path)
    paths = [path, tmp_path / "model.pt"]
    torch.save(model.state_dict(), paths[1])
    for p in paths:
        outcomes = []
        for fast in (True, False):
            with _fast_path(fast):
                outcomes.append(repr(read_file(str(p), p.name, os.stat(p))))
        assert outcomes[0] == outcomes[1]


def test_numel_past_32_bits(tmp_path: Path) -> None:
    """torch writes numel >= 2**31 as LONG1; derive such a stream from a real one by re-encoding a BININT."""
    data = _saved({f"t{i}": torch.zeros(5, 7) for i in range(4)}, tmp_path / "m.pt")
    numel = b"J" + struct.pack("<i", 35)
    assert data.count(b"K\x23t") == 4  # BININT1 35 then TUPLE closes each pid
    for value in (2**31, 2**40 + 3, 2**63 - 1):
        raw = value.to_bytes(9, "little", signed=True).rstrip(b"\x00")
        patched = data.replace(b"K\x23t", b"\x8a" + bytes([len(raw)]) + raw + b"t")
        with _counting_runs() as taken:
            fast = _same(patched)
        assert len(taken) == 3 and str(value) in fast[0]
        _same(data.replace(b"K\x23t", numel + b"t"))


# ---------------------------------------------------------------------------------------------------------------
# Damaged streams and limits around the runs


@pytest.fixture(scope="module")
def streams(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """Two state dicts: one whose runs cross memo index 255 (BINPUT -> LONG_BINPUT), one that reads everything
    (``_rebuild_tensor_v2`` included) with LONG_BINGET because 300 strings were stored first."""
    sd: dict[str, Any] = {f"layer{i}.weight": torch.zeros(3, 2).t() if i % 3 else torch.zeros(4) for i in range(45)}
    sd["grad"] = torch.ones(2, requires_grad=True)
    tmp = tmp_path_factory.mktemp("small")
    long_sd = {"names": [f"n{i}" for i in range(300)], **dict(list(sd.items())[-6:])}
    return [_saved(sd, tmp / "a.pt"), _saved(long_sd, tmp / "b.pt")]


def _windows(data: bytes) -> list[range]:
    """Byte ranges over whole runs (and the opcodes around them): the 2nd tensor's, and the two on either side of
    the first LONG_BINPUT (when the stream has a run with BINPUTs only)."""
    starts = [i for i in range(len(data) - 4) if data[i + 2 : i + 4] == b"((" and data[i] == 0x68]
    starts += [i for i in range(len(data) - 7) if data[i + 5 : i + 7] == b"((" and data[i] == 0x6A]
    starts.sort()
    first_long = next(i for i, s in enumerate(starts) if b"tr" in data[s : starts[i + 1]])  # TUPLE LONG_BINPUT
    windows = [range(starts[0] - 3, starts[1] + 6)]
    if first_long >= 2:
        windows.append(range(starts[first_long - 1], starts[first_long + 1] + 6))
    return windows


def test_every_truncation(streams: list[bytes]) -> None:
    for data in streams:
        for window in _windows(data):
            for cut in window:
                _same(data[:cut])


# Bytes that change one opcode of a run into another it could hold (or into STOP / an unknown opcode).
_REPLACEMENTS = (0x00, 0xFF, 0x28, 0x29, 0x4A, 0x68, 0x6A, 0x71, 0x72, 0x74, 0x86, 0x8A)


def test_every_byte_replaced(streams: list[bytes]) -> None:
    for stream in streams:
        data = bytearray(stream)
        for window in _windows(stream):
            for at in window:
                old = data[at]
                for new in {*_REPLACEMENTS, old ^ 0x01, (old + 1) & 0xFF}:
                    data[at] = new
                    _same(bytes(data))
                data[at] = old


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4))
def test_random_edits(streams: list[bytes], edits: list[tuple[int, int]]) -> None:
    data = bytearray(streams[0])
    window = _windows(streams[0])[1]
    for at, value in edits:
        data[window.start + at % len(window)] = value
    _same(bytes(data))


def test_limits_tripping_inside_runs(streams: list[bytes]) -> None:
    for data in streams:
        total = _same(data)
        opcodes = int(total[0].split("opcodes=")[1].split(",")[0])
        for max_ops in [*range(1, 120), *range(opcodes - 80, opcodes + 2)]:
            _same(data, Limits(pickle_opcodes=max_ops))
        for memo in range(0, 370):
            _same(data, Limits(pickle_memo_entries=memo))
        for depth in range(0, 6):
            _same(data, Limits(nesting_depth=depth))


def test_hand_made_runs_without_stores() -> None:
    """A run with no BINPUT at all, built from pickle's own opcodes around a real torch run."""
    rebuild = b"ctorch._utils\n_rebuild_tensor_v2\nq\x00"
    head = b"\x80\x02(" + rebuild + b"ccollections\nOrderedDict\nq\x01" + b"X\x07\x00\x00\x00storageq\x02"
    head += b"ctorch\nFloatStorage\nq\x03X\x03\x00\x00\x00cpuq\x04"
    run = b"h\x00((h\x02h\x03X\x01\x00\x00\x00%dh\x04K\x06tQK\x00K\x02K\x03\x86K\x03K\x01\x86\x89h\x01)RtR"
    body = b"".join(run.replace(b"%d", str(i).encode()) for i in range(4))
    data = head + body + b"l."
    with _counting_runs() as taken:
        fast = _same(data)
    assert len(taken) == 4 and fast[1] == "()"


def test_runs_reading_their_own_stores_fall_back() -> None:
    """A BINGET of an index the same run stored is left to the generic loop (and still agrees)."""
    rebuild = b"ctorch._utils\n_rebuild_tensor_v2\nq\x00ccollections\nOrderedDict\nq\x01"
    run = b"h\x00((X\x01\x00\x00\x00aq\x05h\x05X\x01\x00\x00\x00kh\x05K\x01tQK\x00)q\x06h\x06\x89h\x01)RtR."
    with _counting_runs() as taken:
        _same(b"\x80\x02" + rebuild + run)
    assert not taken


def test_persistent_load_errors_report_the_same_opcode(streams: list[bytes]) -> None:
    """An exception from persistent_load surfaces with the same opcode, byte and count on both paths."""
    calls = 0

    def fail_third(pid: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise ValueError("boom")
        return pid

    outs = []
    for fast in (True, False):
        calls = 0
        with _fast_path(fast):
            outs.append(repr(pickle_walk.walk_pickle(streams[0], persistent_load=fail_third)))
    assert outs[0] == outs[1] and "BINPERSID" in outs[0]


def test_globals_order_and_calls(tmp_path: Path) -> None:
    data = _saved({"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.int8), "c": torch.zeros(3)}, tmp_path / "x")
    with _fast_path(True):
        facts = pickle_walk.walk_pickle(data)[0]
    assert facts is not None
    assert facts.calls[0] == GlobalRef("collections", "OrderedDict")
    assert GlobalRef("torch._utils", "_rebuild_tensor_v2") in facts.calls



# ---------------------------------------------------------------------------------------------------------------
# The run cache (pickle_runs._RUN_CACHE): runs met again at the same offset are looked up, not parsed


@contextmanager
def _counting_parses() -> Iterator[list[int]]:
    """Counts the runs actually parsed (cache misses)."""
    parsed: list[int] = []
    real = pickle_runs._parse_run_unchecked

    def spy(data: bytes, p: int, *rest: Any) -> Any:
        parsed.append(p)
        return real(data, p, *rest)

    pickle_runs._parse_run_unchecked = spy  # type: ignore[assignment]
    try:
        yield parsed
    finally:
        pickle_runs._parse_run_unchecked = real  # type: ignore[assignment]


def _stepped_states(tmp_path: Path) -> list[bytes]:
    """One optimizer's state at three steps of a linear LR schedule, as a Trainer writes them to optimizer.pt:
    the state part is pickled with the same bytes, the param_groups (lr) differ."""
    model = torch.nn.Sequential(*(torch.nn.Linear(3, 3) for _ in range(20)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / 10)
    out = []
    for step in range(3):
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        sched.step()
        out.append(_saved(opt.state_dict(), tmp_path / f"checkpoint-{step}.pt"))
    return out


def test_runs_of_the_next_checkpoint_come_from_the_cache(tmp_path: Path) -> None:
    states = _stepped_states(tmp_path)
    assert states[0] != states[1]  # the learning rate in param_groups differs
    pickle_runs._RUN_CACHE.clear()
    with _counting_parses() as parsed:
        first = _walk(states[0], True)
    assert len(parsed) >= 3 * 40 - 3  # step/exp_avg/exp_avg_sq of 40 parameters, but the first of each dtype
    for data in states[1:]:
        with _counting_parses() as parsed:
            assert _walk(data, True) == _walk(data, False)
        assert parsed == []  # every run was a cache hit
    assert first == _walk(states[0], False)


def test_a_cached_run_whose_memo_reads_differ_is_parsed_again(tmp_path: Path) -> None:
    """Same bytes at the same offsets, but the storage class the runs read from the memo is another one."""
    data = _stepped_states(tmp_path)[0]
    other = data.replace(b"torch\nFloatStorage\n", b"torch\nShortStorage\n")  # same length: same offsets
    assert other != data and len(other) == len(data)
    pickle_runs._RUN_CACHE.clear()
    _walk(data, True)  # fills the cache
    with _counting_parses() as parsed:
        assert _walk(other, True) == _walk(other, False)
    assert parsed  # the memo read of the storage class no longer matched: parsed, not replayed
    assert "ShortStorage" in _walk(other, True)[3]  # what persistent_load was handed


def test_the_cache_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pickle_runs, "_RUN_CACHE_ENTRIES", 5)
    pickle_runs._RUN_CACHE.clear()
    data = _stepped_states(tmp_path)[0]
    assert _walk(data, True) == _walk(data, False)
    assert len(pickle_runs._RUN_CACHE) <= 5


def test_whole_files_of_consecutive_checkpoints_read_the_same(tmp_path: Path) -> None:
    """Through the torch reader (interned storages, so replays reuse the tensor rebuilt last time) the facts of
    each checkpoint's optimizer.pt equal the generic walk's, read in any order and again."""
    _stepped_states(tmp_path)
    paths = sorted(tmp_path.glob("checkpoint-*.pt"))
    pickle_runs._RUN_CACHE.clear()
    for p in [*paths, *reversed(paths)]:
        with _fast_path(True):
            fast = repr(read_file(str(p), p.name, os.stat(p)))
        with _fast_path(False):
            generic = repr(read_file(str(p), p.name, os.stat(p)))
        assert fast == generic


def test_the_passed_values_budget_runs_out_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replayed run takes off the budget of values handed to calls what the generic loop's REDUCE does, so the
    walk records PAST_BUDGET at the same call on both paths, whatever budget is left (0-d tensors' shape and
    stride are one ``()``)."""
    sd: dict[str, Any] = {f"t{i}": torch.zeros(2, 3) for i in range(200)}
    sd["scalars"] = [torch.zeros(()) for _ in range(5)]
    sd["wide"] = torch.zeros(2, 1, 3, 1)
    data = _saved(sd, tmp_path / "m.pt")
    for budget in range(0, 3200, 3):
        monkeypatch.setattr(pickle_walk, "_PASSED_VALUES", budget)
        left = []
        for fast in (True, False):
            with _fast_path(fast):
                walker = pickle_walk._Walker(data, DEFAULT_LIMITS, _Loads(), 0)
                left.append((repr(pickle_walk._finish(walker)), walker.passed_budget))
        assert left[0] == left[1]
