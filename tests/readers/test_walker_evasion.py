"""The walker reads what the real loaders read (issue 22, causes 2-5): each payload here is live under its victim's
real loader (a child process creates its canary) and flagged by a scan that never runs it; the text files real
runs hold beside their checkpoints are not pickles (issue 23)."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptdoctor.model import FileKind
from ckptdoctor.readers.sniff import HEAD_BYTES, sniff
from ckptdoctor.scanner import scan
from tests.helpers.payloads import _by_path

torch = pytest.importorskip("torch")

JOBLIB_LAYER = Path("/work/stacks/joblib")  # joblib is no dependency: a --target layer built for these tests

# Each item: {"path", "loader"}; loaders as the victims load: pickle.load, torch.load(weights_only=False), joblib.load,
# and a weights-only torch.load whose `*._extra_state` tensors are then unpickled as TransformerEngine's
# set_extra_state does (transformer_engine/pytorch/module/base.py), or whose `_extra_state` BytesIO objects are
# torch.load'ed as older TransformerEngine did.
_LOADER = r"""
import io, json, pickle, sys, time
for item in json.load(sys.stdin):
    path, loader = item["path"], item["loader"]
    try:
        if loader == "pickle":
            with open(path, "rb") as f:
                pickle.load(f)
        elif loader == "joblib":
            import joblib
            joblib.load(path)
        elif loader == "torch":
            import torch
            torch.load(path, weights_only=False)
        elif loader == "te":
            import torch
            sd = torch.load(path, weights_only=True)
            for key, state in sd.items():
                if key.endswith("_extra_state") and isinstance(state, torch.Tensor):
                    pickle.loads(state.detach().cpu().numpy().tobytes())
        elif loader == "te-bytesio":
            import torch
            sd = torch.load(path, weights_only=False)
            for key, state in sd.items():
                if key.endswith("_extra_state") and isinstance(state, io.BytesIO):
                    state.seek(0)
                    torch.load(state, weights_only=False)
    except BaseException:
        pass  # payloads may break their stream after the call ran
time.sleep(0.3)
"""


def _touch(canary: Path) -> bytes:
    """A protocol 0 stream that runs ``os.system("touch canary")`` (``posix.system`` once imported)."""
    return b"cos\nsystem\n(S'touch " + str(canary).encode() + b"'\ntR."


class _Reduce:
    def __init__(self, func: Callable[..., object], *args: object) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Callable[..., object], tuple[object, ...]]:
        return self.func, self.args


def _evil(canary: Path, protocol: int = 4) -> bytes:
    return pickle.dumps(_Reduce(os.system, f"touch {canary}"), protocol=protocol)


def _legacy_hex_magic(canary: Path) -> bytes:
    """A legacy torch file whose magic number and version are protocol 0 INTs in hex and octal: ``torch.load``'s
    unpickler reads them with strtol base 0, so they match, and its third pickle.load (sys_info) runs the call."""
    magic = b"I0x1950a86a20f9469cfc6c\n."
    version = b"I01751\n."  # 1001 in octal
    return magic + version + _touch(canary) + pickle.dumps({}, protocol=2) + pickle.dumps([], protocol=2)


def _nul_int(canary: Path) -> bytes:
    """An INT whose line holds a NUL: the C unpickler reads the number up to it and goes on to the call."""
    return b"(I1\x00padding\n0" + _touch(canary)


def _nul_float(canary: Path) -> bytes:
    return b"(F1.5\x00padding\n0" + _touch(canary)


def _long_first_opcode(canary: Path) -> bytes:
    """A ``.pkl`` whose first opcode's argument (a STRING) runs far past the sniffer's head."""
    return b"S'" + b"a" * (4 * HEAD_BYTES) + b"'\n0" + _touch(canary)


def _long_binunicode_first(canary: Path) -> bytes:
    """A protocol 1 stream (no PROTO) whose first opcode is a long BINUNICODE."""
    text = ("x" * (3 * HEAD_BYTES)).encode()
    return b"X" + len(text).to_bytes(4, "little") + text + b"0" + _touch(canary)


def _joblib_zlib(canary: Path) -> bytes:
    """What ``joblib.dump(obj, path, compress=3)`` writes (its default codec, zlib) around a payload."""
    return zlib.compress(_evil(canary), 3)


def _joblib_zf(canary: Path) -> bytes:
    """joblib < 0.10's compressed layout: ``ZF``, a hex length padded to 19 bytes, then zlib."""
    data = _evil(canary)
    return b"ZF" + hex(len(data)).encode().ljust(19) + zlib.compress(data)


def _joblib_lzma(canary: Path) -> bytes:
    import lzma

    return lzma.compress(_evil(canary), format=lzma.FORMAT_ALONE)


def _te_extra_state(canary: Path) -> bytes:
    """A weights-only-loadable state dict whose `_extra_state` uint8 tensor holds a pickle (TE unpickles it)."""
    state = torch.frombuffer(bytearray(_evil(canary)), dtype=torch.uint8)
    buf = io.BytesIO()
    torch.save({"layer.weight": torch.zeros(2, 2), "layer._extra_state": state}, buf)
    return buf.getvalue()


def _te_extra_state_legacy(canary: Path) -> bytes:
    """The same in torch's legacy (magic-number) format, whose storages follow the pickles."""
    state = torch.frombuffer(bytearray(_evil(canary)), dtype=torch.uint8)
    buf = io.BytesIO()
    torch.save({"layer.weight": torch.zeros(2, 2), "layer._extra_state": state}, buf,
               _use_new_zipfile_serialization=False)  # fmt: skip
    return buf.getvalue()


def _te_extra_state_strided(canary: Path) -> bytes:
    """The same, as a non-contiguous view: ``tobytes()`` gathers the elements the view names, not the storage."""
    evil = _evil(canary)
    spread = bytearray(2 * len(evil))
    spread[::2] = evil
    view = torch.frombuffer(spread, dtype=torch.uint8)[::2]
    buf = io.BytesIO()
    torch.save({"layer._extra_state": view}, buf)
    return buf.getvalue()


def _te_bytesio_protocol0(canary: Path) -> bytes:
    """An older TE `_extra_state`: a BytesIO that set_extra_state hands to torch.load; here a protocol 0 stream."""
    buf = io.BytesIO()
    torch.save({"layer._extra_state": io.BytesIO(_touch(canary))}, buf)
    return buf.getvalue()


# name -> (file name in the checkpoint, builder, loader, text a CKD601/603/605 finding must hold)
PAYLOADS: dict[str, tuple[str, Callable[[Path], bytes], str, str]] = {
    "protocol 0 named training_args.yaml": ("training_args.yaml", _touch, "pickle", "system`"),
    "protocol 0 named README.md": ("README.md", _touch, "pickle", "system`"),
    "legacy torch, hex magic": ("pytorch_model.bin", _legacy_hex_magic, "torch", "system`"),
    "INT line with a NUL": ("random_states_0.pkl", _nul_int, "pickle", "system`"),
    "FLOAT line with a NUL": ("random_states_1.pkl", _nul_float, "pickle", "system`"),
    "long first STRING": ("model.pkl", _long_first_opcode, "pickle", "system`"),
    "long first BINUNICODE": ("model.joblib", _long_binunicode_first, "pickle", "system`"),
    "joblib zlib": ("model.joblib", _joblib_zlib, "joblib", "system`"),
    "joblib ZF": ("model.pkl", _joblib_zf, "joblib", "system`"),
    "joblib lzma": ("model.pkl.lzma", _joblib_lzma, "joblib", "system`"),
    "TE extra_state": ("model.pt", _te_extra_state, "te", "system`"),
    "TE extra_state legacy": ("pytorch_model.bin", _te_extra_state_legacy, "te", "system`"),
    "TE extra_state strided": ("model.pt", _te_extra_state_strided, "te", "system`"),
    "TE BytesIO protocol 0": ("model.pt", _te_bytesio_protocol0, "te-bytesio", "system`"),
}


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name)


def _joblib_env() -> dict[str, str] | None:
    if not (JOBLIB_LAYER / "joblib").is_dir():
        return None
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(JOBLIB_LAYER), env.get("PYTHONPATH", "")]))
    return env


def test_every_payload_is_live(tmp_path: Path) -> None:
    """Each payload runs under its loader (in a child process): none of them is dead weight."""
    env = _joblib_env()
    items, expected = [], []
    for name, (filename, build, loader, _) in PAYLOADS.items():
        if loader == "joblib" and env is None:
            continue
        canary = tmp_path / f"canary-{_slug(name)}"
        path = tmp_path / _slug(name) / filename
        path.parent.mkdir()
        path.write_bytes(build(canary))
        items.append({"path": str(path), "loader": loader})
        expected.append((name, canary))
    subprocess.run([sys.executable, "-c", _LOADER], input=json.dumps(items).encode(), check=True, timeout=300,
                   capture_output=True, cwd=tmp_path, env=env)  # fmt: skip
    dead = [name for name, canary in expected if not canary.exists()]
    assert not dead, f"payloads that did not run: {dead}"


def test_every_payload_is_flagged_and_never_run(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    root = tmp_path / "root"
    placed = {}
    for name, (filename, build, _, expect) in PAYLOADS.items():
        path = root / _slug(name) / "checkpoint-1" / filename
        path.parent.mkdir(parents=True)
        path.write_bytes(build(canary))
        placed[str(path.relative_to(root))] = (name, expect)
    found = _by_path(scan(str(root)).findings)
    missed = []
    for path, (name, expect) in placed.items():
        hits = [f for f in found.get(path, []) if f.rule in ("CKD601", "CKD603", "CKD605")]
        if not any(expect in f.message for f in hits):
            missed.append((name, [f"{f.rule}: {f.message}" for f in found.get(path, [])]))
    assert not missed, missed
    assert not canary.exists()


# ---------------------------------------------------------------------------------------------------------------
# Text is text (issue 23): LLaMA Board's training_args.yaml (yaml.safe_dump sorts keys, so fp16/fp32 runs start with
# `cutoff_len:`, a GLOBAL opcode), and the other text files real runs hold.

LLAMA_BOARD_ARGS = {
    "cutoff_len": 1024, "dataset": "alpaca_en_demo", "dataset_dir": "data", "ddp_timeout": 180000000,
    "do_train": True, "finetuning_type": "lora", "fp16": True, "gradient_accumulation_steps": 8,
    "include_num_input_tokens_seen": True, "learning_rate": 5.0e-05, "logging_steps": 5, "lora_alpha": 16,
    "lora_dropout": 0, "lora_rank": 8, "lora_target": "all", "lr_scheduler_type": "cosine", "max_grad_norm": 1.0,
    "max_samples": 100000, "model_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct", "num_train_epochs": 3.0,
    "optim": "adamw_torch", "output_dir": "saves/Qwen2.5-0.5B-Instruct/lora/train_2026-11-27-00-00-00",
    "packing": False, "per_device_train_batch_size": 2, "plot_loss": True, "preprocessing_num_workers": 16,
    "report_to": "none", "save_steps": 100, "stage": "sft", "template": "qwen", "trust_remote_code": True,
    "warmup_steps": 0,
}  # fmt: skip

TEXTS = {
    "README.md": b"checkpoint\nThis folder holds the adapter.\n",
    "notes.txt": b"cat\nfoo\nbar baz\n",
    "chat_template.jinja": b"{% for message in messages %}{{ message['content'] }}{% endfor %}\n",
    "trainer_log.jsonl": b'{"current_steps": 5, "total_steps": 10, "loss": 1.5}\n{"current_steps": 10}\n',
    "run.py": b"class Foo:\n    pass\n",
    "config.yaml": b"cd: into\nthe: folder\n",
}


def _yaml_text() -> bytes:
    yaml = pytest.importorskip("yaml")
    # LLaMA-Factory src/llamafactory/webui/common.py `save_args`: `yaml.safe_dump` (keys sorted by default)
    text: bytes = yaml.safe_dump(LLAMA_BOARD_ARGS).encode()
    assert text.startswith(b"cutoff_len: 1024\n")
    return text


def test_llama_board_training_args_yaml_is_text() -> None:
    text = _yaml_text()
    for name in ("training_args.yaml", "llamaboard_config.yaml", "training_args"):
        assert sniff(text[:HEAD_BYTES], name, len(text)) is FileKind.OTHER, name


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_text_files_of_real_runs_are_not_pickles(name: str) -> None:
    data = TEXTS[name]
    assert sniff(data[:HEAD_BYTES], name, len(data)) is not FileKind.PICKLE


def test_llama_factory_run_scans_without_security_findings(tmp_path: Path) -> None:
    """A LLaMA-Factory-shaped output folder: its training_args.yaml and text files raise no CKD601/CKD603."""
    run = tmp_path / "saves" / "lora" / "train"
    ck = run / "checkpoint-100"
    ck.mkdir(parents=True)
    (run / "training_args.yaml").write_bytes(_yaml_text())
    (ck / "training_args.yaml").write_bytes(_yaml_text())
    for name, data in TEXTS.items():
        (run / name).write_bytes(data)
        (ck / name).write_bytes(data)
    report = scan(str(tmp_path / "saves"))
    assert [f for f in report.findings if f.rule.startswith("CKD6")] == []
    # JSON Lines and Jinja templates are text, not JSON documents (issue 23: CKD211 on every chat-model checkpoint)
    assert [f for f in report.findings if f.rule in ("CKD202", "CKD211")] == []


def test_a_pickle_name_keeps_a_long_first_opcode() -> None:
    data = _long_first_opcode(Path("/nonexistent"))
    assert sniff(data[:HEAD_BYTES], "model.pkl", len(data)) is FileKind.PICKLE
    assert sniff(data[:HEAD_BYTES], "x.joblib", len(data)) is FileKind.PICKLE


# ---------------------------------------------------------------------------------------------------------------
# The text arguments of protocol 0 opcodes read exactly as the C unpickler reads them (differential, seeded).

_LINE_ALPHABET = [b"0", b"1", b"7", b"8", b"x", b"X", b"a", b"f", b"e", b".", b"+", b"-", b" ", b"\t", b"\x00",
                  b"_", b"L", b"b", b"inf", b"nan", b"z", b"\x0b"]  # fmt: skip


def _outcome(data: bytes) -> tuple[object, ...]:
    from ckptdoctor.readers.pickle_walk import walk_pickle

    facts, problems, _ = walk_pickle(data)
    if problems or facts is None:
        return ("error",)
    return ("ok", type(facts.value), repr(facts.value))


def _real(data: bytes) -> tuple[object, ...]:
    try:
        value = pickle.loads(data)  # our own harmless bytes: numbers only
    except Exception:
        return ("error",)
    return ("ok", type(value), repr(value))


def test_number_lines_parse_as_the_c_unpickler_does() -> None:
    import random

    rnd = random.Random(22)
    for _ in range(20_000):
        line = b"".join(rnd.choice(_LINE_ALPHABET) for _ in range(rnd.randint(0, 5)))
        data = rnd.choice([b"I", b"L", b"F"]) + line + b"\n."
        assert _outcome(data) == _real(data), data
    for _ in range(5_000):
        a, b = (b"".join(rnd.choice([b"0", b"1", b" ", b"\x00", b"_", b"-", b"+"]) for _ in range(rnd.randint(0, 4)))
                for _ in range(2))  # fmt: skip
        data = b"(I5\np" + a + b"\n0g" + b + b"\n."
        assert _outcome(data) == _real(data), data


@pytest.mark.parametrize(
    ("line", "value"),
    [(b"I0x10", 16), (b"I010", 8), (b"I 1", True), (b"I+1", True), (b"I-0", False), (b"I1\x00z", 1),
     (b"I01", True), (b"I0 ", 0), (b"L0x10L", 16), (b"F1.5\x00zz", 1.5), (b"Finf", float("inf"))],
)  # fmt: skip
def test_edge_lines(line: bytes, value: object) -> None:
    assert _real(line + b"\n.") == _outcome(line + b"\n.") == ("ok", type(value), repr(value))


# ---------------------------------------------------------------------------------------------------------------
# Every budget is a finding.


def _verdict_of(data: bytes) -> tuple[str, ...]:
    from ckptdoctor.pickle_verdict.judge import judge
    from ckptdoctor.readers.pickle_walk import walk_pickle

    facts, _, _ = walk_pickle(data)
    assert facts is not None
    return judge(facts).unsafe


def test_nested_protocol0_pickle_in_bytes_is_judged() -> None:
    assert any("system" in u for u in _verdict_of(pickle.dumps({"blob": _touch(Path("/x"))}, protocol=2)))


def test_nested_pickles_past_the_count_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    """Hundreds of nested pickles (a TransformerEngine model's `_extra_state` records) are judged; past the count
    bound the rest is a finding."""
    import ckptdoctor.readers.nested as nested

    inner = pickle.dumps({"a": 1}, protocol=2)
    many = pickle.dumps([inner + i.to_bytes(2, "little") for i in range(600)], protocol=2)
    assert _verdict_of(many) == ()
    monkeypatch.setattr(nested, "MAX_NESTED", 64)
    assert any("past the first 64" in u for u in _verdict_of(many))
    few = pickle.dumps([inner] * 3, protocol=2)
    assert _verdict_of(few) == ()


def test_nested_pickles_past_the_byte_budget_are_reported() -> None:
    from ckptdoctor.limits import Limits
    from ckptdoctor.pickle_verdict.judge import judge
    from ckptdoctor.readers.pickle_walk import walk_pickle

    inner = pickle.dumps({"a": "x" * 100}, protocol=2)
    facts, _, _ = walk_pickle(pickle.dumps([inner + bytes([i]) for i in range(50)], protocol=2))
    assert facts is not None and judge(facts).unsafe == ()
    assert any("bytes in all" in u for u in judge(facts, Limits(pickle_bytes=len(inner) * 10)).unsafe)


def test_nested_pickles_past_the_depth_are_reported() -> None:
    blob = pickle.dumps({"a": 1}, protocol=2)
    for _ in range(5):
        blob = pickle.dumps({"inner": blob}, protocol=2)
    assert any("nested more than" in u for u in _verdict_of(blob))


def test_globals_deep_in_call_arguments_count_as_called() -> None:
    """The call tracker looks at every level of a call's arguments (it stopped at three, and at 64 items)."""
    from ckptdoctor.model import GlobalRef
    from ckptdoctor.readers.pickle_walk import walk_pickle

    deep = b"\x80\x02cbuiltins\nlist\n" + b"(" + b"]" * 6 + b"cmylib\nHook\na" + b"a" * 5 + b"tR."
    wide = b"\x80\x02cbuiltins\nlist\n(" + b"]" + b"K\x01a" * 100 + b"cmylib\nHook\natR."
    for data in (deep, wide):
        facts, problems, _ = walk_pickle(data)
        assert problems == () and facts is not None
        assert GlobalRef("mylib", "Hook") in facts.calls


def test_the_call_trackers_budget_is_a_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptdoctor.readers.pickle_walk as pw

    monkeypatch.setattr(pw, "_PASSED_VALUES", 50)
    data = b"\x80\x02cbuiltins\nlist\n(]" + b"]a" * 100 + b"tR."  # a list of 100 lists: more than 50 values
    facts, _, _ = pw.walk_pickle(data)
    assert facts is not None and pw.PAST_BUDGET in facts.calls
    from ckptdoctor.pickle_verdict.judge import judge

    assert any("budget" in u for u in judge(facts).unsafe)


# ---------------------------------------------------------------------------------------------------------------
# A container reader that gives up keeps the walk's own problem.


def test_failed_legacy_walk_keeps_its_problem(tmp_path: Path) -> None:
    ck = tmp_path / "run" / "checkpoint-1"
    ck.mkdir(parents=True)
    (ck / "pytorch_model.bin").write_bytes(b"(I1\nI2\nI3\nI4\nI5\nt\x00garbage")
    (ck / "zeroed.bin").write_bytes(bytes(4096))
    found = _by_path(scan(str(tmp_path / "run")).findings)
    assert any(f.rule == "CKD603" for f in found["checkpoint-1/pytorch_model.bin"])
    assert not any(f.rule == "CKD603" for f in found.get("checkpoint-1/zeroed.bin", []))


def test_safetensors_shaped_pickle_keeps_its_problem() -> None:
    from ckptdoctor.limits import DEFAULT_LIMITS
    from ckptdoctor.readers import _read_safetensors_or_pickle

    # Eight bytes that are a pickle's first opcodes and a (too large) header length, then a JSON header: the
    # safetensors reader gives up on the length; the walk's own problem (at the header's `{`) is kept.
    data = b"\x80\x02((((((" + b'{"__metadata__":{}}'
    out = _read_safetensors_or_pickle(io.BytesIO(data), len(data), DEFAULT_LIMITS)
    assert any("read as a pickle" in p.message for p in out.problems)
    # A genuine header that merely starts like a pickle (PROTO 2: a 640-byte header) is left alone.
    from safetensors.torch import save

    real = save({"w": torch.zeros(1)}, metadata={"x": "y" * (640 - 60)})
    out = _read_safetensors_or_pickle(io.BytesIO(real), len(real), DEFAULT_LIMITS)
    assert not any("read as a pickle" in p.message for p in out.problems)


# ---------------------------------------------------------------------------------------------------------------
# Clean real files stay clean.


def test_clean_te_extra_state_and_joblib_files_raise_no_ckd6xx(tmp_path: Path) -> None:
    ck = tmp_path / "run" / "checkpoint-1"
    ck.mkdir(parents=True)
    for name, state in (("none.pt", None), ("plain.pt", {"amax_history_len": 16, "margin": 0, "scale": [1.0]})):
        t = torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)
        torch.save({"layer.weight": torch.zeros(2), "layer._extra_state": t}, ck / name)
    env = _joblib_env()
    if env is not None:  # written by joblib itself, with its default codec and the others it offers
        script = (
            "import joblib, sys\n"
            "obj = {'a': 1, 'b': [1.5, 'x'], 'c': (None, True)}\n"
            "for name, c in [('plain.joblib', 0), ('z.joblib', 3), ('lz.joblib', ('lzma', 3)),"
            " ('gz.pkl', ('gzip', 3)), ('bz.pkl', ('bz2', 3)), ('x.pkl.z', True)]:\n"
            "    joblib.dump(obj, sys.argv[1] + '/' + name, compress=c)\n"
        )
        subprocess.run([sys.executable, "-c", script, str(ck)], check=True, env=env, timeout=120, capture_output=True)
    report = scan(str(tmp_path / "run"))
    assert [f"{f.rule} {f.path}: {f.message}" for f in report.findings if f.rule.startswith("CKD6")] == []


def test_the_passed_search_budget_is_a_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    """A class of an unknown package named in a big value: past the search's budget it may be handed to a call."""
    import ckptdoctor.pickle_verdict.judge as pa
    from ckptdoctor.model import GlobalRef, PickleFacts
    from ckptdoctor.pickle_verdict.policy import Standing

    monkeypatch.setattr(pa.FileStandings, "__call__", lambda self, g: (Standing.UNKNOWN, "test"))
    value = {"a": [[i] for i in range(100)], "cls": GlobalRef("mylib", "Cls")}
    facts = PickleFacts(2, value, (GlobalRef("mylib", "Cls"),), (), 10)
    assert pa.judge(facts).unsafe == ()
    monkeypatch.setattr(pa, "_MAX_PASSED", 20)
    assert any("not searched" in u for u in pa.judge(facts).unsafe)
