"""Links out of the scan root are read like the Trainer reads them; unreadable and vanishing paths are reported as
such (never as empty folders, interrupted saves or corrupt files), and as errors where the resume would load them."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from transformers.trainer_utils import get_last_checkpoint

from ckptdoctor import discover as discover_mod
from ckptdoctor.cli import main
from ckptdoctor.findings import Finding, Severity
from ckptdoctor.gate import gate
from ckptdoctor.limits import Limits
from ckptdoctor.model import FileFacts
from ckptdoctor.readers import read_file
from ckptdoctor.scanner import scan
from tests import test_hostile_trees as hostile

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def _at(findings: Any, path: str, rule: str | None = None) -> list[Finding]:
    return [f for f in findings if f.path == path and (rule is None or f.rule == rule)]


def _linked_out(tmp_path: Path, fixture: str = "clean-full", ck: str = "checkpoint-8") -> tuple[Path, Path]:
    """A shipped real run ``sl`` whose ``ck`` was moved to another folder (``sl_store``) and symlinked back."""
    root = tmp_path / "sl"
    shutil.copytree(FIXTURES / fixture, root)
    store = tmp_path / "sl_store"
    store.mkdir()
    shutil.move(str(root / ck), store / ck)
    os.symlink(f"../sl_store/{ck}", root / ck)
    return root, store / ck


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# 1. A checkpoint folder linked from another disk is what the resume loads: it is read


def test_truncated_weights_behind_a_linked_checkpoint_are_found(tmp_path: Path) -> None:
    root, target = _linked_out(tmp_path)
    weights = target / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 4096)
    # What transformers resumes from: the link, whose weights are cut short.
    assert get_last_checkpoint(str(root)) == str(root / "checkpoint-8")

    code, out = _cli("scan", "--format", "json", str(root))
    doc = json.loads(out)
    (run,) = doc["runs"] if "runs" in doc else doc["roots"][0]["runs"]
    assert run["resume_pick"] in {c["path"] for c in run["checkpoints"]}
    report = scan(str(root))
    assert code == 1
    assert _at(report.findings, "checkpoint-8/model.safetensors", "CKD202")
    (link,) = _at(report.findings, "checkpoint-8", "CKD604")
    assert link.severity is Severity.WARNING
    assert "followed for reading" in link.message and "copy" in link.message

    g = gate(root)
    assert g.checkpoint == str(root / "checkpoint-8") and g.verdict == "fail"
    assert "CKD413" in {f.rule for f in g.findings}


def test_a_linked_intact_checkpoint_is_clean_but_for_the_link(tmp_path: Path) -> None:
    root, _ = _linked_out(tmp_path)
    report = scan(str(root))
    assert {f.rule for f in report.findings} == {"CKD604"}
    assert gate(root).verdict == "pass"


def test_a_real_trainer_checkpoint_moved_to_another_disk_and_linked_back(tmp_path: Path) -> None:
    from tests.test_rules_transformers import llama, train

    out = train(tmp_path / "run", llama())
    in_place = {(f.rule, f.path) for f in scan(str(out)).findings}  # CKD401: this short run's schedule is done
    store = tmp_path / "other-disk"
    store.mkdir()
    last = Path(get_last_checkpoint(str(out)))
    shutil.move(str(last), store / last.name)
    os.symlink(store / last.name, last)
    assert get_last_checkpoint(str(out)) == str(last)
    assert {(f.rule, f.path) for f in scan(str(out)).findings} == in_place | {("CKD604", last.name)}

    (store / last.name / "trainer_state.json").write_text('{"global_step": 4, "log_hist')  # cut by a crash
    found = scan(str(out)).findings
    assert _at(found, f"{last.name}/trainer_state.json", "CKD402")
    (torn,) = _at(found, last.name, "CKD102")
    assert torn.severity is Severity.ERROR


def test_linked_files_and_folders_out_of_the_root_count_against_the_limits(tmp_path: Path) -> None:
    root, _ = _linked_out(tmp_path)
    tree = discover_mod.discover(str(root), Limits(dir_entries=10))
    assert any(p.problem.message.startswith("more than 10 entries") for p in tree.path_problems)


def test_links_to_folders_holding_the_root_or_to_proc_are_not_followed(tmp_path: Path) -> None:
    root, _ = _linked_out(tmp_path)
    os.symlink("/", root / "checkpoint-4" / "slash")
    os.symlink(tmp_path, root / "checkpoint-4" / "up")
    if os.path.isdir("/proc/self"):
        os.symlink("/proc/self", root / "checkpoint-4" / "proc")
    tree = discover_mod.discover(str(root))
    msgs = {p.path: p.problem.message for p in tree.path_problems}
    assert "a loop" in msgs["checkpoint-4/slash"] and "a loop" in msgs["checkpoint-4/up"]
    if os.path.isdir("/proc/self"):
        assert "proc pseudo file system" in msgs["checkpoint-4/proc"]
    assert not [f for f in tree.all_files() if "/slash/" in f.path or "/up/" in f.path or "/proc/" in f.path]


def test_two_links_to_one_outside_folder_and_a_link_cycle_outside(tmp_path: Path) -> None:
    root, target = _linked_out(tmp_path)
    os.symlink(target, root / "checkpoint-9")
    os.symlink(target.parent, target / "back")  # a cycle entirely outside the root
    tree = discover_mod.discover(str(root))
    (run,) = tree.runs
    assert [c.path for c in run.checkpoints] == ["checkpoint-4", "checkpoint-8", "checkpoint-9"]
    assert run.resume_pick == "checkpoint-9"
    kinds = {p.path: p.problem.kind.value for p in tree.path_problems}
    assert kinds["checkpoint-8/back"] == kinds["checkpoint-9/back"] == "link-escapes-root"


def test_fixes_never_act_through_a_followed_link(tmp_path: Path) -> None:
    # A CKD205 index rewrite planned for a file inside a linked folder, and a CKD102 quarantine of the link itself.
    root, target = _linked_out(tmp_path, "sharded-wrong-index")
    index = target / "model.safetensors.index.json"
    before = _sha(index)
    _, out = _cli("fix", "--format", "json", str(root))
    doc = json.loads(out)
    skipped = json.dumps(doc)
    assert "is a symbolic link; the fixer never writes through one" in skipped
    assert _sha(index) == before and os.path.islink(root / "checkpoint-8")
    assert not (root / ".ckptdoctor" / "quarantine").exists()

    root2, target2 = _linked_out(tmp_path / "torn")
    (target2 / "trainer_state.json").unlink()
    _, out = _cli("fix", str(root2))
    assert "`checkpoint-8` is a symbolic link; the fixer never writes through one" in out
    assert os.path.islink(root2 / "checkpoint-8") and (target2 / "model.safetensors").exists()


# ---------------------------------------------------------------------------------------------------------------
# 2. Unreadable folders and files


# Permission denied on chosen paths, as a user without access sees it (root ignores mode 000).
deny = hostile.deny


def _run(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    shutil.copytree(FIXTURES / "clean-full", root)
    return root


def test_an_unreadable_checkpoint_folder_is_not_called_empty(tmp_path: Path, deny: Callable[[Path], None]) -> None:
    root = _run(tmp_path)
    deny(root / "checkpoint-4")
    found = scan(str(root)).findings
    (hit,) = _at(found, "checkpoint-4")
    assert hit.rule == "CKD001" and "cannot list this folder" in hit.message and "Permission denied" in hit.message
    assert hit.severity is Severity.WARNING  # not the one the resume picks
    assert not [f for f in found if f.rule == "CKD102"]


def test_the_picked_checkpoint_unreadable_is_an_error(tmp_path: Path, deny: Callable[[Path], None]) -> None:
    root = _run(tmp_path)
    deny(root / "checkpoint-8")
    found = scan(str(root)).findings
    (hit,) = _at(found, "checkpoint-8")
    assert hit.rule == "CKD001" and hit.severity is Severity.ERROR
    assert not [f for f in found if f.rule == "CKD102"]


@pytest.mark.parametrize("name", ["optimizer.pt", "trainer_state.json", "model.safetensors"])
def test_an_unreadable_file_the_resume_loads_is_an_error(
    tmp_path: Path, deny: Callable[[Path], None], name: str
) -> None:
    root = _run(tmp_path)
    deny(root / "checkpoint-8" / name)
    deny(root / "checkpoint-4" / name)
    (root / "checkpoint-8" / "notes.txt").write_text("x")
    deny(root / "checkpoint-8" / "notes.txt")
    found = scan(str(root)).findings
    assert [f.severity for f in _at(found, f"checkpoint-8/{name}", "CKD001")] == [Severity.ERROR]
    assert [f.severity for f in _at(found, f"checkpoint-4/{name}", "CKD001")] == [Severity.WARNING]
    assert [f.severity for f in _at(found, "checkpoint-8/notes.txt", "CKD001")] == [Severity.WARNING]
    code, _ = _cli("scan", str(root))
    assert code == 1


def _nobody_can_run() -> bool:
    return os.geteuid() == 0 and shutil.which("setpriv") is not None


@pytest.mark.skipif(not _nobody_can_run(), reason="needs root and setpriv to drop CAP_DAC_OVERRIDE")
def test_mode_000_seen_by_an_unprivileged_user() -> None:
    # Real permissions, as a user sees them: the scan runs as nobody, in a folder nobody may enter.
    base = Path(tempfile.mkdtemp(prefix="ckd-nobody-", dir="/tmp"))
    try:
        base.chmod(0o755)
        root = base / "run"
        shutil.copytree(FIXTURES / "clean-full", root)
        for p in [root, *root.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        (root / "checkpoint-4").chmod(0)
        (root / "checkpoint-8" / "optimizer.pt").chmod(0)
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
               sys.executable, "-m", "ckptdoctor", "scan", "--format", "json", str(root)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd="/")
        if "Permission denied" in proc.stderr and not proc.stdout:
            pytest.skip(f"nobody cannot run the interpreter here: {proc.stderr[-200:]}")
        assert proc.returncode == 1, proc.stderr
        text = proc.stdout
        assert "CKD102" not in text
        doc = json.loads(text)
        hits = [f for f in _json_findings(doc) if f["rule"] == "CKD001"]
        by_path = {f["path"]: f["severity"] for f in hits}
        assert by_path["checkpoint-4"] == "warning"
        assert by_path["checkpoint-8/optimizer.pt"] == "error"
    finally:
        for p in base.rglob("*"):
            if not p.is_symlink():
                p.chmod(0o755)
        shutil.rmtree(base)


def _json_findings(doc: Any) -> list[dict[str, Any]]:
    """Every finding object in a scan JSON document, wherever the format nests them."""
    out: list[dict[str, Any]] = []
    stack = [doc]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            if "rule" in v and "severity" in v and "path" in v:
                out.append(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return out


# ---------------------------------------------------------------------------------------------------------------
# 3. A file gone between the listing and the read (a rotation at work) is not corrupt


@pytest.mark.parametrize(
    ("name", "not_rules"),
    [
        ("trainer_state.json", {"CKD402", "CKD102"}),
        ("config.json", {"CKD211"}),
        ("model.safetensors", {"CKD202"}),
        ("optimizer.pt", {"CKD203"}),
    ],
)
def test_a_file_vanishing_during_the_scan_is_reported_as_such(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, not_rules: set[str]
) -> None:
    root = _run(tmp_path)
    gone = root / "checkpoint-4" / name
    real_read = read_file

    def rotate_then_read(abs_path: str, rel: str, *args: Any) -> FileFacts:
        if abs_path == str(gone):
            gone.unlink()  # save_total_limit's rotation got there first
        return real_read(abs_path, rel, *args)

    monkeypatch.setattr(discover_mod, "read_file", rotate_then_read)
    found = scan(str(root)).findings
    (hit,) = _at(found, f"checkpoint-4/{name}")
    assert hit.rule == "CKD001" and hit.severity is Severity.WARNING
    assert "vanished during the scan" in hit.message
    assert not [f for f in found if f.rule in not_rules], [str(f) for f in found]


def test_a_checkpoint_folder_vanishing_during_the_scan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _run(tmp_path)
    real_scandir = os.scandir

    def rotate_then_list(path: Any = ".") -> Any:
        if isinstance(path, str) and path == str(root / "checkpoint-4"):
            shutil.rmtree(root / "checkpoint-4")
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", rotate_then_list)
    found = scan(str(root)).findings
    (hit,) = _at(found, "checkpoint-4")
    assert hit.rule == "CKD001" and "vanished during the scan" in hit.message
    assert not [f for f in found if f.rule == "CKD102"]
