"""Architecture boundaries, checked statically on the package's source (and one import in a subprocess).

- Reading never executes: no pickle/marshal loading, torch.load, eval or exec anywhere outside the reference trainer.
- The scan path imports neither torch, numpy, safetensors nor peft (the reference trainer may; ``--deep`` may import
  numpy lazily inside functions).
- Only the fixer writes: no module outside ``WRITERS`` (the modules of ``ckptdoctor/fixer/`` that change the disk)
  opens files for writing, renames, replaces or deletes, or reaches the fixer's write seam (``fixer/calls.py``);
  ``cli/output.py`` writes only the report, to the file a user names with ``--output-file``, and ``cache/store.py``
  only its own files, in the user's cache folder.
- Layers: every import follows the flow (``LAYERS``), no import circle exists, and the core modules import without
  click or tabulate.
"""

from __future__ import annotations

import ast
import functools
import os
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
           "fixer/transaction.py", "fixer/manifest.py",
           # the report itself, to the file the user names with --output-file (what `> PATH` would write)
           "cli/output.py",
           # the verdict cache: its own files in the user's cache folder, never in a scanned root (the scanner turns
           # the cache off for a root that holds that folder: ``scanner.open_cache``); it changes no checkpoint
           "cache/store.py"}
# The fixer's write seam: every write system call goes through its `CALLS`; using it, or any name it defines, writes.
SEAM = PKG / "fixer" / "calls.py"
SEAM_MODULE = "ckptdoctor.fixer.calls"


@functools.cache
def parsed() -> dict[Path, ast.Module]:
    """Every module of the package, parsed once for all the tests of this file."""
    return {p: ast.parse(p.read_text(), str(p)) for p in sorted(PKG.rglob("*.py"))}


def scan_path_modules() -> list[Path]:
    return [p for p in parsed() if "reference" not in p.relative_to(PKG).parts]


def _dotted(node: ast.AST) -> tuple[str, str] | None:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return node.value.id, node.attr
    return None


# The one loader call the scan path makes: the verdict cache's own file, ``marshal.loads`` (which builds values and
# code objects, never runs one) of a body whose MAC under the user's private key was checked first
# (``test_the_cache_decodes_only_what_its_key_signed``). Never a checkpoint's bytes.
SIGNED_LOAD = ("store.py", "read", ("marshal", "loads"))


def test_no_loader_eval_or_exec_in_the_package() -> None:
    bad = []
    for path in scan_path_modules():
        tree = parsed()[path]
        signed = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and (path.name, f.name) ==
                  SIGNED_LOAD[:2] for n in ast.walk(f)}  # fmt: skip
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                d = _dotted(node.func)
                if d in LOADERS and not (d == SIGNED_LOAD[2] and id(node) in signed):
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


def test_the_cache_decodes_only_what_its_key_signed() -> None:
    """``Store.read``'s one ``marshal.loads`` comes after the MAC check that returns on a mismatch, and reads the
    body that check covered."""
    tree = parsed()[PKG / "cache" / "store.py"]
    (read,) = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "read"]
    calls = [n for n in ast.walk(read) if isinstance(n, ast.Call)]
    loads = [c for c in calls if _dotted(c.func) == ("marshal", "loads")]
    checks = [c for c in calls if isinstance(c.func, ast.Name) and c.func.id == "_compare_digest"]
    assert len(loads) == 1 and len(checks) == 1
    assert checks[0].lineno < loads[0].lineno
    (check_if,) = [n for n in ast.walk(read) if isinstance(n, ast.If) and checks[0] in ast.walk(n.test)]
    assert isinstance(check_if.body[0], ast.Return)
    mac_arg = next(a for a in checks[0].args if isinstance(a, ast.Call))  # self._mac(body)
    assert [ast.unparse(a) for a in mac_arg.args] == [ast.unparse(a) for a in loads[0].args] == ["body"]


def test_scan_path_has_no_top_level_heavy_imports() -> None:
    bad = []
    for path in scan_path_modules():
        tree = parsed()[path]
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


@functools.cache
def _seam_names() -> frozenset[str]:
    """Every name the write seam defines at module level (functions, classes, `CALLS`, constants)."""
    names: set[str] = set()
    for node in parsed()[SEAM].body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for tgt in targets for n in ast.walk(tgt) if isinstance(n, ast.Name)}
    return frozenset(names)


def writes(path: Path) -> list[str]:
    """The places in ``path`` that write: write calls on os/shutil/paths, and uses of the fixer's write seam."""
    where = path.relative_to(PKG)
    tree = parsed()[path]
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
        tree = parsed()[path]
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            elif isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            if any(m.startswith("ckptdoctor.reference") for m in mods):
                bad.append(f"{path.relative_to(PKG)}:{node.lineno}")
    assert not bad, bad


# ---------------------------------------------------------------------------------------------------------------
# Layers: data flows one way (sources -> readers -> model -> trainer_view -> rules -> scanner | gate | fixer ->
# render -> cli). A module imports only from its own layer or the ones below it, and no import circle exists.

LAYERS: list[set[str]] = [
    # values: frozen facts, no I/O but the package's data files (the version too: nothing below the API imports it)
    {"ckptdoctor.version", "ckptdoctor.errors", "ckptdoctor.limits", "ckptdoctor.findings", "ckptdoctor.model",
     "ckptdoctor.progress", "ckptdoctor.schedules", "ckptdoctor.packaged", "ckptdoctor.patterns",
     "ckptdoctor.hashing", "ckptdoctor.gaps"},
    {"ckptdoctor.readers"},  # bytes -> facts
    {"ckptdoctor.sources"},  # where roots live: list, stat, ranged read (local disk, fsspec)
    # the roots asked about, walking them, tensor data; which program wrote each folder, how it lays out and
    # resumes its runs
    {"ckptdoctor.roots", "ckptdoctor.discover", "ckptdoctor.deep", "ckptdoctor.stacks"},
    # the verdict cache: a source that reads through the user's cache folder, handed to discovery by the scanner
    {"ckptdoctor.cache"},
    # what the Trainer picks and loads; facts rules share; the key layout each transformers saves against its live one
    {"ckptdoctor.trainer_view", "ckptdoctor.facts", "ckptdoctor.key_layouts"},
    # the gate's rules, and the plan and prediction they read, judge a resume as the scan rules judge a tree: they
    # import nothing above this row, so the registry (``rules.RULE_MODULES``) loads them in the flow's direction
    # judging pickles: the policy and the verdict, between the walk (readers) and the rules that report it
    {"ckptdoctor.pickle_verdict"},
    {"ckptdoctor.rules", "ckptdoctor.resume_gate.rules", "ckptdoctor.resume_gate.plan",
     "ckptdoctor.resume_gate.args_file", "ckptdoctor.resume_gate.resolve", "ckptdoctor.resume_gate.predict",
     "ckptdoctor.resume_gate.torchtitan",
     "ckptdoctor.resume_gate.accelerate_rules"},
    {"ckptdoctor.settings"},  # settings files, rule selection, exit policy
    {"ckptdoctor.scanner", "ckptdoctor.fanout", "ckptdoctor.inspection", "ckptdoctor.resume_gate", "ckptdoctor.fixer"},
    # ckptdoctor.scan / ckptdoctor.fix; the package face, whose API names are imported lazily, by name
    {"ckptdoctor.api", "ckptdoctor"},
    {"ckptdoctor.render"},
    {"ckptdoctor.integrations"},
    {"ckptdoctor.cli", "ckptdoctor.__main__"},
]
# Modules that must import without click or tabulate: the library under the command line, i.e. every module but
# the command line itself, the integrations (they import transformers) and the reference trainer (torch, peft).
NOT_CORE = ("ckptdoctor.cli", "ckptdoctor.__main__", "ckptdoctor.integrations", "ckptdoctor.reference")


def core_modules() -> list[str]:
    return sorted(m for m in map(_module_name, PKG.rglob("*.py")) if not m.startswith(NOT_CORE))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of the package (the reference trainer aside) -> the package modules it imports, at any depth of
    the code (an import inside a function runs too), except under ``if TYPE_CHECKING:`` (never runs)."""
    return {name: set(targets) for name, targets in _import_graph().items()}  # a copy: callers may extend it


@functools.cache
def _import_graph() -> dict[str, frozenset[str]]:
    paths = {_module_name(p): p for p in scan_path_modules()}
    graph: dict[str, frozenset[str]] = {}
    for name, path in paths.items():
        tree = parsed()[path]
        typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                       and "TYPE_CHECKING" in ast.unparse(node.test) for m in node.body for n in ast.walk(m)}
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    module = ".".join([*base[: len(base) - node.level + 1], *([module] if module else [])])
                # `from ckptdoctor.fixer import calls` imports the submodule; `from ckptdoctor import __version__`
                # the package
                found |= {f"{module}.{a.name}" if f"{module}.{a.name}" in paths else module for a in node.names}
        graph[name] = frozenset(m for m in found if m in paths and m != name)
    return graph


def layer(module: str) -> int:
    """The index in ``LAYERS`` of the longest prefix naming ``module`` (a package names its submodules)."""
    best = (-1, -1)
    for i, names in enumerate(LAYERS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and len(n) > best[0]:
                best = (len(n), i)
    assert best[1] >= 0, f"{module} is in no layer: add it to LAYERS where it belongs"
    return best[1]


def registry_imports() -> set[str]:
    """The modules the rule registry imports by name (``rules.RULE_MODULES``, each loaded with ``importlib`` so that
    the registry and the modules registering into it do not import each other at load time)."""
    from ckptdoctor.rules import RULE_MODULES

    return set(RULE_MODULES)


def test_every_import_follows_the_flow() -> None:
    graph = import_graph()
    graph["ckptdoctor.rules"] = graph["ckptdoctor.rules"] | registry_imports()  # the registry's imports too
    against = sorted(
        f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
        for a, targets in graph.items()
        for b in targets
        if layer(b) > layer(a)
    )
    assert not against, against


def test_the_registry_imports_are_seen() -> None:
    """Every module the registry loads by name exists and registers rules, and the layering test checks its place
    (a rule module above the registry's row would be an import against the flow)."""
    from ckptdoctor.rules import all_rules

    graph = import_graph()
    modules = registry_imports()
    assert modules <= set(graph), sorted(modules - set(graph))
    assert {r.func.__module__ for r in all_rules()} == modules
    assert all(layer(m) <= layer("ckptdoctor.rules") for m in modules)


def test_no_import_circle_in_the_package() -> None:
    graph = import_graph()
    edges = graph
    circles = []
    for start in edges:  # a path back to `start`, depth first
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in edges[node]:
                if nxt == start:
                    circles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not circles, sorted(circles)[:10]


def test_core_modules_import_without_click_or_tabulate() -> None:
    import subprocess
    import sys

    code = (
        f"import importlib, sys; [importlib.import_module(m) for m in {core_modules()!r}]; "
        "from ckptdoctor.rules import all_rules; all_rules(); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('click', 'tabulate')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


_CLEAN_RUN = Path(__file__).resolve().parents[1] / "fixtures" / "clean-full"


def _modules_after_scan(flags: list[str], which: str, xdg: Path | None = None) -> str:
    """The ``MODULES [...]`` line a scan of a real run (``fixtures/clean-full``) with ``flags`` prints in a fresh
    interpreter, for the loaded modules the expression ``which`` picks (``m`` names one of ``sys.modules``)."""
    import subprocess
    import sys

    code = (
        "import sys; from ckptdoctor.cli import main\n"
        f"try: main(['scan', *{flags!r}, '--format', 'json', {str(_CLEAN_RUN)!r}], standalone_mode=False)\n"
        "except SystemExit: pass\n"
        f"print('MODULES', sorted(m for m in sys.modules if {which}))"
    )
    env = {**os.environ, **({"XDG_CACHE_HOME": str(xdg)} if xdg is not None else {})}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint-8" in proc.stdout  # the scan ran
    return proc.stdout.rstrip().splitlines()[-1]


def test_a_local_scan_loads_no_pool_and_no_resource_machinery() -> None:
    """Start-up is most of a one-checkpoint scan: a local scan (one read at a time) of a real run, pickles judged,
    loads neither ``concurrent.futures`` (the reading pool) nor ``importlib.resources`` (and its ``tempfile``,
    ``shutil``, ``zipfile``): the package's data files are read from its folder (``ckptdoctor.packaged``)."""
    which = "m in ('concurrent.futures', 'importlib.resources', 'tempfile', 'zipfile')"
    assert _modules_after_scan(["--no-cache"], which) == "MODULES []"


def test_a_scan_loads_no_openssl(tmp_path: Path) -> None:
    """``hashlib`` and ``hmac`` load OpenSSL's library when imported (3 ms of a scan): a scan, the cache filled and
    then taken, hashes with the interpreter's own BLAKE2 (``ckptdoctor.hashing``) and loads neither."""
    for _ in range(2):  # the cache filled, then every file's facts taken from it
        assert _modules_after_scan(["--cache"], "m in ('hashlib', 'hmac', '_hashlib')", tmp_path) == "MODULES []"
    assert list((tmp_path / "ckptdoctor" / "facts").iterdir())  # and the cache was used


def test_a_warm_rescan_imports_no_reader(tmp_path: Path) -> None:
    """A rescan that takes every file's facts and verdict from the verdict cache reads no file, so it loads none of
    the readers (the sniffer, the pickle walker, the format readers, ``pickletools``): only the readers' package
    (what the walk names of it) and the memo the cache keeps its values in. Nor the gate's planning (no scan does).
    Scans of a real run: the first fills the cache (``--cache``), the second is measured."""
    gate = "'ckptdoctor.resume_gate.plan', 'ckptdoctor.schedules'"
    which = f"m.startswith('ckptdoctor.readers') or m in ('pickletools', {gate})"
    _modules_after_scan(["--cache"], "False", tmp_path)
    assert _modules_after_scan([], which, tmp_path) == "MODULES ['ckptdoctor.readers', 'ckptdoctor.readers.seen']"


def test_the_sniffers_opcode_bytes_are_pickletools_table() -> None:
    import pickletools

    from ckptdoctor.readers.sniff import OPCODE_CODES

    assert frozenset(op.code for op in pickletools.opcodes) == OPCODE_CODES
