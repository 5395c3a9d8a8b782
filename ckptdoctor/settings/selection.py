"""Rule selection and trust: one request's ``Options`` (built and checked once at the door) resolved with each
folder's closest settings file into a ``Scope`` (``RootSettings`` per root), a project file kept from turning off or
lowering security rules (``keep_security_rules``; ``kept_message``, ``warn_kept``), and the user's pickle-global
allowances (``user_allowances``)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import field
from typing import TYPE_CHECKING, NamedTuple

from ckptdoctor.errors import UsageError
from ckptdoctor.model import frozen
from ckptdoctor.settings.codes import check_codes, rule_codes, split_codes
from ckptdoctor.settings.exit import ExitPolicy, check_fail_on
from ckptdoctor.settings.files import (
    Config,
    config_folders,
    find_config,
    folder_config,
    nested_configs,
    user_table,
    walk_configs,
)

if TYPE_CHECKING:
    from ckptdoctor.rules import Selection


KeptCallback = Callable[[str, Sequence[str]], None]
"""Told ``(settings file, codes)`` when a settings file tried to turn off or lower security rules that stay on."""


def kept_message(source: str, codes: Sequence[str], how: str) -> str:
    """What is said when the settings file ``source`` may not turn off or lower the security rules ``codes``;
    ``how`` says how the caller turns one off (an option on the command line, an argument in Python)."""
    return (
        f"ckptdoctor: {source} may not turn off or lower security rules ({', '.join(codes)}): they stay on (a "
        f"settings file in a scanned folder can come from whoever made the checkpoint); {how} to turn one off."
    )


def warn_kept(source: str, codes: Sequence[str]) -> None:
    """The Python API's word for security rules a settings file may not turn off: a ``UserWarning`` at the first
    caller outside ckptdoctor (a script calling ``ckptdoctor.scan``), not the command line's note on stderr."""
    import warnings

    level, frame = 2, sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("ckptdoctor."):
        frame, level = frame.f_back, level + 1
    warnings.warn(kept_message(source, codes, "pass ignore=[...]"), UserWarning, stacklevel=level)


def user_allowances(allow_global: Sequence[str] = ()) -> tuple[tuple[str, str], ...]:
    """The user's pickle-global allowances as (pattern, origin): ``--allow-global`` patterns, then the
    ``allow-globals`` list of the user configuration file (``user_config_path``). A settings file inside a scanned
    folder cannot hold them (it is not the user's: an unknown setting there is a usage error).

    Raises ``UsageError`` for a pattern that is not ``module.Name``/``module.*``, or names something dangerous, and
    for a user configuration file that cannot be read as TOML or whose ``allow-globals`` is not a list of strings.
    """
    from ckptdoctor.pickle_verdict.policy import check_pattern

    out: list[tuple[str, str]] = [(p.strip(), "--allow-global") for p in allow_global]
    found = user_table()
    if found is not None:
        path, table = found
        listed = table.get("allow-globals", [])
        if not isinstance(listed, list) or not all(isinstance(x, str) for x in listed):
            raise UsageError(f"{path}: `allow-globals` must be a list of strings")
        out.extend((x.strip(), path) for x in listed)
    for pattern, origin in out:
        why = check_pattern(pattern)
        if why is not None:
            raise UsageError(f"{origin}: {why}")
    return tuple(dict.fromkeys(out))


@frozen
class Scope:
    """The settings one folder of a root is checked under: the closest settings file's (``config``) with the
    command line's ``--select``/``--ignore`` over it, resolved to a ``selection`` and the file's ``fail_on``.

    ``folder`` is relative to ``root`` (``/`` separators); ``""`` is the root itself and every folder below it that
    no nested file governs. ``kept`` are the security rules the file tried to turn off or lower and that stay on.
    """

    root: str
    folder: str
    config: Config
    selection: Selection
    fail_on: str | None
    kept: tuple[str, ...] = ()

    def holds(self, root: str, path: str) -> bool:
        """True when ``path`` (relative to ``root``, as a finding's) is this scope's folder or below it."""
        if root != self.root:
            return False
        return not self.folder or path == self.folder or path.startswith(self.folder + "/")


@frozen
class RootSettings:
    """Every scope of one root: ``scopes[0]`` the root's own (``find_config``), then the settings files found
    below it (``nested_configs``), outermost first. The deepest scope holding a path decides for it."""

    root: str
    scopes: tuple[Scope, ...]

    def scope_of(self, path: str) -> Scope:
        """The scope whose settings apply to ``path`` (relative to the root): the closest file above it."""
        if len(self.scopes) <= _FEW_SCOPES:
            best = self.scopes[0]
            for scope in self.scopes[1:]:
                if scope.holds(self.root, path) and len(scope.folder) > len(best.folder):
                    best = scope
            return best
        # A fleet with a settings file in each run: look up the path's folders, deepest first, rather than compare
        # every scope (a report's folders times its scopes, quadratic in the runs).
        index = _folder_index(self)
        while path:
            found = index.get(path)
            if found is not None:
                return found
            path = path.rpartition("/")[0]
        return self.scopes[0]


_FEW_SCOPES = 8  # up to this many, ``scope_of`` compares each
_LAST_INDEX: tuple[RootSettings | None, dict[str, Scope]] = (None, {})  # the last settings indexed, and the index


def _folder_index(settings: RootSettings) -> dict[str, Scope]:
    """``settings``' nested scopes by folder (the first of a folder, as ``scope_of``'s comparison keeps), kept for
    the settings indexed last: a report looks up many paths in one root's settings in a row."""
    global _LAST_INDEX
    last = _LAST_INDEX
    if last[0] is settings:
        return last[1]
    index: dict[str, Scope] = {}
    for scope in settings.scopes[1:]:
        if scope.root == settings.root and scope.folder:
            index.setdefault(scope.folder, scope)
    _LAST_INDEX = (settings, index)
    return index


Codes = Sequence[str] | str
"""Rule codes, prefixes or names: one string (``"CKD2,CKD601"``) or several, as ``--select``/``--ignore`` take."""


def _listed(codes: Codes) -> tuple[str, ...]:
    return (codes,) if isinstance(codes, str) else tuple(codes)


@frozen
class Options:
    """What a command that runs rules is asked for, built and checked once at the door (``Options.build``, as
    pip-audit builds its ``AuditOptions``): every command and API call takes this one value.

    ``select``/``ignore`` are the command line's rule codes (names resolved, each matching a rule), ``fail_on``
    the caller's (None: each settings file's, else error), ``no_config`` ignores every settings file,
    ``allowances`` are the user's pickle-global allowances (``--allow-global`` patterns as ``allow_global``, then the
    user configuration's: ``user_allowances``), ``allow_empty`` accepts a root holding no checkpoint, and
    ``on_kept`` is told of security rules a project file may not turn off (None: nothing is said).
    """

    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    fail_on: str | None = None
    no_config: bool = False
    allow_global: tuple[str, ...] = ()
    allowances: tuple[tuple[str, str], ...] = ()
    allow_empty: bool = False
    on_kept: KeptCallback | None = field(default=None, compare=False)

    @classmethod
    def build(
        cls,
        *,
        select: Codes = (),
        ignore: Codes = (),
        fail_on: str | None = None,
        no_config: bool = False,
        allow_global: Codes = (),
        allow_empty: bool = False,
        on_kept: KeptCallback | None = None,
    ) -> Options:
        """The options of one request, checked: raises ``UsageError`` for a ``fail_on`` not in ``FAIL_ON``, an
        empty ``--select``/``--ignore`` (an unset variable in a script must not mean every rule), a code, prefix
        or name that matches no rule, and an allowance ``user_allowances`` refuses."""
        check_fail_on(fail_on)
        select, ignore = _listed(select), _listed(ignore)
        sel_codes, ign_codes = split_codes(select), split_codes(ignore)
        for option, given, parsed in (("--select", select, sel_codes), ("--ignore", ignore, ign_codes)):
            if given and not parsed:
                raise UsageError(f"{option} was given no rule code")
        check_codes(sel_codes, "--select")
        check_codes(ign_codes, "--ignore")
        allow = _listed(allow_global)
        return cls(sel_codes, ign_codes, fail_on, no_config, allow, user_allowances(allow), allow_empty, on_kept)

    def ignoring(self, *codes: str) -> Options:
        """These options with ``codes`` (rule codes, checked by the caller) ignored too."""
        return dataclasses.replace(self, ignore=(*self.ignore, *codes))


class _Resolver:
    """Resolves settings files against one request's ``Options`` (checked once when they were built): each file's
    codes checked as the command line's are."""

    def __init__(self, options: Options) -> None:
        self.select, self.ignore, self.no_config = options.select, options.ignore, options.no_config
        self.on_kept, self.allowances = options.on_kept, options.allowances

    def scope(self, root: str, folder: str, cfg: Config) -> Scope:
        """``cfg`` (a settings file, or none) resolved for ``folder`` of ``root``."""
        from ckptdoctor.rules import Selection, all_rules, keep_security_rules

        # A typo in a settings file must not select nothing (a clean scan that checked nothing): as on the command
        # line.
        cfg = dataclasses.replace(cfg, select=rule_codes(cfg.select), ignore=rule_codes(cfg.ignore))
        check_codes(cfg.select, f"{cfg.source}: select")
        check_codes(cfg.ignore, f"{cfg.source}: ignore")
        codes = {r.code for r in all_rules()}
        for code in cfg.severity:
            if code not in codes:  # overrides apply to exact codes only: a prefix would silently change nothing
                raise UsageError(f"{cfg.source}: severity {code}: not a rule code (see `ckptdoctor rules`)")
        selection = Selection(
            select=self.select or cfg.select,
            ignore=self.ignore + cfg.ignore,
            severity=dict(cfg.severity),
            allow_globals=self.allowances,
        )
        kept: tuple[str, ...] = ()
        if cfg.source is not None and not cfg.trusted:
            selection, kept = keep_security_rules(selection, Selection(select=self.select, ignore=self.ignore))
            if kept and self.on_kept is not None:
                self.on_kept(str(cfg.source), kept)
        return Scope(root, folder, cfg, selection, cfg.fail_on, kept)

    def root(self, root: str, nested_files: Iterable[str] = ()) -> RootSettings:
        """The settings of ``root``: the closest file from it upward, then the files among ``nested_files``."""
        scopes = [self.scope(root, "", Config() if self.no_config else find_config(root))]
        if not self.no_config:
            scopes.extend(self.scope(root, folder, cfg) for folder, cfg in nested_configs(root, nested_files))
        return RootSettings(root, tuple(scopes))


def show_settings(roots: Sequence[str], options: Options, *, nested: bool = True) -> list[RootSettings]:
    """What ``--show-settings`` shows: each root's ``RootSettings`` with the settings files below it (``nested``;
    found by walking the folder, ``walk_configs``, as nothing is discovered or read but settings files)."""
    found = {r: walk_configs(r) for r in roots} if nested and not options.no_config else None
    return root_settings(roots, options, nested=found)


def resolve_selection(path: str, options: Options) -> tuple[Selection, str | None]:
    """The rule selection of ``options`` plus the settings file closest to ``path`` (``find_config``: upward from
    it, else the user configuration), and that file's fail-on.

    Raises ``UsageError`` for a settings file that cannot be used. When a project settings file tries to turn off
    or lower security rules, ``options.on_kept(source, codes)`` is told which stay on (the command line prints a
    note, the Python API warns; None: nothing is said).
    """
    first = resolve_scope(path, options)
    return first.selection, first.fail_on


def resolve_scope(path: str, options: Options) -> Scope:
    """The ``Scope`` of the settings file closest to ``path`` (``resolve_selection``'s), with whether that file is
    the trusted user configuration (``scope.config.trusted``). Raises as ``resolve_selection``."""
    return _Resolver(options).root(path).scopes[0]


def root_settings(
    roots: Sequence[str], options: Options, *, nested: Mapping[str, Iterable[str]] | None = None
) -> list[RootSettings]:
    """Each root's ``RootSettings``: its own closest file (``find_config``) and, for a root in ``nested``, the
    settings files among the listed paths below it (``nested_configs``). Raises as ``resolve_selection``."""
    resolver = _Resolver(options)
    return [resolver.root(r, (nested or {}).get(r, ())) for r in roots]


class Group(NamedTuple):
    """Roots whose own settings give one selection and fail-on, with each root's settings."""

    roots: list[str]
    selection: Selection
    fail_on: str | None
    settings: list[RootSettings]


def selection_groups(paths: Sequence[str], options: Options) -> list[Group]:
    """The roots grouped by the selection and fail-on their own settings files give (``root_settings``).

    Each root is judged by its own closest settings file: one may travel with each checkpoint, so the first root's
    must not decide what the others are checked or fixed for. Neighbouring roots with the same settings share a
    group. Files below a root are applied once the scan has listed them (``api.scan``).
    """
    groups: list[Group] = []
    for rs in root_settings(paths, options):
        top = rs.scopes[0]
        key = (top.selection, top.fail_on, top.config.trusted)
        last = groups[-1] if groups else None
        if last is not None and (last.selection, last.fail_on, last.settings[0].scopes[0].config.trusted) == key:
            last.roots.append(rs.root)
            last.settings.append(rs)
        else:
            groups.append(Group([rs.root], top.selection, top.fail_on, [rs]))
    return groups


def check_runnable(codes: Sequence[str], deep: bool) -> None:
    """``--select`` of rules a scan (or fix) never runs (gate-only, or deep-only without ``--deep``) would pass
    silently: a ``UsageError`` instead."""
    from ckptdoctor.rules import all_rules

    for c in codes:
        matched = [r for r in all_rules() if r.code.startswith(c)]
        if matched and all(r.gate_only for r in matched):
            raise UsageError(f"--select {c}: `ckptdoctor gate` runs {c}, a scan never does")
        if matched and not deep and all(r.deep_only or r.gate_only for r in matched):
            raise UsageError(f"--select {c}: {c} reads tensor data and runs only with --deep")


@frozen
class SettingsUse:
    """A settings file a command applied: its ``path`` (or URL), whether it is the ``trusted`` user configuration,
    and the ``folders`` it applied to (each root, run and checkpoint folder it governs, as the user can paste them)."""

    path: str
    trusted: bool
    folders: tuple[str, ...]


def settings_used(pairs: Iterable[tuple[RootSettings, Iterable[str]]]) -> tuple[SettingsUse, ...]:
    """The settings files of ``pairs`` (a root's settings and the folders discovery found in it, relative to the
    root; the root itself is always counted) with the folders each one governs, in the order first used."""
    from ckptdoctor.findings import display_path

    # each file's folders as the keys of a dict (in order, each once): a file that governs every folder of a fleet
    # is looked up once per folder, not compared with every folder listed before it
    used: dict[str, tuple[bool, dict[str, None]]] = {}
    for rs, folders in pairs:
        for folder in dict.fromkeys([".", *folders]):
            scope = rs.scope_of("" if folder == "." else folder)
            if scope.config.source is None:
                continue
            entry = used.setdefault(scope.config.source, (scope.config.trusted, {}))
            entry[1].setdefault(display_path(rs.root, folder))
    return tuple(SettingsUse(path, trusted, tuple(folders)) for path, (trusted, folders) in used.items())


def with_nested(
    settings: RootSettings, files: Iterable[str], options: Options, memo: dict[str, Scope | None] | None = None
) -> RootSettings:
    """``settings`` (a root's own scope) with a scope for each settings file among ``files`` below the root
    (``nested_configs``), resolved against the same ``options``. Unchanged when none configures ckptdoctor.

    ``memo`` (a folder's scope, None for a folder whose file does not configure ckptdoctor) resolves each folder's
    file once across calls for one root: a scan judging run after run reads and checks each settings file once,
    and tells ``options.on_kept`` of it once."""
    memo = {} if memo is None else memo
    resolver: _Resolver | None = None
    scopes: list[Scope] = []
    for folder in config_folders(files):
        if folder not in memo:
            cfg = folder_config(settings.root, folder)
            if cfg is None:
                memo[folder] = None
            else:
                resolver = resolver or _Resolver(options)
                memo[folder] = resolver.scope(settings.root, folder, cfg)
        scope = memo[folder]
        if scope is not None:
            scopes.append(scope)
    if not scopes:
        return settings
    return RootSettings(settings.root, (settings.scopes[0], *scopes))


def exit_policy(fail_on: str | None, settings: Sequence[RootSettings]) -> ExitPolicy:
    """The exit policy of every scope of ``settings`` (each root's settings files, with their trust) under the
    caller's ``fail_on``."""
    return ExitPolicy(
        fail_on,
        tuple((s.root, s.folder, s.fail_on, s.config.trusted) for rs in settings for s in rs.scopes),
    )
