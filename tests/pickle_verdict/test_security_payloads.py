"""The payload corpus: every technique is live (loading it creates its canary) and every one is flagged by a scan
that never creates the canary; files the real libraries write raise no CKD6xx finding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptdoctor.findings import Finding
from ckptdoctor.scanner import scan
from tests.helpers import payloads
from tests.helpers.paths import REPO
from tests.helpers.payloads import _by_path

torch = pytest.importorskip("torch")

_LOADER = r"""
import copyreg, io, json, pickle, sys, time
copyreg.add_extension("posix", "system", 240)
copyreg.add_extension("os", "system", 65536)
for item in json.load(sys.stdin):
    data = open(item["path"], "rb").read()
    try:
        if item["loader"] == "pickle":
            pickle.loads(data)
        else:
            import torch
            start, end = item.get("slice") or (0, len(data))
            torch.load(io.BytesIO(data[start:end]), weights_only=False)
    except BaseException:
        pass  # many payloads break the stream after their call ran
time.sleep(0.5)  # webbrowser and pty.spawn create their canary from a child process
"""


def _extra_torch_payloads(canary: Path) -> list[payloads.Payload]:
    """Payloads that need torch to build: a legacy torch file and a .distcp holding a hostile blob."""
    import io
    import os as _os

    evil = payloads._reducer(_os.system, (f"touch {canary}",))
    legacy = io.BytesIO()
    torch.save(evil, legacy, _use_new_zipfile_serialization=False)
    blob = io.BytesIO()
    torch.save({"lr": evil}, blob)
    real = io.BytesIO()
    torch.save({"lr": 0.1}, real)
    distcp = real.getvalue() + blob.getvalue()
    start = len(real.getvalue())
    return [
        payloads.Payload("legacy torch", "legacy.bin", legacy.getvalue(), "torch", "posix.system"),
        payloads.Payload(
            "DCP .distcp blob", "optimizer_0/__0_0.distcp", distcp, f"slice:{start}:{len(distcp)}", "posix.system"
        ),
    ]


def _all(canary: Path) -> list[payloads.Payload]:
    return payloads.corpus(canary) + _extra_torch_payloads(canary)


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name)


def test_every_payload_is_live(tmp_path: Path) -> None:
    """Loading each payload the way a victim would creates its canary (in a child process)."""
    items = []
    expected = []
    for p in _all(tmp_path / "unused"):
        if not p.live or p.loader == "none":
            continue
        canary = tmp_path / f"canary-{_slug(p.name)}"
        again = {q.name: q for q in _all(canary)}[p.name]
        path = tmp_path / f"{_slug(p.name)}.bin"
        path.write_bytes(again.data)
        item: dict[str, object] = {"path": str(path), "loader": "pickle" if again.loader == "pickle" else "torch"}
        if again.loader.startswith("slice:"):
            item["slice"] = [int(x) for x in again.loader.split(":")[1:]]
        items.append(item)
        expected.append((p.name, canary))
    subprocess.run(
        [sys.executable, "-c", _LOADER],
        input=json.dumps(items).encode(),
        check=True,
        timeout=300,
        capture_output=True,
        cwd=tmp_path,
    )
    dead = [name for name, canary in expected if not canary.exists()]
    assert not dead, f"payloads that did not run: {dead}"


def _write_tree(root: Path, canary: Path) -> dict[str, payloads.Payload]:
    """One run folder per payload: ``root/<slug>/checkpoint-1/<filename>``; returns file path -> payload."""
    placed = {}
    for p in _all(canary):
        folder = root / _slug(p.name) / "checkpoint-1"
        path = folder / p.filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(p.data)
        if path.name == ".metadata" or path.suffix == ".distcp":
            (path.parent / "__1_0.distcp").write_bytes(b"")  # a DCP folder
        placed[str(path.relative_to(root)).replace(os.sep, "/")] = p
    return placed


def test_every_payload_is_flagged_and_never_run(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    placed = _write_tree(tmp_path / "root", canary)
    report = scan(str(tmp_path / "root"))
    found = _by_path(report.findings)
    missed = []
    for path, p in placed.items():
        hits = [f for f in found.get(path, []) if f.rule in ("CKD601", "CKD605")]
        if not any(p.expect in f.message for f in hits):
            missed.append((p.name, [f"{f.rule}: {f.message}" for f in found.get(path, [])]))
    assert not missed, missed
    assert not canary.exists()


def test_zip_tricks_are_ckd605(tmp_path: Path) -> None:
    placed = _write_tree(tmp_path / "root", tmp_path / "canary")
    found = _by_path(scan(str(tmp_path / "root")).findings)
    for path, p in placed.items():
        if p.name.startswith("zip:"):
            assert any(f.rule == "CKD605" for f in found[path]), p.name


def _ckd6(findings: tuple[Finding, ...]) -> list[str]:
    return [f"{f.rule} {f.path}: {f.message}" for f in findings if f.rule.startswith("CKD6")]


def test_real_library_files_raise_no_ckd6xx(tmp_path: Path) -> None:
    """optimizer/scheduler/rng_state/training_args, a state dict (zip and legacy), DCP, a peft adapter .bin."""
    from bench import make_allowlist

    ck = tmp_path / "run" / "checkpoint-2"
    ck.mkdir(parents=True)
    payloads.save_training_files(ck)
    payloads.save_model_state(ck / "pytorch_model.bin")
    payloads.save_model_state(ck / "legacy.bin", legacy=True)
    payloads.save_dcp(ck / "pytorch_model_fsdp_0")
    make_allowlist.write_peft_adapter(ck)
    make_allowlist.write_torch_files(tmp_path / "run" / "checkpoint-4")
    assert _ckd6(scan(str(tmp_path / "run")).findings) == []


@pytest.mark.slow
def test_real_trainer_checkpoint_raises_no_ckd6xx(tmp_path: Path) -> None:
    """A checkpoint written by a real 2-step transformers.Trainer run, and accelerate.save_state."""
    from bench import make_allowlist

    make_allowlist.run_trainer(tmp_path)
    make_allowlist.write_accelerate_state(tmp_path)
    assert _ckd6(scan(str(tmp_path)).findings) == []


def test_fixtures_raise_no_ckd6xx() -> None:
    fixtures = REPO / "fixtures"
    assert _ckd6(scan(str(fixtures)).findings) == []
