"""Settings files, rule selection and the exit policy: what the command line and the Python API share (no click).

A folder's settings come from the closest ``.ckptdoctor.toml`` or ``[tool.ckptdoctor]`` in ``pyproject.toml`` from
it upward (``find_config``, as ruff finds its configuration), else from the user configuration (``user_config``);
``root_settings`` resolves them with ``--select``/``--ignore`` for each root and the files below it (``Scope``,
``RootSettings``); ``exit_code`` and ``ExitPolicy`` decide 0 or 1 from findings. Nothing
here prints: what the command line says on stderr is handed to a callback, and errors are ``UsageError``s.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from ckptdoctor.errors import UsageError
from ckptdoctor.findings import Finding, Severity
from ckptdoctor.model import frozen_value

if TYPE_CHECKING:
    from ckptdoctor.rules import Selection


FAIL_ON = ("error", "warning", "info", "never")


class ConfigError(UsageError):
    """A settings file that cannot be used; the command line reports it as a usage error (exit 2)."""


class UnknownRule(UsageError):
    """A rule code, prefix or name that matches no rule: selecting it would silently check nothing."""

    def __init__(self, pattern: str) -> None:
        super().__init__(f"no rule code starts with {pattern!r} and no rule has that name (see `ckptdoctor rules`)")
        self.pattern = pattern


def rule_codes(patterns: Iterable[str]) -> tuple[str, ...]:
    """``patterns`` (codes, prefixes or rule names, any case) stripped and upper-cased, each rule name replaced by its
    code; anything else is kept as it is, for ``rule_patterns`` to judge."""
    out = tuple(p.strip().upper() for p in patterns)
    if all(p.startswith("CKD") for p in out):
        return out  # codes only: the rule registry (every rule module) is not imported for nothing
    from ckptdoctor.rules import all_rules

    names = {r.name.upper(): r.code for r in all_rules()}
    return tuple(names.get(p, p) for p in out)


def rule_patterns(patterns: Iterable[str]) -> tuple[str, ...]:
    """``patterns`` as ``rule_codes`` gives them, each checked to match a rule.

    Raises ``UnknownRule`` (with the pattern as written) for one that matches no rule, an empty one included:
    ``select = [""]`` or a typo must not select nothing (a clean scan that checked nothing).
    """
    from ckptdoctor.rules import all_rules  # the registry imports every rule module: only when a pattern is read

    raws = tuple(patterns)
    codes = [r.code for r in all_rules()]
    out = rule_codes(raws)
    for raw, p in zip(raws, out, strict=True):
        if not p.startswith("CKD") or not any(code.startswith(p) for code in codes):
            raise UnknownRule(raw)
    return out


def severity_overrides(raw: Mapping[str, Severity]) -> dict[str, Severity]:
    """Severity overrides keyed by rule code, from keys that are codes, rule names or prefixes.

    A prefix stands for every rule it matches (``CKD4 = "error"``); a more specific key wins whatever the order
    (``CKD4`` then ``CKD404``: CKD404 keeps its own). Raises ``UnknownRule`` for a key that matches no rule and
    ``ValueError`` for one rule given twice (``CKD601`` and ``unsafe-pickle-global``).
    """
    from ckptdoctor.rules import all_rules

    codes = [r.code for r in all_rules()]
    keyed: dict[str, tuple[str, Severity]] = {}  # resolved pattern -> (as written, severity)
    for key, level in raw.items():
        (pattern,) = rule_patterns([key])
        if pattern in keyed:
            raise ValueError(f"severity {key}: {keyed[pattern][0]} names the same rules; give one")
        keyed[pattern] = (key, level)
    out: dict[str, Severity] = {}
    for pattern in sorted(keyed, key=len):  # shorter prefixes first, so the more specific key is applied last
        for code in codes:
            if code.startswith(pattern):
                out[code] = keyed[pattern][1]
    return out


@frozen_value
@dataclass(frozen=True, slots=True, eq=False, repr=False)
class Config:
    """Rule selection settings read from a file; empty when no file configures ckptdoctor."""

    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    severity: dict[str, Severity] = field(default_factory=dict)
    fail_on: str | None = None
    source: str | None = None
    # True only for the user configuration file (``user_config``): it never travels with a checkpoint, so it may
    # turn off or lower security rules as the command line may. Every project file found is untrusted.
    trusted: bool = False


def _codes(value: Any, key: str, src: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{src}: `{key}` must be a list of rule codes or prefixes")
    return tuple(v.strip().upper() for v in value if v.strip())


def _parse(table: Any, src: str) -> Config:
    if not isinstance(table, dict):
        raise ConfigError(f"{src}: the ckptdoctor table must be a table")
    known = {"select", "ignore", "severity", "fail-on", "fail_on"}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"{src}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    levels: dict[str, Severity] = {}
    raw_sev = table.get("severity", {})
    if not isinstance(raw_sev, dict):
        raise ConfigError(f'{src}: `severity` must be a table of CODE = "error|warning|info"')
    for code, level in raw_sev.items():
        try:
            levels[str(code)] = Severity(str(level).lower())
        except ValueError:
            raise ConfigError(f"{src}: severity for {code} must be error, warning or info, not {level!r}") from None
    try:
        # Keys are codes, prefixes or names, as in select/ignore; a security rule a prefix lowers is put back by
        # ``rules.keep_security_rules`` (the overrides are per code by then).
        sev = severity_overrides(levels)
    except UnknownRule as exc:
        raise ConfigError(
            f"{src}: severity {exc.pattern}: not a rule code, prefix or name (see `ckptdoctor rules`)"
        ) from None
    except ValueError as exc:
        raise ConfigError(f"{src}: {exc}") from None
    if "fail-on" in table and "fail_on" in table:
        raise ConfigError(f"{src}: give `fail-on` or `fail_on`, not both")
    fail_on = table.get("fail-on", table.get("fail_on"))
    if fail_on is not None and fail_on not in ("error", "warning", "info", "never"):
        raise ConfigError(f"{src}: `fail-on` must be error, warning, info or never")
    return Config(
        select=_codes(table.get("select", []), "select", src),
        ignore=_codes(table.get("ignore", []), "ignore", src),
        severity=sev,
        fail_on=fail_on,
        source=src,
    )


CONFIG_NAMES = (".ckptdoctor.toml", "pyproject.toml")
"""The names of a project settings file, in the order they win when both are in one folder."""


def load_config(root: str) -> Config:
    """Read ``.ckptdoctor.toml`` (whole file is the table) or ``pyproject.toml``'s ``[tool.ckptdoctor]`` in the
    folder ``root`` itself (the folder of a file root); ``find_config`` looks upward from there.

    ``.ckptdoctor.toml`` wins when both exist; a ``pyproject.toml`` without ``[tool.ckptdoctor]`` does not count.
    For a URL root (``s3://bucket/run/``) at that prefix, one small request per name.
    """
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib

    for name in CONFIG_NAMES:
        found = _config_bytes(root, name)
        if found is None:
            continue
        path, raw = found
        if len(raw) > _MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: larger than {_MAX_CONFIG_BYTES} bytes; not a settings file")
        try:
            data = tomllib.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"{path}: {exc}") from None
        except RecursionError:  # tomllib recurses per nested array or inline table; the file may be hostile
            raise ConfigError(f"{path}: values nested too deeply; not a settings file") from None
        tool = data.get("tool", {})
        table = data if name == ".ckptdoctor.toml" else (tool.get("ckptdoctor") if isinstance(tool, dict) else None)
        if table is None:
            continue
        return _parse(table, path)
    return Config()


def _maybe_config(folder: str) -> bool:
    """True when ``folder`` holds an entry named like a settings file: ``os.stat`` only, so the upward walk from a
    scan root costs two failed stats per folder and reads TOML only where a file is."""
    for name in CONFIG_NAMES:
        try:
            os.lstat(os.path.join(folder, name))
        except OSError:
            continue
        return True
    return False


def find_config(root: str) -> Config:
    """The settings of the closest settings file from ``root`` upward, as ruff finds its configuration.

    Looks in ``root`` (the folder of a file root), then each parent up to the filesystem root, and stops at the
    first folder whose ``.ckptdoctor.toml``, or ``pyproject.toml`` with ``[tool.ckptdoctor]``, configures
    ckptdoctor (``load_config``). Nothing is merged: the closest file is used whole. When no project file is found,
    the user configuration file (``user_config``) applies, as ruff's does. A URL root is looked at only at its own
    prefix (its parents are other people's buckets and cost a request each), then the user configuration.
    """
    from ckptdoctor.sources import is_remote

    if is_remote(root):
        cfg = load_config(root)
        return cfg if cfg.source is not None else user_config()
    folder = os.path.abspath(root if os.path.isdir(root) else os.path.dirname(root) or ".")
    relative = not os.path.isabs(root)  # a file found is named as the root was given: relative to the cwd or not
    while True:
        if _maybe_config(folder):
            cfg = load_config(os.path.relpath(folder) if relative else folder)
            if cfg.source is not None:
                return cfg
        parent = os.path.dirname(folder)
        if parent == folder:
            return user_config()
        folder = parent


def nested_configs(root: str, files: Iterable[str]) -> list[tuple[str, Config]]:
    """The settings files strictly below ``root`` among ``files`` (paths relative to the root, ``/`` separators,
    as discovery lists them), as ``(folder relative to the root, Config)``, outermost first.

    The scan's own listing is used, so finding them costs no extra look at the disk; a ``pyproject.toml`` without
    ``[tool.ckptdoctor]`` does not count. ``root``'s own file is ``find_config``'s, and is left out here.
    """
    folders = sorted(
        {f.rsplit("/", 1)[0] for f in files if "/" in f and f.rsplit("/", 1)[1] in CONFIG_NAMES},
        key=lambda d: (d.count("/"), d),
    )
    out = []
    for rel in folders:
        cfg = load_config(os.path.join(root, *rel.split("/")))
        if cfg.source is not None:
            out.append((rel, cfg))
    return out


def walk_configs(root: str) -> list[str]:
    """Paths (relative to ``root``, ``/`` separators) of every file named like a settings file below ``root``, for
    ``--show-settings``, which shows what a scan would apply without discovering checkpoints. Links to folders are
    not followed, and the fixer's ``.ckptdoctor/`` is skipped, as discovery skips it."""
    from ckptdoctor.sources import is_remote

    if is_remote(root) or not os.path.isdir(root):
        return []
    out: list[str] = []
    from ckptdoctor.sources.interface import OWN_DIR

    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != OWN_DIR)  # the fixer's folder, which discovery skips too
        rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
        if rel != ".":
            out.extend(f"{rel}/{name}" for name in CONFIG_NAMES if name in filenames)
    return out


_MAX_CONFIG_BYTES = 1 << 20  # a settings file; anything bigger is not one


def _config_bytes(root: str, name: str) -> tuple[str, bytes] | None:
    """The path and bytes of the settings file ``name`` beside ``root``, or None when there is none."""
    from ckptdoctor.sources import is_remote

    if is_remote(root):
        from ckptdoctor.sources.fsspec import read_small_object  # only a URL root pays for it

        url = root.rstrip("/") + "/" + name
        try:
            raw = read_small_object(url, _MAX_CONFIG_BYTES)
        except OSError as exc:
            raise ConfigError(f"{url}: {exc}") from None
        return None if raw is None else (url, raw)
    folder = root if os.path.isdir(root) else os.path.dirname(root) or "."
    path = os.path.join(folder, name)
    target = path
    if os.path.islink(path):
        # The folder may come from anyone: a settings file linked to /etc/passwd or ~/.netrc must not be read
        # (its first line would be echoed in the parse error). A link to a file inside the folder is fine.
        target = os.path.realpath(path)
        inside = os.path.realpath(folder).rstrip(os.sep) + os.sep
        if not target.startswith(inside):
            raise ConfigError(f"{path}: a symbolic link to a file outside {folder}; not read as a settings file")
    if not os.path.isfile(target):
        return None
    try:
        # The resolved target, not following a link swapped in since, and not blocking on a FIFO swapped in.
        fd = os.open(target, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        with open(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return None
            return path, fh.read(_MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: {exc}") from None


# ---------------------------------------------------------------------------------------------------------------
# Rule selection: --select/--ignore plus each folder's closest settings file, for every command that runs rules

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


def split_codes(values: Sequence[str]) -> tuple[str, ...]:
    """Rule codes from repeated and comma-separated ``--select``/``--ignore`` values, upper-cased; a rule's name
    (``stub-weights-shadow-adapter``, as ``ckptdoctor explain`` takes it) stands for its code."""
    return rule_codes(p for v in values for p in v.split(",") if p.strip())


def _check_codes(codes: Sequence[str], option: str) -> None:
    """A ``UsageError`` for a code or prefix that matches no rule (``rule_patterns`` decides)."""
    try:
        rule_patterns(codes)
    except UnknownRule as exc:
        c = exc.pattern
        raise UsageError(f"{option} {c}: no rule code starts with {c!r} (see `ckptdoctor rules`)") from None


USER_CONFIG_ENV = "CKPTDOCTOR_USER_CONFIG"


def user_config_path() -> str:
    """The user's own configuration file: ``$CKPTDOCTOR_USER_CONFIG``, else ``$XDG_CONFIG_HOME/ckptdoctor/
    config.toml``, else ``~/.config/ckptdoctor/config.toml``. It never travels with a checkpoint."""
    explicit = os.environ.get(USER_CONFIG_ENV)
    if explicit:
        return explicit
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "ckptdoctor", "config.toml")


def _user_table() -> tuple[str, dict[str, Any]] | None:
    """The user configuration file's path and table, or None when there is none (or this user cannot read it).

    Raises ``UsageError`` for a file that is not TOML."""
    path = user_config_path()
    try:
        with open(path, "rb") as fh:
            raw = fh.read(_MAX_CONFIG_BYTES)
    except OSError:  # absent, or not readable by this user (HOME inherited across sudo): no settings, stricter
        return None
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib
    try:
        table = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:
        raise UsageError(f"{path}: values nested too deeply; not a settings file") from None
    unknown = sorted(set(table) - _USER_KEYS)
    if unknown:  # checked whether or not a project file is found, so a typo is never silently ignored
        raise ConfigError(f"{path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(_USER_KEYS))}")
    return path, table


_USER_KEYS = frozenset({"allow-globals", "select", "ignore", "severity", "fail-on", "fail_on"})


def user_config() -> Config:
    """The ordinary settings of the user configuration file (``user_config_path``): the keys a project file takes
    (select, ignore, severity, fail-on), used when no project file is found from a root upward (``find_config``).

    It is ``trusted``: it never travels with a checkpoint, so, like the command line, it may turn off or lower
    security rules. Empty (no ``source``) when the file is absent or holds only ``allow-globals``.
    """
    found = _user_table()
    if found is None:
        return Config()
    path, table = found
    ordinary = {k: v for k, v in table.items() if k != "allow-globals"}
    if not ordinary:
        return Config()
    return dataclasses.replace(_parse(ordinary, path), trusted=True)


def user_allowances(allow_global: Sequence[str] = ()) -> tuple[tuple[str, str], ...]:
    """The user's pickle-global allowances as (pattern, origin): ``--allow-global`` patterns, then the
    ``allow-globals`` list of the user configuration file (``user_config_path``). A settings file inside a scanned
    folder cannot hold them (it is not the user's: an unknown setting there is a usage error).

    Raises ``UsageError`` for a pattern that is not ``module.Name``/``module.*``, or names something dangerous, and
    for a user configuration file that cannot be read as TOML or whose ``allow-globals`` is not a list of strings.
    """
    from ckptdoctor.rules.pickle_policy import check_pattern

    out: list[tuple[str, str]] = [(p.strip(), "--allow-global") for p in allow_global]
    found = _user_table()
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


@frozen_value
@dataclass(frozen=True, slots=True, eq=False, repr=False)
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


@frozen_value
@dataclass(frozen=True, slots=True, eq=False, repr=False)
class RootSettings:
    """Every scope of one root: ``scopes[0]`` the root's own (``find_config``), then the settings files found
    below it (``nested_configs``), outermost first. The deepest scope holding a path decides for it."""

    root: str
    scopes: tuple[Scope, ...]

    def scope_of(self, path: str) -> Scope:
        """The scope whose settings apply to ``path`` (relative to the root): the closest file above it."""
        best = self.scopes[0]
        for scope in self.scopes[1:]:
            if scope.holds(self.root, path) and len(scope.folder) > len(best.folder):
                best = scope
        return best


Codes = Sequence[str] | str
"""Rule codes, prefixes or names: one string (``"CKD2,CKD601"``) or several, as ``--select``/``--ignore`` take."""


def _listed(codes: Codes) -> tuple[str, ...]:
    return (codes,) if isinstance(codes, str) else tuple(codes)


@frozen_value
@dataclass(frozen=True, slots=True, eq=False, repr=False)
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
        _check_codes(sel_codes, "--select")
        _check_codes(ign_codes, "--ignore")
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
        _check_codes(cfg.select, f"{cfg.source}: select")
        _check_codes(cfg.ignore, f"{cfg.source}: ignore")
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
    first = _Resolver(options).root(path).scopes[0]
    return first.selection, first.fail_on


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


def check_fail_on(fail_on: str | None) -> None:
    """A ``UsageError`` for a fail-on that is not one of ``FAIL_ON`` (None: not given)."""
    if fail_on is not None and fail_on not in FAIL_ON:
        raise UsageError(f"fail_on must be one of {', '.join(FAIL_ON)}, not {fail_on!r}")


# ---------------------------------------------------------------------------------------------------------------
# The exit policy: 0 nothing at or above fail-on, 1 findings at or above it (2, a usage error, is the caller's)

SECURITY_NEVER_NOTE = (
    'ckptdoctor: security errors fail the scan even with fail-on = "never" in a settings file; pass '
    "--fail-on never on the command line to override."
)
"""What the command line says on stderr when ``exit_code`` fails a scan its settings file's fail-on would pass."""


def fails(findings: Iterable[Finding], fail_on: str = "error") -> bool:
    """True when a finding is at or above ``fail_on`` (``never`` never fails)."""
    if fail_on == "never":
        return False
    threshold = Severity(fail_on).rank
    return any(f.severity.rank >= threshold for f in findings)


def exit_code(
    findings: Sequence[Finding],
    fail_on: str | None,
    settings_fail_on: str | None,
    *,
    on_security_kept: Callable[[], None] | None = None,
) -> int:
    """The exit code of ``findings`` under the caller's ``fail_on`` (``--fail-on``), else the settings file's.

    A settings file's ``fail-on = "never"`` came with the checkpoint and cannot wave a security error through: then
    the code is 1 and ``on_security_kept()`` is called (the command line prints ``SECURITY_NEVER_NOTE``).
    """
    code = 1 if fails(findings, fail_on or settings_fail_on or "error") else 0
    if code == 0 and fail_on is None and settings_fail_on == "never":
        from ckptdoctor.rules import security_codes

        # As with keep_security_rules: a settings file from the scanned folder cannot wave a malicious pickle through.
        security = security_codes()
        if any(f.rule in security and f.severity is Severity.ERROR for f in findings):
            if on_security_kept is not None:
                on_security_kept()
            code = 1
    return code


@frozen_value
@dataclass(frozen=True, slots=True, eq=False, repr=False)
class ExitPolicy:
    """How the exit code of a scan (or of what a fix leaves) is decided, as the command line decides it.

    ``fail_on`` is the caller's (``--fail-on``; None: not given) and ``scopes`` each folder's settings, as
    ``(root, folder, the settings file's fail-on, trusted)`` (``RootSettings``): a finding is judged under the
    deepest scope holding its path. The default policy fails on errors, as a scan without settings does.
    """

    fail_on: str | None = None
    scopes: tuple[tuple[str, str, str | None, bool], ...] = ()
    # The untrusted settings file's fail-on for a finding under no scope: the gate's, from RUN_DIR's closest file.
    settings_fail_on: str | None = None

    @classmethod
    def of_settings(cls, fail_on: str | None, settings: Sequence[RootSettings]) -> ExitPolicy:
        """The policy of every scope of ``settings`` under the caller's ``fail_on``."""
        return cls(
            fail_on,
            tuple((s.root, s.folder, s.fail_on, s.config.trusted) for rs in settings for s in rs.scopes),
        )

    def _scope(self, f: Finding) -> tuple[str | None, bool]:
        best: tuple[str, str, str | None, bool] | None = None
        for scope in self.scopes:
            root, folder = scope[0], scope[1]
            if root != f.root or (folder and f.path != folder and not f.path.startswith(folder + "/")):
                continue
            if best is None or len(folder) > len(best[1]):
                best = scope
        return (self.settings_fail_on, False) if best is None else (best[2], best[3])

    def exit_code(self, findings: Sequence[Finding], *, on_security_kept: Callable[[], None] | None = None) -> int:
        """The highest ``exit_code`` of the findings of each settings file's fail-on (a finding's ``root`` and
        ``path`` say its scope; one under no scope is judged without settings). The user configuration's fail-on
        is trusted as ``--fail-on`` is; ``on_security_kept`` is called once per fail-on it concerns."""
        parts: dict[tuple[str | None, bool], list[Finding]] = {(self.settings_fail_on, False): []}
        for f in findings:
            parts.setdefault(self._scope(f), []).append(f)
        codes = [0]
        for (cfg_fail_on, trusted), mine in parts.items():
            if trusted:
                codes.append(exit_code(mine, self.fail_on or cfg_fail_on, None))
            else:
                codes.append(exit_code(mine, self.fail_on, cfg_fail_on, on_security_kept=on_security_kept))
        return max(codes)


class Outcome:
    """The one answer to "did it fail, and with which exit code" that every result shares (``Report``,
    ``GateResult``, ``FixResult``): its ``exit_policy`` judges its ``judged_findings``, as the command line does."""

    __slots__ = ()

    def exit_policy(self) -> ExitPolicy:
        """How this result's findings are judged (the caller's fail-on and each settings file's)."""
        raise NotImplementedError

    def judged_findings(self) -> Sequence[Finding]:
        """The findings the exit code is decided on (for a fix: what remains)."""
        raise NotImplementedError

    def pending_change(self) -> bool:
        """True when the result fails whatever its findings (a dry run that would change something)."""
        return False

    def exit_status(self, *, on_security_kept: Callable[[], None] | None = None) -> int:
        """The command line's exit code for this result: 1 when a judged finding reaches its fail-on (or a
        security error that only a settings file's "never" would pass: ``on_security_kept()`` is then called, the
        command line's note), or when ``pending_change``; else 0."""
        code = self.exit_policy().exit_code(self.judged_findings(), on_security_kept=on_security_kept)
        return max(code, 1 if self.pending_change() else 0)


@frozen_value
@dataclass(frozen=True, slots=True, eq=False, repr=False)
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

    used: dict[str, tuple[bool, list[str]]] = {}
    for rs, folders in pairs:
        for folder in dict.fromkeys([".", *folders]):
            scope = rs.scope_of("" if folder == "." else folder)
            if scope.config.source is None:
                continue
            entry = used.setdefault(scope.config.source, (scope.config.trusted, []))
            shown = display_path(rs.root, folder)
            if shown not in entry[1]:
                entry[1].append(shown)
    return tuple(SettingsUse(path, trusted, tuple(folders)) for path, (trusted, folders) in used.items())


def with_nested(settings: RootSettings, files: Iterable[str], options: Options) -> RootSettings:
    """``settings`` (a root's own scope) with a scope for each settings file among ``files`` below the root
    (``nested_configs``), resolved against the same ``options``. Unchanged when none configures ckptdoctor."""
    found = nested_configs(settings.root, files)
    if not found:
        return settings
    resolver = _Resolver(options)
    scopes = [resolver.scope(settings.root, folder, cfg) for folder, cfg in found]
    return RootSettings(settings.root, (settings.scopes[0], *scopes))
