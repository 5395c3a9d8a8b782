"""``--deep``: streaming tensor-data checks on real files (torch, safetensors, peft) and the numpy boundary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from ckptdoctor import deep
from ckptdoctor.cli import main
from ckptdoctor.discover import discover
from ckptdoctor.findings import Finding
from ckptdoctor.model import ProblemKind
from ckptdoctor.scanner import scan
from tests.helpers.builders import make_checkpoint, trainer_state
from tests.helpers.console import HANG_GUARD

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def _deep(root: Path, jobs: int = 1) -> list[Finding]:
    return list(scan(str(root), deep=True, jobs=jobs).findings)


def _codes(findings: list[Finding], code: str) -> dict[str, str]:
    return {f.path: f.message for f in findings if f.rule == code}


def _poisoned() -> dict[str, torch.Tensor]:
    """One tensor per dtype with NaN and Inf at known places (one spanning chunk boundaries), plus clean ones."""
    torch.manual_seed(0)
    out: dict[str, torch.Tensor] = {}
    for dt in DTYPES:
        name = str(dt).split(".")[-1]
        t = torch.randn(64, 33).to(dt)
        t[0, 0] = float("nan")
        t[63, 32] = float("inf")  # the very last element
        t[10, 5] = float("-inf")
        out[f"bad.{name}.weight"] = t
        out[f"good.{name}.weight"] = torch.randn(17, 9).to(dt)
    out["ints"] = torch.arange(10)
    return out


@pytest.mark.parametrize("chunk", [deep.CHUNK_BYTES, 64, 6])
def test_nan_and_inf_in_safetensors_and_torch_zip(tmp_path: Path, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deep, "CHUNK_BYTES", chunk)  # small chunks: every tensor spans many reads
    sd = _poisoned()
    save_file(sd, str(tmp_path / "model.safetensors"))
    torch.save(sd, tmp_path / "pytorch_model.bin")
    found = _codes(_deep(tmp_path), "CKD209")
    assert set(found) == {"model.safetensors", "pytorch_model.bin"}
    for msg in found.values():
        assert msg.startswith("4 of 8 floating-point tensors hold 4 NaN and 8 Inf values")
    tree = scan(str(tmp_path), deep=True).trees[0]
    for data in tree.data:
        stats = {t.name: (t.nan, t.inf, t.numel) for t in data.tensors}
        for dt in DTYPES:
            name = str(dt).split(".")[-1]
            assert stats[f"bad.{name}.weight"] == (1, 2, 64 * 33)
            assert stats[f"good.{name}.weight"] == (0, 0, 17 * 9)
        assert "ints" not in stats  # integers hold no NaN: not even read
        assert data.problems == () and data.skipped == ()


def test_views_in_torch_archives_are_measured_over_their_own_elements(tmp_path: Path) -> None:
    base = torch.randn(8, 4)
    base[0, 0] = float("nan")
    torch.save({"base": base, "tail": base[1:], "col": base[:, 1]}, tmp_path / "pytorch_model.bin")
    tree = scan(str(tmp_path), deep=True).trees[0]
    (data,) = tree.data
    nan = {t.name: t.nan for t in data.tensors}
    assert nan == {"base": 1, "tail": 0, "col": 0}


def test_all_zero_weight_matrix_but_not_bias_or_optimizer(tmp_path: Path) -> None:
    ck = make_checkpoint(tmp_path / "checkpoint-4", 4)
    sd = {"dense.weight": torch.zeros(8, 8), "dense.bias": torch.zeros(8), "scale": torch.zeros(1)}
    save_file(sd, str(ck / "model.safetensors"))
    findings = _deep(tmp_path)
    assert _codes(findings, "CKD212") == {
        "checkpoint-4/model.safetensors": "1 of 3 floating-point tensors are all zeros: `dense.weight`"
    }


def test_healthy_checkpoint_is_silent(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "checkpoint-4", 4)
    make_checkpoint(tmp_path / "checkpoint-8", 8)
    findings = _deep(tmp_path, jobs=3)
    assert [f for f in findings if f.rule in ("CKD209", "CKD212", "CKD213", "CKD303")] == []
    tree = scan(str(tmp_path), deep=True).trees[0]
    # Weights and optimizer, scheduler, RNG archives were all streamed.
    assert {d.path.rsplit("/", 1)[-1] for d in tree.data} >= {"model.safetensors", "optimizer.pt", "rng_state.pth"}
    assert all(d.bytes_read > 0 for d in tree.data if d.path.endswith(("model.safetensors", "optimizer.pt")))


# ---------------------------------------------------------------------------------------------------------------
# LoRA adapters from peft


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(8, 8)
        self.v = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.v(torch.relu(self.q(x)))


def _adapter_checkpoint(folder: Path, step: int, train_steps: int, safe: bool = True) -> Path:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(_Tiny(), LoraConfig(r=2, target_modules=["q", "v"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(train_steps):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(str(folder), safe_serialization=safe)
    (folder / "trainer_state.json").write_text(json.dumps(trainer_state(step, 10), indent=2))
    return folder


@pytest.mark.parametrize("safe", [True, False])
def test_untrained_lora_adapter(tmp_path: Path, safe: bool) -> None:
    _adapter_checkpoint(tmp_path / "checkpoint-5", step=5, train_steps=0, safe=safe)
    _adapter_checkpoint(tmp_path / "checkpoint-10", step=10, train_steps=3, safe=safe)
    name = "adapter_model.safetensors" if safe else "adapter_model.bin"
    found = _codes(_deep(tmp_path), "CKD303")
    assert found == {
        f"checkpoint-5/{name}": "all 2 LoRA B matrices are zero after 5 training steps: "
        "the adapter is still at its initialization"
    }
    # Zero lora_B is by design: never an all-zero-tensor finding.
    assert _codes(_deep(tmp_path), "CKD212") == {}


def test_untrained_adapter_at_step_zero_is_silent(tmp_path: Path) -> None:
    _adapter_checkpoint(tmp_path / "checkpoint-0", step=0, train_steps=0)
    assert _codes(_deep(tmp_path), "CKD303") == {}


# ---------------------------------------------------------------------------------------------------------------
# Hostile and changing files


def test_file_changed_after_header_read_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    save_file({"w": torch.randn(64, 64)}, str(tmp_path / "model.safetensors"))
    torch.save({"w": torch.randn(64, 64)}, tmp_path / "pytorch_model.bin")
    tree = discover(str(tmp_path))
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(100)
    (tmp_path / "pytorch_model.bin").unlink()
    data = {d.path: d for d in deep.check_tree(tree)}
    assert [p.kind for p in data["model.safetensors"].problems] == [ProblemKind.UNREADABLE]
    assert "changed while scanning" in data["model.safetensors"].problems[0].message
    assert [p.kind for p in data["pytorch_model.bin"].problems] == [ProblemKind.UNREADABLE]


def test_truncated_and_corrupt_files_never_raise(tmp_path: Path) -> None:
    save_file({"w": torch.randn(256, 64), "v": torch.randn(64)}, str(tmp_path / "a.safetensors"))
    torch.save({"w": torch.randn(256, 64)}, tmp_path / "b.bin")
    for name in ("a.safetensors", "b.bin"):
        raw = (tmp_path / name).read_bytes()
        (tmp_path / f"trunc-{name}").write_bytes(raw[: len(raw) - 5000])
        flipped = bytearray(raw)
        for i in range(0, len(flipped), 997):
            flipped[i] ^= 0x5A
        (tmp_path / f"flip-{name}").write_bytes(bytes(flipped))
    report = scan(str(tmp_path), deep=True, jobs=2)
    assert report.trees[0].files_seen == 6
    assert not [f for f in report.findings if "internal error" in f.message]


def test_unsupported_float_dtype_is_reported_as_skipped(tmp_path: Path) -> None:
    save_file(
        {"w8": torch.randn(4, 4).to(torch.float8_e4m3fn), "w": torch.randn(4, 4)}, str(tmp_path / "m.safetensors")
    )
    found = _codes(_deep(tmp_path), "CKD213")
    assert found == {"m.safetensors": "1 floating-point tensor(s) not checked: w8 (F8_E4M3)"}


# ---------------------------------------------------------------------------------------------------------------
# Command line and the numpy boundary


def test_cli_deep_is_quiet_without_a_tty(tmp_path: Path) -> None:
    t = torch.randn(4, 4)
    t[1, 1] = float("nan")
    save_file({"w": t}, str(tmp_path / "model.safetensors"))
    result = CliRunner().invoke(main, ["scan", "--deep", "--format", "json", str(tmp_path)])
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert [f["rule"] for f in doc["findings"]] == ["CKD209"]
    assert result.stderr == ""
    plain = CliRunner().invoke(main, ["scan", "--format", "json", str(tmp_path)])
    assert plain.exit_code == 0 and json.loads(plain.stdout)["findings"] == []


def test_progress_line_shows_files_bytes_and_eta(tmp_path: Path) -> None:
    import io

    from ckptdoctor import progress

    save_file({"w": torch.randn(128, 128)}, str(tmp_path / "model.safetensors"))
    stream = io.StringIO()
    ticks = iter(range(0, 10_000, 2))  # each reading of the clock is 2 s later: past the delay, ETA shown
    with pytest.MonkeyPatch.context() as m:
        m.setattr(progress, "_clock", lambda: float(next(ticks)))
        scan(str(tmp_path), deep=True, progress=stream)
    text = stream.getvalue()
    assert "1/1 files" in text and "ETA" in text and "65.6 KB" in text
    assert text.endswith("\r")  # the line is erased before the report, as the README says


_IMPORTS = (
    "import sys\n"
    "from ckptdoctor.scanner import scan\n"
    "scan({root!r}, deep={deep}, jobs=2)\n"
    "print(sorted(m for m in ('numpy', 'torch', 'safetensors', 'peft') if m in sys.modules))\n"
)


def test_numpy_is_imported_only_with_deep(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "checkpoint-2", 2)
    for flag, expected in ((False, "[]"), (True, "['numpy']")):
        code = _IMPORTS.format(root=str(tmp_path), deep=flag)
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip() == expected


_NO_NUMPY = """
import sys
sys.modules["numpy"] = None  # what an environment without numpy gives: ImportError on import
import ckptdoctor
from ckptdoctor.errors import UsageError
try:
    ckptdoctor.scan({root!r}, deep=True)
except UsageError as exc:
    print(type(exc).__name__, isinstance(exc, RuntimeError), exc)
"""


def test_deep_without_numpy_is_a_usage_error(tmp_path: Path) -> None:
    """As docs/api.md says of everything the command exits 2 for: `UsageError` (it was a bare RuntimeError)."""
    make_checkpoint(tmp_path / "checkpoint-2", 2)
    p = subprocess.run([sys.executable, "-c", _NO_NUMPY.format(root=str(tmp_path))], capture_output=True, text=True,
                       timeout=HANG_GUARD)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("DeepUnavailable True --deep needs numpy"), p.stdout


_SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-40, -1e-40, 65504.0, -3.0e38]
_SPECIAL += [float("inf"), float("-inf"), float("nan"), -float("nan")]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_chunk_stats_match_torch_on_every_sign_and_class(dtype: torch.dtype) -> None:
    """The F16/BF16 path reads the bits (signed and unsigned maxima): every sign of zero, subnormals, extremes, Inf
    and NaN, alone and mixed, give torch's own counts."""
    import itertools

    import numpy as np

    code = "F16" if dtype == torch.float16 else "BF16"
    scratch = np.empty(64, dtype=np.uint16)
    cases = [[v] for v in _SPECIAL] + [list(c) for c in itertools.combinations(_SPECIAL, 2)]
    cases += [[-0.0] * 5, [0.0, -0.0, 0.0], [-0.0, float("-inf")], [-1e-40, -0.0]]
    for values in cases:
        t = torch.tensor(values, dtype=torch.float32).to(dtype)
        raw = bytearray(t.view(torch.int16).numpy().tobytes())
        want = (int(t.isnan().sum()), int(t.isinf().sum()), bool((t != 0).any()) or bool(t.isnan().any()))
        assert deep._chunk_stats(np, raw, len(values), code, scratch) == want, (code, values)


def test_competing_forms_compare_values_only_where_bytes_are_the_tensor(tmp_path: Path) -> None:
    """`--deep` compares two full-weight forms by each tensor's bytes: a strided view in a torch archive (the same
    values, other byte order) is left out rather than called different; a changed value is found (CKD206)."""
    torch.manual_seed(0)
    a, v = torch.randn(3, 5), torch.randn(4)
    ck = tmp_path / "checkpoint-8"
    ck.mkdir()
    save_file({"w": a.T.contiguous(), "v": v}, str(ck / "model.safetensors"))
    torch.save({"w": a.T, "v": v}, ck / "pytorch_model.bin")  # `w` is a transposed view: equal values
    assert not a.T.is_contiguous() and _codes(_deep(tmp_path), "CKD206") == {}
    torch.save({"w": a.T, "v": v + 1}, ck / "pytorch_model.bin")
    (msg,) = _codes(_deep(tmp_path), "CKD206").values()
    assert "(1 of 1 tensor compared differ, e.g. `v`)" in msg, msg
    assert deep._row_major((3, 5), (5, 1)) and deep._row_major((1, 5), (7, 1)) and not deep._row_major((3, 5), (1, 3))
