"""A pickle walk resumed from a snapshot of an earlier stream with the same leading bytes (``pickle_resume``) gives
exactly what a fresh walk gives: on real torch.save files of optimizers and models, on pickles of every protocol,
on every truncation, random byte edits and insertions after the resume point, on streams that diverge inside a
tensor run or a memo'd structure or change an earlier memo'd value, on limits that trip after the resume point,
and from several threads at once."""

from __future__ import annotations

import collections
import io
import os
import pickle
import pickletools
import random
import struct
import threading
import zipfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.readers import pickle_resume, pickle_walk, read_file
from ckptdoctor.readers.pickle_values import Obj, SetNode
from ckptdoctor.readers.torchstore import Storages
from tests.readers.test_pickle_fastpath import _Loads as _RecordingLoads


class _Loads(_RecordingLoads):
    """The fast-path tests' recording persistent_load, resumable: its record is its state."""

    def walk_state(self) -> Any:
        return list(self.seen)

    def walk_state_fits(self, state: Any) -> bool:
        return True

    def walk_restore(self, state: Any) -> None:
        self.seen = list(state)


Load = Callable[[], Any]


def _loads() -> _Loads:
    return _Loads()


def _no_load() -> None:
    return None


def _storages() -> Storages:
    return Storages(None, legacy=False)


def _show(facts: Any, load: Any) -> tuple[str, ...]:
    """Everything a walk shows, as comparable text (repr also compares dict order and NaNs)."""
    state = repr(load.walk_state()) if load is not None else ""
    return repr(facts[0]), repr(facts[1]), str(facts[2]), state


def _walk(data: bytes, resume: bool, limits: Limits = DEFAULT_LIMITS, load: Load = _loads) -> tuple[str, ...]:
    pl = load()
    saved = pickle_walk._RESUME
    pickle_walk._RESUME = resume
    try:
        return _show(pickle_walk.walk_pickle(data, limits=limits, persistent_load=pl), pl)
    finally:
        pickle_walk._RESUME = saved


def _fresh(data: bytes, limits: Limits = DEFAULT_LIMITS, load: Load = _loads) -> tuple[str, ...]:
    return _walk(data, False, limits, load)


def _learn(*streams: bytes, limits: Limits = DEFAULT_LIMITS, load: Load = _loads) -> pickle_resume.Snapshot | None:
    """Forget every stream, walk these (the second one takes a snapshot where it stops sharing the first's
    bytes); the newest snapshot kept."""
    pickle_resume.STREAMS.clear()
    for data in streams:
        assert _walk(data, True, limits, load) == _fresh(data, limits, load)
    stream = pickle_resume.STREAMS.get((0, streams[0][: pickle_resume.HEAD]))
    return stream.snapshots[0] if stream is not None and stream.snapshots else None


@contextmanager
def _counting() -> Iterator[dict[str, int]]:
    """Counts resumed walks and those that stopped because they would change a shared value."""
    counts = {"resumed": 0, "diverged": 0}
    real_from, real_touch = pickle_walk._Walker.__dict__["from_snapshot"], pickle_walk._Walker._touch

    def from_snapshot(cls: Any, *args: Any) -> Any:
        counts["resumed"] += 1
        return real_from.__func__(cls, *args)

    def touch(self: Any) -> None:
        if self.resumed:
            counts["diverged"] += 1
        real_touch(self)

    pickle_walk._Walker.from_snapshot = classmethod(from_snapshot)  # type: ignore[method-assign,assignment]
    pickle_walk._Walker._touch = touch  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        pickle_walk._Walker.from_snapshot = real_from  # type: ignore[method-assign]
        pickle_walk._Walker._touch = real_touch  # type: ignore[method-assign]


def _same(data: bytes, limits: Limits = DEFAULT_LIMITS, load: Load = _loads) -> tuple[str, ...]:
    """A walk with the snapshots learnt so far equals a fresh one; the snapshots are left as they were."""
    kept = {k: (v, v.last, v.snapshots) for k, v in pickle_resume.STREAMS._items.items()}
    got = _walk(data, True, limits, load)
    pickle_resume.STREAMS.clear()
    for k, (v, last, snapshots) in kept.items():
        v.last, v.snapshots = last, snapshots
        pickle_resume.STREAMS._items[k] = v
    assert got == _fresh(data, limits, load)
    return got


def _boundaries(data: bytes) -> list[int]:
    """Every opcode boundary of a stream, STOP's start the last."""
    return [at for _, _, at in pickletools.genops(data) if at is not None]


def _saved(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    with zipfile.ZipFile(buf) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def _optimizer_states(steps: int, layers: int = 30, width: int = 3, save_to: list[Path] | None = None) -> list[bytes]:
    """An AdamW state at successive steps of a decaying LR, as a Trainer's checkpoints hold it: the bytes are
    equal up to the learning rate in param_groups. ``save_to``: torch.save each step's state to these files too."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 - s / 100)
    out = []
    for step in range(steps):
        model(torch.randn(2, width)).sum().backward()
        opt.step()
        sched.step()
        out.append(_saved(opt.state_dict()))
        if save_to is not None:
            torch.save(opt.state_dict(), save_to[step])
    return out


@pytest.fixture(scope="module")
def optimizer_states() -> list[bytes]:
    states = _optimizer_states(4)
    assert len(states[0]) >= pickle_resume.MIN_BYTES and len({len(s) for s in states}) == 1
    return states


class _Thing:
    """An object pickled as NEWOBJ + BUILD (its class is only named in the stream)."""

    def __init__(self, i: int) -> None:
        self.i = i
        self.tags = {f"t{i}", "shared"}
        self.parts = [i, (i, "x"), {"k": i}]


class _Listish(list):  # type: ignore[type-arg]
    """A list subclass: APPENDS on an object the stream built."""


def _rich(n: int, tail: Any = None) -> dict[str, Any]:
    """A value with every kind of container, shared and recursive parts, and non-scalar dict keys."""
    shared_list: list[Any] = [1, 2.5, "s"]
    cyc: list[Any] = []
    cyc.append(cyc)
    cyc_d: dict[str, Any] = {}
    cyc_d["me"] = cyc_d
    items = []
    for i in range(n):
        items.append({
            "i": i, "f": i / 7, "b": bytes([i % 256]) * 3, "big": 2**70 + i, "neg": -i, "none": None,
            "t": (i, (i, [i]), shared_list), "set": {i, i + 1}, "fs": frozenset({"a", i}),
            (i, "k"): "tuple key", "obj": _Thing(i), "od": collections.OrderedDict([("a", i), ("b", [i])]),
            "sub": _Listish([i, {"x": i}]), "c": complex(i, 1), "cyc": cyc if i % 5 == 0 else cyc_d,
        })  # fmt: skip
    return {"items": items, "shared": shared_list, "tail": tail}


@pytest.fixture(scope="module", params=[0, 2, 4, 5])
def rich_streams(request: pytest.FixtureRequest) -> list[bytes]:
    """Pickles of one value at a protocol, that differ only at their end (as a checkpoint's lr does)."""
    proto = request.param
    out = [pickle.dumps(_rich(60, tail), protocol=proto) for tail in (0.001, 0.002, 0.003)]
    assert len(out[0]) >= pickle_resume.MIN_BYTES
    return out


# ---------------------------------------------------------------------------------------------------------------
# Real torch files


def test_later_checkpoints_resume_with_the_facts_of_a_fresh_walk(optimizer_states: list[bytes]) -> None:
    for load in (_loads, _storages, _no_load):
        pickle_resume.STREAMS.clear()
        with _counting() as counts:
            for data in optimizer_states:
                assert _walk(data, True, load=load) == _fresh(data, load=load)
        assert counts == {"resumed": len(optimizer_states) - 2, "diverged": 0}
    snap = _learn(*optimizer_states[:2])
    assert snap is not None and len(optimizer_states[0]) - snap.pos < 800  # it stopped in the param_groups
    for data in [*optimizer_states, *reversed(optimizer_states)]:
        _same(data)


def test_files_of_a_training_run_read_the_same(tmp_path: Path) -> None:
    """Through the torch reader (its Storages is resumable): every checkpoint's optimizer.pt (larger than the
    small files whose outcome is kept by digest), in any order."""
    paths = [tmp_path / f"checkpoint-{i}" / "optimizer.pt" for i in range(5)]
    for p in paths:
        p.parent.mkdir()
    _optimizer_states(5, width=16, save_to=paths)
    assert paths[0].stat().st_size > 64 * 1024
    pickle_resume.STREAMS.clear()
    with _counting() as counts:
        for p in [*paths, *reversed(paths), *paths]:
            outcomes = []
            for resume in (True, False):
                pickle_walk._RESUME = resume
                try:
                    outcomes.append(repr(read_file(str(p), p.name, os.stat(p))))
                finally:
                    pickle_walk._RESUME = True
            assert outcomes[0] == outcomes[1]
    assert counts == {"resumed": 13, "diverged": 0}


def test_model_state_dicts_with_metadata() -> None:
    """A module's state dict (an OrderedDict with ``_metadata``, set by BUILD) whose last tensor changes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(90)), torch.nn.LayerNorm(4))
    streams = []
    for scale in (1, 2, 3):
        sd = model.state_dict()
        sd["extra"] = torch.zeros(scale, 2)
        streams.append(_saved(sd))
    assert _learn(*streams[:2]) is not None
    with _counting() as counts:
        for data in streams:
            _same(data)
    assert counts["resumed"] == 3


# ---------------------------------------------------------------------------------------------------------------
# Where the snapshot is taken: at every kind of boundary, inside runs and structures


def _snapshots_along(data: bytes, every: int, load: Load = _loads) -> Iterator[tuple[int, pickle_resume.Snapshot]]:
    """For boundaries ``q`` about ``every`` bytes apart: learn from ``data`` and ``data`` with NONE POP inserted
    at ``q`` (so the streams share exactly the bytes before ``q``), and yield the snapshot taken at ``q``."""
    last = -every
    for q in _boundaries(data):
        if q < pickle_resume.MIN_BYTES or q - last < every or data[q] == 0x4E:
            continue
        last = q
        snap = _learn(data, data[:q] + b"N0" + data[q:], load=load)
        if snap is not None:
            assert snap.pos == q
            yield q, snap


def _owned_tails(snap: pickle_resume.Snapshot) -> list[bytes]:
    """Opcodes that read a value the snapshot shares back from the memo and change it in place."""
    out = []
    for idx, v in snap.memo.items():
        if id(v) not in snap.graph.owned:
            continue
        get = b"h" + bytes([idx]) if idx < 256 else b"j" + struct.pack("<I", idx)
        t = type(v)
        if t is dict:
            out.append(get + b"NNs0")
        elif t is list:
            out.append(get + b"Na0")
        elif t is SetNode and not v.frozen:
            out.append(get + b"(N\x900")
        elif t is Obj:
            out.append(get + b"}b0")
    return out


def test_rich_pickles_resumed_at_boundaries_all_along(rich_streams: list[bytes]) -> None:
    data = rich_streams[0]
    seen_owned = 0
    taken = 0
    for q, snap in _snapshots_along(data, len(data) // 16):
        taken += 1
        _same(data)
        _same(data[:q] + b"N0" + data[q:])
        _same(rich_streams[1])  # differs after q: resumed, or not (the tail is in the frame the snapshot read)
        for cut in (q, q + 1, q + 2, q + 7, (q + len(data)) // 2, len(data) - 1):
            _same(data[:cut])
        for tail in _owned_tails(snap)[:4]:
            with _counting() as counts:
                _same(data[:q] + tail + data[q:])
            assert counts["diverged"] == counts["resumed"]
            seen_owned += 1
    assert taken >= 4
    assert seen_owned >= 10


def test_optimizer_resumed_inside_tensor_runs_and_dicts(optimizer_states: list[bytes]) -> None:
    """A stream that stops sharing bytes inside a tensor run (a shape byte changed) or inside a per-parameter
    dict: the snapshot is taken opcode by opcode inside it, and later streams resume from there."""
    data = optimizer_states[0]
    runs = [i + 1 for i in range(len(data) - 3) if data[i] == 0x68 and data[i + 2 : i + 4] == b"(("]
    late = [r for r in runs if r > pickle_resume.MIN_BYTES + 100]
    inside = [r + k for r in late[:3] for k in (0, 1, 2, 5, 9, 14, 20, 28, 40)]
    dicts = [i for i in range(late[0], len(data) - 20) if data[i : i + 9] == b"X\x04\x00\x00\x00step"][:3]
    tried = 0
    for q in [*inside, *dicts]:
        for bump in (1, 2):
            other = data[:q] + bytes([(data[q] + bump) & 0xFF]) + data[q + 1 :]
            snap = _learn(data, other)
            if snap is None:
                continue
            tried += 1
            with _counting() as counts:
                _same(data)
                _same(other)
                _same(data[:q] + bytes([(data[q] + 3) & 0xFF]) + data[q + 1 :])
                for cut in range(snap.pos, min(snap.pos + 60, len(data))):
                    _same(data[:cut])
            assert counts["resumed"] >= 2
    assert tried >= 20


def test_a_learning_walk_that_changes_a_shared_value_keeps_no_snapshot(rich_streams: list[bytes]) -> None:
    data = rich_streams[0]
    q, snap = next(iter(_snapshots_along(data, len(data) // 2)))
    tails = _owned_tails(snap)
    assert tails
    later = next(b for b in _boundaries(data) if b > q + 40)
    for tail in tails[:5]:
        changed = data[:later] + tail + data[later:]
        assert _learn(data, data[:q] + b"N0" + changed[q:]) is None  # the second walk changed a shared value
        _same(data)
        _same(changed)


# ---------------------------------------------------------------------------------------------------------------
# Damaged streams, limits, threads


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255), st.booleans()), min_size=1, max_size=4),
    which=st.integers(0, 2),
)
def test_random_edits_and_insertions_after_the_resume_point(
    optimizer_states: list[bytes], edits: list[tuple[int, int, bool]], which: int
) -> None:
    snap = _learn(*optimizer_states[:2])
    assert snap is not None
    data = bytearray(optimizer_states[which])
    for at, value, insert in edits:
        at = snap.pos + at % (len(data) - snap.pos)
        if insert:
            data[at:at] = bytes([value])
        else:
            data[at] = value
    _same(bytes(data))


def test_every_truncation_after_the_resume_point(optimizer_states: list[bytes]) -> None:
    snap = _learn(*optimizer_states[:2])
    assert snap is not None
    data = optimizer_states[2]
    with _counting() as counts:
        for cut in range(snap.pos - 3, len(data) + 1):
            _same(data[:cut])
    assert counts["resumed"] == len(data) + 1 - snap.pos


def test_every_byte_after_the_resume_point_replaced(optimizer_states: list[bytes]) -> None:
    snap = _learn(*optimizer_states[:2])
    assert snap is not None
    data = bytearray(optimizer_states[3])
    for at in range(snap.pos, len(data)):
        old = data[at]
        for new in (0x00, 0x2E, 0x28, 0x4E, 0x68, 0x73, 0x75, old ^ 0x01):
            data[at] = new
            _same(bytes(data))
        data[at] = old


def _opcodes(facts: tuple[str, ...]) -> int:
    return int(facts[0].split("opcodes=")[1].split(",")[0])


def test_limits_tripping_after_the_resume_point(optimizer_states: list[bytes]) -> None:
    data = optimizer_states[2]
    snap = _learn(*optimizer_states[:2])
    assert snap is not None
    at_snapshot, total = snap.state[0], _opcodes(_fresh(data))
    memo_at, memo_total = len(snap.memo), max(snap.memo) + 40
    cases = [Limits(pickle_opcodes=n) for n in (at_snapshot - 1, at_snapshot, at_snapshot + 1, total - 1, total)]
    cases += [Limits(pickle_opcodes=n) for n in range(at_snapshot + 2, total - 1, max((total - at_snapshot) // 12, 1))]
    cases += [Limits(pickle_memo_entries=n) for n in range(memo_at - 2, memo_total, 7)]
    cases += [Limits(nesting_depth=n) for n in (1, 2, 3, 4)]
    for limits in cases:
        _learn(*optimizer_states[:2], limits=limits)
        with _counting() as counts:
            for stream in optimizer_states:
                _same(stream, limits)
        if limits.pickle_opcodes > at_snapshot and limits.pickle_memo_entries >= memo_at and limits.nesting_depth > 5:
            assert counts["resumed"] >= 2, (limits.pickle_opcodes, limits.pickle_memo_entries)
    # a snapshot serves only walks with its own limits
    _learn(*optimizer_states[:2])
    with _counting() as counts:
        _same(data, Limits(pickle_opcodes=total - 1))
    assert counts["resumed"] == 0


def test_persistent_load_state_is_carried_and_checked(optimizer_states: list[bytes]) -> None:
    """Storages with other record sizes (another layout) never resume from a snapshot taken with these; with the
    same, the declared storages and the problems come out as a fresh walk's."""
    sizes = {str(i): 4 for i in range(1000)}
    bad_sizes = {str(i): 8 for i in range(1000)}
    _learn(*optimizer_states[:2], load=lambda: Storages(sizes, legacy=False))
    with _counting() as counts:
        _same(optimizer_states[2], load=lambda: Storages(sizes, legacy=False))
        _same(optimizer_states[2], load=lambda: Storages(dict(sizes), legacy=False))
        _same(optimizer_states[2], load=lambda: Storages(bad_sizes, legacy=False))
        _same(optimizer_states[2], load=_loads)
        _same(optimizer_states[2], load=_no_load)
    assert counts["resumed"] == 2


def test_concurrent_walks(optimizer_states: list[bytes], rich_streams: list[bytes]) -> None:
    """Walks resumed from the same snapshots in several threads at once, some of them diverging."""
    snap = _learn(*optimizer_states[:2])
    assert snap is not None
    tails = _owned_tails(snap)
    rng = random.Random(7)
    streams = [*optimizer_states, *rich_streams]
    for _ in range(20):
        base = rng.choice(optimizer_states)
        streams.append(base[: snap.pos] + rng.choice(tails) + base[snap.pos :])
        cut = rng.randrange(snap.pos, len(base))
        streams.append(base[:cut])
    expected = [_fresh(s) for s in streams]
    pickle_resume.STREAMS.clear()
    barrier = threading.Barrier(4)

    def walk(i: int) -> tuple[str, ...]:
        if i < 4:
            barrier.wait()
        return _walk(streams[i % len(streams)], True)

    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            got = list(pool.map(walk, range(len(streams))))
            assert got == expected


def test_a_second_run_sharing_a_first_part_learns_its_own_snapshot(optimizer_states: list[bytes]) -> None:
    """Checkpoints of another run whose streams share only a first part with the first run's: the early snapshot
    they fit is resumed from, and a later one of their own is learnt on the way."""
    first = optimizer_states
    at = next(b for b in _boundaries(first[0]) if b > pickle_resume.MIN_BYTES + 200)
    assert len(first[0]) - at > pickle_resume.MIN_BYTES // 4
    second = [s[:at] + b"N0" + s[at:] for s in first]  # another run: equal to the first up to ``at``
    snap = _learn(*first[:2])
    assert snap is not None
    with _counting() as counts:
        for data in second:
            assert _walk(data, True) == _fresh(data)
    assert counts["resumed"] == len(second) - 1  # the 2nd from the early snapshot, the rest from their own
    stream = pickle_resume.STREAMS.get((0, first[0][: pickle_resume.HEAD]))
    assert stream is not None and max(s.pos for s in stream.snapshots) > snap.pos
    for data in [*first, *second]:
        _same(data)


def test_a_resumed_walk_that_takes_a_snapshot_still_guards_the_values_it_shares(rich_streams: list[bytes]) -> None:
    """A resumed walk that learns a snapshot of its own while a value shared with the first snapshot is on its
    stack, then changes that value: it stops (and is walked afresh), leaving the first snapshot as it was."""
    data = rich_streams[0]
    q, snap = next(iter(_snapshots_along(data, len(data) // 2)))
    filler = b"N0" * (pickle_resume.MIN_BYTES // 2 + 100)
    for tail in _owned_tails(snap)[:4]:
        get = tail[: 2 if tail[:1] == b"h" else 5]
        keep = data[:q] + get + filler + b"0" + data[q:]  # the shared value only sits on the stack
        change = data[:q] + get + filler + tail[len(get) :] + b"0" + data[q:]
        _learn(data, data[:q] + b"N0" + data[q:])
        with _counting() as counts:
            for stream in (keep, change, data, keep, change):
                assert _walk(stream, True) == _fresh(stream)
        assert counts["diverged"] == 2
