"""Adversarial use of the command line and the gate: odd roots, hostile names and settings, non-finite numbers.

Every case here once crashed, hung, lied or surprised; each runs on copies of the shipped fixtures (real
checkpoints written by the reference trainer) or on real folders built in tmp_path.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ckptdoctor.render.report import render_text
from ckptdoctor.resume_gate import GateInputError, gate
from ckptdoctor.scanner import scan
from tests.helpers.cli import FIXTURES, copy_fixture, invoke


def patch_state(ck: Path, text_patch: dict[str, str]) -> None:
    """Rewrite top-level values of ``trainer_state.json`` with raw JSON text (``1e999``, ``NaN``, huge ints)."""
    path = ck / "trainer_state.json"
    state = json.loads(path.read_text())
    for key in text_patch:
        state[key] = f"@@{key}@@"
    text = json.dumps(state)
    for key, raw in text_patch.items():
        text = text.replace(f'"@@{key}@@"', raw)
    path.write_text(text)


# ---------------------------------------------------------------------------------------------------------------
# Roots


def test_a_single_file_root_is_named_once_in_every_format(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = (FIXTURES / "stub-shadow" / "checkpoint-4" / "pytorch_model.bin").read_bytes()
    (tmp_path / "trunc.bin").write_bytes(whole[:500])
    monkeypatch.chdir(tmp_path)
    code, out, _ = invoke("scan", "trunc.bin")
    assert code == 1
    assert out.startswith("trunc.bin: CKD203 [error]"), out
    _, sarif, _ = invoke("scan", "--format", "sarif", "trunc.bin")
    (result,) = json.loads(sarif)["runs"][0]["results"]
    assert result["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "trunc.bin"
    _, github, _ = invoke("scan", "--format", "github", "trunc.bin")
    assert "file=trunc.bin," in github and "trunc.bin/trunc.bin" not in github


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_root_that_is_a_fifo_or_a_device_is_a_usage_error(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "root"
    if kind == "fifo":
        os.mkfifo(root)
    else:
        root.symlink_to("/dev/zero")
    code, out, err = invoke("scan", str(root))
    assert code == 2 and out == ""
    assert "not a folder or a regular file" in err
    code, out, err = invoke("inspect", str(root))  # never opened: a FIFO would block the read
    assert code == 2 and out == ""
    assert "not a folder or a regular file" in err


def test_closed_stdout_is_no_traceback(tmp_path: Path) -> None:
    root = copy_fixture("stub-shadow", tmp_path / "run")
    proc = subprocess.run(
        ["sh", "-c", f'"{sys.executable}" -m ckptdoctor scan "{root}" >&-'], capture_output=True, text=True, timeout=60
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 1


def test_text_report_of_many_checkpoints_counts_each_row(tmp_path: Path) -> None:
    """The statuses come from one tally of the findings (rendering 10,000 rows took 11 s when every row scanned
    every finding; speed is measured by hand, not asserted here)."""
    for i in range(1000):
        (tmp_path / f"checkpoint-{i}").mkdir()
    text = render_text(scan(str(tmp_path)))
    assert re.search(r"^checkpoint-999 +999 ", text, re.MULTILINE)
    assert len(re.findall(r"  1 warning$", text, re.MULTILINE)) == 999
    assert len(re.findall(r"  1 error  <- resume picks$", text, re.MULTILINE)) == 1


@pytest.mark.parametrize(("code", "why"), [("CKD407", "`ckptdoctor gate` runs"), ("CKD209", "only with --deep")])
def test_selecting_only_rules_a_scan_never_runs_is_a_usage_error(code: str, why: str) -> None:
    # was: exit 0, "No problems found", having checked nothing
    status, out, err = invoke("scan", "--select", code, str(FIXTURES / "stub-shadow"))
    assert status == 2 and out == "" and why in err


# ---------------------------------------------------------------------------------------------------------------
# Names a terminal would act on


def test_control_characters_in_names_are_escaped_in_text_not_in_json(tmp_path: Path) -> None:
    root = copy_fixture("stub-shadow", tmp_path / "run")
    (root / "checkpoint-8").rename(root / "checkpoint-8\n")  # get_last_checkpoint's `$` accepts a trailing newline
    (root / "checkpoint-9\x1b]0;pwned\x07").mkdir()
    (root / "checkpoint-4" / "README.md").rename(root / "checkpoint-4" / "x\u202etxt.exe")
    report = scan(str(root))
    text = render_text(report, color=False)
    for raw in ("\x1b", "\x07", "\u202e"):
        assert raw not in text
    assert "`checkpoint-9\\x1b]0;pwned\\x07`" in text or "checkpoint-9\\x1b]0;pwned\\x07" in text
    for line in text.splitlines():  # a newline in a name no longer splits a finding over two lines
        assert not line.startswith("/pytorch_model.bin")
    assert f"{root}/checkpoint-8\\x0a/pytorch_model.bin: CKD201 [error]" in text
    _, out, _ = invoke("scan", "--format", "json", str(root))
    paths = {f["path"] for f in json.loads(out)["findings"]}
    assert "checkpoint-8\n/pytorch_model.bin" in paths  # JSON keeps the exact name; its escaping is JSON's


def test_gate_text_escapes_control_characters(tmp_path: Path) -> None:
    root = copy_fixture("lr-finished", tmp_path / "run\x1b[2J")
    code, out, _ = invoke("gate", str(root))
    assert code == 1 and "\x1b" not in out and "run\\x1b[2J" in out


def test_a_shard_index_naming_a_path_outside_the_checkpoint_says_so(tmp_path: Path) -> None:
    root = copy_fixture("sharded", tmp_path / "run")
    index = root / "checkpoint-8" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    first, second = list(doc["weight_map"])[:2]
    doc["weight_map"][first] = "/dev/zero"
    doc["weight_map"][second] = "../../elsewhere.safetensors"
    index.write_text(json.dumps(doc))
    messages = [f.message for f in scan(str(root)).findings if f.rule == "CKD204"]
    assert "maps 1 tensor to `/dev/zero`, a path outside the checkpoint folder" in " ".join(messages)
    assert "maps 1 tensor to `../../elsewhere.safetensors`, a path outside the checkpoint folder" in " ".join(messages)


# ---------------------------------------------------------------------------------------------------------------
# Settings files


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        (".ckptdoctor.toml", 'select = ["CKD2O1"]\n', "no rule code starts with 'CKD2O1'"),
        (".ckptdoctor.toml", 'ignore = ["CKD9"]\n', "no rule code starts with 'CKD9'"),
        (".ckptdoctor.toml", '[severity]\nCKD9 = "info"\n', "severity CKD9: not a rule code"),
        (".ckptdoctor.toml", 'fail-on = "never"\nfail_on = "error"\n', "not both"),
        (".ckptdoctor.toml", "x = " + "[" * 50_000 + "]" * 50_000 + "\n", "nested too deeply"),
    ],
)
def test_a_settings_file_that_would_silently_check_nothing_is_a_usage_error(
    tmp_path: Path, name: str, text: str, expected: str
) -> None:
    root = copy_fixture("stub-shadow", tmp_path / "run")
    (root / name).write_text(text)
    code, out, err = invoke("scan", str(root))
    assert code == 2 and out == ""
    assert expected in err


def test_each_root_is_judged_by_its_own_settings_file(tmp_path: Path) -> None:
    quiet = copy_fixture("stub-shadow", tmp_path / "quiet")
    (quiet / ".ckptdoctor.toml").write_text('ignore = ["CKD2"]\n')
    plain = copy_fixture("stub-shadow", tmp_path / "plain")
    for order in ((quiet, plain), (plain, quiet)):  # the first root's file once silenced the second root too
        code, out, _ = invoke("scan", "--format", "json", *map(str, order))
        doc = json.loads(out)
        assert code == 1
        assert sorted(f["root"] for f in doc["findings"]) == [str(plain)] * 2
        assert doc["roots"] == [str(p) for p in order]


def test_a_pyproject_whose_tool_is_not_a_table_is_not_ours(tmp_path: Path) -> None:
    root = copy_fixture("stub-shadow", tmp_path / "run")
    (root / "pyproject.toml").write_text("tool = 3\n")
    code, out, _ = invoke("scan", str(root))
    assert code == 1 and "CKD201" in out


# ---------------------------------------------------------------------------------------------------------------
# The gate: numbers from the command line, a JSON file or the checkpoint itself


@pytest.mark.parametrize(
    "args",
    [
        ("--num-train-epochs", "nan"),
        ("--num-train-epochs", "inf"),
        ("--learning-rate", "nan"),
        ("--learning-rate", "1e400"),
        ("--warmup-steps", "inf"),
    ],
)
def test_gate_non_finite_planned_numbers_are_usage_errors(args: tuple[str, str]) -> None:
    code, out, err = invoke("gate", str(FIXTURES / "clean-full"), *args)
    assert code == 2 and out == ""
    assert "must be a finite number" in err


def test_gate_lr_steps_is_bounded() -> None:
    # 100,000,000 predicted LRs took minutes and gigabytes before printing one line of them.
    code, out, err = invoke(
        "gate", str(FIXTURES / "clean-full"), "--max-steps", "1000000000", "--lr-steps", "100000001"
    )
    assert code == 2 and out == "" and "--lr-steps" in err
    with pytest.raises(GateInputError, match="lr_steps"):
        gate(FIXTURES / "clean-full", lr_steps=10**8)
    with pytest.raises(GateInputError, match="lr_steps"):
        gate(FIXTURES / "clean-full", lr_steps=-1)


@pytest.mark.parametrize(
    ("planned", "match"),
    [
        ({"max_steps": "10"}, "max_steps must be an integer"),
        ({"max_steps": True}, "max_steps must be an integer"),
        ({"steps_per_epoch": 0}, "steps_per_epoch must be an integer >= 1"),  # was ZeroDivisionError, as CKD413
        ({"world_size": 0}, "world_size must be an integer >= 1"),
        ({"num_train_epochs": "3"}, "num_train_epochs must be a finite number"),
        ({"lr_scheduler_kwargs": [1], "max_steps": 40}, "lr_scheduler_kwargs must be a mapping"),  # was TypeError
        ({"ignore_data_skip": "yes"}, "ignore_data_skip must be True or False"),
        ({"lr_steps": 2.5}, "lr_steps must be an integer"),
    ],
)
def test_gate_api_rejects_planned_values_of_the_wrong_type(planned: dict[str, object], match: str) -> None:
    with pytest.raises(GateInputError, match=match):
        gate(FIXTURES / "clean-full", **planned)


def test_gate_api_takes_scheduler_kwargs_as_a_json_string_like_training_arguments() -> None:
    # was ValueError from dict() on the string
    as_text = gate(
        FIXTURES / "clean-full",
        max_steps=40,
        lr_scheduler_type="cosine_with_restarts",
        lr_scheduler_kwargs='{"num_cycles": 2}',
    )
    as_dict = gate(
        FIXTURES / "clean-full",
        max_steps=40,
        lr_scheduler_type="cosine_with_restarts",
        lr_scheduler_kwargs={"num_cycles": 2},
    )
    assert as_text.lr == as_dict.lr and len(as_text.lr) == 5


def test_gate_api_rejects_non_finite_planned_numbers() -> None:
    with pytest.raises(GateInputError, match="num_train_epochs"):
        gate(FIXTURES / "clean-full", num_train_epochs=float("nan"))
    with pytest.raises(GateInputError, match="learning_rate"):
        gate(FIXTURES / "clean-full", training_args={"learning_rate": float("inf")})


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        ({"num_train_epochs": "1e999", "max_steps": "0"}, "OverflowError"),
        ({"num_train_epochs": "NaN", "max_steps": "0"}, "ValueError"),
        ({"max_steps": "1" + "0" * 400}, "OverflowError"),
    ],
)
def test_gate_on_a_trainer_state_with_impossible_numbers_predicts_the_crash(
    tmp_path: Path, patch: dict[str, str], expected: str
) -> None:
    root = copy_fixture("clean-full", tmp_path / "run")
    ck = root / "checkpoint-8"
    (ck / "training_args.bin").unlink()  # so trainer_state.json supplies the arguments
    patch_state(ck, patch)
    code, out, _ = invoke("gate", str(root))
    assert code == 1
    assert "CKD413" in out and expected in out
    code, out, _ = invoke("gate", "--format", "json", str(root))
    doc = json.loads(out)  # strict JSON: non-finite values are null
    assert code == 1 and doc["verdict"] == "fail"
    assert any(f["rule"] == "CKD413" for f in doc["findings"])


def test_gate_scheduler_kwargs_of_the_wrong_type_or_size(tmp_path: Path) -> None:
    args = tmp_path / "args.json"
    args.write_text(
        json.dumps({"lr_scheduler_type": "cosine_with_restarts", "lr_scheduler_kwargs": {"num_cycles": "x"}})
    )
    code, out, _ = invoke("gate", str(FIXTURES / "clean-full"), "--training-args", str(args), "--max-steps", "40")
    assert code == 1 and "CKD413" in out and "ValueError" in out
    args.write_text('{"lr_scheduler_type": "polynomial", "lr_scheduler_kwargs": {"power": 1e400}}')
    code, out, _ = invoke(
        "gate", str(FIXTURES / "clean-full"), "--training-args", str(args), "--max-steps", "40", "--format", "json"
    )
    doc = json.loads(out)
    assert doc["resolved"]["lr_scheduler_kwargs"] == {"power": None}
    assert all(isinstance(x, float) for x in doc["lr"])


def test_gate_checkpoint_option_naming_a_folder_without_weights(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    code, out, _ = invoke("gate", str(FIXTURES / "clean-full"), "--checkpoint", str(tmp_path / "empty"))
    assert code == 1
    assert "Can't find a valid checkpoint" in out and "resume_from_checkpoint=True finds" not in out


# ---------------------------------------------------------------------------------------------------------------
# Help


def test_top_level_help_shows_whole_command_summaries() -> None:
    code, out, _ = invoke("--help")
    assert code == 0
    assert "explain  Print one rule's document (by code, e.g. CKD201, or by name)." in out


# ---------------------------------------------------------------------------------------------------------------
# Storage backends that log tracebacks


def test_a_backend_logging_a_traceback_shows_one_line(tmp_path: Path) -> None:
    """gcsfs logs each failed request with its traceback (seen offline: 50 lines for `scan gs://bucket/run`); the
    command line shows the backend's message on one line and its own error once."""
    script = tmp_path / "boom.py"
    script.write_text(
        "import logging, sys\n"
        "import fsspec\n"
        "from fsspec.implementations.memory import MemoryFileSystem\n"
        "class Boom(MemoryFileSystem):\n"
        "    protocol = 'boom'\n"
        "    def exists(self, path, **kw):\n"
        "        try:\n"
        "            raise ConnectionError('Cannot connect to host example.invalid')\n"
        "        except ConnectionError:\n"
        "            logging.getLogger('boomfs').exception('_request out of retries on exception')\n"
        "            raise\n"
        "fsspec.register_implementation('boom', Boom, clobber=True)\n"
        "from ckptdoctor.cli import main\n"
        "sys.argv = ['ckptdoctor', 'scan', 'boom://bucket/run']\n"
        "main()\n"
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        "boomfs: _request out of retries on exception",
        "Error: boom://bucket/run: cannot list: ConnectionError: Cannot connect to host example.invalid",
    ]


# ---------------------------------------------------------------------------------------------------------------
# fix's --select; Ctrl-C


def test_fix_selecting_only_rules_it_never_runs_is_a_usage_error() -> None:
    # was: "Nothing to fix", exit 0, having checked nothing
    status, out, err = invoke("fix", "--dry-run", "--select", "CKD407", str(FIXTURES / "stub-shadow"))
    assert status == 2 and out == "" and "`ckptdoctor gate` runs" in err


@pytest.mark.parametrize("command", ["scan", "fix"])
def test_an_interrupt_exits_130_not_1(command: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """click says "Aborted!" and exits 1 on Ctrl-C, which a script reads as "findings"."""
    import ckptdoctor.scanner

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(ckptdoctor.scanner, "scan", interrupted)
    monkeypatch.setattr(ckptdoctor.scanner, "scan_root", interrupted)  # the command's scan, one part at a time
    root = copy_fixture("stub-shadow", tmp_path / "run")
    status, _, err = invoke(command, str(root))
    assert status == 130 and "Interrupted." in err and "Aborted" not in err
