"""Settings from ``[tool.ckptdoctor]`` in ``pyproject.toml`` or from ``.ckptdoctor.toml`` at the scan root."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

from ckptdoctor.findings import Severity

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration file that cannot be used; the CLI reports it as a usage error (exit 2)."""


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
    sev: dict[str, Severity] = {}
    raw_sev = table.get("severity", {})
    if not isinstance(raw_sev, dict):
        raise ConfigError(f'{src}: `severity` must be a table of CODE = "error|warning|info"')
    for code, level in raw_sev.items():
        try:
            sev[str(code).upper()] = Severity(str(level).lower())
        except ValueError:
            raise ConfigError(f"{src}: severity for {code} must be error, warning or info, not {level!r}") from None
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
    from ckptdoctor.remote import is_remote, read_small_object  # cheap: fsspec is imported only for a URL

    if is_remote(root):
        url = root.rstrip("/") + "/" + name
        try:
            raw = read_small_object(url, _MAX_CONFIG_BYTES)
        except OSError as exc:
            raise ConfigError(f"{url}: {exc}") from None
        return None if raw is None else (url, raw)
    folder = root if os.path.isdir(root) else os.path.dirname(root) or "."
    path = os.path.join(folder, name)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as fh:
            return path, fh.read(_MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: {exc}") from None
