"""Architecture boundaries, checked statically on the package's source.

- Reading never executes: no pickle/marshal loading, torch.load, eval or exec anywhere outside the reference trainer.
- The scan path imports neither torch, numpy, safetensors nor peft (the reference trainer may; ``--deep`` may import
  numpy lazily inside functions).
- Only the fixer writes: no module outside ``WRITERS`` (the modules of ``ckptdoctor/fixer/`` that change the disk)
  opens files for writing, renames, replaces or deletes, or reaches the fixer's write seam (``fixer/calls.py``).
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
# Modules allowed to write (paths relative to ckptdoctor/): the fixer's modules that change the disk (the write seam
# and durable writes, the journal, the lock, applying, undoing, transactions, manifests). The rest of the fixer
# (planning, digests, rendering, the commands) reads only. The reference trainer writes checkpoints by design and is
# never imported by the scan path.
WRITERS = {"fixer/calls.py", "fixer/journal.py", "fixer/guard.py", "fixer/apply.py", "fixer/recover.py",
           "fixer/transaction.py", "fixer/manifest.py"}
# The fixer's write seam: every write system call goes through its `CALLS`; using it, or any name it defines, writes.
SEAM = PKG / "fixer" / "calls.py"
SEAM_MODULE = "ckptdoctor.fixer.calls"


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


def _seam_names() -> set[str]:
    """Every name the write seam defines at module level (functions, classes, `CALLS`, constants)."""
    names: set[str] = set()
    for node in ast.parse(SEAM.read_text(), str(SEAM)).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for tgt in targets for n in ast.walk(tgt) if isinstance(n, ast.Name)}
    return names


def writes(path: Path) -> list[str]:
    """The places in ``path`` that write: write calls on os/shutil/paths, and uses of the fixer's write seam."""
    where = path.relative_to(PKG)
    tree = ast.parse(path.read_text(), str(path))
    seam_names = _seam_names()
    seam_aliases: set[str] = set()  # local names of the seam module itself, and of what was imported from it
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in (SEAM_MODULE, "ckptdoctor.fixer"):
            for a in node.names:
                if node.module == SEAM_MODULE or a.name in seam_names or a.name == "calls":
                    seam_aliases.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            seam_aliases |= {a.asname for a in node.names if a.name == SEAM_MODULE and a.asname}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in seam_aliases | {"CALLS"}:
            found.append(f"{where}:{node.lineno} uses the write seam ({node.id})")
        if isinstance(node, ast.Attribute) and node.attr == "CALLS":
            found.append(f"{where}:{node.lineno} uses the write seam (.CALLS)")
        if not isinstance(node, ast.Call):
            continue
        d = _dotted(node.func)
        if d in WRITE_CALLS:
            found.append(f"{where}:{node.lineno} {d[0]}.{d[1]}")
        if isinstance(node.func, ast.Attribute) and node.func.attr in WRITE_METHODS and d is None:
            found.append(f"{where}:{node.lineno} .{node.func.attr}()")
        if isinstance(node.func, ast.Name) and node.func.id == "open":
            mode = node.args[1] if len(node.args) > 1 else next(
                (k.value for k in node.keywords if k.arg == "mode"), None)
            if isinstance(mode, ast.Constant) and isinstance(mode.value, str) and set(mode.value) & set("wax+"):
                found.append(f"{where}:{node.lineno} open(..., {mode.value!r})")
        if d == ("os", "open") and len(node.args) > 1:
            flags = ast.unparse(node.args[1])
            if any(w in flags for w in ("O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND")):
                found.append(f"{where}:{node.lineno} os.open({flags})")
    return found


def test_only_the_fixer_writes() -> None:
    bad = []
    for path in scan_path_modules():
        if path.relative_to(PKG).as_posix() not in WRITERS:
            bad += writes(path)
    assert not bad, bad


def test_the_writer_exemption_names_exactly_the_modules_that_write() -> None:
    """Each exempted module exists and writes: a rename or a module that stops writing cannot leave the exemption
    pointing at nothing, or wider than what writes."""
    missing = sorted(w for w in WRITERS if not (PKG / w).is_file())
    assert not missing, f"WRITERS names files that do not exist: {missing}"
    idle = sorted(w for w in WRITERS if not writes(PKG / w))
    assert not idle, f"WRITERS exempts modules that do not write: {idle}"
    assert SEAM.relative_to(PKG).as_posix() in WRITERS


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
