"""Transactions: apply a plan (journal first), complete one a crash interrupted, roll back, undo."""

from __future__ import annotations

import os
import time

from ckptdoctor.findings import OpKind
from ckptdoctor.fixer import calls
from ckptdoctor.fixer.apply import apply_op
from ckptdoctor.fixer.calls import ensure_dir, quietly
from ckptdoctor.fixer.crash import crash_point
from ckptdoctor.fixer.digests import Digest, digest, sha256_of
from ckptdoctor.fixer.errors import FixRefused
from ckptdoctor.fixer.guard import RootLock, preflight
from ckptdoctor.fixer.journal import Journal, JournalOp, load_journals, new_txid, save_journal, save_quietly
from ckptdoctor.fixer.paths import OWN_DIR, OWN_MANIFEST, abs_path, check_path, link_on_the_way, own_path, parent_rel
from ckptdoctor.fixer.plan import RootPlan
from ckptdoctor.fixer.recover import check_redo, check_undo, settle_temp, undo_op


def _restore_times(abs_root: str, j: Journal) -> None:
    """Give the touched folders back their mtimes: the Trainer's rotation orders checkpoints by folder mtime."""
    for rel, times in sorted(j.dir_times.items(), key=lambda kv: -kv[0].count("/")):
        path = abs_path(abs_root, rel) if rel != "." else abs_root
        if rel == "." or (link_on_the_way(abs_root, rel, last=True) is None and os.path.isdir(path)):
            calls.CALLS.utime(path, times)


# Saving the whole journal after every operation made a transaction of n operations cost O(n^2): each save
# encodes and fsyncs all n operations. Measured on 2 cores (tiny folders quarantined through `apply_plan`, then
# `undo`): 500 folders 22.8 s fix + 22.1 s undo, 2,000 folders 123 s for the undo alone. An operation's status is a
# hint, never the truth: recovery recognises each operation's state on disk from its hashes (`recover._op_state`),
# and a kill between an operation and its save (crash point `op:<k>:moved`) always left a done operation marked
# pending. So between the write-ahead save (before any change) and the save of the final state, the statuses are
# saved once every `_batch(n)` operations: at most `JOURNAL_SAVES` saves in between, whatever n, and a small
# transaction (n <= JOURNAL_SAVES) still saves after each one. A kill between two saves leaves at most `_batch(n)`
# done operations marked pending, each recognised as applied (or, undoing, as restored) from the disk. After:
# 500 folders 0.42 s + 0.35 s, 2,000 folders 1.4 s + 1.2 s (tests/fixer/test_fix_scale.py counts the saves).
JOURNAL_SAVES = 16


def _batch(n_ops: int) -> int:
    """How many operations go between two saves of a journal of ``n_ops`` operations."""
    return max(1, -(-n_ops // JOURNAL_SAVES))


def _forward(abs_root: str, j: Journal, states: list[str]) -> None:
    """Apply every operation not yet applied, marking each done in the journal as it completes (saved in batches)."""
    every, unsaved = _batch(len(j.ops)), 0
    for k, (op, state) in enumerate(zip(j.ops, states, strict=True), 1):
        if op.status == "done":
            continue
        if state == "pending":
            apply_op(abs_root, j.txid, op, k)
        elif op.kind != OpKind.QUARANTINE:
            settle_temp(abs_root, j.txid, op)
        crash_point(f"op:{k}:moved")
        op.status = "done"
        unsaved += 1
        if unsaved == every:
            save_journal(abs_root, j)
            unsaved = 0
        crash_point(f"op:{k}")
    _restore_times(abs_root, j)
    j.state = "applied"
    save_journal(abs_root, j)


def _backward(abs_root: str, j: Journal, *, final: str, strict: bool) -> int:
    """Roll every applied operation back, newest first. ``strict`` journal writes (undo) or best effort
    (rollback after a fault). Returns the number of operations restored."""
    states = check_undo(abs_root, j)
    save = save_journal if strict else save_quietly
    j.state = "undoing"
    save(abs_root, j)
    crash_point("undo:journal")
    restored, every, unsaved = 0, _batch(len(j.ops)), 0
    for k in range(len(j.ops), 0, -1):
        op, state = j.ops[k - 1], states[k - 1]
        undo_op(abs_root, j.txid, op, state)
        restored += state == "applied"
        op.status = "undone"
        unsaved += 1
        if unsaved == every:  # in batches, as `_forward`: the state "undoing" is what a later run must see
            save(abs_root, j)
            unsaved = 0
        crash_point(f"undo:{k}")
    _restore_times(abs_root, j)
    _prune_quarantine(abs_root, j.txid)
    j.state = final
    save(abs_root, j)
    return restored


def _prune_quarantine(abs_root: str, txid: str) -> None:
    """Remove the transaction's quarantine folders once empty (they held only what went back)."""
    top = own_path(abs_root, "quarantine", txid)
    if link_on_the_way(abs_root, f"{OWN_DIR}/quarantine/{txid}", last=True) is not None or not os.path.isdir(top):
        return  # never walk (and prune) through a link: it would lead out of the root
    for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda t: -len(t[0])):
        quietly(calls.CALLS.rmdir, dirpath)


def apply_plan(plan: RootPlan, *, force: bool = False) -> Journal | None:
    """Apply one root's plan as a transaction and return its journal (None when there is nothing to do).

    Raises ``FixRefused`` for a refusal (nothing written) or a failure; after a failure the transaction is rolled
    back when possible, else the message says to run ``ckptdoctor undo`` or ``ckptdoctor fix``.
    """
    if not plan.ops:
        return None
    preflight(plan, force=force)
    root = plan.abs_root
    dir_times: dict[str, tuple[int, int]] = {}
    for rel in {"."} | {parent_rel(op.path) for op in plan.ops}:
        st = os.lstat(abs_path(root, rel) if rel != "." else root)
        dir_times[rel] = (st.st_atime_ns, st.st_mtime_ns)
    with RootLock(root):
        ops: list[JournalOp] = []
        for i, p in enumerate(plan.ops):
            now_st, why = check_path(root, p.path, own_manifest=p.path == OWN_MANIFEST,
                                     link_ok=p.kind == OpKind.QUARANTINE)
            if now_st is None:
                raise FixRefused(f"{why}; nothing was changed")
            try:
                before = digest(abs_path(root, p.path))
            except OSError as e:
                raise FixRefused(f"`{p.path}` cannot be read: {e.strerror or e}; nothing was changed") from None
            if p.before_sha256 is not None and before.sha256 != p.before_sha256:
                raise FixRefused(f"`{p.path}` changed while the fix was planned; nothing was changed")
            after = None
            if p.content is not None:
                data = p.content.encode("utf-8")
                after = Digest("file", len(data), sha256_of(data), before.mode)
            times = (now_st.st_atime_ns, now_st.st_mtime_ns) if p.is_dir else None
            ops.append(JournalOp(i + 1, p.kind, p.path, list(p.rules), p.title, before, after, p.content, times))
        j = Journal(new_txid(), root, time.time(), "applying", ops, dir_times)
        written = False
        try:
            ensure_dir(root, f"{OWN_DIR}/journal")
            save_journal(root, j)
            written = True
            crash_point("journal")
            _forward(root, j, ["pending"] * len(ops))
        except (OSError, FixRefused) as e:
            written = written or os.path.lexists(own_path(root, "journal", f"{j.txid}.json"))  # saved, not yet synced
            raise FixRefused(_after_fault(plan.root, root, j, e, written)) from None
    return j


def _after_fault(shown: str, root: str, j: Journal, e: Exception, written: bool) -> str:
    what = f"{e.strerror or e}" if isinstance(e, OSError) else e
    if not written:
        return f"fix of {shown} failed before any change ({what}); nothing was changed"
    try:
        _backward(root, j, final="rolled-back", strict=False)
    except (OSError, FixRefused) as e2:
        return (
            f"fix of {shown} failed ({what}) and could not be rolled back ({e2}). Transaction {j.txid} is recorded "
            f"in the journal: run `ckptdoctor undo {shown}` to restore the tree, or `ckptdoctor fix {shown}` to "
            "complete it"
        )
    return f"fix of {shown} failed ({what}); transaction {j.txid} was rolled back and the tree is as before"


def complete_interrupted(path: str) -> list[str]:
    """Roll forward every transaction a crash left in the ``applying`` state; returns their txids."""
    root = os.path.realpath(path)
    pending = [j for j in load_journals(root) if j.state in ("applying", "undoing")]
    if not pending:
        return []
    undoing = [j.txid for j in pending if j.state == "undoing"]
    if undoing:
        raise FixRefused(
            f"an undo of transaction {undoing[0]} in {path} was interrupted; run `ckptdoctor undo {path}` to finish it"
        )
    done: list[str] = []
    with RootLock(root):
        for j in pending:
            try:
                _forward(root, j, check_redo(root, j))
            except OSError as e:
                raise FixRefused(
                    f"cannot complete interrupted transaction {j.txid}: {e.strerror or e}; run `ckptdoctor fix "
                    f"{path}` again or `ckptdoctor undo {path}`"
                ) from None
            done.append(j.txid)
    return done


def undo(path: str, txid: str | None = None) -> tuple[Journal, int]:
    """Restore the last (or the named) transaction under root ``path`` byte for byte; returns it and the number
    of operations restored. Refuses, changing nothing, when a file changed since the fix."""
    root = os.path.realpath(path)
    if not os.path.isdir(root):
        raise FixRefused(f"{path} is not a folder")
    with RootLock(root):
        journals = load_journals(root)
        if txid is not None:
            found = [j for j in journals if j.txid == txid]
            if not found:
                raise FixRefused(f"no transaction {txid} under {path} (see `ckptdoctor undo --list {path}`)")
            j = found[0]
            if j.state in ("undone", "rolled-back"):
                raise FixRefused(f"transaction {txid} was already {j.state.replace('-', ' ')}")
        else:
            live = [j for j in journals if j.state in ("applied", "applying", "undoing")]
            if not live:
                raise FixRefused(f"no fix transaction to undo under {path}")
            j = live[-1]
        try:
            restored = _backward(root, j, final="undone", strict=True)
        except OSError as e:
            raise FixRefused(
                f"undo of {j.txid} failed: {e.strerror or e}; run `ckptdoctor undo {path}` again to finish it"
            ) from None
    return j, restored
