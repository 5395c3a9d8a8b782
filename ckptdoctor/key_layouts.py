"""The key layout a transformers release saves a model in against the one it builds it in (``key_layouts.json``).

Some releases save a model under other tensor names than the live model's: 4.52-4.57 vision-language classes
(``_checkpoint_conversion_mapping``, reversed by ``save_pretrained``), and 5.x mixture-of-experts and other types
(``conversion_mapping``: per-expert ``w1``/``w2``/``w3`` saved, fused ``gate_up_proj``/``down_proj`` live).
``from_pretrained`` converts the saved keys back; the Trainer's resume does not. The table is generated from the
releases by ``bench/make_key_layouts.py``; this module reads it and converts a list of saved keys into the keys a
release's live model has. Pure functions of the table and the model: no I/O beyond the packaged table.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any

from ckptdoctor import trainer_view
from ckptdoctor.facts import version_tuple
from ckptdoctor.model import Checkpoint, frozen

# A saved key as a release's live model names it, and how many live tensors the WeightConverter that took it makes
# of its group (it merges, splits or reshapes: no live shape is the saved one); 0 when it was only renamed (the same
# tensor under another name) or left alone.
Converted = tuple[str, int]


@frozen
class Conversion:
    """What a release's conversion does to one checkpoint's saved keys."""

    model: str  # how the checkpoint names its model: config.json's ``architectures[0]``, else its ``model_type``
    name: str  # the class or model type the table matched
    release: str  # the table's release whose conversion was applied
    changed: tuple[str, ...]  # saved keys the conversion renames or merges, in name order
    targets: tuple[str, ...]  # the live keys they become that no unchanged saved key already is, in name order
    fused: tuple[str, ...]  # saved keys a WeightConverter takes (no live tensor has their shape), in name order
    fused_live: int  # the live tensors the WeightConverters make of them (a split makes several of one group)
    live_count: int  # the live model's tensors, as the saved keys become


@functools.cache
def releases() -> dict[str, Any]:
    """The generated table's releases, read on first use; empty when it is missing."""
    from importlib import resources

    try:
        doc = json.loads(resources.files("ckptdoctor").joinpath("key_layouts.json").read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    found = doc.get("releases") if isinstance(doc, dict) else None
    return found if isinstance(found, dict) else {}


def release_for(version: str | None) -> tuple[str, dict[str, Any]] | None:
    """The table's entry for ``version``: the nearest release read at or below it, of the same major."""
    want = version_tuple(version)
    if want is None:
        return None
    best: tuple[tuple[int, int], str] | None = None
    for release in releases():
        v = version_tuple(release)
        if v is not None and v[0] == want[0] and v <= want and (best is None or v > best[0]):
            best = (v, release)
    return None if best is None else (best[1], releases()[best[1]])


# The transforms the table records by name only: in transformers 5 each is a WeightRenaming subclass (a prefix added
# or removed, a group of renames, an index offset, layer pairs collapsed): one saved tensor to one live tensor of the
# same shape, under a name the table cannot say.
_RENAMES_BY_NAME = frozenset({"PrefixChange", "GroupWeightRename", "Inkling2IndexOffsetWeightRename",
                              "LayerPairCollapse"})


def _converter(entry: dict[str, Any], names: tuple[str, ...],
               shapes_only: bool = False) -> tuple[str, Callable[[str], Converted]] | None:
    """The key conversion ``entry`` applies to a model of class or type ``names`` (the first found), as a function
    of a saved key; None when it has none, or one whose transforms are not modelled (counted as unknown).
    ``shapes_only``: the renamings recorded by name only are passed over (the live names may then be wrong, but
    which keys a WeightConverter takes, and how many live tensors there are, is right)."""
    if entry.get("kind") == "regex_sub":
        for name in names:
            pairs = entry.get("classes", {}).get(name)
            if pairs:
                compiled = [(re.compile(p), r) for p, r in pairs]

                def sub(key: str, compiled: list[tuple[re.Pattern[str], str]] = compiled) -> Converted:
                    for pattern, repl in compiled:  # from_pretrained's key_mapping: the first pattern that matches
                        new, n = pattern.subn(repl, key)
                        if n:
                            return new, 0
                    return key, 0

                return name, sub
        return None
    if entry.get("kind") != "conversion":
        return None
    for name in names:
        transforms = entry.get("types", {}).get(name)
        if not transforms:
            continue
        modelled = [t for t in transforms if t.get("kind") in ("WeightRenaming", "WeightConverter")]
        unknown = {str(t.get("kind")) for t in transforms} - {"WeightRenaming", "WeightConverter"}
        if unknown and not (shapes_only and unknown <= _RENAMES_BY_NAME):
            return None
        # a converter's group is named by its first target; it makes len(targets) live tensors (a Chunk splits one)
        steps = [(re.compile(t["regex"]), str(t["targets"][0]),
                  len(t["targets"]) if t["kind"] == "WeightConverter" else 0) for t in modelled]

        def convert(key: str, steps: list[tuple[re.Pattern[str], str, int]] = steps) -> Converted:
            made = 0
            for pattern, target, n_targets in steps:  # WeightTransform.rename_source_key, each transform in turn
                m = pattern.search(key)
                if m is None:
                    continue
                replacement = target
                if "\\1" in target:
                    group = next(g for g, v in m.groupdict().items() if v is not None)
                    replacement = target.replace("\\1", m.group(pattern.groupindex[group] + 1) or "")
                key = key.replace(m.group(0), replacement, 1)
                made = n_targets or made
            return key, made

        return name, convert
    return None


def model_names(config: object) -> tuple[str, ...]:
    """The names the table may list a checkpoint's model under: ``architectures[0]``, then ``model_type``."""
    if not isinstance(config, dict):
        return ()
    arch = config.get("architectures")
    names = tuple(a for a in (arch if isinstance(arch, list) else []) if isinstance(a, str))[:1]
    return names + ((config["model_type"],) if isinstance(config.get("model_type"), str) else ())


def saved_keys(ck: Checkpoint, weights: str) -> list[str] | None:
    """The tensor names of the weights file (or shard index) ``weights`` of ``ck``, in name order."""
    f = ck.file(weights)
    if weights in (trainer_view.SAFE_INDEX, trainer_view.BIN_INDEX):
        wm = trainer_view.weight_map(f) if f is not None else None
        return sorted(wm) if wm is not None else None
    tensors = trainer_view.tensors_of(f) if f is not None else None
    return sorted(t.name for t in tensors) if tensors is not None else None


def convert(version: str | None, names: tuple[str, ...], saved: list[str],
            shapes_only: bool = False) -> Conversion | None:
    """What transformers ``version``'s live model makes of the ``saved`` keys of a model named ``names``; None when
    its conversion changes none of them (or the table has no entry, or one not modelled). ``shapes_only``: see
    ``_converter`` (the live names may be wrong, the count and which tensors are fused are right)."""
    found = release_for(version)
    conv = _converter(found[1], names, shapes_only) if found is not None and names else None
    if found is None or conv is None:
        return None
    live = {k: conv[1](k) for k in saved}
    changed = [k for k in saved if live[k][0] != k]
    if not changed:
        return None
    unchanged = set(saved) - set(changed)
    targets = {live[k][0] for k in changed} - unchanged
    groups = {live[k][0]: live[k][1] for k in changed if live[k][1]}  # a fused group's live name: tensors it makes
    fused_live = sum(n for key, n in groups.items() if key in targets)
    return Conversion(names[0], conv[0], found[0], tuple(changed), tuple(sorted(targets)),
                      tuple(k for k in changed if live[k][1]), fused_live,
                      len(unchanged) + len(targets - groups.keys()) + fused_live)


def written_layout(ck: Checkpoint, saved: list[str]) -> Conversion | None:
    """How many tensors the live model of the release that wrote ``ck`` (``config.json`` ``transformers_version``)
    made of the ``saved`` ones, and which of them it fused: what its optimizer state was built on (``shapes_only``:
    the live names are not needed). None when it saved the live layout, or nothing says which release wrote it."""
    config = trainer_view.json_value(ck.file("config.json"))
    wrote = config.get("transformers_version") if isinstance(config, dict) else None
    return convert(wrote, model_names(config), saved, shapes_only=True) if isinstance(wrote, str) else None
