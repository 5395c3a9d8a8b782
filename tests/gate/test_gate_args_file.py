"""`gate --training-args FILE` judges the pickle it reads: the launcher will `torch.load` that same file
(`weights_only=False`: TrainingArguments is no tensor), so a payload in it fails the gate as `scan` would."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
from click.testing import CliRunner  # noqa: E402
from transformers import TrainingArguments  # noqa: E402

from ckptdoctor.cli import main  # noqa: E402
from ckptdoctor.resume_gate.args_file import read_training_args  # noqa: E402
from tests.helpers.payloads import _reducer, hostile_payloads  # noqa: E402


def _args(out: Path) -> Any:
    return TrainingArguments(output_dir=str(out), num_train_epochs=3, learning_rate=1e-3, report_to=[],
                             use_cpu=True)


def _gate(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(main, ["gate", *args])
    if r.exception and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r.exit_code, r.output


def test_a_real_training_args_bin_passes(midway: Path, tmp_path: Path) -> None:
    """What Trainer._save writes (torch.save of TrainingArguments) is read once, judged clean, and plans."""
    path = tmp_path / "training_args.bin"
    torch.save(_args(midway), path)
    assert read_training_args(str(path)).facts is not None  # a pickle: judged
    code, out = _gate(str(midway), "--training-args", str(path), "--format", "json")
    doc = json.loads(out)
    assert code == 0 and doc["verdict"] == "pass", out
    assert doc["resolved"]["num_train_epochs"] == 3 and not [f for f in doc["findings"] if f["rule"] >= "CKD6"]


def test_a_payload_in_training_args_bin_fails_the_gate(midway: Path, tmp_path: Path) -> None:
    """A genuine TrainingArguments whose run_name is a `posix.system` call: it still plans, and the gate fails on
    CKD601 naming the file as given. Built with torch.save, never loaded (the canary stays absent)."""
    canary = tmp_path / "canary"
    args = _args(midway)
    object.__setattr__(args, "run_name", _reducer(os.system, (f"touch {canary}",)))
    path = tmp_path / "job" / "training_args.bin"
    path.parent.mkdir()
    torch.save(args, path)
    given = os.path.relpath(path)
    code, out = _gate(str(midway), "--training-args", given)
    assert code == 1, out
    assert f"{given}: CKD601" in out and "posix.system" in out, out
    code, out = _gate(str(midway), "--training-args", given, "--format", "json")
    hits = [f for f in json.loads(out)["findings"] if f["rule"] == "CKD601"]
    assert code == 1 and [f["path"] for f in hits] == [given], out
    assert not canary.exists()


def test_a_bare_payload_is_a_usage_error_that_says_so(midway: Path, tmp_path: Path) -> None:
    """No TrainingArguments in it: nothing to plan (exit 2), and the message warns that loading it runs code."""
    path = tmp_path / "training_args.bin"
    path.write_bytes(hostile_payloads(tmp_path / "canary")["os.system"][0])
    code, out = _gate(str(midway), "--training-args", str(path))
    assert code == 2 and "loading it can run code" in out and "posix.system" in out, out


class LauncherTag:
    """A launcher's own class stored in the arguments: unknown to the allowlist until the user allows it."""


def test_allow_global_applies_to_the_args_file(midway: Path, tmp_path: Path) -> None:
    args = _args(midway)
    object.__setattr__(args, "run_name", LauncherTag())
    path = tmp_path / "training_args.bin"
    torch.save(args, path)
    code, out = _gate(str(midway), "--training-args", str(path))
    assert code == 1 and f"{path}: CKD601" in out and "LauncherTag" in out, out
    code, out = _gate(str(midway), "--training-args", str(path), "--allow-global", f"{__name__}.LauncherTag")
    assert code == 0 and "CKD601" not in out, out


def test_json_and_yaml_args_are_not_judged(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(json.dumps({"num_train_epochs": 3}))
    (tmp_path / "a.yaml").write_text("num_train_epochs: 3\n")
    for name in ("a.json", "a.yaml"):
        got = read_training_args(str(tmp_path / name))
        assert got.args == {"num_train_epochs": 3} and got.facts is None


def test_the_python_api_takes_the_file_too(midway: Path, tmp_path: Path) -> None:
    """``gate(run_dir, training_args=PATH)`` reads the file as --training-args does: a training_args.bin plans the
    same as its mapping, a JSON file too, and a payload in a training_args.bin fails it (CKD601 at the path)."""
    from ckptdoctor.resume_gate import gate
    from ckptdoctor.resume_gate.plan import GateInputError

    args = _args(midway)
    path = tmp_path / "training_args.bin"
    torch.save(args, path)
    mapping = gate(midway, training_args=args.to_dict())
    for given in (path, str(path)):
        by_file = gate(midway, training_args=given)
        assert by_file.verdict == "pass" and by_file.settings is not None
        assert (by_file.max_steps, by_file.lr) == (mapping.max_steps, mapping.lr)
        assert by_file.settings.num_train_epochs == 3 and by_file.settings.sources["num_train_epochs"] == "planned"
    (tmp_path / "args.json").write_text(args.to_json_string())
    assert gate(midway, training_args=tmp_path / "args.json").lr == mapping.lr
    canary = tmp_path / "canary"
    object.__setattr__(args, "run_name", _reducer(os.system, (f"touch {canary}",)))
    torch.save(args, tmp_path / "bad.bin")
    bad = gate(midway, training_args=tmp_path / "bad.bin")
    assert bad.verdict == "fail" and [f.path for f in bad.findings if f.rule == "CKD601"] == [
        str(tmp_path / "bad.bin")]
    assert not canary.exists()
    with pytest.raises(GateInputError, match="no such file"):
        gate(midway, training_args=tmp_path / "missing.bin")
