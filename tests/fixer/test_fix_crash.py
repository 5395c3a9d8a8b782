"""A fix (or an undo) killed with SIGKILL at every step: `undo` then restores the original tree exactly, and
`fix` completes the transaction to exactly the planned tree. Names, contents, modes and mtimes are compared."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ckptdoctor import fixer as fixmod
from ckptdoctor.findings import OpKind
from tests.test_fix import age, clone, mixed_run, run_cli, tree_state


def _kill_at(root: Path, point: str, *args: str, env_name: str = fixmod.CRASH_ENV) -> None:
    env = {**os.environ, env_name: point}
    proc = subprocess.run(
        [sys.executable, "-m", "ckptdoctor", *args, str(root)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, (point, proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The mixed tree (both rewrite kinds, a file and a folder quarantine), its plan and both end states."""
    base = tmp_path_factory.mktemp("crash")
    (base / "src").mkdir()
    src = age(mixed_run(base / "src"))
    code, out = run_cli("fix", "--dry-run", "--format", "json", str(src))
    assert code == 1
    kinds = [OpKind(op["kind"]) for op in json.loads(out)["roots"][0]["operations"]]
    assert sorted(k.value for k in kinds) == ["quarantine", "quarantine", "rewrite-json", "rewrite-text"]
    done = clone(src, base / "done")
    run_cli("fix", str(done))
    return {"src": src, "before": tree_state(src), "planned": tree_state(done), "kinds": kinds}


def _points(kinds: list[OpKind]) -> list[str]:
    from tests.test_fix_concurrent import EXCHANGE  # here: that module imports this one

    points = fixmod.crash_points(kinds)
    if EXCHANGE:  # where the atomic exchange works, a rewrite also passes `op:<k>:exchanged`
        for k, kind in enumerate(kinds, 1):
            if kind != OpKind.QUARANTINE:
                points.insert(points.index(f"op:{k}:saved") + 1, f"op:{k}:exchanged")
    return points


def test_every_crash_point_is_reached(mixed: dict[str, Any]) -> None:
    points = _points(mixed["kinds"])
    assert len(points) in (1 + 2 * 4 + 2 * 2, 1 + 2 * 4 + 2 * 3)  # + `exchanged` per rewrite where supported
    assert "op:1:temp" in points and "op:1:saved" in points  # mid-rewrite


@pytest.mark.parametrize("direction", ["undo", "fix"])
def test_killed_fix_recovers_either_way(mixed: dict[str, Any], tmp_path: Path, direction: str) -> None:
    for i, point in enumerate(_points(mixed["kinds"])):
        root = clone(mixed["src"], tmp_path / f"t{i}")
        _kill_at(root, point, "fix")
        (j,) = fixmod.load_journals(str(root))  # the journal is on disk before any change
        assert j.state == "applying", point
        recover_either_way(root, j.txid, direction, mixed, point)


def recover_either_way(root: Path, txid: str, direction: str, mixed: dict[str, Any], point: object) -> None:
    """After a kill: `undo` restores the tree as it was, or `fix` completes the transaction, which then undoes."""
    if direction == "undo":
        code, out = run_cli("undo", str(root))
        assert code == 0, (point, out)
        assert tree_state(root) == mixed["before"], point
    else:
        code, out = run_cli("fix", str(root))
        assert f"completed interrupted transaction {txid}" in out, (point, out)
        assert tree_state(root) == mixed["planned"], point
        # the completed transaction is undoable like any other
        assert run_cli("undo", "--txid", txid, str(root))[0] == 0
        assert tree_state(root) == mixed["before"], point


def test_crash_after_op_alias(mixed: dict[str, Any], tmp_path: Path) -> None:
    root = clone(mixed["src"], tmp_path / "alias")
    _kill_at(root, "2", "fix", env_name=fixmod.CRASH_AFTER_OP_ENV)
    (j,) = fixmod.load_journals(str(root))
    assert [op.status for op in j.ops] == ["done", "done", "pending", "pending"]
    code, out = run_cli("fix", "--dry-run", str(root))
    assert code == 1 and f"would complete interrupted transaction {j.txid}" in out
    assert run_cli("undo", str(root))[0] == 0
    assert tree_state(root) == mixed["before"]


def test_killed_undo_is_finished_by_undo(mixed: dict[str, Any], tmp_path: Path) -> None:
    n = len(mixed["kinds"])
    for point in ["undo:journal", *(f"undo:{k}" for k in range(n, 0, -1))]:
        root = clone(mixed["src"], tmp_path / point.replace(":", "_"))
        run_cli("fix", str(root))
        _kill_at(root, point, "undo")
        code, out = run_cli("fix", str(root))
        assert code == 2 and "was interrupted" in out, out  # fix does not fight an undo half done
        code, out = run_cli("undo", str(root))
        assert code == 0, (point, out)
        assert tree_state(root) == mixed["before"], point
