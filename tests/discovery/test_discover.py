"""Discovery: walking real checkpoint trees into runs, checkpoints and loose files, and surviving hostile ones."""

from __future__ import annotations

import functools
import io
import json
import os
import random
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers.trainer_utils import get_last_checkpoint

from ckptdoctor.discover import discover
from ckptdoctor.limits import Limits
from ckptdoctor.model import Checkpoint, FileKind, FolderRole, JsonFacts, ProblemKind, Run, TextFacts, Tree

# ---------------------------------------------------------------------------------------------------------------
# Builders: real files from the real libraries, made once and copied.


@functools.cache
def _blobs() -> dict[str, bytes]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sched.step()

    def saved(obj: object) -> bytes:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()

    weights = Path(os.environ.get("TMPDIR", "/tmp")) / f"ckptdoctor-test-{os.getpid()}.safetensors"
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(weights), {"format": "pt"})
    st = weights.read_bytes()
    weights.unlink()
    return {
        "model.safetensors": st,
        "config.json": json.dumps({"model_type": "toy", "hidden_size": 3}, indent=2).encode(),
        "optimizer.pt": saved(opt.state_dict()),
        "scheduler.pt": saved(sched.state_dict()),
        "rng_state.pth": saved({"python": random.getstate(), "cpu": torch.get_rng_state()}),
        "training_args.bin": saved({"output_dir": "out", "learning_rate": 1e-3}),
    }


def _trainer_state(step: int) -> bytes:
    state: dict[str, Any] = {
        "global_step": step,
        "max_steps": 100,
        "best_metric": float("nan"),
        "log_history": [{"loss": 1.0, "step": step, "grad_norm": float("inf")}],
        "train_batch_size": 2,
    }
    return (json.dumps(state, indent=2, sort_keys=True) + "\n").encode()


def _checkpoint(d: Path, step: int, *, optimizer: bool = True) -> Path:
    """A Trainer-style checkpoint folder (ANATOMY §1.2): weights, config, state, optimizer, scheduler, rng."""
    d.mkdir(parents=True, exist_ok=True)
    for name, data in _blobs().items():
        if optimizer or name not in ("optimizer.pt", "scheduler.pt"):
            (d / name).write_bytes(data)
    (d / "trainer_state.json").write_bytes(_trainer_state(step))
    return d


def _adapter(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    save_file({"base_model.model.l.lora_A.weight": torch.zeros(2, 3)}, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2}))


def _oracle(root: Path, run_rel: str) -> str | None:
    """transformers' own answer, relative to the root like ``Run.resume_pick``."""
    picked = get_last_checkpoint(str(root / run_rel))
    if picked is None:
        return None
    return Path(os.path.relpath(picked, root)).as_posix()


def _run(tree: Tree, path: str) -> Run:
    runs = [r for r in tree.runs if r.path == path]
    assert len(runs) == 1, [r.path for r in tree.runs]
    return runs[0]


def _ck(run: Run, path: str) -> Checkpoint:
    cks = [c for c in run.checkpoints if c.path == path]
    assert len(cks) == 1, [c.path for c in run.checkpoints]
    return cks[0]


def _problems(tree: Tree, kind: ProblemKind) -> dict[str, str | None]:
    return {p.path: p.target for p in tree.path_problems if p.problem.kind is kind}


# ---------------------------------------------------------------------------------------------------------------
# Layouts


def test_output_dir_with_checkpoints_and_final_model(tmp_path: Path) -> None:
    out = tmp_path / "out"
    for step in (4, 8, 12):
        _checkpoint(out / f"checkpoint-{step}", step)
    _checkpoint(out / "tmp-checkpoint-16", 16)
    _checkpoint(out / "checkpoint-15.bak", 15)
    _checkpoint(out / "checkpoint-0010", 10)
    (out / "checkpoint-50").write_text("a file, not a folder")  # ignored by get_last_checkpoint
    for name in ("model.safetensors", "config.json", "training_args.bin"):  # save_model at the end
        (out / name).write_bytes(_blobs()[name])
    (out / "README.md").write_text("# card\n")
    (out / "runs").mkdir()
    (out / "runs" / "events.out.tfevents.1").write_bytes(b"\x00\x01tensorboard")

    tree = discover(str(out))
    assert tree.root == str(out)
    assert [r.path for r in tree.runs] == ["."]
    run = tree.runs[0]
    assert not run.standalone
    assert [(c.path, c.role, c.step) for c in run.checkpoints] == [
        (".", FolderRole.MODEL, None),
        ("checkpoint-0010", FolderRole.CHECKPOINT, 10),
        ("checkpoint-12", FolderRole.CHECKPOINT, 12),
        ("checkpoint-15.bak", FolderRole.OTHER, None),
        ("checkpoint-4", FolderRole.CHECKPOINT, 4),
        ("checkpoint-8", FolderRole.CHECKPOINT, 8),
        ("tmp-checkpoint-16", FolderRole.TEMP, None),
    ]
    assert run.resume_pick == "checkpoint-12" == _oracle(out, ".")

    model = _ck(run, ".")
    assert [f.path for f in model.files] == [
        "README.md",
        "checkpoint-50",
        "config.json",
        "model.safetensors",
        "training_args.bin",
    ]
    assert model.file("model.safetensors") is not None
    assert [f.path for f in tree.loose_files] == ["runs/events.out.tfevents.1"]

    ck8 = _ck(run, "checkpoint-8")
    names = [ck8.relname(f) for f in ck8.files]
    assert names == sorted(names)
    assert set(names) == {*_blobs(), "trainer_state.json"}
    state = ck8.file("trainer_state.json")
    assert state is not None and state.kind is FileKind.JSON and isinstance(state.content, JsonFacts)
    assert state.content.value["global_step"] == 8
    weights = ck8.file("model.safetensors")
    assert weights is not None and weights.kind is FileKind.SAFETENSORS
    optimizer = ck8.file("optimizer.pt")
    assert optimizer is not None and optimizer.kind is FileKind.TORCH_ZIP
    # Healthy files written by the real libraries read without a single problem, through every reader.
    assert [(f.path, f.problems) for f in tree.all_files() if f.problems] == []
    assert tree.files_seen == len(tree.all_files())
    assert tree.path_problems == ()


def test_run_without_final_model_has_loose_top_files(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "checkpoint-2", 2)
    (tmp_path / "all_results.json").write_text('{"train_loss": 1.0}')
    tree = discover(str(tmp_path))
    run = _run(tree, ".")
    assert [c.path for c in run.checkpoints] == ["checkpoint-2"]
    assert [f.path for f in tree.loose_files] == ["all_results.json"]


@pytest.mark.parametrize(
    "names",
    [
        ["checkpoint-10", "checkpoint-0010", "checkpoint-9"],
        ["checkpoint-0010", "checkpoint-010"],
        ["checkpoint-7"],
        ["tmp-checkpoint-7", "checkpoint-7.bak", "checkpoint_30", "Checkpoint-40", "checkpoint--1"],
        ["checkpoint-\u0661\u0662", "checkpoint-11"],  # Arabic-Indic digits: `\d` and int() accept them
    ],
)
def test_resume_pick_matches_get_last_checkpoint(tmp_path: Path, names: list[str]) -> None:
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer_state.json").write_bytes(_trainer_state(1))
    tree = discover(str(tmp_path))
    run = _run(tree, ".")
    oracle = _oracle(tmp_path, ".")
    if oracle is None:
        assert run.resume_pick is None
        return
    # Same number as the library's choice; ties broken deterministically (canonical name, else first sorted).
    steps = {n: int(n.split("-", 1)[1]) for n in names if n.startswith("checkpoint-") and n[11:].isdigit()}
    assert run.resume_pick is not None
    assert steps[run.resume_pick] == steps[oracle]
    tied = sorted(n for n in steps if steps[n] == steps[oracle])
    canonical = f"checkpoint-{steps[oracle]}"
    assert run.resume_pick == (canonical if canonical in tied else tied[0])


def test_resume_pick_none_when_only_others(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "tmp-checkpoint-3", 3)
    _checkpoint(tmp_path / "checkpoint-5.bak", 5)
    run = _run(discover(str(tmp_path)), ".")
    assert run.resume_pick is None is _oracle(tmp_path, ".")
    assert {c.role for c in run.checkpoints} == {FolderRole.TEMP, FolderRole.OTHER}


def test_many_runs_at_different_depths(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "a" / "run1" / "checkpoint-2", 2)
    _checkpoint(tmp_path / "a" / "run1" / "checkpoint-4", 4)
    _checkpoint(tmp_path / "b" / "c" / "run2" / "checkpoint-3", 3)
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "b" / "data.json").write_text("[1, 2]")
    tree = discover(str(tmp_path))
    assert [r.path for r in tree.runs] == ["a/run1", "b/c/run2"]
    for run in tree.runs:
        assert run.resume_pick == _oracle(tmp_path, run.path)
        assert not run.standalone
    assert _run(tree, "a/run1").resume_pick == "a/run1/checkpoint-4"
    assert [c.path for c in _run(tree, "b/c/run2").checkpoints] == ["b/c/run2/checkpoint-3"]
    assert [f.path for f in tree.loose_files] == ["b/data.json", "notes.txt"]
    ck = _ck(_run(tree, "a/run1"), "a/run1/checkpoint-2")
    assert ck.file("trainer_state.json") is not None
    assert ck.relname(ck.files[0]) == ck.files[0].path[len("a/run1/checkpoint-2/") :]


def test_nested_hyperparameter_search_runs(tmp_path: Path) -> None:
    # output_dir/run-<id>/checkpoint-N during hyper-parameter search; the outer folder is not itself a run.
    _checkpoint(tmp_path / "run-0" / "checkpoint-2", 2)
    _checkpoint(tmp_path / "run-1" / "checkpoint-2", 2)
    tree = discover(str(tmp_path))
    assert [r.path for r in tree.runs] == ["run-0", "run-1"]


def test_single_checkpoint_root(tmp_path: Path) -> None:
    ck_dir = _checkpoint(tmp_path / "out" / "checkpoint-8", 8)
    _adapter(ck_dir / "second")
    tree = discover(str(ck_dir))
    assert len(tree.runs) == 1
    run = tree.runs[0]
    assert run.path == "." and run.standalone and run.resume_pick is None
    (ck,) = run.checkpoints
    assert (ck.path, ck.role, ck.step) == (".", FolderRole.CHECKPOINT, 8)
    assert ck.file("trainer_state.json") is not None
    assert ck.file("second/adapter_model.safetensors") is not None
    assert tree.loose_files == ()


def test_single_checkpoint_root_given_as_dot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck_dir = _checkpoint(tmp_path / "checkpoint-0012", 12)
    monkeypatch.chdir(ck_dir)
    tree = discover(".")
    (ck,) = tree.runs[0].checkpoints
    assert (ck.role, ck.step) == (FolderRole.CHECKPOINT, 12)
    assert tree.root == "."


def test_save_pretrained_model_root(tmp_path: Path) -> None:
    model = tmp_path / "final-model"
    model.mkdir()
    for name in ("model.safetensors", "config.json"):
        (model / name).write_bytes(_blobs()[name])
    tree = discover(str(model))
    (ck,) = tree.runs[0].checkpoints
    assert (ck.path, ck.role, ck.step) == (".", FolderRole.MODEL, None)
    assert tree.runs[0].standalone


def test_folder_without_checkpoints_is_loose(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "x.txt").write_text("x")
    tree = discover(str(tmp_path))
    assert tree.runs == ()
    assert [f.path for f in tree.loose_files] == ["config.json", "sub/x.txt"]


def test_single_file_root(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors"
    p.write_bytes(_blobs()["model.safetensors"])
    tree = discover(str(p))
    assert tree.runs == ()
    assert [(f.path, f.kind) for f in tree.loose_files] == [("model.safetensors", FileKind.SAFETENSORS)]
    assert tree.files_seen == 1


def test_single_file_root_with_bad_name(tmp_path: Path) -> None:
    bad = os.fsencode(str(tmp_path)) + b"/w\xff.json"
    with open(bad, "wb") as f:
        f.write(b'{"a": 1}')
    tree = discover(os.fsdecode(bad))
    assert [(f.path, f.kind) for f in tree.loose_files] == [("w\\xff.json", FileKind.JSON)]
    assert [(p.path, p.problem.kind) for p in tree.path_problems] == [("w\\xff.json", ProblemKind.BAD_NAME)]


def test_missing_root(tmp_path: Path) -> None:
    tree = discover(str(tmp_path / "nope"))
    assert tree.runs == () and tree.loose_files == ()
    assert [(p.path, p.problem.kind) for p in tree.path_problems] == [(".", ProblemKind.UNREADABLE)]


def test_adapter_subfolders(tmp_path: Path) -> None:
    ck = tmp_path / "checkpoint-5"
    ck.mkdir()
    (ck / "trainer_state.json").write_bytes(_trainer_state(5))
    _adapter(ck)
    _adapter(ck / "other_adapter")
    tree = discover(str(tmp_path))
    c = _ck(_run(tree, "."), "checkpoint-5")
    assert c.file("adapter_model.safetensors") is not None
    assert c.file("other_adapter/adapter_config.json") is not None
    assert [c.relname(f) for f in c.files] == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "other_adapter/adapter_config.json",
        "other_adapter/adapter_model.safetensors",
        "trainer_state.json",
    ]


def test_final_adapters_at_run_top_level(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "checkpoint-2", 2)
    _adapter(tmp_path)
    _adapter(tmp_path / "extra")
    run = _run(discover(str(tmp_path)), ".")
    model = _ck(run, ".")
    assert model.role is FolderRole.MODEL
    assert model.file("extra/adapter_model.safetensors") is not None


def test_deepspeed_layout(tmp_path: Path) -> None:
    ck = _checkpoint(tmp_path / "checkpoint-12", 12, optimizer=False)
    tag = ck / "global_step12"
    tag.mkdir()
    (tag / "mp_rank_00_model_states.pt").write_bytes(_blobs()["optimizer.pt"])
    for rank in (0, 1):
        (tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(_blobs()["optimizer.pt"])
    (ck / "latest").write_text("global_step12")
    (ck / "zero_to_fp32.py").write_text("#!/usr/bin/env python\n")
    c = _ck(_run(discover(str(tmp_path)), "."), "checkpoint-12")
    latest = c.file("latest")
    assert latest is not None and latest.kind is FileKind.TEXT and latest.content == TextFacts("global_step12")
    assert c.file("global_step12/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt") is not None
    script = c.file("zero_to_fp32.py")
    assert script is not None and script.kind is FileKind.OTHER


def test_dcp_folders(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    ck = tmp_path / "checkpoint-3"
    ck.mkdir()
    (ck / "trainer_state.json").write_bytes(_trainer_state(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.zeros(3)}}, checkpoint_id=str(ck / "pytorch_model_fsdp_0"))
    # A `*.metadata` pickle outside any DCP folder is just a pickle; a lone `.metadata` makes a (broken) DCP folder.
    (tmp_path / "misc").mkdir()
    (tmp_path / "misc" / "run.metadata").write_bytes((ck / "pytorch_model_fsdp_0" / ".metadata").read_bytes())
    (tmp_path / "lone").mkdir()
    (tmp_path / "lone" / ".metadata").write_bytes((ck / "pytorch_model_fsdp_0" / ".metadata").read_bytes())
    tree = discover(str(tmp_path))
    c = _ck(_run(tree, "."), "checkpoint-3")
    meta = c.file("pytorch_model_fsdp_0/.metadata")
    data = c.file("pytorch_model_fsdp_0/__0_0.distcp")
    assert meta is not None and meta.kind is FileKind.DCP_METADATA
    assert data is not None and data.kind is FileKind.DCP_DATA
    assert [(f.path, f.kind) for f in tree.loose_files] == [
        ("lone/.metadata", FileKind.DCP_METADATA),
        ("misc/run.metadata", FileKind.PICKLE),
    ]


def test_fixer_folder_is_ignored(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "checkpoint-2", 2)
    _checkpoint(tmp_path / ".ckptdoctor" / "quarantine" / "tx1" / "checkpoint-9", 9)
    tree = discover(str(tmp_path))
    assert [r.path for r in tree.runs] == ["."]
    assert [c.path for c in tree.runs[0].checkpoints] == ["checkpoint-2"]


# ---------------------------------------------------------------------------------------------------------------
# Robustness


def test_symlink_loops(tmp_path: Path) -> None:
    ck = _checkpoint(tmp_path / "checkpoint-2", 2)
    (ck / "up").symlink_to("..")  # a folder loop
    (ck / "self.json").symlink_to("self.json")  # a link to itself
    (ck / "a").symlink_to("b")
    (ck / "b").symlink_to("a")
    tree = discover(str(tmp_path))
    loops = _problems(tree, ProblemKind.SYMLINK_LOOP)
    assert set(loops) == {"checkpoint-2/up", "checkpoint-2/self.json", "checkpoint-2/a", "checkpoint-2/b"}
    c = _ck(_run(tree, "."), "checkpoint-2")
    assert {c.relname(f) for f in c.files} == {*_blobs(), "trainer_state.json"}


def test_link_escaping_root(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    _checkpoint(outside / "elsewhere", 9)
    (outside / "secret.safetensors").write_bytes(_blobs()["model.safetensors"])
    root = tmp_path / "root"
    ck = _checkpoint(root / "checkpoint-2", 2)
    (ck / "extra.safetensors").symlink_to(outside / "secret.safetensors")
    (root / "checkpoint-9").symlink_to(outside / "elsewhere")  # get_last_checkpoint follows it
    (root / "checkpoint-3").symlink_to("../outside/elsewhere")
    tree = discover(str(root))
    escapes = _problems(tree, ProblemKind.LINK_ESCAPES_ROOT)
    real_outside = os.path.realpath(outside)
    assert escapes == {
        "checkpoint-2/extra.safetensors": os.path.join(real_outside, "secret.safetensors"),
        "checkpoint-3": os.path.join(real_outside, "elsewhere"),
        "checkpoint-9": os.path.join(real_outside, "elsewhere"),
    }
    run = _run(tree, ".")
    # Not read, not followed (CKD604 reports each link); still what the library would pick.
    assert all("secret" not in f.path and "extra" not in f.path for f in tree.all_files())
    assert [c.path for c in run.checkpoints] == ["checkpoint-2"]
    assert run.resume_pick == "checkpoint-9" == _oracle(root, ".")


def test_links_inside_root_are_followed(tmp_path: Path) -> None:
    # Hugging Face cache layout: snapshots hold links to blobs.
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / "abc123").write_bytes(_blobs()["model.safetensors"])
    (blobs / "def456").write_bytes(_blobs()["config.json"])
    snap = tmp_path / "snapshots" / "rev1"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to("../../blobs/abc123")
    (snap / "config.json").symlink_to("../../blobs/def456")
    # And a linked checkpoint folder inside the root.
    _checkpoint(tmp_path / "run" / "real-3", 3)
    (tmp_path / "run" / "checkpoint-3").symlink_to("real-3")
    tree = discover(str(tmp_path))
    by_path = {f.path: f for f in tree.all_files()}
    weights = by_path["snapshots/rev1/model.safetensors"]
    assert weights.is_link and weights.kind is FileKind.SAFETENSORS
    assert weights.size == len(_blobs()["model.safetensors"])
    assert not by_path["blobs/abc123"].is_link
    run = _run(tree, "run")
    assert run.resume_pick == "run/checkpoint-3" == _oracle(tmp_path, "run")
    ck = _ck(run, "run/checkpoint-3")
    assert ck.file("trainer_state.json") is not None
    assert tree.path_problems == ()


def test_broken_link(tmp_path: Path) -> None:
    ck = _checkpoint(tmp_path / "checkpoint-1", 1)
    (ck / "model-00002-of-00002.safetensors").symlink_to("missing-blob")
    tree = discover(str(tmp_path))
    assert [(p.path, p.problem.kind) for p in tree.path_problems] == [
        ("checkpoint-1/model-00002-of-00002.safetensors", ProblemKind.UNREADABLE)
    ]
    assert "broken" in tree.path_problems[0].problem.message


def test_permission_denied_file_and_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = _checkpoint(tmp_path / "checkpoint-4", 4)
    locked_dir = _checkpoint(tmp_path / "checkpoint-8", 8)
    locked_file = ck / "optimizer.pt"
    if os.geteuid() == 0:
        # root ignores file modes: emulate the OSError the kernel would give an ordinary user.
        real_open, real_scandir = os.open, os.scandir

        def deny_open(path: Any, flags: int, *args: Any) -> int:
            if os.fspath(path) == str(locked_file):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, flags, *args)

        def deny_scandir(path: Any = ".") -> Any:
            if os.fspath(path) == str(locked_dir):
                raise PermissionError(13, "Permission denied", str(path))
            return real_scandir(path)

        monkeypatch.setattr(os, "open", deny_open)
        monkeypatch.setattr(os, "scandir", deny_scandir)
    else:
        locked_file.chmod(0)
        locked_dir.chmod(0)
    try:
        tree = discover(str(tmp_path))
    finally:
        locked_file.chmod(0o644)
        locked_dir.chmod(0o755)
    assert [(p.path, p.problem.kind) for p in tree.path_problems] == [("checkpoint-8", ProblemKind.UNREADABLE)]
    run = _run(tree, ".")
    # get_last_checkpoint still picks the unreadable folder; it is a checkpoint with no readable files.
    assert run.resume_pick == "checkpoint-8" == _oracle(tmp_path, ".")
    assert _ck(run, "checkpoint-8").files == ()
    opt = _ck(run, "checkpoint-4").file("optimizer.pt")
    assert opt is not None and [p.kind for p in opt.problems] == [ProblemKind.UNREADABLE]
    # The scan went on past both.
    assert _ck(run, "checkpoint-4").file("trainer_state.json") is not None


def test_non_utf8_name(tmp_path: Path) -> None:
    ck = _checkpoint(tmp_path / "checkpoint-1", 1)
    bad = os.fsencode(str(ck)) + b"/model-\xff\xfe.safetensors"
    with open(bad, "wb") as f:
        f.write(_blobs()["model.safetensors"])
    bad_dir = os.fsencode(str(tmp_path)) + b"/logs-\xe9"
    os.mkdir(bad_dir)
    with open(bad_dir + b"/x.json", "wb") as f:
        f.write(b"{}")
    tree = discover(str(tmp_path))
    bad_names = _problems(tree, ProblemKind.BAD_NAME)
    assert set(bad_names) == {"checkpoint-1/model-\\xff\\xfe.safetensors", "logs-\\xe9"}
    files = {f.path: f for f in tree.all_files()}
    assert files["checkpoint-1/model-\\xff\\xfe.safetensors"].kind is FileKind.SAFETENSORS
    assert files["logs-\\xe9/x.json"].kind is FileKind.JSON
    for path in files:
        path.encode("utf-8")  # every reported path is printable UTF-8


def test_fifo_never_opened(tmp_path: Path) -> None:
    ck = _checkpoint(tmp_path / "checkpoint-1", 1)
    os.mkfifo(ck / "model.safetensors.fifo")
    os.mkfifo(ck / "pytorch_model.bin")
    tree = discover(str(tmp_path))  # would hang if a FIFO were opened for reading
    c = _ck(_run(tree, "."), "checkpoint-1")
    fifo = c.file("pytorch_model.bin")
    assert fifo is not None and fifo.kind is FileKind.SPECIAL
    assert [p.kind for p in fifo.problems] == [ProblemKind.SPECIAL_FILE]


def test_deep_tree_hits_depth_limit(tmp_path: Path) -> None:
    d = tmp_path
    for i in range(12):
        d = d / f"d{i}"
    d.mkdir(parents=True)
    (d / "deep.json").write_text("{}")
    tree = discover(str(tmp_path), Limits(dir_depth=5))
    limits = _problems(tree, ProblemKind.LIMIT)
    assert list(limits) == ["d0/d1/d2/d3/d4/d5"]
    assert tree.loose_files == ()
    # With the default limit the same tree is walked whole.
    assert [f.path for f in discover(str(tmp_path)).loose_files] == [
        "/".join(f"d{i}" for i in range(12)) + "/deep.json"
    ]


def test_entry_limit(tmp_path: Path) -> None:
    for i in range(30):
        (tmp_path / f"f{i:02d}.txt").write_text("x")
    tree = discover(str(tmp_path), Limits(dir_entries=10))
    assert [p.problem.kind for p in tree.path_problems] == [ProblemKind.LIMIT]
    assert tree.files_seen == 10


def test_deterministic_and_read_only(tmp_path: Path) -> None:
    for step in (1, 2):
        _checkpoint(tmp_path / f"checkpoint-{step}", step)
    _adapter(tmp_path / "checkpoint-2" / "extra")

    def snapshot() -> list[tuple[str, int, int]]:
        out = []
        for dirpath, dirnames, filenames in os.walk(tmp_path):
            for n in dirnames + filenames:
                p = os.path.join(dirpath, n)
                s = os.lstat(p)
                out.append((p, s.st_size, s.st_mtime_ns))
        return sorted(out)

    before = snapshot()
    first = discover(str(tmp_path))
    second = discover(str(tmp_path))
    assert snapshot() == before
    assert first == second
    for run in first.runs:
        for ck in run.checkpoints:
            assert [f.path for f in ck.files] == sorted(f.path for f in ck.files)


def test_checkpoint_mtime_is_newest(tmp_path: Path) -> None:
    ck = _checkpoint(tmp_path / "checkpoint-1", 1)
    _adapter(ck / "sub")
    future = 4_000_000_000
    os.utime(ck / "sub" / "adapter_config.json", (future, future))
    c = _ck(_run(discover(str(tmp_path)), "."), "checkpoint-1")
    assert c.mtime == future
    old = 1_000_000_000
    for f in ck.rglob("*"):
        os.utime(f, (old, old))
    os.utime(ck, (old + 5, old + 5))
    c = _ck(_run(discover(str(tmp_path)), "."), "checkpoint-1")
    assert c.mtime == old + 5
