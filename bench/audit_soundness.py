"""Soundness against the real unpickler: every stream ckptdoctor scans clean must load without running code.

    python bench/audit_soundness.py --minutes 25 --seed 1 --corpus bench/soundness_corpus

1. **Streams.** ``StreamGen`` writes pickle streams from the opcode grammar of protocols 0-5 (every opcode that
   pushes, calls, builds, memoizes or frames, in each protocol's spellings) whose globals are drawn from every
   class, function and method the installed torch, numpy, transformers, peft, accelerate and the stdlib define
   (``bench/audit_globals.py``), favouring those the policy admits (a stream naming a denied global is flagged at
   once and teaches nothing). Calls get arguments shaped by the callee's parameter names (code for ``stmt``,
   ``source``, ``command``; a path for ``path``, ``filename``; ``"w"`` for ``mode``; globals as arguments too).
2. **Containers.** Each stream is packed the way a loader meets it (``CONTAINERS``): a raw ``.pkl`` and ``.pt``, a
   torch zip's ``data.pkl``, a legacy torch file's main stream, the legacy tar format's ``pickle`` member, an
   ``.npy`` / ``.npz`` object array, a member of a ``.tar``, ``.tar.gz`` and ``.zip``, a gzip'd pickle, a DCP
   ``.metadata``.
3. **Static verdict.** ``ckptdoctor.scan`` (the public API, no settings file) scans the case folder. A case with any
   CKD6xx error is flagged and done.
4. **Real load.** A clean case is loaded by its container's loader in a throw-away child under an audit hook
   (``bench/audit_loader.py``). Any event (``exec``, ``compile``, ``os.system``, ``subprocess.Popen``, ``open`` for
   writing, ``socket.*``, ``ctypes.*``, a filesystem or type change, ``import`` of a module not already loaded) is a
   counterexample: its files and a ``case.json`` (events, globals, opcode path, container, seed) go to ``--corpus``
   (the first ``--per-family`` of each family: event, the global the unpickler found last, container), and it is
   printed.

Case ``i`` of seed ``s`` is drawn from ``random.Random(f"{s}:{i}")`` over the candidate list (fixed for one set of
installed versions), so a run is repeatable; a slower machine draws fewer cases of the same sequence. Exit 1 on
any counterexample.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gzip
import hashlib
import json
import random
import shutil
import struct
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.audit_globals import Candidate, enumerate_globals  # noqa: E402
from bench.peer_corpus import _npy_object, _tar, _torch_zip, _zip  # noqa: E402

CONTAINERS = ("pkl", "pt-raw", "torch-zip", "legacy", "torch-tar", "npy", "npz", "tar", "tar.gz", "zip", "gz", "dcp")
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
CANARY = "ckd_audit_canary"


# ---------------------------------------------------------------------------------------------------------------
# Containers


def pack(data: bytes, container: str) -> tuple[dict[str, bytes], str, str]:
    """``data`` (one pickle stream) as the files of ``container``: ({name: bytes}, the file to load, its loader)."""
    if container == "pkl":
        return {"state.pkl": data}, "state.pkl", "pickle"
    if container == "pt-raw":  # torch.load unpickles the first stream of a non-zip file (the legacy magic number)
        return {"optimizer.pt": data}, "optimizer.pt", "torch"
    if container == "torch-zip":
        return {"pytorch_model.bin": _torch_zip(data)}, "pytorch_model.bin", "torch"
    if container == "legacy":  # magic, protocol version, sys_info, then the main object: this stream
        import pickle

        head = _LEGACY_MAGIC + b"." + pickle.dumps(1001, protocol=2)
        head += pickle.dumps({"protocol_version": 1001, "little_endian": True, "type_sizes": {}}, protocol=2)
        return {"model.pt": head + data + pickle.dumps([], protocol=2)}, "model.pt", "torch"
    if container == "torch-tar":  # torch/serialization.py legacy_load: storages, tensors, pickle members
        import pickle

        zero = pickle.dumps(0, protocol=2)
        members = {"storages": zero + pickle.dumps([], protocol=2), "tensors": zero, "pickle": data}
        return {"model.pt": _tar(members, "w", tarfile.PAX_FORMAT)}, "model.pt", "torch"
    if container == "npy":
        return {"arrays.npy": _npy_object(data)}, "arrays.npy", "numpy"
    if container == "npz":
        ints = b"\x93NUMPY\x01\x00" + _npy_header("<i8")
        return {"arrays.npz": _zip({"a.npy": ints + b"\0" * 8, "b.npy": _npy_object(data)})}, "arrays.npz", "numpy"
    if container == "tar":
        return {"bundle.tar": _tar({"x/model.pkl": data})}, "bundle.tar", "tar:x/model.pkl"
    if container == "tar.gz":
        return {"bundle.tar.gz": _tar({"x/model.pkl": data}, "w:gz")}, "bundle.tar.gz", "tar:x/model.pkl"
    if container == "zip":
        return {"bundle.zip": _zip({"x/model.pkl": data})}, "bundle.zip", "zip:x/model.pkl"
    if container == "gz":
        return {"state.pkl.gz": gzip.compress(data, mtime=0)}, "state.pkl.gz", "gz"
    if container == "dcp":
        return {".metadata": data}, ".metadata", "dcp"
    raise ValueError(container)


def _npy_header(descr: str) -> bytes:
    text = f"{{'descr': '{descr}', 'fortran_order': False, 'shape': (1,), }}"
    pad = 64 - (10 + len(text) + 1) % 64
    raw = (text + " " * pad + "\n").encode()
    return struct.pack("<H", len(raw)) + raw


# ---------------------------------------------------------------------------------------------------------------
# Streams

# Strings a callee may treat as code, a command, a path or a mode, by its parameter's name.
_CODE = ("__import__('os').system('touch " + CANARY + "')", "print(1)", "import os", "x", "1+1", "lambda: 0")
_CMD = ("touch " + CANARY, "true", "ls")
_PATH = (CANARY, "./" + CANARY + ".txt", ".", "/dev/null")
_PARAM_KINDS = (
    (("stmt", "setup", "code", "source", "src", "expr", "expression", "script", "body", "fn_str", "string", "text",
      "program", "statement", "globals", "locals", "func_str"), "code"),
    (("cmd", "command", "args", "argv", "executable", "shell", "popenargs"), "cmd"),
    (("path", "file", "filename", "fname", "dir", "directory", "root", "output_dir", "save_path", "dst", "dest",
      "target", "log_dir", "logdir", "cache_dir", "name", "prefix", "f", "fp", "filepath", "save_directory",
      "folder", "url", "uri", "location"), "path"),
    (("mode", "flag", "flags", "openmode"), "mode"),
)  # fmt: skip


def _param_kind(name: str) -> str:
    low = name.lower()
    for names, kind in _PARAM_KINDS:
        if low in names or any(low.endswith("_" + n) for n in names):
            return kind
    return "any"


@dataclasses.dataclass
class Case:
    """One generated stream: its bytes, protocol, the globals it names (and how), the opcodes it used."""

    data: bytes
    protocol: int
    globals: list[str]
    path: list[str]


class StreamGen:
    """Writes one pickle stream of protocol ``proto`` (see the module docstring); ``pick()`` draws a global."""

    def __init__(self, rng: random.Random, proto: int, pick: Any) -> None:
        self.rng = rng
        self.proto = proto
        self.pick = pick
        self.memo = 0
        self.path: list[str] = []
        self.globals: list[str] = []
        self.budget = 40  # values left to write

    # -- scalars -------------------------------------------------------------------------------------------
    def _op(self, tag: str) -> None:
        if len(self.path) < 80:
            self.path.append(tag)

    def int_(self, v: int | None = None) -> bytes:
        r = self.rng
        v = r.choice([0, 1, -1, 2, 7, 255, 256, 65535, 2**31 - 1, 2**40, -(2**33), 3]) if v is None else v
        if self.proto == 0 or r.random() < 0.1:
            spelling = r.choice([str(v), str(v), hex(v) if v >= 0 else str(v), f"0o{v:o}" if v >= 0 else str(v)])
            if -(2**31) <= v < 2**31 and r.random() < 0.7:
                self._op("INT")
                return b"I" + spelling.encode() + b"\n"
            self._op("LONG")
            return b"L" + str(v).encode() + b"L\n"
        if 0 <= v < 256:
            self._op("BININT1")
            return b"K" + bytes([v])
        if 0 <= v < 65536:
            self._op("BININT2")
            return b"M" + struct.pack("<H", v)
        if -(2**31) <= v < 2**31 and r.random() < 0.7:
            self._op("BININT")
            return b"J" + struct.pack("<i", v)
        raw = v.to_bytes((v.bit_length() + 8) // 8 or 1, "little", signed=True)
        self._op("LONG1")
        return b"\x8a" + bytes([len(raw)]) + raw

    def str_(self, s: str) -> bytes:
        r = self.rng
        raw = s.encode("utf-8")
        if self.proto == 0 or r.random() < 0.05:
            if r.random() < 0.5 and s.isascii():
                self._op("STRING")
                return b"S" + repr(s).encode() + b"\n"
            self._op("UNICODE")
            return b"V" + s.encode("raw-unicode-escape").replace(b"\n", b"\\u000a") + b"\n"
        if self.proto >= 4 and len(raw) < 256 and r.random() < 0.7:
            self._op("SHORT_BINUNICODE")
            return b"\x8c" + bytes([len(raw)]) + raw
        if self.proto >= 4 and r.random() < 0.2:
            self._op("BINUNICODE8")
            return b"\x8d" + struct.pack("<Q", len(raw)) + raw
        if self.proto < 3 and s.isascii() and r.random() < 0.3:
            self._op("SHORT_BINSTRING" if len(raw) < 256 else "BINSTRING")
            return (b"U" + bytes([len(raw)]) if len(raw) < 256 else b"T" + struct.pack("<i", len(raw))) + raw
        self._op("BINUNICODE")
        return b"X" + struct.pack("<I", len(raw)) + raw

    def bytes_(self, b: bytes) -> bytes:
        r = self.rng
        if self.proto < 3:
            return self.call_raw(b"c_codecs\nencode\n", [self.str_(b.decode("latin-1")), self.str_("latin1")])
        if self.proto == 5 and r.random() < 0.2:
            self._op("BYTEARRAY8")
            return b"\x96" + struct.pack("<Q", len(b)) + b
        if len(b) < 256 and r.random() < 0.6:
            self._op("SHORT_BINBYTES")
            return b"C" + bytes([len(b)]) + b
        if self.proto >= 4 and r.random() < 0.3:
            self._op("BINBYTES8")
            return b"\x8e" + struct.pack("<Q", len(b)) + b
        self._op("BINBYTES")
        return b"B" + struct.pack("<I", len(b)) + b

    def scalar(self, kind: str = "any") -> bytes:
        r = self.rng
        if kind == "code":
            return self.str_(r.choice(_CODE))
        if kind == "cmd":
            return (
                self.str_(r.choice(_CMD)) if r.random() < 0.6 else self.list_([self.str_(x) for x in _CMD[0].split()])
            )
        if kind == "path":
            return self.str_(r.choice(_PATH))
        if kind == "mode":
            return self.str_(r.choice(["w", "wb", "a", "x", "r+", "exec"]))
        roll = r.random()
        if roll < 0.25:
            return self.int_()
        if roll < 0.5:
            return self.str_(r.choice([*_CODE, *_CMD, *_PATH, "w", "cpu", "float32", "a", ""]))
        if roll < 0.6:
            return self.bytes_(r.choice([b"", b"x", b"\x80\x02N.", b"\0" * 8]))
        if roll < 0.7:
            self._op("NONE")
            return b"N"
        if roll < 0.8:
            v = r.random() < 0.5
            if self.proto >= 2:
                self._op("NEWTRUE" if v else "NEWFALSE")
                return b"\x88" if v else b"\x89"
            self._op("INT-bool")
            return b"I01\n" if v else b"I00\n"
        f = r.choice([0.0, 1.5, -2.0, 1e300])
        if self.proto == 0:
            self._op("FLOAT")
            return b"F" + repr(f).encode() + b"\n"
        self._op("BINFLOAT")
        return b"G" + struct.pack(">d", f)

    # -- containers ----------------------------------------------------------------------------------------
    def list_(self, items: list[bytes]) -> bytes:
        if self.proto == 0 or self.rng.random() < 0.3:
            self._op("LIST")
            return b"(" + b"".join(items) + b"l"
        self._op("EMPTY_LIST")
        if self.rng.random() < 0.5:
            self._op("APPEND")
            return b"]" + b"".join(i + b"a" for i in items)
        self._op("APPENDS")
        return b"](" + b"".join(items) + b"e"

    def tuple_(self, items: list[bytes]) -> bytes:
        if self.proto >= 2 and 1 <= len(items) <= 3 and self.rng.random() < 0.6:
            self._op(f"TUPLE{len(items)}")
            return b"".join(items) + bytes([0x84 + len(items)])
        if not items and self.proto >= 1:
            self._op("EMPTY_TUPLE")
            return b")"
        self._op("TUPLE")
        return b"(" + b"".join(items) + b"t"

    def dict_(self, pairs: list[tuple[bytes, bytes]]) -> bytes:
        body = b"".join(k + v for k, v in pairs)
        if self.proto == 0 or self.rng.random() < 0.3:
            self._op("DICT")
            return b"(" + body + b"d"
        self._op("EMPTY_DICT")
        if self.rng.random() < 0.5:
            self._op("SETITEM")
            return b"}" + b"".join(k + v + b"s" for k, v in pairs)
        self._op("SETITEMS")
        return b"}(" + body + b"u"

    def set_(self, items: list[bytes], frozen: bool) -> bytes:
        if self.proto < 4:
            name = b"frozenset" if frozen else b"set"
            return self.call_raw(b"c__builtin__\n" + name + b"\n" if self.proto < 3 else b"cbuiltins\n" + name + b"\n",
                                 [self.list_(items)])  # fmt: skip
        if frozen:
            self._op("FROZENSET")
            return b"(" + b"".join(items) + b"\x91"
        self._op("EMPTY_SET+ADDITEMS")
        return b"\x8f(" + b"".join(items) + b"\x90"

    # -- globals and calls ---------------------------------------------------------------------------------
    def global_(self, c: Candidate) -> bytes:
        self.globals.append(c.dotted)
        if self.proto >= 4 and self.rng.random() < 0.6:
            self._op("STACK_GLOBAL")
            return self.str_(c.module) + self.str_(c.name) + b"\x93"
        self._op("GLOBAL")
        return b"c" + c.module.encode() + b"\n" + c.name.encode() + b"\n"

    def call_raw(self, func: bytes, args: list[bytes]) -> bytes:
        self._op("REDUCE")
        return func + self.tuple_(args) + b"R"

    def args_for(self, c: Candidate, depth: int) -> list[bytes]:
        r = self.rng
        params = list(c.params)
        n = min(len(params), r.choice([0, 1, 1, 2, 2, 3, len(params)])) if params else r.choice([0, 1, 2])
        out = []
        for i in range(n):
            kind = _param_kind(params[i]) if i < len(params) else "any"
            if kind == "any" and depth < 3 and r.random() < 0.3:
                out.append(self.value(depth + 1))
            else:
                out.append(self.scalar(kind))
        return out

    def call(self, c: Candidate, depth: int) -> bytes:
        r = self.rng
        args = self.args_for(c, depth)
        roll = r.random()
        p = self.proto
        if p >= 4 and roll < 0.15:
            kw = [(self.str_(k), self.scalar(_param_kind(k))) for k in c.params[len(args) :][:2]]
            self._op("NEWOBJ_EX")
            out = self.global_(c) + self.tuple_(args) + self.dict_(kw) + b"\x92"
        elif p >= 2 and roll < 0.3:
            self._op("NEWOBJ")
            out = self.global_(c) + self.tuple_(args) + b"\x81"
        elif p >= 1 and roll < 0.4:
            self._op("OBJ")
            out = b"(" + self.global_(c) + b"".join(args) + b"o"
        elif roll < 0.5 and "." not in c.name:
            self._op("INST")
            self.globals.append(c.dotted)
            out = b"(" + b"".join(args) + b"i" + c.module.encode() + b"\n" + c.name.encode() + b"\n"
        else:
            out = self.call_raw(self.global_(c), args)
        roll = r.random()
        if roll < 0.2:  # BUILD: __setstate__, or __dict__ / slot state
            keys = [*c.params[:3], "__dict__", "__class__", "_modules", "forward"]
            state = self.dict_([(self.str_(r.choice(keys)), self.value(depth + 1)) for _ in range(r.randint(1, 2))])
            if r.random() < 0.3:
                state = self.tuple_([b"N", state])
            self._op("BUILD")
            out += state + b"b"
        elif roll < 0.3:  # SETITEM / APPEND on the built object: its __setitem__ / append / extend runs
            if r.random() < 0.5:
                self._op("SETITEMS-on-object")
                out += b"(" + self.scalar() + self.value(depth + 1) + b"u"
            else:
                self._op("APPENDS-on-object")
                out += b"(" + self.value(depth + 1) + b"e"
        return out

    def value(self, depth: int = 0) -> bytes:
        r = self.rng
        self.budget -= 1
        roll = r.random()
        if depth >= 4 or self.budget <= 0:
            roll = min(roll, 0.2)
        if roll < 0.25:
            out = self.scalar()
        elif roll < 0.55:
            out = self.call(self.pick(), depth)
        elif roll < 0.65:
            out = self.global_(self.pick())
        elif roll < 0.75:
            out = self.list_([self.value(depth + 1) for _ in range(r.randint(0, 3))])
        elif roll < 0.82:
            out = self.tuple_([self.value(depth + 1) for _ in range(r.randint(0, 3))])
        elif roll < 0.92:
            pairs = [(self.scalar() if r.random() < 0.8 else self.value(depth + 1), self.value(depth + 1))
                     for _ in range(r.randint(0, 3))]  # fmt: skip
            out = self.dict_(pairs)
        else:
            out = self.set_([self.scalar() for _ in range(r.randint(0, 2))], r.random() < 0.5)
        roll = r.random()
        if roll < 0.15:  # memoize, and sometimes fetch it back at once (shared references)
            idx = self.memo
            self.memo += 1
            if self.proto >= 4 and r.random() < 0.5:
                self._op("MEMOIZE")
                out += b"\x94"
            elif self.proto >= 1:
                self._op("BINPUT" if idx < 256 else "LONG_BINPUT")
                out += b"q" + bytes([idx]) if idx < 256 else b"r" + struct.pack("<I", idx)
            else:
                self._op("PUT")
                out += b"p" + str(idx).encode() + b"\n"
            if r.random() < 0.3:
                get = (b"h" + bytes([idx]) if idx < 256 else b"j" + struct.pack("<I", idx)) if self.proto >= 1 \
                    else b"g" + str(idx).encode() + b"\n"  # fmt: skip
                self._op("GET")
                out = self.list_([out, get])
        elif roll < 0.2:
            self._op("DUP+POP")
            out += b"20"
        elif roll < 0.23:
            self._op("MARK+POP_MARK")
            out = b"(" + self.scalar() + b"1" + out
        return out

    def stream(self) -> bytes:
        body = self.value(0)
        if self.rng.random() < 0.5:
            body = self.list_([body, *[self.value(1) for _ in range(self.rng.randint(0, 3))]])
        head = b"\x80" + bytes([self.proto]) if self.proto >= 2 else b""
        if self.proto >= 4 and self.rng.random() < 0.5:
            self._op("FRAME")
            body = b"\x95" + struct.pack("<Q", len(body) + 1) + body
        return head + body + b"."


# ---------------------------------------------------------------------------------------------------------------
# The global pool


class Pool:
    """Candidate globals, drawn with a bias towards those the policy admits (``pickle_policy.standing``)."""

    def __init__(self, candidates: list[Candidate], rng: random.Random, prescreen: int) -> None:
        from ckptdoctor.model import GlobalRef
        from ckptdoctor.pickle_verdict import policy as pickle_policy

        self.all = candidates
        self.by_name = {c.dotted: c for c in candidates}
        self._ref = GlobalRef
        self._policy = pickle_policy
        exact = sorted(pickle_policy.ALLOWED | pickle_policy._allowlist())
        self.exact = [self.by_name.get(d) or _split(d) for d in exact]
        self.admitted: list[Candidate] = []
        self.hot: list[Candidate] = []  # admitted, with a parameter a callee may run or write (code, command, path)
        self.looked: set[str] = set()
        for c in rng.sample(candidates, min(prescreen, len(candidates))):
            self.screen(c)

    def screen(self, c: Candidate) -> bool:
        """Whether the policy admits ``c`` (by the allowlist or by source); remembered in ``admitted``."""
        if c.dotted in self.looked:
            return False
        self.looked.add(c.dotted)
        try:
            st, _ = self._policy.standing(self._ref(c.module, c.name))
        except Exception:  # the policy's own bug (a crash family of the run): never drawn as admitted
            return False
        if st is self._policy.Standing.ALLOWED:
            self.admitted.append(c)
            if any(_param_kind(p) != "any" for p in c.params):
                self.hot.append(c)
            return True
        return False

    def picker(self, rng: random.Random) -> Any:
        def pick() -> Candidate:
            roll = rng.random()
            if roll < 0.3 and self.exact:
                return rng.choice(self.exact)
            if roll < 0.55 and self.hot:
                return rng.choice(self.hot)
            if roll < 0.85 and self.admitted:
                return rng.choice(self.admitted)
            c = rng.choice(self.all)
            self.screen(c)
            return c

        return pick


def _split(dotted: str) -> Candidate:
    module, _, name = dotted.rpartition(".")
    return Candidate(module, name, "allowlist", ())


# ---------------------------------------------------------------------------------------------------------------
# The run


def make_case(pool: Pool, seed: int, index: int) -> tuple[Case, str]:
    """Case ``index`` of ``seed``: a stream and the container it goes in."""
    rng = random.Random(f"{seed}:{index}")
    proto = rng.randint(0, 5)
    gen = StreamGen(rng, proto, pool.picker(rng))
    data = gen.stream()
    return Case(data, proto, gen.globals, gen.path), rng.choice(CONTAINERS)


class ScanCrash(Exception):
    """``ckptdoctor.scan`` raised: bad input must be a finding, never a traceback (a family of its own)."""


def static_clean(folder: Path) -> tuple[bool, list[str]]:
    """Whether ``ckptdoctor.scan`` of ``folder`` has no CKD6xx error; the security findings it has. Raises
    ``ScanCrash`` when the scan itself raises."""
    from ckptdoctor import scan
    from ckptdoctor.findings import Severity

    try:
        report = scan(str(folder), no_config=True)
    except Exception as e:
        raise ScanCrash(f"{type(e).__name__}: {e}") from e
    sec = [f for f in report.findings if f.rule.startswith("CKD6")]
    return not any(f.severity is Severity.ERROR for f in sec), [f"{f.rule} {f.message[:120]}" for f in sec]


def family(container: str, events: list[dict[str, Any]]) -> str:
    """What makes two counterexamples the same. An effect (an event outside any import): the event, the last
    global the unpickler found before it, the container. Else an import: the package of the first module imported
    (one family per package, whatever the container: importing runs that module's top level)."""
    effects = [e for e in events if e["event"] != "import" and not e["in_import"]]
    if effects:
        first = effects[0]
        glob = first["after"][-1] if first["after"] else "?"
        return f"effect: {first['event']} after {glob} [{container}]"
    imports = [e for e in events if e["event"] == "import"]
    if not imports:  # the import raised partway: its module's body ran, and it is gone from sys.modules
        return "import: a module whose import ran and then failed"
    module = imports[0]["module"]
    parts = module.split(".")
    where = ".".join(parts[:2]) if len(parts) > 1 and parts[1] in ("testing", "tests", "_inductor") else parts[0]
    return f"import: a module of {where} not loaded before"


@dataclasses.dataclass
class Tally:
    """Counts of one run."""

    cases: int = 0
    clean: int = 0
    loaded: int = 0
    timeouts: int = 0
    by_container: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    clean_by_container: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    families: dict[str, int] = dataclasses.field(default_factory=dict)
    examples: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


def run_case(pool: Pool, server: Any, seed: int, index: int, work: Path, tally: Tally,
             corpus: Path | None, per_family: int) -> dict[str, Any] | None:  # fmt: skip
    """Generate, scan and (when clean) load case ``index``; the counterexample record, or None."""
    case, container = make_case(pool, seed, index)
    files, target, loader = pack(case.data, container)
    folder = work / f"case{index}"
    folder.mkdir(parents=True)
    try:
        for name, raw in files.items():
            (folder / name).write_bytes(raw)
        tally.cases += 1
        tally.by_container[container] += 1
        try:
            clean, findings = static_clean(folder)
        except ScanCrash as e:
            return _record(tally, corpus, per_family, files, f"scan crash: {str(e)[:80]} [{container}]",
                           seed, index, case, container, loader, target, [], {"error": str(e)})  # fmt: skip
        if not clean:
            return None
        tally.clean += 1
        tally.clean_by_container[container] += 1
        answer = server.load(str(folder / target), loader)
        tally.loaded += 1
        if answer.get("error") == "timeout":
            tally.timeouts += 1
        events = answer.get("events") or []
        if not events:
            return None
        return _record(tally, corpus, per_family, files, family(container, events), seed, index, case, container,
                       loader, target, findings, answer)  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _record(tally: Tally, corpus: Path | None, per_family: int, files: dict[str, bytes], fam: str, seed: int,
            index: int, case: Case, container: str, loader: str, target: str, findings: list[str],
            answer: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    record = {"family": fam, "seed": seed, "case": index, "container": container, "loader": loader,
              "target": target, "protocol": case.protocol, "globals": case.globals, "opcodes": case.path,
              "scan_findings": findings, "events": answer.get("events", []), "finds": answer.get("finds", []),
              "load_error": answer.get("error")}  # fmt: skip
    n = tally.families.get(fam, 0)
    tally.families[fam] = n + 1
    if n < per_family:
        tally.examples.setdefault(fam, record)
        if corpus is not None:
            save(corpus, files, record)
    return record


def save(corpus: Path, files: dict[str, bytes], record: dict[str, Any]) -> Path:
    """Write one counterexample under ``corpus``: its files in ``files/`` and ``case.json``."""
    digest = hashlib.sha256(b"".join(files.values())).hexdigest()[:12]
    out = corpus / f"s{record['seed']}-c{record['case']}-{digest}"
    (out / "files").mkdir(parents=True, exist_ok=True)
    for name, raw in files.items():
        (out / "files" / name).write_bytes(raw)
    (out / "case.json").write_text(json.dumps(_trimmed(record), indent=1) + "\n")
    return out


def _trimmed(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with the events a reader needs: the first effects, imports and import-body events, short stacks."""
    events = record["events"]
    effects = [e for e in events if e["event"] != "import" and not e["in_import"]][:3]
    imports = [e for e in events if e["event"] == "import"][:4]
    bodies = [e for e in events if e["in_import"]][:2]
    keep = [{**e, "stack": e["stack"][:6]} for e in events if any(e is x for x in (*effects, *imports, *bodies))]
    return {**record, "events": keep, "finds": record["finds"][:20]}


_FRESH_SCAN = """
import json, sys
from ckptdoctor import scan
from ckptdoctor.findings import Severity
out = {}
for folder in sys.argv[1:]:
    try:
        report = scan(folder, no_config=True)
    except Exception as e:
        out[folder] = {"crash": f"{type(e).__name__}: {e}"}
        continue
    sec = [f for f in report.findings if f.rule.startswith("CKD6")]
    out[folder] = {"clean": not any(f.severity is Severity.ERROR for f in sec),
                   "findings": [f"{f.rule} {f.message[:120]}" for f in sec]}
print(json.dumps(out))
"""


def fresh_verdicts(folders: list[Path]) -> dict[str, dict[str, Any]]:
    """``ckptdoctor.scan`` of each folder in one fresh process, as the command line meets them: nothing but the
    scan path imported (what a policy lookup finds can depend on what the process has imported). Per folder:
    ``{"clean": bool, "findings": [...]}`` or ``{"crash": "..."}``."""
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _FRESH_SCAN, *map(str, folders)], capture_output=True, text=True,
                          env=env, cwd=ROOT, check=True)  # fmt: skip
    verdicts: dict[str, dict[str, Any]] = json.loads(done.stdout)
    return verdicts


def replay_all(cases: list[Path], server: Any, work: Path) -> dict[str, tuple[bool, list[str], list[dict[str, Any]]]]:
    """Saved counterexamples judged again by this checkout (in a fresh process) and loaded again, by case name:
    (scanned clean, its security findings, the load's events; none when the scan flags it). Soundness holds for a
    case that is not clean or has no events; a scan that raises is ``ScanCrash``'s text in the findings, clean."""
    folders = []
    for case in cases:
        folder = work / case.name
        shutil.copytree(case / "files", folder)
        folders.append(folder)
    verdicts = fresh_verdicts(folders)
    out: dict[str, tuple[bool, list[str], list[dict[str, Any]]]] = {}
    for case, folder in zip(cases, folders, strict=True):
        v = verdicts[str(folder)]
        if "crash" in v:
            out[case.name] = (True, [f"scan raised {v['crash']}"], [{"event": "scan crash", "args": v["crash"],
                                                                   "in_import": False, "after": []}])  # fmt: skip
            continue
        if not v["clean"]:
            out[case.name] = (False, v["findings"], [])
            continue
        record = json.loads((case / "case.json").read_text())
        answer = server.load(str(folder / record["target"]), record["loader"])
        out[case.name] = (True, v["findings"], answer.get("events") or [])
    return out


def replay_corpus(corpus: Path) -> int:
    """Every case of ``corpus`` judged by this checkout and loaded again; exit 1 while any is still unsound."""
    from bench.audit_loader import LoaderServer

    still = 0
    cases = sorted(p for p in corpus.iterdir() if (p / "case.json").exists())
    with tempfile.TemporaryDirectory(prefix="ckd-replay-") as tmp, LoaderServer() as server:
        results = replay_all(cases, server, Path(tmp))
    for case in cases:
        family = json.loads((case / "case.json").read_text())["family"]
        clean, findings, events = results[case.name]
        if clean and events:
            still += 1
            first = next((e for e in events if e["event"] != "import" and not e["in_import"]), events[0])
            print(f"STILL    {case.name}: {first['event']} {first['args'][:60]}  ({family})")
        elif clean:
            print(f"HARMLESS {case.name}: scanned clean, loads without an event now  ({family})")
        else:
            print(f"FLAGGED  {case.name}: {findings[0] if findings else ''}  ({family})")
    print(f"command: python bench/audit_soundness.py --replay {corpus}")
    print(f"outcome: {still} of {len(cases)} cases still unsound")
    return 1 if still else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--cases", type=int, default=0, help="stop after this many cases (0: only the time bounds it)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--start", type=int, default=0, help="first case index")
    ap.add_argument("--prescreen", type=int, default=3000, help="random globals judged up front to seed the pool")
    ap.add_argument("--corpus", type=Path, default=None, help="folder for counterexamples")
    ap.add_argument("--per-family", type=int, default=1, help="counterexamples saved per family")
    ap.add_argument("--replay", type=Path, default=None, help="judge and load every saved case of this corpus again")
    args = ap.parse_args()
    from bench.audit_loader import LoaderServer

    if args.replay is not None:
        return replay_corpus(args.replay)

    start = time.monotonic()
    candidates = enumerate_globals()
    # The scan path imports neither numpy nor torch, and a policy lookup can depend on what is imported.
    assert "numpy" not in sys.modules and "torch" not in sys.modules, "the harness must judge as a fresh scan does"
    pool = Pool(candidates, random.Random(args.seed), args.prescreen)
    print(f"globals: {len(candidates)} candidates, {len(pool.exact)} exact allowlist entries, "
          f"{len(pool.admitted)} of {len(pool.looked)} screened admitted by the policy ({len(pool.hot)} with a "
          "code, command or path parameter)", flush=True)  # fmt: skip
    tally = Tally()
    deadline = start + args.minutes * 60
    with tempfile.TemporaryDirectory(prefix="ckd-audit-") as tmp, LoaderServer() as server:
        i = args.start
        while time.monotonic() < deadline and (not args.cases or i < args.start + args.cases):
            rec = run_case(pool, server, args.seed, i, Path(tmp), tally, args.corpus, args.per_family)
            if rec is not None and tally.families[rec["family"]] == 1:
                print(f"COUNTEREXAMPLE case {i}: {rec['family']}; globals {rec['globals'][:6]}", flush=True)
            i += 1
    minutes = (time.monotonic() - start) / 60
    cmd = " ".join(["python bench/audit_soundness.py", *sys.argv[1:]])
    print(f"command: {cmd}")
    print(f"{tally.cases} cases (index {args.start}..{i - 1}) in {minutes:.1f} min; {tally.clean} scanned clean and "
          f"loaded under the hook ({tally.timeouts} timed out); "
          f"by container {dict(sorted(tally.by_container.items()))}; "
          f"clean by container {dict(sorted(tally.clean_by_container.items()))}")  # fmt: skip
    total = sum(tally.families.values())
    print(f"outcome: {total} counterexamples in {len(tally.families)} families; admitted pool {len(pool.admitted)}")
    for fam, n in sorted(tally.families.items(), key=lambda kv: -kv[1]):
        ex = tally.examples[fam]
        print(f"  {n:5d}  {fam}  (seed {ex['seed']} case {ex['case']}, protocol {ex['protocol']}, "
              f"globals {ex['globals'][:5]})")  # fmt: skip
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
