"""The rule engine's speed work changes no finding: every scenario's findings match a golden list captured from the
code before it was made cheaper (codes, severities, paths, messages, fix plans, order).

Scenarios: the checked-in fixtures (with pinned file times), small runs written by bench/synth.py (real headers,
real torch archives), runs of real torch/safetensors checkpoints mixed the way stale-checkpoint and history checks
care about, and the hostile pickle corpus. tests/data/rules_cost_golden.json was written by the rules as they were
before (as of commit e36c44e; the `weights_forms` scenario was added later and recorded by running this
file against that commit's rule files). Regenerate it only for an intended behaviour change:
``CKPTDOCTOR_WRITE_GOLDEN=1 python -m pytest tests/rules/test_rules_cost.py``.

The property tests below check the cheaper walks against the ones they replaced (kept here as references).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import json
import math
import os
import pickle
import shutil
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import ckptdoctor.readers as readers_package
from ckptdoctor import facts, trainer_view
from ckptdoctor.findings import Finding
from ckptdoctor.model import (
    Checkpoint,
    FileFacts,
    FileKind,
    FolderRole,
    GlobalRef,
    JsonFacts,
    Opaque,
    TensorRef,
)
from ckptdoctor.pickle_verdict import judge as pickle_judge
from ckptdoctor.readers import nested as pickle_analysis  # the nested-pickle search, found at read time
from ckptdoctor.readers.pickle_walk import iter_values
from ckptdoctor.scanner import scan
from tests.helpers import builders, payloads
from tests.helpers.paths import REPO

torch = pytest.importorskip("torch")

ROOT = REPO
GOLDEN = ROOT / "tests" / "data" / "rules_cost_golden.json"
T0 = 1_700_000_000.0  # pinned file times: messages print them, and CKD101 compares them
CANARY = Path("/nonexistent/ckptdoctor-canary")  # payload bytes hold this path; nothing ever creates it


def _synth() -> ModuleType:
    name = "bench_synth"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "synth.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _synth_args(**kw: Any) -> argparse.Namespace:
    base: dict[str, Any] = dict(
        model="tiny", checkpoints=3, runs=1, save_steps=5, logging_steps=1, max_shard_gb=0.0002, weights_only=False
    )
    base.update(kw)
    return argparse.Namespace(**base)


def _pin_times(root: Path, when: Callable[[Path], float] | None = None) -> None:
    """Set every file's and folder's mtime (deepest first, so folders keep theirs)."""
    paths = sorted(root.rglob("*"), key=lambda p: (-len(p.parts), str(p)))
    for p in [*paths, root]:
        t = T0 if when is None else when(p)
        os.utime(p, (t, t), follow_symlinks=False)


def _rewrite_state(ck: Path, **changes: Any) -> None:
    path = ck / "trainer_state.json"
    state = json.loads(path.read_text())
    state.update(changes)
    path.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------------------------------------
# Scenarios: each builds a tree under the given folder and returns the path to scan


def fixtures_pinned(root: Path) -> Path:
    shutil.copytree(ROOT / "fixtures", root / "fixtures", symlinks=True)
    _pin_times(root)
    return root / "fixtures"


def fixtures_spread(root: Path) -> Path:
    """The fixtures with times increasing in path order: later folders look newer (CKD101's certain branch)."""
    shutil.copytree(ROOT / "fixtures", root / "fixtures", symlinks=True)
    order = {p: i for i, p in enumerate(sorted(root.rglob("*")))}
    _pin_times(root, lambda p: T0 + 10.0 * order.get(p, 0))
    return root / "fixtures"


def synth_one_run(root: Path) -> Path:
    _synth().generate(root / "run", _synth_args(checkpoints=4))
    _pin_times(root)
    return root / "run"


def synth_runs(root: Path) -> Path:
    _synth().generate(root / "runs", _synth_args(runs=2, checkpoints=3, logging_steps=2, weights_only=True))
    _pin_times(root)
    return root / "runs"


def _synth_stale(root: Path, newer_b: bool | None, diverge_loss: bool = False) -> Path:
    """Run A saved checkpoint-5..20 (max_steps 20); run B (max_steps 40) then overwrote checkpoint-5 and -10."""
    synth = _synth()
    run = root / "run"
    synth.generate(run, _synth_args(checkpoints=4))
    b = root / "b"
    synth.generate(b, _synth_args(checkpoints=2))
    targs = synth.training_args_bytes()
    for step in (5, 10):
        shutil.rmtree(run / f"checkpoint-{step}")
        synth.make_checkpoint(run / f"checkpoint-{step}", synth.MODELS["tiny"], step, 40, _synth_args(), targs)
        if diverge_loss:
            _rewrite_state(run / f"checkpoint-{step}", max_steps=20)
            state = json.loads((run / f"checkpoint-{step}" / "trainer_state.json").read_text())
            for e in state["log_history"]:  # A's story except one loss
                if "loss" in e:
                    e["loss"] = 7.25 if e["step"] == 3 else 2.5 - e["step"] / 20
                    e["learning_rate"] = 2e-5 * (20 - e["step"]) / 20
            _rewrite_state(run / f"checkpoint-{step}", log_history=state["log_history"])
    shutil.rmtree(b)
    b_folders = {run / "checkpoint-5", run / "checkpoint-10"}

    def when(p: Path) -> float:
        in_b = any(f == p or f in p.parents for f in b_folders)
        if newer_b is None or not in_b:
            return T0
        return T0 + (500.0 if newer_b else -500.0)

    _pin_times(root, when)
    return run


def synth_stale_certain(root: Path) -> Path:
    return _synth_stale(root, newer_b=True)


def synth_stale_uncertain(root: Path) -> Path:
    return _synth_stale(root, newer_b=None)


def synth_stale_older(root: Path) -> Path:
    return _synth_stale(root, newer_b=False)


def synth_stale_loss(root: Path) -> Path:
    return _synth_stale(root, newer_b=True, diverge_loss=True)


def _small_run(root: Path, steps: tuple[int, ...] = (2, 4, 6, 8), max_steps: int = 8) -> Path:
    return builders.make_run(root, steps, max_steps)


def histories(root: Path) -> Path:
    """Several runs whose log_histories agree, diverge, overlap or not, with odd entries (bools, NaN, duplicates)."""
    out = root / "runs"
    # a: one healthy run
    _small_run(out / "a")
    # b: checkpoint-2 and -4 rewritten by another run (other max_steps, so other LRs at the same steps), newer
    run = _small_run(out / "b")
    for s in (2, 4):
        _rewrite_state(run / f"checkpoint-{s}", **builders.trainer_state(s, 16))
    # c: the lower checkpoints share no logged step with the pick and were written later: identity difference
    run = _small_run(out / "c")
    for s in (2, 4):
        state = builders.trainer_state(s, 16, epochs=2.0)
        state["log_history"] = [{"eval_loss": 1.0, "step": s}]
        _rewrite_state(run / f"checkpoint-{s}", **state)
    # d: odd entries: duplicate steps with other losses, bool and string steps, bool and NaN losses, non-dicts
    run = _small_run(out / "d")
    for s in (2, 4, 6, 8):
        hist = builders.trainer_state(s, 8)["log_history"]
        hist.insert(1, {"loss": 9.5, "step": 1})
        hist.append({"loss": True, "step": True, "learning_rate": 1})
        hist.append({"loss": float("nan"), "step": "3"})
        hist.append("not a dict")
        hist.append({"learning_rate": -0.0, "step": 2})
        _rewrite_state(run / f"checkpoint-{s}", log_history=hist)
    # e: divergence only in the pick (last entry of the pick changes a step the others logged)
    run = _small_run(out / "e")
    hist = builders.trainer_state(8, 8)["log_history"]
    hist.append({"loss": 1.5, "step": 5})
    _rewrite_state(run / "checkpoint-8", log_history=hist)
    # f: same as b but with int LRs and a missing global_step / log_history
    run = _small_run(out / "f", steps=(2, 4, 6))
    _rewrite_state(run / "checkpoint-2", log_history=[{"learning_rate": 1, "loss": 2, "step": 1}])
    _rewrite_state(run / "checkpoint-4", log_history="nope", global_step=None)
    _rewrite_state(run / "checkpoint-6", log_history=[{"learning_rate": 1.0, "loss": 2.0, "step": 1}])

    def when(p: Path) -> float:
        rel = p.relative_to(out).parts if p != out else ()
        newer = len(rel) >= 2 and rel[0] in ("b", "c") and rel[1] in ("checkpoint-2", "checkpoint-4")
        return T0 + (300.0 if newer else 0.0)

    _pin_times(out, when)
    return out


class Custom:
    """A class outside the allowlist (CKD602 when imported by a pickle)."""

    def __init__(self, x: Any) -> None:
        self.x = x


def _state_dict_pickle(extra: Any) -> bytes:
    buf = io.BytesIO()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    torch.save({"model": model.state_dict(), "extra": extra}, buf)
    return buf.getvalue()


def pickles(root: Path) -> Path:
    """Hostile corpus plus state dicts carrying bytes, strings, nested pickles and unknown globals."""
    out = root / "pickles"
    for i, p in enumerate(payloads.corpus(CANARY)):
        path = out / f"p{i:03d}" / "checkpoint-1" / p.filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(p.data)
    inner_unknown = pickle.dumps(Custom(1), protocol=2)
    inner_evil = payloads.hostile_payloads(CANARY)["os.system"][0]
    import base64

    extras: dict[str, Any] = {
        "plain": {"a": 1, "b": [1.0, 2.0], "c": ("x" * 40, b"\x00" * 40)},
        "nested-unknown": {"blob": inner_unknown, "text": base64.b64encode(inner_unknown).decode()},
        "nested-evil": [1, 2, {"k": inner_evil}],
        "urlsafe": base64.urlsafe_b64encode(inner_evil).decode(),
        "shared": (lambda s: [s, s, {"again": s}])([b"x", inner_unknown]),
        "custom": Custom([inner_evil, "y" * 20]),
        "ordered": OrderedDict(x=inner_unknown),
        "set": {b"\x80\x02N."},  # set members are not walked
        "nested-zip": _state_dict_pickle(inner_evil),
        "many": [inner_unknown] * 70,  # more nested pickles than the per-file budget
        "class-ref": {"cls": Custom, "t": (Custom, 1)},  # unproven (not installed): CKD601
        "installed-class-ref": {"cls": argparse.Action, "t": (argparse.Action, 1)},  # named, never called: CKD602
        "nested-class-ref": {"blob": pickle.dumps(Custom, protocol=2), "s": "z" * 15},
        "mixed": [Custom, inner_evil, pickle.dumps(Custom, protocol=4)],
    }
    for name, extra in extras.items():
        path = out / name / "checkpoint-1" / "pytorch_model.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_state_dict_pickle(extra))
        (path.parent / "extra.pkl").write_bytes(pickle.dumps(extra, protocol=4))
    _pin_times(root)
    return out


def weights_forms(root: Path) -> Path:
    """Folders holding one, two or three full-weight forms (same or other tensors), and configs that disagree."""
    out = root / "runs"
    shutil.copytree(ROOT / "fixtures" / "sharded", out / "sharded", symlinks=True)
    fx = ROOT / "fixtures"
    shutil.copy(fx / "clean-full" / "checkpoint-8" / "model.safetensors", out / "sharded" / "checkpoint-8")
    shutil.copy(fx / "prefixed-keys-ddp" / "checkpoint-4" / "model.safetensors", out / "sharded" / "checkpoint-4")
    shutil.copy(fx / "clean-bin" / "checkpoint-8" / "pytorch_model.bin", out / "sharded" / "checkpoint-4")
    _synth().generate(out / "synth", _synth_args(checkpoints=2))
    cfg = out / "synth" / "checkpoint-5" / "config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "vocab_size": 7, "num_hidden_layers": 9}))
    _pin_times(root)
    return out


def pickles_tight(root: Path) -> Path:
    """The pickle scenario under tiny per-file budgets (values visited, nested pickles walked): the cut-offs."""
    return pickles(root)


# scenario -> pickle_analysis budgets patched while it is scanned
TIGHT = {"pickles_tight": {"MAX_VALUES": 7, "MAX_NESTED": 2}}


SCENARIOS: dict[str, Callable[[Path], Path]] = {
    f.__name__: f
    for f in (
        fixtures_pinned,
        fixtures_spread,
        synth_one_run,
        synth_runs,
        synth_stale_certain,
        synth_stale_uncertain,
        synth_stale_older,
        synth_stale_loss,
        histories,
        pickles,
        pickles_tight,
        weights_forms,
    )
}


def _record(f: Finding, root: str) -> list[Any]:
    fix = None
    if f.fix is not None:
        ops = [
            [op.kind.value, op.path, None if op.content is None else hashlib.sha256(op.content.encode()).hexdigest()]
            for op in f.fix.ops
        ]
        fix = [f.fix.title, f.fix.applicability.value, ops]
    return [f.rule, f.name, f.severity.value, f.path, f.message.replace(root, "<root>"), fix]


def _findings(name: str, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[Any]]:
    target = SCENARIOS[name](tmp)
    for attr, value in TIGHT.get(name, {}).items():
        monkeypatch.setattr(pickle_analysis, attr, value)
        # outcomes of small files are kept per process, nested pickles included: read them again under the budgets
        monkeypatch.setattr(readers_package, "_OUTCOMES", {})
    report = scan(str(target), jobs=1)
    return [_record(f, str(tmp)) for f in report.findings]


@pytest.fixture(autouse=True)
def _utc(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_findings_match_golden(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    got = _findings(name, tmp_path, monkeypatch)
    if os.environ.get("CKPTDOCTOR_WRITE_GOLDEN"):
        golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
        golden[name] = got
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        return
    expected = json.loads(GOLDEN.read_text())[name]
    assert got == expected


def test_golden_is_not_trivial() -> None:
    """The golden list exercises what the speed work touched: stale picks, history divergence, pickle verdicts."""
    golden = json.loads(GOLDEN.read_text())
    rules = {rec[0] for recs in golden.values() for rec in recs}
    assert {"CKD101", "CKD601", "CKD602", "CKD605"} <= rules
    messages = [rec[4] for recs in golden.values() for rec in recs if rec[0] == "CKD101"]
    assert any("diverges at step" in m for m in messages) and any("max_steps" in m for m in messages)


# ---------------------------------------------------------------------------------------------------------------
# The cheaper walks against the ones they replace, on generated values


def _tensor(i: int) -> TensorRef:
    return TensorRef("F32", (i, 2), (2, 1), 0, str(i), 2 * i, "cpu", 8 * i)


_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=True),
    st.text(max_size=24),
    st.binary(max_size=24),
    st.sampled_from([b"\x80\x02N.", "gAJOLg==" * 3, "x" * 16, _tensor(1), _tensor(2), GlobalRef("a", "b")]),
    st.frozensets(st.integers(0, 3), max_size=2),
)


def _containers(kids: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(kids, max_size=5),
        st.lists(kids, max_size=5).map(tuple),
        st.dictionaries(st.one_of(st.integers(0, 9), st.text(max_size=3)), kids, max_size=5),
        st.builds(Opaque, st.none(), st.lists(kids, max_size=3).map(tuple) | kids, st.none() | kids),
    )


_VALUES = st.recursive(_LEAVES, _containers, max_leaves=40)


@st.composite
def _shared(draw: st.DrawFn) -> Any:
    """A value whose containers are reached more than once (as pickle memo references make them)."""
    parts = draw(st.lists(_VALUES, min_size=1, max_size=4))
    picks = draw(st.lists(st.integers(0, len(parts) - 1), max_size=8))
    inner = {"state": {i: {"exp_avg": _tensor(i), "step": _tensor(0)} for i in range(draw(st.integers(0, 4)))}}
    p = {"exp_avg": _tensor(1)}
    aliased = draw(st.permutations([[p], {0: p, 1: p}, {5: p}, {6: {"x": 1}, 7: p}]))
    return [parts[i] for i in picks] + [inner, inner["state"], *aliased, parts[0]]


def _texts_reference(value: Any) -> list[tuple[int, Any]]:
    return [
        (i, v)
        for i, (_, v) in enumerate(iter_values(value))
        if i < pickle_analysis.MAX_VALUES and (type(v) is bytes or (type(v) is str and len(v) >= 16))
    ]


@settings(max_examples=400, deadline=None)
@given(value=st.one_of(_VALUES, _shared()))
def test_texts_visits_what_iter_values_visits(value: Any) -> None:
    """Same candidates at the same positions, so the per-file budgets cut at the same values."""
    assert list(pickle_analysis._texts(value)) == _texts_reference(value)


@settings(max_examples=100, deadline=None)
@given(value=_shared(), cap=st.integers(0, 30))
def test_texts_stops_at_the_value_budget(value: Any, cap: int) -> None:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(pickle_analysis, "MAX_VALUES", cap)
        got = list(pickle_analysis._texts(value))
        # past the budget, a _CUT marker says values were left unsearched (reported, never a silent cut)
        assert [x for x in got if x[1] is not pickle_analysis._CUT] == _texts_reference(value)
        assert all(x[1] is pickle_analysis._CUT for x in got[-1:] if x[0] >= cap)


def _old_history_divergence(older: Any, newer_log: tuple[dict[str, Any], ...]) -> str | None:
    """history_divergence as it was: merge newer's entries per step, then walk every older entry."""
    by_step: dict[int, dict[str, Any]] = {}
    for e in newer_log:
        step = e.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            by_step.setdefault(step, {}).update(e)
    for e in older.log_history:
        step = e.get("step")
        if not isinstance(step, int) or step not in by_step:
            continue
        other = by_step[step]
        for key in ("loss", "learning_rate"):
            a, b = e.get(key), other.get(key)
            # numbers read through trainer_view.number, as the rule reads them since a3d1d75 (a JSON integer past
            # float range is an infinity)
            x, y = trainer_view.number(a), trainer_view.number(b)
            if x is not None and y is not None and a != b and not facts._close(x, y):
                # the rule's message since dbabd70: one number format per comparison (facts.versus)
                return f"log_history diverges at step {step} ({key} {facts.versus(a, b)})"
    return None


def _view(log: list[Any], name: str = "trainer_state.json") -> trainer_view.TrainerStateView:
    f = FileFacts(f"c/{name}", 1, 0.0, FileKind.JSON, JsonFacts({"log_history": log, "global_step": 1}))
    ts = trainer_view.trainer_state(Checkpoint("c", FolderRole.CHECKPOINT, 1, (f,)))
    assert ts is not None
    return ts


_NUMBERS = st.one_of(
    st.integers(-2, 2), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.just(-0.0), st.just(10**400)
)
_ENTRY = st.dictionaries(
    st.sampled_from(["step", "loss", "learning_rate", "epoch", "grad_norm", "eval_loss"]),
    st.one_of(_NUMBERS, st.integers(0, 6), st.sampled_from([1.0, 2.0, "3", None, [1]])),
    max_size=5,
)


def _outcome(fn: Callable[[], str | None]) -> Any:
    try:
        return fn()
    except Exception as exc:  # the old code raised on a few values (an int too big for a float): so must the new
        return type(exc)


@settings(max_examples=600, deadline=None)
@given(
    common=st.lists(_ENTRY, max_size=8),
    older_tail=st.lists(_ENTRY, max_size=3),
    newer_tail=st.lists(_ENTRY, max_size=4),
    edits=st.lists(st.tuples(st.integers(0, 10), _ENTRY), max_size=2),
)
# equal entries that the old walk treats apart: a float step equal to an int one, an int too big for a float
@example(
    common=[{"step": 1.0, "loss": 1.0}], older_tail=[], newer_tail=[{"step": 1, "loss": 5.0}],
    edits=[(0, {"step": 1, "loss": 1.0})],
)
@example(
    common=[{"step": 1, "loss": 1.0}], older_tail=[], newer_tail=[{"step": 1, "loss": 5.0}],
    edits=[(0, {"step": 1.0, "loss": 1.0})],
)
@example(common=[{"step": 1, "loss": 10**400}], older_tail=[], newer_tail=[{"step": 1, "loss": 1}], edits=[])
@example(common=[{"step": 2, "loss": -0.0}], older_tail=[], newer_tail=[{"step": 2, "loss": 3}], edits=[])
@example(common=[{"step": True, "loss": 1}, {"step": 1, "loss": 2}], older_tail=[], newer_tail=[], edits=[])
# a step logged once whose loss is unequal to itself (its merged entry is the entry itself), beside a repeated step
@example(common=[{"step": 1, "loss": math.nan}, {"step": 2, "loss": 1.0}, {"step": 2, "eval_loss": 3.0}],
         older_tail=[], newer_tail=[{"step": 3, "learning_rate": math.nan}], edits=[])
# a step logged again later, not beside its first entry (and one logged twice side by side)
@example(common=[{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}, {"step": 2, "loss": 2.5}],
         older_tail=[], newer_tail=[{"step": 1, "loss": 3.0}], edits=[])
def test_history_divergence_is_unchanged(
    common: list[dict[str, Any]],
    older_tail: list[dict[str, Any]],
    newer_tail: list[dict[str, Any]],
    edits: list[tuple[int, dict[str, Any]]],
) -> None:
    """Histories that share a prefix (the fast path), differ in places, or are unrelated: same answer as before."""
    older_log = [dict(e) for e in common] + older_tail
    for i, e in edits:
        if older_log:
            older_log[i % len(older_log)] = e
    newer_log = [dict(e) for e in common] + newer_tail
    older, newer = _view(older_log), _view(newer_log)
    want = _outcome(lambda: _old_history_divergence(older, newer.log_history))
    assert _outcome(lambda: facts.history_divergence(older, newer)) == want
    # and the other way round, with the newer view's caches already built
    assert _outcome(lambda: facts.history_divergence(newer, older)) == _outcome(
        lambda: _old_history_divergence(newer, older.log_history)
    )


def test_merged_steps_match_the_old_dict() -> None:
    log = [{"step": 1, "loss": 2.0}, {"step": 1, "eval_loss": 1.0}, {"step": True, "loss": 9}, {"step": 2.0}]
    ts = _view([*log, "not an entry"])
    assert ts.log_history == tuple(log)
    assert dict(ts.by_step) == {1: {"step": 1, "loss": 2.0, "eval_loss": 1.0}}
    assert True in ts.by_step and 2 not in ts.by_step and len(ts.by_step) == 1


@settings(max_examples=300, deadline=None)
@given(log=st.lists(st.one_of(_ENTRY, st.builds(lambda s, e: {**e, "step": s}, st.integers(0, 4), _ENTRY)), max_size=9))
@example(log=[{"step": 2, "loss": 1.0}, {"step": 1, "lr": 3}, {"step": 2, "eval_loss": 2.0}, {"step": 2, "loss": -0.0}])
def test_merged_steps_are_unchanged(log: list[dict[str, Any]]) -> None:
    """The merge built at C speed (plain dicts, integer steps: a train and an eval log at one step) and the one
    built entry by entry (anything else) give what the old loop gave, key order included."""
    old: dict[int, dict[str, Any]] = {}
    for e in log:
        step = e.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            old.setdefault(step, {}).update(e)
    ts = _view(log)
    assert repr(list(ts.by_step.items())) == repr(list(old.items()))
    assert repr(trainer_view.merged_steps(ts)) == repr(old)


@settings(max_examples=300, deadline=None)
@given(log=st.lists(_ENTRY, max_size=9))
def test_learning_rates_are_unchanged(log: list[dict[str, Any]]) -> None:
    """``TrainerStateView.learning_rates`` read at C speed (plain JSON values) gives what the entry-by-entry loop
    gave (an integer step, a number that is no bool; an integer past float range an infinity)."""
    ts = _view(log)
    old = [
        (step, lr)
        for e in ts.log_history
        if (step := trainer_view.integer(e.get("step"))) is not None
        and (lr := trainer_view.number(e.get("learning_rate"))) is not None
    ]
    assert repr(ts.learning_rates()) == repr(old)


def test_histories_sharing_entries_are_read_alike() -> None:
    """A log_history that is a prefix of, or extends, one already read (the same entry objects, as a run's
    checkpoints share them) is checked by identity; a non-dict entry is still dropped wherever it sits."""
    trainer_view.forget()
    entries: list[Any] = [{"step": i, "loss": 1.0 / (i + 1)} for i in range(40)]
    logs = [entries[:30], entries[:10], entries, [*entries, 5, {"step": 40}], [*entries[:20], "x"], entries[:40]]
    for i, log in enumerate(logs):
        want = tuple(e for e in log if isinstance(e, dict))
        assert _view(list(log)).log_history == want
        if i == 3:
            trainer_view.forget()  # a run judged: the next starts with nothing known


def test_each_pickle_is_judged_once_per_scan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CKD601 and CKD602 report one verdict per file, judged once before the rules run (``Tree.pickle_verdicts``)."""
    run = builders.make_run(tmp_path / "run", (2, 4))
    calls: list[int] = []
    real = pickle_judge._judged  # what judge() and tree_verdicts() both run

    def counting(pf: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(id(pf))
        return real(pf, *args, **kwargs)

    monkeypatch.setattr(pickle_judge, "_judged", counting)
    scan(str(run), jobs=1)
    assert calls and len(calls) == len(set(calls)) == 2 * 3  # optimizer.pt, scheduler.pt, rng_state.pth


# The walks over a checkpoint's files that its kept listing (``Checkpoint.entries``, ``top_files``) replaced.
def _old_file(ck: Checkpoint, relname: str) -> FileFacts | None:
    prefix = "" if ck.path in ("", ".") else f"{ck.path}/"
    for f in ck.files:
        if f.path.startswith(prefix) and ck.relname(f) == relname:
            return f
    return None


def _old_is_fsdp(ck: Checkpoint) -> bool:
    for f in ck.files:
        rel = ck.relname(f)
        if ("/" in rel and "pytorch_model_fsdp" in rel.split("/", 1)[0]) or rel == "pytorch_model_fsdp.bin":
            return True
    return False


def _old_is_deepspeed(ck: Checkpoint) -> bool:
    return any("/" in (rel := ck.relname(f)) and (rel.startswith("global_step") or (
        rel.count("/") == 1 and trainer_view.is_deepspeed_state(f.name))) for f in ck.files)


def _old_adapter_subdirs(ck: Checkpoint) -> tuple[str, ...]:
    return tuple(sorted({p[0] for f in ck.files if len(p := ck.relname(f).split("/")) == 2 and p[1] in (
        trainer_view.ADAPTER_SAFE, trainer_view.ADAPTER_BIN)}))


def _old_world_size(ck: Checkpoint) -> int | None:
    ranks = {int(m.group(1)) for f in ck.files if (m := facts._DCP_RANK_RE.match(f.name) or facts._DS_RANK_RE.search(
        f.name))}
    return max(ranks) + 1 if ranks else None


_NAMES = st.sampled_from([
    "trainer_state.json", "optimizer.pt", "model-00001-of-00002.safetensors", "rng_state_1.pth",
    "pytorch_model_fsdp.bin",
    "pytorch_model_fsdp_0/__0_0.distcp", "__3_0.distcp", "global_step4/zero_pp_rank_2_mp_rank_00_optim_states.pt",
    "tag/mp_rank_00_model_states.pt", "tag/zero_pp_rank_1_mp_rank_00_optim_states.pt\n", "a/b/__1_0.distcp",
    "second/adapter_model.safetensors", "x/y/adapter_model.bin", "adapter_model.bin", "optim_states.pt/x", "",
])


@settings(max_examples=300, deadline=None)
@given(folder=st.sampled_from(["", ".", "run/checkpoint-2", "checkpoint-2"]), names=st.lists(_NAMES, max_size=8),
       stray=st.booleans())
def test_checkpoint_listing_answers_as_the_walks_did(folder: str, names: list[str], stray: bool) -> None:
    """``Checkpoint.file``, ``entries`` and ``top_files`` and the views walking them give what the walks over
    ``files`` gave (repeated paths, nested and hostile names, a file outside the folder)."""
    trainer_view.forget()
    inside = "" if folder in ("", ".") else f"{folder}/"
    paths = [f"{inside}{n}" for n in names] + (["elsewhere/optimizer.pt"] if stray and inside else [])
    files = tuple(FileFacts(p, i, 0.0, FileKind.OTHER) for i, p in enumerate(paths))
    ck = Checkpoint(folder, FolderRole.CHECKPOINT, 2, files)
    assert ck.entries() == tuple((ck.relname(f), f) for f in files)
    assert ck.top_files() == tuple((ck.relname(f), f) for f in files if "/" not in ck.relname(f))
    for rel in {*names, "optimizer.pt", "nothing", "s/optimizer.pt"}:
        assert ck.file(rel) is _old_file(ck, rel)
    assert trainer_view.is_fsdp(ck) == _old_is_fsdp(ck)
    assert trainer_view.is_deepspeed(ck) == _old_is_deepspeed(ck)
    assert trainer_view.adapter_subdirs(ck) == _old_adapter_subdirs(ck)
    assert facts.saved_world_size(ck) == _old_world_size(ck)
    copy = pickle.loads(pickle.dumps(ck))  # what it keeps is no field: neither pickled nor compared
    assert copy == ck and hash(copy) == hash(ck) and repr(copy) == repr(ck) and copy.entries() == ck.entries()
