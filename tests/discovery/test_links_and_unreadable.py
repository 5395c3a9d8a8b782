"""Links out of the scan root are never read, and are errors where the resume loads through them; unreadable and
vanishing paths are reported as such (never as empty folders, interrupted saves or corrupt files), and as errors
where the resume would load them."""

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

import ckptdoctor
from ckptdoctor import discover as discover_mod
from ckptdoctor.cli import main
from ckptdoctor.findings import Finding, Severity
from ckptdoctor.model import FileFacts
from ckptdoctor.readers import read_file
from ckptdoctor.resume_gate import gate
from ckptdoctor.scanner import scan
from ckptdoctor.sources import local as local_source
from tests.helpers.console import HANG_GUARD
from tests.helpers.paths import REPO

FIXTURES = REPO / "fixtures"


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
# 1. A checkpoint folder linked from another disk is what the resume loads. It is not read (a folder may come from
#    anyone: a link named `latest` to ~/.ssh/id_ed25519 would put the key in the report), so it is an error there.


def test_a_picked_checkpoint_linked_out_of_the_root_is_an_error_and_never_read(tmp_path: Path) -> None:
    root, target = _linked_out(tmp_path)
    weights = target / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 4096)
    # What transformers resumes from: the link, whose weights are cut short.
    assert get_last_checkpoint(str(root)) == str(root / "checkpoint-8")

    code, _ = _cli("scan", "--format", "json", str(root))
    assert code == 1
    report = scan(str(root))
    assert not [f for f in report.trees[0].all_files() if f.path.startswith("checkpoint-8/")]
    (link,) = _at(report.findings, "checkpoint-8", "CKD604")
    assert link.severity is Severity.ERROR
    assert "not followed" in link.message and "what it loads was not checked" in link.message

    g = gate(root)  # the resume picks the link: the gate says so, and does not claim there is no checkpoint
    assert g.checkpoint == str(root / "checkpoint-8") and g.verdict == "fail"
    assert "CKD604" in {f.rule for f in g.findings} and "CKD413" not in {f.rule for f in g.findings}


def test_a_link_out_of_an_older_checkpoint_is_a_warning(tmp_path: Path) -> None:
    root, _ = _linked_out(tmp_path, ck="checkpoint-4")
    (link,) = _at(scan(str(root)).findings, "checkpoint-4", "CKD604")
    assert link.severity is Severity.WARNING


def test_a_secret_behind_a_link_never_reaches_the_report(tmp_path: Path) -> None:
    """Links out of the root are not followed (292be50): when they were, CKD503 quoted a key file in every format."""
    secret = tmp_path / "id_ed25519"
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nsecret-key-material\n-----END OPENSSH PRIVATE KEY-----\n")
    root = tmp_path / "run"
    shutil.copytree(FIXTURES / "clean-full", root)
    os.symlink(secret, root / "checkpoint-8" / "latest")
    (root / "checkpoint-8" / "training_args.bin").unlink()
    os.symlink(secret, root / "checkpoint-8" / "training_args.bin")
    for fmt in ("text", "json", "sarif", "github"):
        _, out = _cli("scan", "--format", fmt, str(root))
        assert "secret-key-material" not in out and "PRIVATE KEY" not in out, fmt


def test_a_real_trainer_checkpoint_moved_to_another_disk_and_linked_back(tmp_path: Path) -> None:
    from tests.helpers.trainer_runs import llama, train

    out = train(tmp_path / "run", llama())
    store = tmp_path / "other-disk"
    store.mkdir()
    last = Path(get_last_checkpoint(str(out)))
    shutil.move(str(last), store / last.name)
    os.symlink(store / last.name, last)
    assert get_last_checkpoint(str(out)) == str(last)
    (link,) = _at(scan(str(out)).findings, last.name, "CKD604")
    assert link.severity is Severity.ERROR
    # What the message advises: scanning the target itself checks it.
    assert scan(str(store / last.name)).exit_code() == 0


def test_links_out_of_the_root_are_never_walked(tmp_path: Path) -> None:
    root, _ = _linked_out(tmp_path)
    os.symlink("/", root / "checkpoint-4" / "slash")
    os.symlink(tmp_path, root / "checkpoint-4" / "up")
    os.symlink("/usr", root / "checkpoint-4" / "usr")
    tree = discover_mod.discover(str(root))
    kinds = {p.path: p.problem.kind.value for p in tree.path_problems}
    assert kinds["checkpoint-4/slash"] == kinds["checkpoint-4/up"] == kinds["checkpoint-4/usr"] == "link-escapes-root"
    assert all((f.path.startswith("checkpoint-4/") and "/" not in f.path[len("checkpoint-4/"):])
               or not f.path.startswith("checkpoint-4/") for f in tree.all_files())  # fmt: skip
    (run,) = tree.runs
    assert [c.path for c in run.checkpoints] == ["checkpoint-4"] and run.resume_pick == "checkpoint-8"


def test_fixes_never_act_through_a_link(tmp_path: Path) -> None:
    root, target = _linked_out(tmp_path, "sharded-wrong-index")
    index = target / "model.safetensors.index.json"
    before = _sha(index)
    code, _ = _cli("fix", "--force", str(root))
    assert code == 1  # the CKD604 error remains: nothing the fixer can do
    assert _sha(index) == before and os.path.islink(root / "checkpoint-8")


# ---------------------------------------------------------------------------------------------------------------
# 2. Unreadable folders and files


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
    # side files no resume opens (trainer_view.resume_reads), whatever their suffix: a warning
    for side in ("notes.txt", "ema_backup.safetensors"):
        (root / "checkpoint-8" / side).write_text("x")
        deny(root / "checkpoint-8" / side)
    found = scan(str(root)).findings
    assert [f.severity for f in _at(found, f"checkpoint-8/{name}", "CKD001")] == [Severity.ERROR]
    assert [f.severity for f in _at(found, f"checkpoint-4/{name}", "CKD001")] == [Severity.WARNING]
    for side in ("notes.txt", "ema_backup.safetensors"):
        assert [f.severity for f in _at(found, f"checkpoint-8/{side}", "CKD001")] == [Severity.WARNING]
    code, _ = _cli("scan", str(root))
    assert code == 1


def _nobody_can_run() -> bool:
    return os.geteuid() == 0 and shutil.which("setpriv") is not None


def _as_nobody(base: Path) -> tuple[list[str], dict[str, str]]:
    """The argv prefix that runs this interpreter as the user nobody, and its environment. The checkout may sit
    where nobody cannot enter (root's home, a `mktemp -d`): nobody imports a copy of the package from ``base/lib``."""
    shutil.copytree(Path(ckptdoctor.__file__).parent, base / "lib" / "ckptdoctor",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    for p in (base / "lib").rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    (base / "lib").chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(base / "lib"), "PYTHONDONTWRITEBYTECODE": "1"}
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable], env


@pytest.mark.skipif(not _nobody_can_run(), reason="needs root and setpriv to drop CAP_DAC_OVERRIDE")
def test_an_unreadable_root_is_a_usage_error_for_an_unprivileged_user() -> None:
    """A root the user may not read is exit 2 on every command and a PermissionError in Python, as the README's
    exit-code table says (it said CKD002, exit 1; click refused it with its own words, the API scanned nothing)."""
    base = Path(tempfile.mkdtemp(prefix="ckd-nobody-", dir="/tmp"))
    try:
        base.chmod(0o755)
        root = base / "run"
        shutil.copytree(FIXTURES / "clean-full", root)
        root.chmod(0)
        nobody, env = _as_nobody(base)
        for command in ("scan", "gate", "fix", "undo"):
            proc = subprocess.run([*nobody, "-m", "ckptdoctor", command, str(root)], capture_output=True, text=True,
                                  timeout=HANG_GUARD, cwd="/", env=env)  # fmt: skip
            if proc.returncode != 2 and "ModuleNotFoundError" in proc.stderr:
                pytest.skip(f"the user nobody cannot run this interpreter: {proc.stderr[-300:]}")
            assert proc.returncode == 2 and proc.stdout == "", (command, proc.stdout, proc.stderr)
            assert f"{root}: cannot be read (permission denied)" in proc.stderr, (command, proc.stderr)
        code = f"import ckptdoctor\ntry:\n    ckptdoctor.scan({str(root)!r})\nexcept PermissionError as e:\n print(e)"
        proc = subprocess.run([*nobody, "-c", code], capture_output=True, text=True, timeout=HANG_GUARD, cwd="/",
                              env=env)  # fmt: skip
        assert "cannot be read (permission denied)" in proc.stdout, (proc.stdout, proc.stderr)
    finally:
        root.chmod(0o755)
        shutil.rmtree(base)


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
        nobody, env = _as_nobody(base)  # only an interpreter nobody cannot run is a reason to skip
        probe = subprocess.run([*nobody, "-c", "import ckptdoctor.cli"], capture_output=True, text=True, timeout=60,
                               cwd="/", env=env)  # fmt: skip
        if probe.returncode != 0:
            pytest.skip(f"the user nobody cannot run this interpreter or import its packages: {probe.stderr[-300:]}")
        cmd = [*nobody, "-m", "ckptdoctor", "scan", "--format", "json", str(root)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd="/", env=env)
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

    monkeypatch.setattr(local_source, "read_file", rotate_then_read)
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
