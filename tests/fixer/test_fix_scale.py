"""A big transaction stays linear: a fix and an undo of 1,000 quarantined folders restore byte for byte while the
journal is saved a bounded number of times (counted at the write seam), and a kill between two batched saves is
recovered either way at every crash point (`fix` completes, `undo` restores), with the statuses on disk showing
exactly the batches saved."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptdoctor import fixer as fixmod
from ckptdoctor.findings import OpKind
from ckptdoctor.fixer import apply, transaction
from ckptdoctor.fixer import calls as fixcalls
from tests.helpers.crash import _points, recover_either_way
from tests.helpers.fixing import age, clone, mixed_run, run_cli, tree_state

N_FOLDERS = 1_000


class JournalSaves:
    """A ``WriteCalls`` that counts the journal saves: each ends with an ``os.replace`` onto ``<txid>.json``."""

    def __init__(self) -> None:
        self.saves = 0

    def calls_obj(self) -> fixmod.WriteCalls:
        base = fixmod.WriteCalls()

        def replace(src: str, dst: str) -> None:
            if os.path.dirname(dst).endswith(os.path.join(".ckptdoctor", "journal")) and dst.endswith(".json"):
                self.saves += 1
            base.replace(src, dst)

        return fixmod.WriteCalls(**{**{n: getattr(base, n) for n in fixmod.WriteCalls.NAMES}, "replace": replace})


@pytest.fixture
def saves(monkeypatch: pytest.MonkeyPatch) -> JournalSaves:
    counter = JournalSaves()
    monkeypatch.setattr(fixcalls, "CALLS", counter.calls_obj())
    return counter


def test_a_thousand_folders_fix_and_undo_with_few_journal_saves(tmp_path: Path, saves: JournalSaves) -> None:
    root = tmp_path / "run"
    for i in range(1, N_FOLDERS + 1):  # leftover staging folders (CKD103): each one safe folder quarantine
        (root / f"tmp-checkpoint-{i}").mkdir(parents=True)
        (root / f"tmp-checkpoint-{i}" / "config.json").write_text(json.dumps({"step": i}))
    age(root)
    before = tree_state(root)
    # quarantining every staging folder leaves the run without any checkpoint: CKD002 unless --allow-empty
    code, out = run_cli("fix", "--allow-empty", str(root))
    assert code == 0 and f"Fixed {N_FOLDERS:,} problems" in out, out[-500:]
    (j,) = fixmod.load_journals(str(root))
    assert len(j.ops) == N_FOLDERS and {op.status for op in j.ops} == {"done"} and j.state == "applied"
    assert not any(p.name.startswith("tmp-checkpoint-") for p in root.iterdir())
    # The write-ahead save, one per batch, the final state: bounded whatever the number of operations.
    every = transaction._batch(N_FOLDERS)
    assert every > 1 and saves.saves == 1 + N_FOLDERS // every + 1 <= transaction.JOURNAL_SAVES + 2
    saves.saves = 0
    code, out = run_cli("undo", str(root))
    assert code == 0 and f"restored {N_FOLDERS:,} operations" in out, out
    assert saves.saves == 1 + N_FOLDERS // every + 1  # `undoing`, the batches, `undone`
    assert tree_state(root) == before


def test_a_small_transaction_still_saves_after_each_operation() -> None:
    assert [transaction._batch(n) for n in (1, 4, transaction.JOURNAL_SAVES)] == [1, 1, 1]
    assert transaction._batch(transaction.JOURNAL_SAVES + 1) == 2
    assert all(-(-n // transaction._batch(n)) <= transaction.JOURNAL_SAVES for n in range(1, 5_000, 7))


# ---------------------------------------------------------------------------------------------------------------
# Kills between batched saves: the mixed tree (both rewrites, a file and a folder move) with batches of 2 and 4


@pytest.fixture(scope="module")
def mixed_s(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("scale")
    (base / "src").mkdir()
    src = age(mixed_run(base / "src"))
    done = clone(src, base / "done")
    run_cli("fix", str(done))
    (j,) = fixmod.load_journals(str(done))
    kinds = [op.kind for op in j.ops]
    assert sorted(k.value for k in kinds) == ["quarantine", "quarantine", "rewrite-json", "rewrite-text"]
    return {"src": src, "before": tree_state(src), "planned": tree_state(done), "kinds": kinds}


class _Killed(BaseException):
    """A kill at a crash point: nothing of the fixer's catches it, so nothing is rolled back or saved."""


@pytest.fixture
def kill_at(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str | None], None]]:
    """Kill the fixer in this process at a named crash point (None: nowhere)."""

    def install(point: str | None) -> None:
        def crash(name: str) -> None:
            if name == point:
                raise _Killed(name)

        for module in (apply, transaction):
            monkeypatch.setattr(module, "crash_point", crash)

    yield install


def _saved_statuses(point: str, n: int, every: int) -> list[str]:
    """The statuses on disk after a kill at ``point`` of a fix saving every ``every`` operations."""
    parts = point.split(":")
    if parts[0] == "journal":
        return ["pending"] * n
    k = int(parts[1])
    done = k if len(parts) == 2 else k - 1  # `op:<k>` comes after op k is marked done; `op:<k>:<step>` before
    saved = done - done % every
    return ["done"] * saved + ["pending"] * (n - saved)


@pytest.mark.parametrize("every", [2, 4])
@pytest.mark.parametrize("direction", ["undo", "fix"])
def test_a_kill_between_batched_saves_recovers_either_way(
    mixed_s: dict[str, Any], tmp_path: Path, kill_at: Any, monkeypatch: pytest.MonkeyPatch, every: int, direction: str
) -> None:
    n = len(mixed_s["kinds"])
    monkeypatch.setattr(transaction, "JOURNAL_SAVES", n // every)
    assert transaction._batch(n) == every
    for i, point in enumerate(_points(mixed_s["kinds"])):
        root = clone(mixed_s["src"], tmp_path / f"t{i}")
        kill_at(point)
        with pytest.raises(_Killed):
            run_cli("fix", str(root))
        kill_at(None)
        (j,) = fixmod.load_journals(str(root))
        assert j.state == "applying", point
        assert [op.status for op in j.ops] == _saved_statuses(point, n, every), point
        recover_either_way(root, j.txid, direction, mixed_s, point)


@pytest.mark.parametrize("every", [2, 4])
def test_a_kill_between_batched_undo_saves_is_finished_by_undo(
    mixed_s: dict[str, Any], tmp_path: Path, kill_at: Any, monkeypatch: pytest.MonkeyPatch, every: int
) -> None:
    n = len(mixed_s["kinds"])
    monkeypatch.setattr(transaction, "JOURNAL_SAVES", n // every)
    for point in ["undo:journal", *(f"undo:{k}" for k in range(n, 0, -1))]:
        root = clone(mixed_s["src"], tmp_path / point.replace(":", "_"))
        run_cli("fix", str(root))
        kill_at(point)
        with pytest.raises(_Killed):
            run_cli("undo", str(root))
        kill_at(None)
        (j,) = fixmod.load_journals(str(root))
        undone = 0 if point == "undo:journal" else n - int(point.split(":")[1]) + 1
        saved = undone - undone % every
        assert j.state == "undoing" and [op.status for op in j.ops].count("undone") == saved, point
        code, out = run_cli("fix", str(root))
        assert code == 2 and "was interrupted" in out, out  # fix does not fight an undo half done
        code, out = run_cli("undo", str(root))
        assert code == 0, (point, out)
        assert tree_state(root) == mixed_s["before"], point


def test_a_real_kill_between_batched_saves(mixed_s: dict[str, Any], tmp_path: Path) -> None:
    """SIGKILL (not an exception) after op 3 of 4 with only the first and the last save: the journal on disk says
    nothing was done, the disk says three operations were; `undo` restores the tree."""
    root = clone(mixed_s["src"], tmp_path / "sigkill")
    code = (
        "import sys; from ckptdoctor.fixer import transaction; transaction.JOURNAL_SAVES = 1; "
        "from ckptdoctor.cli import main; sys.argv[0] = 'ckptdoctor'; main()"
    )
    env = {**os.environ, fixmod.CRASH_ENV: "op:3"}
    proc = subprocess.run(
        [sys.executable, "-c", code, "fix", str(root)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stdout, proc.stderr)
    (j,) = fixmod.load_journals(str(root))
    assert [op.status for op in j.ops] == ["pending"] * 4
    assert sum(op.kind == OpKind.QUARANTINE for op in j.ops[:3]) >= 1
    code_, out = run_cli("undo", str(root))
    assert code_ == 0 and "restored 3 operations" in out, out
    assert tree_state(root) == mixed_s["before"]
