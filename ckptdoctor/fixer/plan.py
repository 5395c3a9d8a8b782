"""The plan: the findings' fix plans checked against the disk, as operations the fixer will perform."""

from __future__ import annotations

import difflib
import json
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ckptdoctor.deep import manifest_from_document
from ckptdoctor.findings import Applicability, Finding, OpKind, path_order
from ckptdoctor.fixer.digests import sha256_of
from ckptdoctor.fixer.paths import CLOEXEC, NOFOLLOW, OWN_MANIFEST, abs_path, check_path, quarantine_path
from ckptdoctor.model import Tree

REWRITE_MAX_BYTES = 64 * 1024 * 1024  # rewrites are for JSON indexes, trainer states and `latest`, never weights

# First bytes of formats the fixer must never rewrite: pickles (protocol 2+) and zip archives (torch.save).
_BINARY_MAGIC = (b"\x80", b"PK\x03\x04", b"PK\x05\x06")
_BINARY_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".safetensors", ".distcp", ".metadata")


@dataclass(frozen=True, slots=True)
class PlannedOp:
    """One operation the fixer will perform, checked against the disk: what it changes and (rewrites) the diff."""

    kind: OpKind
    path: str
    rules: tuple[str, ...]
    title: str
    content: str | None = None
    is_dir: bool = False
    change: str = ""  # "1 entry changed", "`global_step9` -> `global_step8`"
    diff: str = ""  # unified diff of a rewrite
    before_sha256: str | None = None  # rewrites: the bytes the plan was computed against

    def describe(self, txid: str = "<txid>") -> str:
        """``move `a` to `.ckptdoctor/quarantine/<txid>/a` `` or ``rewrite `x.json`: 1 entry changed``."""
        if self.kind == OpKind.QUARANTINE:
            slash = "/" if self.is_dir else ""
            return f"move `{self.path}{slash}` to `{quarantine_path(txid, self.path)}{slash}`"
        return f"rewrite `{self.path}`: {self.change}"


@dataclass(frozen=True, slots=True)
class Skipped:
    """A finding with a fix plan the fixer does not apply, and why."""

    finding: Finding
    reason: str


@dataclass(frozen=True, slots=True)
class RootPlan:
    """What ``fix`` would do under one root: the operations, the findings they fix, what it leaves and why."""

    root: str  # as the user gave it
    abs_root: str  # resolved once; every path the fixer touches is below it
    tree: Tree
    ops: tuple[PlannedOp, ...]
    planned: tuple[Finding, ...]
    skipped: tuple[Skipped, ...] = ()
    manual: tuple[Finding, ...] = ()
    interrupted: tuple[str, ...] = ()  # transactions a crash left half-applied (fix completes them first)


def _flatten(value: Any, prefix: str, out: dict[str, str]) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(value, list) and value:
        for i, v in enumerate(value):
            _flatten(v, f"{prefix}[{i}]", out)
    else:
        out[prefix] = json.dumps(value, sort_keys=True)


def _json_change(old: str, new: str) -> str:
    a: dict[str, str] = {}
    b: dict[str, str] = {}
    try:
        _flatten(json.loads(old), "", a)
    except ValueError:
        return "replaces a file that is not valid JSON"
    _flatten(json.loads(new), "", b)
    n = sum(1 for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    return f"{n} entr{'y' if n == 1 else 'ies'} changed" if n else "formatting only"


def _unified(path: str, old: str, new: str, limit: int = 80) -> str:
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    lines = list(difflib.unified_diff(a, b, f"a/{path}", f"b/{path}", n=2))
    lines = [ln if ln.endswith("\n") else ln + "\n\\ No newline at end of file\n" for ln in lines]
    if len(lines) > limit:
        lines = [*lines[:limit], f"... ({len(lines) - limit} more diff lines)\n"]
    return "".join(lines)


def _read_small(abs_root: str, rel: str) -> bytes:
    """Up to ``REWRITE_MAX_BYTES + 1`` bytes of a file the fixer may rewrite, never through a final link."""
    fd = os.open(abs_path(abs_root, rel), os.O_RDONLY | NOFOLLOW | CLOEXEC)
    try:
        return os.read(fd, REWRITE_MAX_BYTES + 1)
    finally:
        os.close(fd)


def _plan_op(abs_root: str, kind: OpKind, rel: str, content: str | None, rule: str, title: str) -> PlannedOp | str:
    """One fix operation checked against the disk, or the reason it is rejected."""
    st, why = check_path(abs_root, rel, link_ok=kind == OpKind.QUARANTINE)
    if st is None:
        return why or f"`{rel}` cannot be used"
    if kind == OpKind.QUARANTINE:
        # a link is moved as the link (a dangling Lightning `last.ckpt`, CKD441), never followed
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            return f"`{rel}` is not a regular file, folder or link"
        return PlannedOp(kind, rel, (rule,), title, is_dir=stat.S_ISDIR(st.st_mode))
    if content is None:
        return f"the plan to rewrite `{rel}` carries no new text"
    if not stat.S_ISREG(st.st_mode):
        return f"`{rel}` is not a regular file"
    name = rel.rsplit("/", 1)[-1].lower()
    if name.endswith(_BINARY_SUFFIXES) or (kind == OpKind.REWRITE_JSON and not name.endswith(".json")):
        return f"`{rel}` is not a text file the fixer rewrites (pickles and weights are never rewritten)"
    if st.st_size > REWRITE_MAX_BYTES:
        return f"`{rel}` is {st.st_size:,} bytes, more than a JSON or text file the fixer rewrites"
    try:
        raw = _read_small(abs_root, rel)
        old = raw.decode("utf-8")
    except OSError as e:
        return f"`{rel}` cannot be read: {e.strerror or e}"
    except UnicodeDecodeError:
        return f"`{rel}` is not UTF-8 text; never rewritten"
    if raw.startswith(_BINARY_MAGIC) or "\0" in old:
        return f"`{rel}` holds binary data (a pickle or an archive); never rewritten"
    if kind == OpKind.REWRITE_JSON:
        try:
            json.loads(content)
        except ValueError as e:
            return f"the new text for `{rel}` is not valid JSON ({e})"
    if content == old:
        return f"`{rel}` already holds the planned text"
    change = _json_change(old, content) if kind == OpKind.REWRITE_JSON else f"`{old.strip()}` -> `{content.strip()}`"
    return PlannedOp(kind, rel, (rule,), title, content, False, change, _unified(rel, old, content), sha256_of(raw))


def plan_root(tree: Tree, findings: Sequence[Finding], *, unsafe: bool = False, root: str | None = None) -> RootPlan:
    """Turn the findings' fix plans into checked operations for one root.

    Safe plans are taken; unsafe ones only with ``unsafe``; manual ones are listed. A plan is taken whole or not at
    all: one operation outside the root, through a link, on a binary file or in conflict with another plan rejects
    it. Operations inside a folder that is quarantined anyway are dropped (the move covers them).
    """
    given = tree.root if root is None else root
    abs_root = os.path.realpath(given)
    skipped: list[Skipped] = []
    manual: list[Finding] = []
    taken: list[tuple[Finding, list[PlannedOp]]] = []
    for f in findings:
        if f.fix is None:
            continue
        if f.fix.applicability == Applicability.MANUAL or not f.fix.ops:
            manual.append(f)
            continue
        if f.fix.applicability == Applicability.UNSAFE and not unsafe:
            skipped.append(Skipped(f, "unsafe fix: applied only with --unsafe-fixes"))
            continue
        ops: list[PlannedOp] = []
        reason: str | None = None
        for op in f.fix.ops:
            planned = _plan_op(abs_root, op.kind, op.path, op.content, f.rule, f.fix.title)
            if isinstance(planned, str):
                reason = planned
                break
            ops.append(planned)
        if reason is not None:
            skipped.append(Skipped(f, reason))
        else:
            taken.append((f, ops))

    by_path: dict[str, PlannedOp] = {}
    planned_findings: list[Finding] = []
    for f, ops in taken:
        clash = next(
            (
                o.path
                for o in ops
                if o.path in by_path and (by_path[o.path].kind, by_path[o.path].content) != (o.kind, o.content)
            ),
            None,
        )
        if clash is not None:
            skipped.append(Skipped(f, f"another fix changes `{clash}` differently; run `ckptdoctor fix` again after"))
            continue
        for o in ops:
            old = by_path.get(o.path)
            by_path[o.path] = o if old is None else _with_rule(old, o.rules)
        planned_findings.append(f)
    folders = {p for p, o in by_path.items() if o.kind == OpKind.QUARANTINE and o.is_dir}
    final = [o for p, o in sorted(by_path.items(), key=lambda po: path_order(po[0])) if not _below(p, folders)]
    manifest = _manifest_op(abs_root, final)
    if manifest is not None:
        final.append(manifest)
    return RootPlan(given, abs_root, tree, tuple(final), tuple(planned_findings), tuple(skipped), tuple(manual))


def _manifest_op(abs_root: str, ops: list[PlannedOp]) -> PlannedOp | None:
    """The rewrite that keeps the root's checksum manifest true to what ``ops`` do, or None when none is needed.

    A manifest written before the fix would otherwise report every file the fix moved as missing and every file it
    rewrote as changed (CKD214) at the next ``--checksums verify``. Entries under a quarantined path are dropped;
    entries of rewritten files get the new text's size and sha256; nothing else in the document changes. The
    update is one more operation of the transaction: journaled, undone with the rest. A manifest that cannot be
    read as one is left alone (verify reports it).
    """
    st, _ = check_path(abs_root, OWN_MANIFEST, own_manifest=True)
    if not ops or st is None or not stat.S_ISREG(st.st_mode) or st.st_size > REWRITE_MAX_BYTES:
        return None
    try:
        raw = _read_small(abs_root, OWN_MANIFEST)
        doc = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    if manifest_from_document(doc) is None:
        return None
    moved = {o.path for o in ops if o.kind == OpKind.QUARANTINE}
    rewritten = {o.path: o.content.encode("utf-8") for o in ops if o.content is not None}
    files: list[dict[str, Any]] = []
    dropped = updated = 0
    for entry in doc["files"]:
        path = entry["path"]
        if path in moved or _below(path, moved):
            dropped += 1
            continue
        if path in rewritten:
            data = rewritten[path]
            new = {**entry, "size": len(data), "sha256": sha256_of(data)}
            updated += new != entry
            entry = new
        files.append(entry)
    if not dropped and not updated:
        return None
    try:  # a NaN elsewhere in the document (json.loads takes it): not one ckptdoctor wrote, so left alone
        content = json.dumps({**doc, "files": files}, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    except (ValueError, RecursionError):
        return None
    change = ", ".join(
        part
        for part in (
            f"{dropped} quarantined file{'s' * (dropped != 1)} no longer listed" if dropped else "",
            f"{updated} rewritten file{'s' * (updated != 1)} listed with the new sha256" if updated else "",
        )
        if part
    )
    rules = tuple(dict.fromkeys(r for o in ops for r in o.rules))
    title = "Keep the checksum manifest true to the fixed files"
    old = raw.decode("utf-8")
    return PlannedOp(
        OpKind.REWRITE_JSON, OWN_MANIFEST, rules, title, content, False, change, _unified(OWN_MANIFEST, old, content),
        sha256_of(raw),
    )  # fmt: skip


def _below(path: str, folders: set[str]) -> bool:
    """Whether ``path`` lies strictly inside one of ``folders`` (its ancestors looked up: linear in the plan, where
    comparing every path with every folder took 21 s for 10,000 torn checkpoints)."""
    at = path.find("/")
    while at >= 0:
        if path[:at] in folders:
            return True
        at = path.find("/", at + 1)
    return False


def _with_rule(op: PlannedOp, rules: tuple[str, ...]) -> PlannedOp:
    merged = tuple(dict.fromkeys(op.rules + rules))
    return PlannedOp(op.kind, op.path, merged, op.title, op.content, op.is_dir, op.change, op.diff, op.before_sha256)
