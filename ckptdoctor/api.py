"""The Python API behind ``ckptdoctor.scan`` and ``ckptdoctor.fix``: the command line's ``scan`` and ``fix``, each
root under its own settings file, returning what the command renders and the exit code it would give.

``scanner.scan`` and ``fixer.fix`` are the lower-level calls: they take a ``Selection`` as given and read no
settings file. The ``ckptdoctor`` command calls these functions, so both resolve settings the same way.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

from ckptdoctor.errors import UsageError
from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.settings import (
    ExitPolicy,
    KeptCallback,
    check_fail_on,
    check_runnable,
    selection_groups,
    split_codes,
    warn_kept,
)

if TYPE_CHECKING:
    from ckptdoctor.fixer.run import FixResult
    from ckptdoctor.scanner import PathArg, Report

NO_CHECKPOINT = "CKD002"  # a root holding no checkpoint: what allow_empty accepts

Codes = Sequence[str] | str
"""Rule codes, prefixes or names: one string (``"CKD2,CKD601"``) or several, as ``--select``/``--ignore`` take."""


def _codes(codes: Codes) -> tuple[str, ...]:
    return (codes,) if isinstance(codes, str) else tuple(codes)


def scan(
    paths: Sequence[PathArg] | PathArg,
    *,
    select: Codes = (),
    ignore: Codes = (),
    fail_on: str | None = None,
    no_config: bool = False,
    deep: bool = False,
    jobs: int | None = None,
    checksums: str | None = None,
    limits: Limits = DEFAULT_LIMITS,
    progress: TextIO | None = None,
    on_kept: KeptCallback | None = None,
    allow_global: Codes = (),
    allow_empty: bool = False,
) -> Report:
    """Scan checkpoint folders or files as ``ckptdoctor scan`` does, and return the ``Report``.

    Each root is checked under its own settings file (``.ckptdoctor.toml``, or ``[tool.ckptdoctor]`` in
    ``pyproject.toml``; not with ``no_config``) plus ``select``/``ignore``, exactly as the command line resolves
    them. ``report.exit_code()`` is the command's exit code: ``fail_on`` (error, warning, info or never) when given,
    else each root's settings file's fail-on, else error; a security error fails even a settings file's "never".
    A settings file that tries to turn off security rules keeps them on and ``on_kept(source, codes)`` is told
    (default: a ``UserWarning``). ``deep``, ``jobs``, ``checksums``, ``limits`` and ``progress`` are
    ``scanner.scan``'s; with ``checksums="write"`` the sums are computed, and writing the manifest is the caller's
    step (``ckptdoctor.fixer.write_manifest``), as a scan never writes. ``allow_global`` are ``--allow-global``
    patterns (``pkg.mod.Name`` or ``pkg.mod.*``), joined by the user configuration's; each use is in the report.
    A root holding no checkpoint at all (empty, only logs, unreadable: a mistyped path) is CKD002, an error, unless
    ``allow_empty`` (``--allow-empty``).

    Raises ``UsageError`` (a ``ValueError``) where the command exits 2: an unknown rule code, a selection that never
    runs, an unusable settings file, a bad ``fail_on`` or ``checksums``; and what ``scanner.scan`` raises for a
    root that cannot be scanned (``FileNotFoundError``, ``ValueError``, ``deep.DeepUnavailable`` without numpy).
    """
    from ckptdoctor.discover import unique_roots
    from ckptdoctor.scanner import Report, as_roots
    from ckptdoctor.scanner import scan as scan_roots

    check_fail_on(fail_on)
    roots = unique_roots(as_roots(paths))  # `scan X X` (or `X ./X/`) scans X once, as ruff does
    select, ignore = _codes(select), _codes(ignore)
    check_runnable(split_codes(select), deep)
    if allow_empty:
        ignore = (*ignore, NO_CHECKPOINT)
    groups = selection_groups(
        roots, select, ignore, no_config, on_kept=on_kept or warn_kept, allow_global=_codes(allow_global)
    )
    if checksums is not None:
        _check_checksums(roots, checksums, deep)
    parts = [
        scan_roots(ps, selection=sel, limits=limits, jobs=jobs, deep=deep, progress=progress, checksums=checksums)
        for ps, sel, _ in groups
    ]
    return Report(
        tuple(t for r in parts for t in r.trees),
        tuple(f for r in parts for f in r.findings),
        sum(r.seconds for r in parts),
        ExitPolicy.of(fail_on, groups),
    )


def _check_checksums(paths: Sequence[str], mode: str, deep: bool) -> None:
    """Usage errors of ``checksums``, raised before a long ``deep`` read rather than after it."""
    if mode not in ("write", "verify"):
        raise UsageError(f"checksums={mode!r}: expected write or verify")
    if not deep:
        raise UsageError(f"--checksums {mode} needs --deep: checksums are computed while --deep reads every byte")
    for p in paths:
        if not os.path.isdir(p):
            raise UsageError(f"--checksums {mode}: {p} is not a folder (the manifest lives at a folder's root)")
    if mode == "write":
        from ckptdoctor.fixer import manifest_refusal

        for p in paths:
            why = manifest_refusal(p)
            if why is not None:
                raise UsageError(f"--checksums write: {why}")
    else:
        from ckptdoctor.deep import MANIFEST_PATH, manifest_exists

        for p in paths:
            if not manifest_exists(p):
                raise UsageError(
                    f"--checksums verify: {p} has no {MANIFEST_PATH}; write one with `--deep --checksums write`"
                )


def fix(
    paths: Sequence[PathArg] | PathArg,
    *,
    select: Codes = (),
    ignore: Codes = (),
    fail_on: str | None = None,
    no_config: bool = False,
    unsafe: bool = False,
    dry_run: bool = False,
    force: bool = False,
    on_kept: KeptCallback | None = None,
    allow_global: Codes = (),
    allow_empty: bool = False,
) -> FixResult:
    """Fix folders as ``ckptdoctor fix`` does: plan, journal, apply atomically (unless ``dry_run``), rescan.

    Each root is fixed under its own settings file plus ``select``/``ignore``, as ``scan`` reads them; ``fail_on``,
    ``no_config``, ``on_kept``, ``allow_global`` and ``allow_empty`` are ``scan``'s. ``result.exit_code()`` is the
    command's exit code (a dry run: 1 when it would change something). Raises ``UsageError`` where the command exits 2,
    ``FixRefused`` (one) included: a remote root, a root inside another, a read-only tree, a run being written
    (``force`` acts anyway).
    """
    from ckptdoctor.discover import unique_roots
    from ckptdoctor.fixer.run import FixResult, _check_roots
    from ckptdoctor.fixer.run import fix as fix_roots
    from ckptdoctor.scanner import as_roots

    check_fail_on(fail_on)
    select, ignore = _codes(select), _codes(ignore)
    check_runnable(split_codes(select), deep=False)
    if allow_empty:
        ignore = (*ignore, NO_CHECKPOINT)
    roots = unique_roots(as_roots(paths))  # `fix X X` (or `X ./X/`) fixes X once, silently, as ruff does
    _check_roots(roots)  # before the roots are grouped: one inside another is refused whatever their settings
    groups = selection_groups(
        roots, select, ignore, no_config, on_kept=on_kept or warn_kept, allow_global=_codes(allow_global)
    )
    results = [
        fix_roots(
            ps,
            selection=selection,
            unsafe=unsafe,
            dry_run=dry_run,
            force=force,
            fail_on=fail_on or cfg_fail_on or "error",
        )
        for ps, selection, cfg_fail_on in groups
    ]
    return dataclasses.replace(FixResult.merge(results), policy=ExitPolicy.of(fail_on, groups))
