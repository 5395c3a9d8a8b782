"""The gate for a PyTorch Lightning run: predict ``Trainer.fit(ckpt_path=...)`` (``stacks.lightning.predict``) and
judge it with the Lightning gate rules (CKD445, CKD446, CKD449) plus the scan's findings about the folder it reads.

``run_gate`` in ``resume_gate.api`` hands a run here when ``stack="lightning"`` is asked, or when none is asked and
the run holds Lightning checkpoints (``handles``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

from ckptdoctor.findings import Finding, display_path
from ckptdoctor.model import FileFacts, Stack, Tree
from ckptdoctor.resume_gate.plan import GateInputError
from ckptdoctor.rules import Selection, all_rules, evaluate
from ckptdoctor.stacks import lightning

# The planned arguments a Lightning resume reads (`gate(..., ckpt_path=..., max_epochs=..., max_steps=...,
# logger_version=..., steps_per_epoch=...)`, the CLI's `--ckpt-path`, `--max-epochs` ...)
PLAN_FIELDS = frozenset({"ckpt_path", "max_epochs", "max_steps", "logger_version", "steps_per_epoch"})
R = TypeVar("R")  # the gate's result (``resume_gate.api.GateResult``, handed in: that module imports this one)
_SCAN_DEPTH = 4  # lightning_logs/version_N/checkpoints/x.ckpt under RUN_DIR


def handles(run_dir: str | os.PathLike[str], stack: str | None, planned: Mapping[str, Any]) -> bool:
    """Whether the gate of ``run_dir`` is Lightning's: asked (``stack="lightning"``), or, with no stack asked, a plan
    of Lightning's own arguments (``ckpt_path``, ``max_epochs``, ``logger_version``) or a local ``run_dir`` holding
    a ``.ckpt`` whose pickle is a Lightning checkpoint's (its signature; up to ``_SCAN_DEPTH`` folders down, the
    default logger's layout)."""
    if stack is not None:
        return stack == Stack.LIGHTNING.value
    if any(planned.get(k) is not None for k in ("ckpt_path", "max_epochs", "logger_version")):
        return True
    from ckptdoctor.sources import is_remote

    root = os.fspath(run_dir)
    if is_remote(root) or not os.path.isdir(root):
        return False
    from ckptdoctor.limits import DEFAULT_LIMITS
    from ckptdoctor.readers import read_file

    for folder, dirs, names in os.walk(root):
        depth = os.path.relpath(folder, root).count(os.sep) + (folder != root)
        if depth >= _SCAN_DEPTH:
            dirs[:] = []
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in sorted(n for n in names if n.endswith(lightning.SUFFIX)):
            path = os.path.join(folder, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            if lightning.signed(read_file(path, name, st, DEFAULT_LIMITS, False, False)):
                return True
    return False


def run_gate(
    run_dir: str | os.PathLike[str], checkpoint: str | os.PathLike[str] | None, planned: Mapping[str, Any],
    selected: tuple[Selection, str | None], fail_on: str | None, result: Callable[..., R], cache: bool | None = False,
) -> R:
    """``gate`` of a Lightning run: ``planned`` holds ``PLAN_FIELDS`` (None: Lightning's default); ``checkpoint``, as
    ``--checkpoint``, is a ``ckpt_path`` path. ``selected`` is ``resume_gate.api.rule_selection``'s answer, ``fail_on``
    the caller's, ``result`` the ``GateResult`` class (handed in: ``resume_gate.api`` imports this module); ``cache``
    as ``scanner.scan``'s."""
    unknown = sorted(k for k, v in planned.items() if v is not None and k not in PLAN_FIELDS)
    if unknown:
        raise GateInputError(f"not planned for a Lightning resume (`fit(ckpt_path=...)` reads none of it): "
                             f"{', '.join(unknown)}; plan ckpt_path, max_epochs, max_steps, logger_version")
    ckpt_path = os.fspath(checkpoint) if checkpoint is not None else planned.get("ckpt_path") or "last"
    plan = lightning.LightningPlan(ckpt_path, planned.get("max_epochs"), planned.get("max_steps"),
                                   planned.get("logger_version"), planned.get("steps_per_epoch"))
    selection, cfg_fail_on = selected
    from ckptdoctor.scanner import scan

    root = os.fspath(run_dir)
    if ckpt_path not in ("last", "best", "none") and os.path.isfile(ckpt_path) and not _inside(ckpt_path, root):
        root = os.path.dirname(os.path.abspath(ckpt_path))  # `fit` loads it from where it is: judge it there
    report = scan(root, selection=selection, cache=cache)
    tree, scanned = report.trees[0], report.findings
    p = lightning.predict(tree, plan, _named(tree, root, ckpt_path))
    unselected = replace(selection, select=())
    rules = [r for r in all_rules() if r.code in ("CKD445", "CKD446", "CKD449") and unselected.enabled(replace(
        r, gate_only=False))]
    found = evaluate(rules, p, tree, selection)
    kept = _kept(scanned, p)
    loaded = p.loaded
    return result(
        os.fspath(run_dir), None if loaded is None else display_path(tree.root, loaded.path), "lightning",
        p.start_step, None if p.steps_to_train is None or p.start_step is None else p.start_step + p.steps_to_train,
        p.steps_to_train, (), tuple(sorted([*kept, *found], key=Finding.sort_key)),
        restores_optimizer=loaded is not None and p.raises is None, epochs_trained=p.start_epoch,
        fail_on=fail_on or cfg_fail_on or "error",
        weights_file=None if loaded is None else loaded.name, stack="lightning",
        fail_on_from_settings=fail_on is None and cfg_fail_on is not None,
    )


def _inside(path: str, folder: str) -> bool:
    real, base = os.path.realpath(path), os.path.realpath(folder)
    return real.startswith(base.rstrip(os.sep) + os.sep)


def _named(tree: Tree, run_dir: str, ckpt_path: str) -> FileFacts | None:
    """The file a path ``ckpt_path`` names (as given, or inside ``run_dir``), found among the tree's files."""
    if ckpt_path in ("last", "best", "none"):
        return None
    for base in (os.getcwd(), run_dir):
        rel = os.path.relpath(os.path.join(base, ckpt_path), run_dir).replace(os.sep, "/")
        for f in tree.all_files():
            if f.path == rel:
                return f
    return None


def _kept(scanned: tuple[Finding, ...], p: lightning.LightningPrediction) -> list[Finding]:
    """The scan findings about what the resume reads: the loaded file (each file it may load, when "last" ties:
    CKD449 then says what CKD448 does, as the gate's error), and the folder "last" looked in (a dangling
    `last.ckpt` link there, CKD441)."""
    loads = {c.loaded.path for c in p.candidates if c.loaded is not None}
    if p.loaded is not None:
        loads.add(p.loaded.path)

    def about(f: Finding) -> bool:
        if f.path in loads:
            return not (p.candidates and f.rule == "CKD448")
        return p.looks_in is not None and f.rule == "CKD441" and f.path.rsplit("/", 1)[0] == p.looks_in

    return [f for f in scanned if about(f)]
