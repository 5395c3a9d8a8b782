"""A fix (or an undo) killed with SIGKILL at every step: `undo` then restores the original tree exactly, and
`fix` completes the transaction to exactly the planned tree. Names, contents, modes and mtimes are compared."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckptdoctor import fixer as fixmod
from ckptdoctor.findings import OpKind
from tests.helpers.crash import _kill_at, _points, recover_either_way
from tests.helpers.fixing import age, clone, mixed_run, run_cli, tree_state


@pytest.fixture(scope="module")
def crash_mixed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
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


def test_every_crash_point_is_reached(crash_mixed: dict[str, Any]) -> None:
    points = _points(crash_mixed["kinds"])
    assert len(points) in (1 + 2 * 4 + 2 * 2, 1 + 2 * 4 + 2 * 3)  # + `exchanged` per rewrite where supported
    assert "op:1:temp" in points and "op:1:saved" in points  # mid-rewrite


@pytest.mark.parametrize("direction", ["undo", "fix"])
def test_killed_fix_recovers_either_way(crash_mixed: dict[str, Any], tmp_path: Path, direction: str) -> None:
    for i, point in enumerate(_points(crash_mixed["kinds"])):
        root = clone(crash_mixed["src"], tmp_path / f"t{i}")
        _kill_at(root, point, "fix")
        (j,) = fixmod.load_journals(str(root))  # the journal is on disk before any change
        assert j.state == "applying", point
        recover_either_way(root, j.txid, direction, crash_mixed, point)


def test_crash_after_op_alias(crash_mixed: dict[str, Any], tmp_path: Path) -> None:
    root = clone(crash_mixed["src"], tmp_path / "alias")
    _kill_at(root, "2", "fix", env_name=fixmod.CRASH_AFTER_OP_ENV)
    (j,) = fixmod.load_journals(str(root))
    assert [op.status for op in j.ops] == ["done", "done", "pending", "pending"]
    code, out = run_cli("fix", "--dry-run", str(root))
    assert code == 1 and f"would complete interrupted transaction {j.txid}" in out
    assert run_cli("undo", str(root))[0] == 0
    assert tree_state(root) == crash_mixed["before"]


def test_killed_undo_is_finished_by_undo(crash_mixed: dict[str, Any], tmp_path: Path) -> None:
    n = len(crash_mixed["kinds"])
    for point in ["undo:journal", *(f"undo:{k}" for k in range(n, 0, -1))]:
        root = clone(crash_mixed["src"], tmp_path / point.replace(":", "_"))
        run_cli("fix", str(root))
        _kill_at(root, point, "undo")
        code, out = run_cli("fix", str(root))
        assert code == 2 and "was interrupted" in out, out  # fix does not fight an undo half done
        code, out = run_cli("undo", str(root))
        assert code == 0, (point, out)
        assert tree_state(root) == crash_mixed["before"], point
