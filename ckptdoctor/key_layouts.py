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

# A saved key as a release's live model names it (a WeightConverter's group: its first target), and the live tensors
# the WeightConverter that took it makes of its group, by name (it merges, splits or reshapes: no live shape is the
# saved one); () when the key was only renamed (the same tensor under another name) or left alone.
Converted = tuple[str, tuple[str, ...]]


@frozen
class Conversion:
    """What a release's conversion does to one checkpoint's saved keys.

    A transform the table records by name only (its renaming is code of its own) leaves a key alone when the key
    does not match the regex recorded with it (``unless``); a key that matches is ``unmodelled``: what it becomes is
    not known, and it is left out of ``changed``, ``targets`` and ``fused`` (``live_count`` counts it as one)."""

    model: str  # how the checkpoint names its model: config.json's ``architectures[0]``, else its ``model_type``
    name: str  # the class or model type the table matched
    release: str  # the table's release whose conversion was applied
    changed: tuple[str, ...]  # saved keys the conversion renames or merges, in name order
    targets: tuple[str, ...]  # the live tensors they become that no unchanged saved key already is, in name order
    fused: tuple[str, ...]  # saved keys a WeightConverter takes (no live tensor has their shape), in name order
    fused_live: int  # the live tensors the WeightConverters make of them (a split makes several of one group)
    live_count: int  # the live model's tensors, as the saved keys become (exact when ``unmodelled`` is empty)
    unmodelled: tuple[str, ...] = ()  # saved keys a transform not modelled here would rename, in name order
    unmodelled_kinds: tuple[str, ...] = ()  # those transforms' class names, as the saved keys meet them


@functools.cache
def releases() -> dict[str, Any]:
    """The generated table's releases, read on first use; empty when it is missing."""
    from ckptdoctor.packaged import read_text

    try:
        doc = json.loads(read_text("ckptdoctor", "key_layouts.json"))
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


# The transforms the table records by name only: in transformers 5 each is a WeightRenaming subclass with its own
# ``rename_source_key`` (a group of renames guarded by its first, an index offset, layer pairs collapsed): one saved
# tensor to one live tensor of the same shape, under a name the table cannot say. Where the table also records the
# regex a key must match for that code to change it (``unless``), a key that does not match is left alone exactly.
# (PrefixChange, whose renaming is the base one, is recorded with its regex: ``"as": "WeightRenaming"``.)
_RENAMES_BY_NAME = frozenset({"GroupWeightRename", "Inkling2IndexOffsetWeightRename", "LayerPairCollapse"})

_Step = tuple[re.Pattern[str], tuple[str, ...]]
# A renaming in the release's order: modelled (its regex and targets), or not (its class name and the regex a key must
# match for it to change the key; None: any key may change)
_Renaming = tuple[_Step, None] | tuple[None, tuple[str, re.Pattern[str] | None]]


def _modelled_kind(t: dict[str, Any]) -> str | None:
    """``WeightRenaming`` or ``WeightConverter``: how ``t`` renames a key, when the table recorded its regex."""
    kind = t.get("kind")
    if kind in ("WeightRenaming", "WeightConverter"):
        return str(kind)
    return "WeightRenaming" if t.get("as") == "WeightRenaming" and "regex" in t else None


def _rename(step: _Step, key: str) -> str | None:
    """``WeightTransform.rename_source_key``: the first matching branch's match, replaced once by the first target
    (its ``\\1`` by that branch's inner group); None when nothing matches."""
    pattern, targets = step
    m = pattern.search(key)
    if m is None:
        return None
    replacement = targets[0]
    if "\\1" in replacement:
        group = next(g for g, v in m.groupdict().items() if v is not None)
        replacement = replacement.replace("\\1", m.group(pattern.groupindex[group] + 1) or "")
    return key.replace(m.group(0), replacement, 1)


def _live_names(key: str, targets: tuple[str, ...]) -> tuple[str, ...]:
    """The live tensors a WeightConverter makes of its group ``key`` (named by its first target):
    ``WeightConverter.convert`` puts each target between the prefix and the suffix around the first one."""
    prefix, found, suffix = key.partition(targets[0])
    if not found or len(targets) == 1:
        return (key,) if len(targets) == 1 else tuple(f"{key}#{i}" for i in range(len(targets)))
    return tuple(prefix + t + suffix for t in targets)


def _transforms(entry: dict[str, Any], names: tuple[str, ...]) -> tuple[str, list[dict[str, Any]]] | None:
    """The transforms ``entry`` lists for the first of ``names`` it has (a class name before a model type, as
    ``extract_weight_conversions_for_model`` looks them up)."""
    for name in names:
        transforms = entry.get("types", {}).get(name)
        if transforms:
            return name, transforms
    return None


# A saved key's conversion: what it becomes, or the class name of the unmodelled transform that would change it
KeyConverter = Callable[[str], "Converted | str"]


def _converter(entry: dict[str, Any], names: tuple[str, ...],
               shapes_only: bool = False) -> tuple[str, KeyConverter] | None:
    """The key conversion ``entry`` applies to a model of class or type ``names`` (the first found), as a function
    of a saved key; None when it has none. The function gives, instead of the converted key, the class name of the
    unmodelled transform that would change the key (``Conversion.unmodelled``). ``shapes_only``: the renamings
    recorded by name only are passed over (the live names may then be wrong, but which keys a WeightConverter takes,
    and how many live tensors there are, is right)."""
    if entry.get("kind") == "regex_sub":
        for name in names:
            pairs = entry.get("classes", {}).get(name)
            if pairs:
                compiled = [(re.compile(p), r) for p, r in pairs]

                def sub(key: str, compiled: list[tuple[re.Pattern[str], str]] = compiled) -> Converted:
                    for pattern, repl in compiled:  # from_pretrained's key_mapping: the first pattern that matches
                        new, n = pattern.subn(repl, key)
                        if n:
                            return new, ()
                    return key, ()

                return name, sub
        return None
    found = _transforms(entry, names) if entry.get("kind") == "conversion" else None
    if found is None:
        return None
    name, transforms = found
    renamings: list[_Renaming] = []
    converters: list[_Step] = []
    for t in transforms:
        kind = _modelled_kind(t)
        if kind is not None:
            step = (re.compile(t["regex"]), tuple(map(str, t["targets"])))
            if kind == "WeightConverter":
                converters.append(step)
            else:
                renamings.append((step, None))
        elif not (shapes_only and t.get("kind") in _RENAMES_BY_NAME):
            unless = t.get("unless")
            renamings.append((None, (str(t.get("kind")), re.compile(unless) if isinstance(unless, str) else None)))

    def convert(key: str, renamings: list[_Renaming] = renamings,
                converters: list[_Step] = converters) -> Converted | str:
        # core_model_loading.rename_source_key: every renaming in turn, then the first converter that matches
        for step, unknown in renamings:
            if step is not None:
                key = _rename(step, key) or key
            elif unknown is not None and (unknown[1] is None or unknown[1].search(key)):
                return unknown[0]  # its own code would change this key, and nothing here says how
        for conv in converters:
            new = _rename(conv, key)
            if new is not None:
                return new, _live_names(new, conv[1])
        return key, ()

    return name, convert


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
    its conversion changes none of them, and no transform it does not model would (or the table has no entry).
    ``shapes_only``: see ``_converter`` (the live names may be wrong, the count and which tensors are fused are
    right)."""
    found = release_for(version)
    conv = _converter(found[1], names, shapes_only) if found is not None and names else None
    if found is None or conv is None:
        return None
    live: dict[str, Converted] = {}
    unknown: dict[str, str] = {}  # a saved key an unmodelled transform renames: that transform's class name
    for k in saved:
        c = conv[1](k)
        if isinstance(c, str):
            unknown[k] = c
        else:
            live[k] = c
    changed = [k for k in live if live[k][0] != k]
    if not changed and not unknown:
        return None
    unchanged = set(live) - set(changed)
    made = {name for k in changed for name in (live[k][1] or (live[k][0],))}  # the live tensors they become
    fused_made = {name for k in changed for name in live[k][1]}
    targets = made - unchanged
    return Conversion(names[0], conv[0], found[0], tuple(changed), tuple(sorted(targets)),
                      tuple(k for k in changed if live[k][1]), len(fused_made & targets),
                      len(unchanged) + len(targets) + len(unknown), tuple(unknown),
                      tuple(dict.fromkeys(unknown.values())))


def written_layout(ck: Checkpoint, saved: list[str]) -> Conversion | None:
    """How many tensors the live model of the release that wrote ``ck`` (``config.json`` ``transformers_version``)
    made of the ``saved`` ones, and which of them it fused: what its optimizer state was built on (``shapes_only``:
    the live names are not needed). None when it saved the live layout, or nothing says which release wrote it."""
    config = trainer_view.json_value(ck.file("config.json"))
    wrote = config.get("transformers_version") if isinstance(config, dict) else None
    found = convert(wrote, model_names(config), saved, shapes_only=True) if isinstance(wrote, str) else None
    return None if found is None or found.unmodelled else found  # an unknown renaming may merge: count not known
