"""Findings as a SARIF 2.1.0 log (for code-scanning upload) or as GitHub Actions workflow annotation lines.

Both renderers take any findings (``scan``'s or ``gate``'s) and describe each rule from the registry, so a result
links to the rule's full document.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import pathlib
import urllib.parse
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ckptdoctor.findings import Finding, Severity
from ckptdoctor.rules import Rule, get_rule
from ckptdoctor.sources import is_remote
from ckptdoctor.version import __version__

SARIF_VERSION = "2.1.0"
SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
FINGERPRINT_KEY = "ckptdoctor/v1"  # stable across runs: rule + path, never the message or byte offsets
_LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "note"}
_GITHUB_LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "notice"}


def finding_location(f: Finding) -> str:
    """The path a reader can open: the root the user gave joined with the finding's path, ``/``-separated."""
    from ckptdoctor.findings import display_path

    return (display_path(f.root, f.path) or ".").replace(os.sep, "/")


def repository_path(where: str) -> str:
    """``where`` as a repository checked out in the working directory names it, the same for SARIF and annotations.

    Under the working directory: relative to it, ``/``-separated, without ``./`` (``./mal/x`` and
    ``$PWD/mal/x`` are both ``mal/x``). Anywhere else (``../other``, ``/tmp``): the absolute path, since a
    relative one would climb out of the repository. URLs (``s3://...``, remote roots) are kept as they are.
    """
    if is_remote(where):
        return where
    try:
        cwd = os.getcwd()
    except OSError:  # the working directory was removed: nothing to be relative to
        return os.path.normpath(where).replace(os.sep, "/")
    full = os.path.normpath(os.path.join(cwd, where))
    try:
        rel = os.path.relpath(full, cwd)
    except ValueError:  # another drive (Windows)
        rel = os.pardir
    outside = rel == os.pardir or rel.startswith(os.pardir + os.sep)
    return (full if outside else rel).replace(os.sep, "/")


def _uri(where: str) -> dict[str, str]:
    """A SARIF artifactLocation for a finding's location (SARIF 2.1.0 §3.4.3, §3.4.4).

    GitHub code scanning resolves ``%SRCROOT%`` to the checkout, taken to be the working directory of the scan:
    files under it get a relative reference against it; others an absolute ``file://`` URI, which may not carry a
    ``uriBaseId`` (an absolute URI is not resolved against a base).
    """
    path = repository_path(where)
    if is_remote(path):
        return {"uri": urllib.parse.quote(path, safe=":/?=&@%~", errors="surrogateescape")}
    if os.path.isabs(path):
        return {"uri": pathlib.Path(path).as_uri()}
    return {"uri": urllib.parse.quote(path, errors="surrogateescape"), "uriBaseId": "%SRCROOT%"}


def _descriptor(code: str, rule: Rule | None) -> dict[str, Any]:
    if rule is None:
        return {"id": code}
    doc = inspect.cleandoc(rule.doc)
    tags = ["checkpoint", "gate" if rule.gate_only else "scan"]
    props: dict[str, Any] = {"tags": tags}
    if rule.security_severity is not None:
        props = {"tags": ["security", *tags], "security-severity": rule.security_severity}
    return {
        "id": rule.code,
        "name": rule.name,
        "shortDescription": {"text": rule.summary},
        "fullDescription": {"text": rule.summary},
        "help": {"text": doc, "markdown": doc},
        "defaultConfiguration": {"level": _LEVEL[rule.severity]},
        "properties": props,
    }


def _location(f: Finding) -> dict[str, Any]:
    """Where a result is anchored: the file at fault (``Finding.file``) with the region GitHub code scanning needs
    to show it (``startLine`` 1: a checkpoint file has no lines to point into); a folder, with no region, when the
    finding is about the folder as a whole (no file is at fault: a missing `trainer_state.json`, a stale run)."""
    if f.file is None:
        return {"physicalLocation": {"artifactLocation": _uri(finding_location(f))}}
    where = finding_location(replace(f, path=f.file))
    return {"physicalLocation": {"artifactLocation": _uri(where), "region": {"startLine": 1}}}


def to_sarif(findings: Sequence[Finding]) -> dict[str, Any]:
    """A SARIF 2.1.0 log with one run: the rules that fired (with their documents) and one result per finding,
    anchored to the file at fault (``_location``); the fingerprint stays rule + the finding's own path."""
    codes = sorted({f.rule for f in findings})
    index = {code: i for i, code in enumerate(codes)}
    results = []
    for f in findings:
        digest = hashlib.sha256(f"{f.rule}\0{f.path}".encode("utf-8", "surrogateescape")).hexdigest()[:32]
        results.append(
            {
                "ruleId": f.rule,
                "ruleIndex": index[f.rule],
                "level": _LEVEL[f.severity],
                "message": {"text": f.message},
                "locations": [_location(f)],
                "partialFingerprints": {FINGERPRINT_KEY: digest},
                **({"properties": {"fix": f.fix.title, "applicability": f.fix.applicability.value}} if f.fix else {}),
            }
        )
    driver = {
        "name": "ckptdoctor",
        "version": __version__,
        "semanticVersion": __version__,
        "rules": [_descriptor(code, get_rule(code)) for code in codes],
    }
    return {
        "$schema": SARIF_SCHEMA,
        "version": SARIF_VERSION,
        "runs": [{"tool": {"driver": driver}, "results": results, "columnKind": "unicodeCodePoints"}],
    }


def render_sarif(findings: Sequence[Finding]) -> str:
    """The SARIF log as strict JSON text."""
    return json.dumps(to_sarif(findings), indent=2, allow_nan=False)


def _escape_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _escape_property(text: str) -> str:
    return _escape_data(text).replace(":", "%3A").replace(",", "%2C")


def github_annotation(level: str, message: str, *, file: str | None = None, title: str | None = None) -> str:
    """One workflow command line: ``::error file=...,title=...::message``, escaped as the runner expects."""
    props = []
    if file is not None:
        props.append(f"file={_escape_property(file)}")
    if title is not None:
        props.append(f"title={_escape_property(title)}")
    return f"::{level}{' ' + ','.join(props) if props else ''}::{_escape_data(message)}"


def render_github(findings: Sequence[Finding], *, notice: str | None = None) -> str:
    """GitHub Actions annotations, one line per finding (``notice`` first, as a plain notice line), each at the
    file at fault (``Finding.file``), else at the finding's folder."""
    lines = [github_annotation("notice", notice, title="ckptdoctor")] if notice else []
    for f in findings:
        title = f"{f.rule} {f.name}"
        # the file at fault, as SARIF anchors it: GitHub shows an annotation on a file, never on a folder
        where = repository_path(finding_location(f if f.file is None else replace(f, path=f.file)))
        lines.append(github_annotation(_GITHUB_LEVEL[f.severity], f.message, file=where, title=title))
    return "\n".join(lines)
