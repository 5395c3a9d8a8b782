"""Every class and function the installed torch, numpy, transformers, peft, accelerate and the stdlib define, with
the parameter names of what calling it runs (a function's own, a class's ``__init__`` or dataclass fields).

Read with ``ast`` from the installed source (no module is imported, so no import-time side effect), plus ``dir()`` of
the builtins and of the C extension modules whose classes have no Python source. Bounded by files per package and
bytes per file; cached in the temp folder by the packages' versions (a cold read takes about a minute).

    python bench/audit_globals.py            # counts by package
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.metadata
import json
import os
import sys
import sysconfig
import tempfile
from pathlib import Path

PACKAGES = ("torch", "numpy", "transformers", "peft", "accelerate")
MAX_FILES = 8000  # .py files read per package (transformers has ~2,500, torch ~4,000)
MAX_BYTES = 2 << 20  # bytes of one source file parsed
# Importing these starts a browser, prints, opens a window or waits for input: never enumerated from dir().
_STDLIB_SKIP = ("antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "ensurepip",
                "venv", "pydoc_data", "__phello__", "site-packages", "dist-packages")  # fmt: skip
# C modules whose classes and functions a pickle may name and that have no .py source (the stdlib's first).
C_MODULES = ("builtins", "posix", "_io", "_pickle", "_codecs", "_collections", "_functools", "_operator", "_socket",
              "_thread", "_struct", "_json", "_random", "itertools", "marshal", "math", "time", "array", "select",
              "_ctypes", "_sqlite3", "zlib", "_sre", "_weakref", "gc", "sys", "torch._C", "torch._C._nn",
              "numpy._core._multiarray_umath", "numpy.random.mtrand", "numpy.random._generator")  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class Candidate:
    """One global a stream may name: ``module``, ``name`` (a qualified name for a method), what it is
    (``class``, ``function``, ``method``, ``builtin``) and the parameter names a call of it fills."""

    module: str
    name: str
    kind: str
    params: tuple[str, ...]

    @property
    def dotted(self) -> str:
        """``module.name``."""
        return f"{self.module}.{self.name}"


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef, drop_self: bool) -> tuple[str, ...]:
    names = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args)]
    if drop_self and names:
        names = names[1:]
    return tuple(names[:12])


def _class_params(node: ast.ClassDef) -> tuple[str, ...]:
    for item in node.body:
        if isinstance(item, ast.FunctionDef) and item.name == "__init__":
            return _params(item, True)
    fields = [i.target.id for i in node.body if isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name)]
    return tuple(fields[:12])


def _module_of(root: Path, file: Path, prefix: str) -> str:
    rel = file.relative_to(root).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([prefix, *parts] if prefix else parts)


def _from_source(root: Path, prefix: str, skip: tuple[str, ...] = (), max_files: int = MAX_FILES) -> list[Candidate]:
    out: list[Candidate] = []
    files = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith(".") and d != "__pycache__")
        for fn in sorted(filenames):
            if not fn.endswith(".py") or files >= max_files:
                continue
            path = Path(dirpath) / fn
            try:
                if path.stat().st_size > MAX_BYTES:
                    continue
                tree = ast.parse(path.read_bytes())
            except (OSError, SyntaxError, ValueError):
                continue
            files += 1
            module = _module_of(root, path, prefix)
            if not module or any(not p.isidentifier() for p in module.split(".")):
                continue
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.append(Candidate(module, node.name, "function", _params(node, False)))
                elif isinstance(node, ast.ClassDef):
                    out.append(Candidate(module, node.name, "class", _class_params(node)))
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef) and not item.name.startswith("__"):
                            out.append(Candidate(module, f"{node.name}.{item.name}", "method", _params(item, True)))
    return out


def _from_dir(module: str) -> list[Candidate]:
    import importlib

    try:
        mod = importlib.import_module(module)
    except Exception:  # an optional C module absent here
        return []
    out = []
    for name in sorted(dir(mod)):
        obj = getattr(mod, name, None)
        if callable(obj) and not name.startswith("__"):
            out.append(Candidate(module, name, "class" if isinstance(obj, type) else "builtin", ()))
    return out


def _from_dirs(modules: tuple[str, ...]) -> list[Candidate]:
    """``_from_dir`` of every C module, in a child process: the harness that scans must not have imported numpy or
    torch (what the policy's source lookups find depends on what the process has imported, as a real scan has not)."""
    import subprocess

    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); from bench.audit_globals import _from_dir;"
            "print(json.dumps([[c.module, c.name, c.kind] for m in sys.argv[2:] for c in _from_dir(m)]))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, str(Path(__file__).resolve().parents[1]), *modules],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return [Candidate(m, n, k, ()) for m, n, k in json.loads(done.stdout)]


def _cache_path(max_files: int, c_modules: int) -> Path:
    versions = []
    for p in PACKAGES:
        try:
            versions.append(f"{p}{importlib.metadata.version(p)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{p}-none")
    key = "-".join([f"py{sys.version_info[0]}.{sys.version_info[1]}", *versions, f"f{max_files}", f"c{c_modules}"])
    return Path(tempfile.gettempdir()) / f"ckptdoctor-audit-globals-{key}.json"


def enumerate_globals(use_cache: bool = True, max_files: int = MAX_FILES,
                      c_modules: tuple[str, ...] = C_MODULES) -> list[Candidate]:  # fmt: skip
    """Every candidate global (see the module docstring), in a fixed order; read once per set of versions.
    ``max_files`` bounds the source files read per package and ``c_modules`` the C modules listed (the suite's slice
    reads the first 80 files and lists the stdlib's C modules only: importing torch for its ``_C`` costs seconds)."""
    cache = _cache_path(max_files, len(c_modules))
    if use_cache and cache.exists():
        return [Candidate(m, n, k, tuple(p)) for m, n, k, p in json.loads(cache.read_text())]
    import importlib.util

    out: list[Candidate] = []
    for pkg in PACKAGES:
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            continue
        out.extend(_from_source(Path(next(iter(spec.submodule_search_locations))), pkg, max_files=max_files))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out.extend(_from_source(stdlib, "", _STDLIB_SKIP, max_files))
    out.extend(_from_dirs(c_modules))
    seen: set[tuple[str, str]] = set()
    unique = [c for c in out if (c.module, c.name) not in seen and not seen.add((c.module, c.name))]  # type: ignore[func-returns-value]
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps([[c.module, c.name, c.kind, list(c.params)] for c in unique]))
    os.replace(tmp, cache)
    return unique


STDLIB_C_MODULES = tuple(m for m in C_MODULES if not m.startswith(("torch", "numpy")))


if __name__ == "__main__":
    import collections

    found = enumerate_globals(use_cache="--fresh" not in sys.argv)
    by = collections.Counter(c.module.split(".")[0] if c.module.split(".")[0] in PACKAGES else "stdlib" for c in found)
    kinds = collections.Counter(c.kind for c in found)
    print(f"{len(found)} globals; by package {dict(by)}; by kind {dict(kinds)}")
