"""A large trainer_state.json is read in pieces, in bounded memory: the document whole but each log_history entry
cut to the keys the rules read (model.HISTORY_KEYS); anything not plainly valid is read whole as before, and says
the same problem. Nothing is rewritten from a value read in pieces (CKD105's fix becomes a manual one)."""

from __future__ import annotations

import io
import json
import shutil
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from ckptdoctor.model import HISTORY_KEYS, JsonFacts
from ckptdoctor.readers import jsonfiles
from ckptdoctor.readers.jsonfiles import read_json
from ckptdoctor.scanner import scan
from tests.helpers.paths import REPO

REAL = REPO / "fixtures" / "lr-finished" / "checkpoint-8" / "trainer_state.json"  # written as the Trainer does


def slim(value: dict[str, Any]) -> dict[str, Any]:
    return {**value, "log_history": [{k: e[k] for k in HISTORY_KEYS if k in e} for e in value["log_history"]]}


@pytest.fixture
def in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file counts as large, read in 7-byte chunks (elements and UTF-8 sequences split across chunks)."""
    monkeypatch.setattr(jsonfiles, "_STREAM_MIN", 0)
    monkeypatch.setattr(jsonfiles, "_STREAM_CHUNK", 7)


def read(data: bytes) -> Any:
    return read_json(io.BytesIO(data), len(data))


@pytest.mark.usefixtures("in_pieces")
def test_a_real_trainer_state_in_pieces_is_the_whole_read_cut_to_the_kept_keys() -> None:
    data = REAL.read_bytes()
    out = read(data)
    assert isinstance(out.content, JsonFacts) and out.content.partial and not out.problems
    assert out.content.value == slim(json.loads(data))
    # non-ASCII text and numbers json writes (NaN) survive the chunking too
    doc = json.loads(data)
    doc["log_history"][0]["note"] = "é" * 11
    doc["log_history"][1]["loss"] = float("nan")
    text = json.dumps(doc, indent=2, sort_keys=True).encode()
    got = read(text).content.value
    assert json.dumps(got) == json.dumps(slim(json.loads(text)))


@pytest.mark.usefixtures("in_pieces")
@pytest.mark.parametrize(
    "edit",
    [
        lambda t: t.replace(b'"loss": ', b'"loss": 1, "loss": ', 1),  # a repeated key
        lambda t: t[: len(t) // 2],  # cut short
        lambda t: t.replace(b"}\n  ],", b"},\n  ],", 1),  # a trailing comma
        lambda t: t.replace(b'"epoch": 0.125', b'"epoch": "\xff"', 1),  # bad UTF-8
        lambda t: t.replace(b'"epoch": 0.125', b'"epoch": ' + b"[" * 498 + b"]" * 498, 1),  # nested too deep
        lambda t: t.replace(b"\n    {", b"\n    7,\n    {", 1),  # not an object
    ],
    ids=["repeated-key", "cut", "trailing-comma", "bad-utf8", "too-deep", "not-an-object"],
)
def test_anything_not_plainly_valid_is_read_whole_and_says_the_same(edit: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    data = edit(REAL.read_bytes())
    pieces = read(data)
    monkeypatch.setattr(jsonfiles, "_STREAM_MIN", 1 << 62)
    whole = read(data)
    assert pieces == whole
    assert not (isinstance(pieces.content, JsonFacts) and pieces.content.partial)


def _large_state(path: Path, entries: int, **top: Any) -> None:
    """A trainer_state.json laid out as the Trainer writes it, with many keys per log entry."""
    doc = {**json.loads(REAL.read_text()), **top}
    extra = {f"eval_metric_{i:02d}": 0.123456789 * i for i in range(40)}
    doc["log_history"] = [
        {"epoch": s / 100, "learning_rate": 1e-3 * (1 - s / entries), "loss": 3.0 - s / entries, "step": s, **extra}
        for s in range(1, entries + 1)
    ]
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def test_a_large_trainer_state_is_read_in_bounded_memory(tmp_path: Path) -> None:
    """A 49 MB file (30,000 entries of 44 keys): the read holds a batch and the kept keys, half the file's size at
    most (parsed whole, such a file takes about six times its size: 1.2 GB for 200 MB)."""
    path = tmp_path / "trainer_state.json"
    _large_state(path, 30_000)
    size = path.stat().st_size
    assert size >= jsonfiles._STREAM_MIN
    tracemalloc.start()
    try:
        with path.open("rb") as f:
            out = read_json(f, size)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(out.content, JsonFacts) and out.content.partial
    history = out.content.value["log_history"]
    assert len(history) == 30_000 and history[-1] == {"learning_rate": 0.0, "loss": 2.0, "step": 30_000}
    assert peak < size / 2, (peak, size)


def test_the_scan_judges_a_large_run_and_offers_no_rewrite_of_it(tmp_path: Path) -> None:
    """Two checkpoints of one run with large trainer states: no stale-run alarm (their histories agree), and a
    best_model_checkpoint from another machine is CKD105 with a manual fix, not a rewrite of a value read in part."""
    run = tmp_path / "run"
    for step in (4, 8):
        ck = run / f"checkpoint-{step}"
        shutil.copytree(REAL.parent, ck)
        _large_state(ck / "trainer_state.json", 30_000, global_step=step,
                     best_model_checkpoint="/home/alice/run/checkpoint-4")  # fmt: skip
    report = scan(str(run))
    assert not [f for f in report.findings if f.rule in ("CKD101", "CKD402")]
    best = [f for f in report.findings if f.rule == "CKD105"]
    assert best and all(f.fix is not None and f.fix.applicability.value == "manual" and not f.fix.ops for f in best)
