"""Build ckptdoctor/key_layouts.json: which models' saved key layout differs from their live one, per transformers.

Usage::

    python bench/make_key_layouts.py --source /work/stacks/tf440 --source /work/stacks/tf4 \
        --source WHEEL_OR_FOLDER ... [--check]

Each ``--source`` is a folder holding a ``transformers`` package (a ``pip install --target`` layer, an unpacked
wheel, a site-packages) or a transformers wheel; this environment's own transformers is always read. Nothing is
guessed: a release that is not given is not in the table, and the gate reads the nearest release at or below the one
that resumes.

- transformers 4.52 to 4.57: a model class whose ``_checkpoint_conversion_mapping`` is a non-empty dict literal
  and whose name holds one of ``modeling_utils.VLMS`` is saved with that mapping reversed
  (``PreTrainedModel.save_pretrained``) and built with the new names; ``from_pretrained`` maps the keys back
  (``key_mapping``), the Trainer's resume (``Trainer._load_from_checkpoint``: ``load_state_dict(strict=False)``)
  does not. Read statically with ``ast`` from ``models/*/modeling_*.py`` and ``modeling_utils.py``.
- transformers 5: ``conversion_mapping._build_checkpoint_conversion_mapping()`` (by model type, or class name),
  reversed on save and applied by ``from_pretrained`` only. Read by importing ``transformers.conversion_mapping``
  of that release in a subprocess (two import shims let an older release import beside this environment's
  packages: an ``httpx`` stand-in and a no-op dependency check; neither changes a mapping). Each transform is
  recorded with the regex transformers compiles for it (``compiled_sources``) and its targets. A subclass of
  ``WeightRenaming`` that keeps ``WeightTransform.rename_source_key`` (``PrefixChange``: a prefix added or removed,
  written as a regex by its ``__init__``) renames a key exactly as a ``WeightRenaming`` with the same regex and
  targets does: it is recorded the same way, with ``"as": "WeightRenaming"``. Any other kind overrides the renaming
  (``GroupWeightRename``, ``Inkling2IndexOffsetWeightRename``, ``LayerPairCollapse``) and is recorded by name, with
  (``unless``) the regex a key must match for that code to change it, read from the code's first statements (a
  ``_scoped_match`` or ``self.<regex>.search`` that returns the key unchanged when it finds nothing): a checkpoint
  none of whose keys match it is converted exactly by the other transforms; one whose keys do match, the gate says it
  did not check (CKD421, info).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "ckptdoctor" / "key_layouts.json"

# Run under a transformers 5 release: print its conversion mappings as JSON.
_V5_DUMP = r"""
import ast, inspect, json, re, sys, textwrap, types
try:
    import transformers
except ImportError:  # an older release's dependency check against this environment's packages: not a mapping
    check = types.ModuleType("transformers.dependency_versions_check")
    check.dep_version_check = lambda *a, **k: None
    sys.modules["transformers.dependency_versions_check"] = check
    for name in [m for m in sys.modules if m.startswith("transformers")]:
        if name != "transformers.dependency_versions_check":
            del sys.modules[name]
    import transformers
from transformers import conversion_mapping as cm
from transformers import core_model_loading as cml


def unless(t):
    # The regex a key must match for t's own rename_source_key to change it: its first statements return the key
    # unchanged when `self._scoped_match(key)` (compiled_sources, for a transform of the root model) or
    # `self.<regex>.search(key)` finds nothing. None when its code starts otherwise (nothing is then known).
    fn = ast.parse(textwrap.dedent(inspect.getsource(type(t).rename_source_key))).body[0]
    body = [b for b in fn.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
    src = [ast.unparse(b) for b in body[:2]]
    if src[:2] == ["matched = self._scoped_match(source_key)", "if matched is None:\n    return (source_key, None)"]:
        return t.compiled_sources.pattern
    m = re.fullmatch(r"if \(match := self\.(\w+)\.search\(source_key\)\) is None:\n    return \(source_key, None\)",
                     src[0] if src else "")
    found = getattr(t, m.group(1), None) if m else None
    return found.pattern if isinstance(found, re.Pattern) else None


out = {}
for key, transforms in cm._build_checkpoint_conversion_mapping().items():
    entry = []
    for t in transforms:
        kind = type(t).__name__
        record = {"kind": kind, "regex": t.compiled_sources.pattern, "targets": list(t.target_patterns)}
        if kind in ("WeightRenaming", "WeightConverter"):
            entry.append(record)
        elif (isinstance(t, cml.WeightRenaming) and not isinstance(t, cml.WeightConverter)
              and type(t).rename_source_key is cml.WeightTransform.rename_source_key):
            entry.append({**record, "as": "WeightRenaming"})  # e.g. PrefixChange: only its regex is its own
        else:
            guard = unless(t) if isinstance(t, cml.WeightRenaming) else None  # a renaming: runs before converters
            entry.append({"kind": kind, **({"unless": guard} if guard is not None else {})})
    out[key] = entry
print(json.dumps({"version": transformers.__version__, "types": out}))
"""

_HTTPX_STUB = "def __getattr__(name):\n    return type(name, (Exception,), {})\n"


def _package_root(source: Path, tmp: Path) -> Path:
    """The folder holding ``transformers/`` for ``source`` (a wheel is unpacked into ``tmp``)."""
    if source.is_file() and source.suffix == ".whl":
        dest = tmp / source.stem
        with zipfile.ZipFile(source) as z:
            z.extractall(dest, [n for n in z.namelist() if n.startswith("transformers")])
        return dest
    return source


def _version_of(root: Path) -> str:
    init = (root / "transformers" / "__init__.py").read_text("utf-8")
    for node in ast.parse(init).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__version__" for t in node.targets):
            value = ast.literal_eval(node.value)
            if isinstance(value, str):
                return value
    raise SystemExit(f"{root}: no transformers __version__")


def _vlms(root: Path) -> list[str]:
    tree = ast.parse((root / "transformers" / "modeling_utils.py").read_text("utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "VLMS" for t in node.targets):
            value = ast.literal_eval(node.value)
            return [str(v) for v in value]
    return []


def read_v4(root: Path) -> dict[str, Any]:
    """The 4.x classes saved in a layout their live model does not have (see the module docstring)."""
    vlms = _vlms(root)
    classes: dict[str, list[list[str]]] = {}
    for path in sorted((root / "transformers" / "models").glob("*/modeling_*.py")):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if not isinstance(node, ast.ClassDef):
                continue
            for stmt in node.body:
                if not (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Dict)
                        and any(getattr(t, "id", "") == "_checkpoint_conversion_mapping" for t in stmt.targets)):
                    continue
                mapping = ast.literal_eval(stmt.value)
                names = [node.name, *(getattr(b, "id", "") for b in node.bases)]
                if mapping and any(v in n.lower() for v in vlms for n in names):
                    classes[node.name] = [[str(k), str(v)] for k, v in mapping.items()]
    return {"kind": "regex_sub", "classes": dict(sorted(classes.items()))}


def read_v5(root: Path, tmp: Path) -> dict[str, Any]:
    """The 5.x conversion mappings, dumped by that release itself (``_V5_DUMP``)."""
    stub = tmp / "stub"
    stub.mkdir(exist_ok=True)
    (stub / "httpx.py").write_text(_HTTPX_STUB)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(stub)])}
    if root == _installed_root():
        env["PYTHONPATH"] = ""  # this environment's own: import it as installed
    proc = subprocess.run([sys.executable, "-c", _V5_DUMP], capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{root}: {proc.stderr[-2000:]}")
    doc: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"kind": "conversion", "types": dict(sorted(doc["types"].items()))}


def _installed_root() -> Path | None:
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    return Path(spec.origin).parents[1] if spec is not None and spec.origin else None


def build(sources: list[Path]) -> dict[str, Any]:
    """The table: per release read, its layouts (``regex_sub`` for 4.x, ``conversion`` for 5.x, none before)."""
    releases: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        installed = _installed_root()
        for source in [*([installed] if installed else []), *sources]:
            root = _package_root(source, tmp)
            version = _version_of(root)
            major = int(version.split(".")[0])
            entry = read_v5(root, tmp) if major >= 5 else read_v4(root)
            if entry.get("classes") == {}:
                entry = {"kind": "none"}
            releases[version] = entry
    order = sorted(releases, key=lambda v: tuple(int(x) for x in v.split(".")[:3] if x.isdigit()))
    return {
        "generated_by": "bench/make_key_layouts.py",
        "about": "per transformers release read: the model classes (4.52-4.57 VLMs) or model types / classes (5.x) "
                 "whose save_pretrained writes keys their live model does not have; the Trainer's resume loads "
                 "them raw (load_state_dict(strict=False))",
        "releases": {v: releases[v] for v in order},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, action="append", default=[],
                    help="a folder holding a transformers package, or a transformers wheel")
    ap.add_argument("--check", action="store_true", help="exit 1 when the pinned file differs for a release read")
    args = ap.parse_args()
    table = build(args.source)
    if args.check:
        pinned = json.loads(OUT.read_text("utf-8"))["releases"]
        changed = [v for v, entry in table["releases"].items() if pinned.get(v) != entry]
        if changed:
            print("differs for " + ", ".join(changed))
            raise SystemExit(1)
        return
    OUT.write_text(json.dumps(table, indent=1, sort_keys=False) + "\n", "utf-8")
    print(f"wrote {OUT}: {', '.join(table['releases'])}")


if __name__ == "__main__":
    main()
