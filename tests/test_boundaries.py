"""Architecture boundaries, checked statically on the package's source.

- Reading never executes: no pickle/marshal loading, torch.load, eval or exec anywhere outside the reference trainer.
- The scan path imports neither torch, numpy, safetensors nor peft (the reference trainer may; ``--deep`` may import
  numpy lazily inside functions).
- Only the fixer writes: no other module opens files for writing, renames, replaces or deletes.
"""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "ckptdoctor"
HEAVY = {"torch", "numpy", "safetensors", "peft", "transformers", "accelerate"}
LOADERS = {("pickle", "load"), ("pickle", "loads"), ("_pickle", "load"), ("_pickle", "loads"),
           ("marshal", "load"), ("marshal", "loads"), ("torch", "load"), ("dill", "load"), ("dill", "loads")}
WRITE_CALLS = {("os", "replace"), ("os", "rename"), ("os", "remove"), ("os", "unlink"), ("os", "rmdir"),
               ("os", "mkdir"), ("os", "makedirs"), ("os", "symlink"), ("os", "link"), ("os", "truncate"),
               ("os", "ftruncate"), ("os", "chmod"), ("shutil", "move"), ("shutil", "rmtree"), ("shutil", "copy"),
               ("shutil", "copy2"), ("shutil", "copyfile"), ("shutil", "copytree")}
# Path methods that write (not `replace`: str has one too).
WRITE_METHODS = {"write_text", "write_bytes", "unlink", "rename", "mkdir", "rmdir", "touch", "chmod"}
# Modules allowed to write: the fixer (journal, quarantine, rewrites). The reference trainer writes checkpoints by
# design and is never imported by the scan path.
WRITERS = {"fix.py"}


def scan_path_modules() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "reference" not in p.relative_to(PKG).parts)


def _dotted(node: ast.AST) -> tuple[str, str] | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id, node.attr
    return None


def test_no_loader_eval_or_exec_in_the_package() -> None:
    bad = []
    for path in scan_path_modules():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                d = _dotted(node.func)
                if d in LOADERS:
                    bad.append(f"{path.name}:{node.lineno} {d[0]}.{d[1]}")
                if isinstance(node.func, ast.Name) and node.func.id in ("eval", "exec", "__import__"):
                    bad.append(f"{path.name}:{node.lineno} {node.func.id}")
            if (
                isinstance(node, ast.ImportFrom)
                and node.module in ("pickle", "_pickle", "marshal")
                and any(a.name in ("load", "loads", "Unpickler") for a in node.names)
            ):
                bad.append(f"{path.name}:{node.lineno} from {node.module} import ...")
    assert not bad, bad


def test_scan_path_has_no_top_level_heavy_imports() -> None:
    bad = []
    for path in scan_path_modules():
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:  # module level only: lazy imports inside --deep functions are allowed
            names = []
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module.split(".")[0]]
            for n in names:
                if n in HEAVY:
                    bad.append(f"{path.relative_to(PKG)}:{node.lineno} imports {n}")
    assert not bad, bad


def test_only_the_fixer_writes() -> None:
    bad = []
    for path in scan_path_modules():
        if path.name in WRITERS:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            d = _dotted(node.func)
            if d in WRITE_CALLS:
                bad.append(f"{path.relative_to(PKG)}:{node.lineno} {d[0]}.{d[1]}")
            if isinstance(node.func, ast.Attribute) and node.func.attr in WRITE_METHODS and d is None:
                bad.append(f"{path.relative_to(PKG)}:{node.lineno} .{node.func.attr}()")
            if isinstance(node.func, ast.Name) and node.func.id == "open":
                mode = node.args[1] if len(node.args) > 1 else next(
                    (k.value for k in node.keywords if k.arg == "mode"), None)
                if isinstance(mode, ast.Constant) and isinstance(mode.value, str) and set(mode.value) & set("wax+"):
                    bad.append(f"{path.relative_to(PKG)}:{node.lineno} open(..., {mode.value!r})")
            if d == ("os", "open") and len(node.args) > 1:
                flags = ast.unparse(node.args[1])
                if any(w in flags for w in ("O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND")):
                    bad.append(f"{path.relative_to(PKG)}:{node.lineno} os.open({flags})")
    assert not bad, bad


def test_reference_trainer_is_not_imported_by_the_scan_path() -> None:
    bad = []
    for path in scan_path_modules():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            if any(m.startswith("ckptdoctor.reference") for m in mods):
                bad.append(f"{path.relative_to(PKG)}:{node.lineno}")
    assert not bad, bad
