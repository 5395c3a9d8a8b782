"""``--show-settings``: which settings file applies to which folder of each root, and the values it resolves to,
as text for people or the ``ckptdoctor.settings/1`` JSON document."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ckptdoctor.findings import display_path
from ckptdoctor.settings.selection import RootSettings, Scope
from ckptdoctor.version import __version__

SCHEMA = "ckptdoctor.settings/1"


def _where(scope: Scope) -> str:
    cfg = scope.config
    if cfg.source is None:
        return "none (the defaults)"
    if cfg.trusted:
        return f"{cfg.source} (the user configuration)"
    return f"{cfg.source}" + (" [tool.ckptdoctor]" if cfg.source.endswith("pyproject.toml") else "")


def scope_json(scope: Scope, fail_on: str | None) -> dict[str, Any]:
    """One scope's folder, file and resolved values as the JSON document gives them."""
    sel = scope.selection
    effective = fail_on or scope.fail_on or "error"
    return {
        "folder": display_path(scope.root, scope.folder or "."),
        "file": scope.config.source,
        "trusted": scope.config.trusted,
        "select": list(sel.select),
        "ignore": list(sel.ignore),
        "severity": {code: level.value for code, level in sorted(sel.severity.items())},
        "fail_on": effective,
        "fail_on_from": "--fail-on" if fail_on else ("settings file" if scope.fail_on else "default"),
        "kept_security_rules": list(scope.kept),
        "allow_globals": [{"pattern": p, "origin": o} for p, o in sel.allow_globals],
    }


def settings_json(settings: Sequence[RootSettings], fail_on: str | None) -> str:
    """The ``ckptdoctor.settings/1`` document: for each root, each scope (the root's own first)."""
    doc = {
        "schema": SCHEMA,
        "version": __version__,
        "roots": [{"root": rs.root, "scopes": [scope_json(s, fail_on) for s in rs.scopes]} for rs in settings],
    }
    return json.dumps(doc, indent=2)


def render_settings_text(settings: Sequence[RootSettings], fail_on: str | None) -> str:
    """For each root, each folder with its own settings file: the file and the values it resolves to."""
    lines: list[str] = []
    project = False
    for rs in settings:
        for scope in rs.scopes:
            v = scope_json(scope, fail_on)
            project = project or (scope.config.source is not None and not scope.config.trusted)
            lines.append(f"{v['folder']}" + ("" if scope is rs.scopes[0] else " (and below)"))
            lines.append(f"  file: {_where(scope)}")
            lines.append(f"  select: {', '.join(v['select']) or 'every rule'}")
            lines.append(f"  ignore: {', '.join(v['ignore']) or 'none'}")
            sev = ", ".join(f"{c} = {lv}" for c, lv in v["severity"].items())
            lines.append(f"  severity: {sev or 'the catalog defaults'}")
            lines.append(f"  fail-on: {v['fail_on']} ({v['fail_on_from']})")
            if scope.kept:
                lines.append(f"  kept on: {', '.join(scope.kept)}")
            for a in v["allow_globals"]:
                lines.append(f"  allow-global: {a['pattern']} ({a['origin']})")
    if project:
        lines.append("")
        lines.append("A project file cannot turn off or lower security rules (kept on); --ignore, --fail-on")
        lines.append("and the user configuration can.")
    return "\n".join(lines)
