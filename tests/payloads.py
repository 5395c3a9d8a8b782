"""Hostile pickles (built by hand or from classes with ``__reduce__``) and real torch files for the reader tests."""

from __future__ import annotations

import functools
import importlib
import operator
import os
import pickle
import random
import struct
import subprocess
from pathlib import Path
from typing import Any


def _reducer(func: Any, args: tuple[Any, ...]) -> Any:
    class Evil:
        def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
            return func, args

    return Evil()


def _s(text: str) -> bytes:
    """A protocol-2 BINUNICODE string."""
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def hostile_payloads(canary: Path) -> dict[str, tuple[bytes, str]]:
    """name -> (pickle bytes whose loading would create ``canary``, the dangerous global it must report)."""
    touch = f"touch {canary}"
    code = f"open({str(canary)!r}, 'w').close()"
    p: dict[str, tuple[bytes, str]] = {
        "os.system": (pickle.dumps(_reducer(os.system, (touch,)), protocol=2), f"{os.name}.system"),
        "posix.system protocol 0": (f"cposix\nsystem\n(S'{touch}'\ntR.".encode(), "posix.system"),
        "subprocess.Popen": (
            pickle.dumps(_reducer(subprocess.Popen, (["touch", str(canary)],)), protocol=4),
            "subprocess.Popen",
        ),
        "builtins.eval": (pickle.dumps(_reducer(eval, (code,)), protocol=3), "builtins.eval"),
        "builtins.exec": (pickle.dumps(_reducer(exec, (code,)), protocol=5), "builtins.exec"),
        "__builtin__.eval (py2 name)": (f'c__builtin__\neval\n(S"{code}"\ntR.'.encode(), "builtins.eval"),
        "functools.partial": (
            pickle.dumps(_reducer(functools.partial(os.system, touch), ()), protocol=2),
            "functools.partial",
        ),
        "importlib + methodcaller": (
            pickle.dumps(
                _reducer(operator.methodcaller("system", touch), (_reducer(importlib.import_module, ("os",)),)),
                protocol=4,
            ),
            "importlib.import_module",
        ),
    }
    # getattr(__import__('os'), 'system')(touch), hand-built at protocol 2.
    p["getattr + __import__"] = (
        b"\x80\x02cbuiltins\ngetattr\ncbuiltins\n__import__\n" + _s("os") + b"\x85R" + _s("system") + b"\x86R"
        + _s(touch) + b"\x85R.",
        "builtins.__import__",
    )  # fmt: skip
    # STACK_GLOBAL whose module and name come from the memo, the name stored long before it is used.
    p["STACK_GLOBAL from memo"] = (
        b"\x80\x04\x8c\x06system\x94\x8c\x05posix\x94\x8c\x05dummy0h\x01h\x00\x93" + _s(touch) + b"\x85R.",
        "posix.system",
    )
    p["INST"] = (f"(S'{touch}'\nios\nsystem\n.".encode(), "os.system")
    p["OBJ"] = (f"(cos\nsystem\nS'{touch}'\no.".encode(), "os.system")
    p["NEWOBJ"] = (
        b"\x80\x02csubprocess\nPopen\n" + _s("touch") + _s(str(canary)) + b"\x86\x85\x81.",
        "subprocess.Popen",
    )
    p["NEWOBJ_EX"] = (
        b"\x80\x04\x8c\nsubprocess\x8c\x05Popen\x93(" + _s("touch") + _s(str(canary)) + b"l\x85}\x92.",
        "subprocess.Popen",
    )
    p["EXT1"] = (b"\x80\x02\x82\xf0" + _s(touch) + b"\x85R.", "<extension>.240")
    p["EXT4"] = (b"\x80\x02\x84\x00\x00\x01\x00" + _s(touch) + b"\x85R.", "<extension>.65536")
    # BUILD on an object whose class has __setstate__ (the real unpickler calls it with the state).
    p["BUILD __setstate__"] = (b"\x80\x02csubprocess\nPopen\n)\x81" + _s(touch) + b"b.", "subprocess.Popen")
    return p


def concatenated_payload(canary: Path) -> tuple[bytes, int]:
    """A harmless pickle followed by a hostile one (how legacy torch files chain pickles); second start offset."""
    first = pickle.dumps({"ok": 1}, protocol=2)
    return first + pickle.dumps(_reducer(os.system, (f"touch {canary}",)), protocol=2), len(first)


def deep_lists(n: int) -> bytes:
    """``[[[...]]]`` n levels deep, nested through the stack like pickle writes it."""
    return b"\x80\x02" + b"]" * n + b"a" * (n - 1) + b"."


def deep_tuples(n: int) -> bytes:
    """``((((),),),)`` n levels deep with a constant stack (TUPLE1 wraps the top item)."""
    return b"\x80\x02)" + b"\x85" * n + b"."


def deep_via_memo(n: int) -> bytes:
    """n empty lists chained by appending each to the previous through the memo: deep without a deep stack."""
    out = bytearray(b"\x80\x02")
    for i in range(n):
        out += b"]r" + struct.pack("<I", i) + b"0"
    for i in range(n - 1):
        out += b"j" + struct.pack("<I", i) + b"j" + struct.pack("<I", i + 1) + b"a0"
    out += b"j" + struct.pack("<I", 0) + b"."
    return bytes(out)


def shared_doubling(levels: int) -> bytes:
    """x0 = []; x(i+1) = [x(i), x(i)]: 2**levels paths through a linear number of nodes."""
    return pickle.dumps(functools.reduce(lambda acc, _: [acc, acc], range(levels), []), protocol=2)


def flip(data: bytes, rnd: random.Random, n: int) -> bytes:
    """``data`` with ``n`` random bytes overwritten."""
    b = bytearray(data)
    for _ in range(n):
        b[rnd.randrange(len(b))] = rnd.randrange(256)
    return bytes(b)


# ---------------------------------------------------------------------------------------------------------------
# Real files


def save_model_state(path: Path, *, legacy: bool = False) -> Any:
    """A real ``torch.save(model.state_dict())`` with a view and a tied tensor; returns the state dict."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2).to(torch.bfloat16))
    sd = model.state_dict()
    sd["view"] = sd["0.weight"][1:]
    sd["tied"] = sd["0.weight"]
    torch.save(sd, path, _use_new_zipfile_serialization=not legacy)
    return sd


def save_training_files(folder: Path) -> dict[str, Path]:
    """optimizer.pt, scheduler.pt, rng_state.pth and training_args.bin as the Trainer writes them."""
    import numpy as np
    import torch
    from torch import nn
    from transformers import TrainingArguments, get_linear_schedule_with_warmup

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    groups = [
        {"params": [p for n, p in model.named_parameters() if "weight" in n], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if "bias" in n], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-3)
    sched = get_linear_schedule_with_warmup(opt, 2, 10)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    out = {name: folder / name for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin")}
    torch.save(opt.state_dict(), out["optimizer.pt"])
    torch.save(sched.state_dict(), out["scheduler.pt"])
    # transformers' Trainer._save_rng_state (single process, CPU).
    torch.save(
        {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()},
        out["rng_state.pth"],
    )
    torch.save(TrainingArguments(output_dir=str(folder / "out"), learning_rate=3e-4), out["training_args.bin"])
    return out


def save_dcp(folder: Path) -> Path:
    """A real single-process ``torch.distributed.checkpoint.save`` of a model and an optimizer state dict."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=str(folder))
    return folder
