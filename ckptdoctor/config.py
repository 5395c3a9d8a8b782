"""Settings from ``[tool.ckptdoctor]`` in ``pyproject.toml`` or from ``.ckptdoctor.toml`` at the scan root."""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptdoctor.findings import Severity

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration file that cannot be used; the CLI reports it as a usage error (exit 2)."""


class UnknownRule(ValueError):
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


@dataclass(frozen=True, slots=True)
class Config:
    """Rule selection settings read from a file; empty when no file configures ckptdoctor."""

    select: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    severity: dict[str, Severity] = field(default_factory=dict)
    fail_on: str | None = None
    source: str | None = None


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


def load_config(root: str) -> Config:
    """Read ``.ckptdoctor.toml`` (whole file is the table) or ``pyproject.toml``'s ``[tool.ckptdoctor]`` at ``root``.

    ``.ckptdoctor.toml`` wins when both exist. A file is looked for only in the root folder itself; for a URL root
    (``s3://bucket/run/``) at that prefix, one small request per name.
    """
    for name in (".ckptdoctor.toml", "pyproject.toml"):
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


_MAX_CONFIG_BYTES = 1 << 20  # a settings file; anything bigger is not one


def _config_bytes(root: str, name: str) -> tuple[str, bytes] | None:
    """The path and bytes of the settings file ``name`` beside ``root``, or None when there is none."""
    from ckptdoctor.sources import is_remote  # cheap: fsspec is imported only for a URL
    from ckptdoctor.sources.fsspec import read_small_object

    if is_remote(root):
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
