"""Settings files: the closest ``.ckptdoctor.toml`` or ``[tool.ckptdoctor]`` in ``pyproject.toml`` from a folder
upward (``find_config``, as ruff finds its configuration), those below a root (``nested_configs``), and the user
configuration (``user_config``, ``user_table``), each read as a ``Config``. Nothing here prints; an unusable file is a
``ConfigError``."""

from __future__ import annotations

import dataclasses
import os
import stat
import sys
from collections.abc import Iterable
from dataclasses import field
from typing import Any

from ckptdoctor.errors import UsageError
from ckptdoctor.findings import Severity
from ckptdoctor.model import frozen
from ckptdoctor.settings.codes import UnknownRule, severity_overrides


class ConfigError(UsageError):
    """A settings file that cannot be used; the command line reports it as a usage error (exit 2)."""


@frozen
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
    return [(rel, cfg) for rel in config_folders(files) if (cfg := folder_config(root, rel)) is not None]


def folder_config(root: str, rel: str) -> Config | None:
    """The settings file of the folder ``rel`` below ``root`` (``load_config``), or None when no file there
    configures ckptdoctor."""
    cfg = load_config(os.path.join(root, *rel.split("/")))
    return cfg if cfg.source is not None else None


def config_folders(files: Iterable[str]) -> list[str]:
    """The folders (relative to the root) strictly below it that hold a file named like a settings file among
    ``files``, outermost first: the folders ``nested_configs`` loads, in its order."""
    return sorted(
        {f.rsplit("/", 1)[0] for f in files if "/" in f and f.rsplit("/", 1)[1] in CONFIG_NAMES},
        key=lambda d: (d.count("/"), d),
    )


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


USER_CONFIG_ENV = "CKPTDOCTOR_USER_CONFIG"


def user_config_path() -> str:
    """The user's own configuration file: ``$CKPTDOCTOR_USER_CONFIG``, else ``$XDG_CONFIG_HOME/ckptdoctor/
    config.toml``, else ``~/.config/ckptdoctor/config.toml``. It never travels with a checkpoint."""
    explicit = os.environ.get(USER_CONFIG_ENV)
    if explicit:
        return explicit
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "ckptdoctor", "config.toml")


def user_table() -> tuple[str, dict[str, Any]] | None:
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
    found = user_table()
    if found is None:
        return Config()
    path, table = found
    ordinary = {k: v for k, v in table.items() if k != "allow-globals"}
    if not ordinary:
        return Config()
    return dataclasses.replace(_parse(ordinary, path), trusted=True)
