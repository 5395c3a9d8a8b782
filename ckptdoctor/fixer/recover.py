"""Recognising each journaled operation's state on disk, whatever interrupted it, and undoing one operation."""

from __future__ import annotations

import os

from ckptdoctor.findings import OpKind
from ckptdoctor.fixer import calls
from ckptdoctor.fixer.apply import give_back, keep_original, move_path
from ckptdoctor.fixer.calls import fsync_dir
from ckptdoctor.fixer.digests import Digest, digest, same_inode, still_holds
from ckptdoctor.fixer.errors import ConcurrentChange, FixRefused, changed_msg
from ckptdoctor.fixer.journal import Journal, JournalOp
from ckptdoctor.fixer.paths import abs_path, link_on_the_way, parent_rel


def _op_state(abs_root: str, txid: str, op: JournalOp) -> tuple[str, str]:
    """Recognise an operation's state on disk: ``applied``, ``pending``, ``both`` (quarantined, and the path
    exists again), ``untouched`` (a rewrite another process got to first), ``raced`` (killed after exchanging a
    target another process had just written: its bytes are at the temp path) or ``conflict``, with a reason."""
    here = abs_path(abs_root, op.path)
    if op.kind == OpKind.QUARANTINE:
        p, q = os.path.lexists(here), os.path.lexists(abs_path(abs_root, op.quarantine(txid)))
        if p and q:
            return "both", f"`{op.path}` exists again (created after the fix)"
        if q:
            return "applied", ""
        if p:
            return "pending", ""
        return "conflict", f"`{op.path}` is neither in place nor in the quarantine"
    held = _digest_or_none(here)  # hashed once: a batched journal leaves many ops pending, each checked here
    if op.status != "done" and not (held is not None and (held.same(op.after) or held.same(op.before))):
        keep = abs_path(abs_root, op.quarantine(txid))
        tmp = abs_path(abs_root, op.temp(txid))
        if not os.path.lexists(keep) or same_inode(keep, here) or still_holds(tmp, op.after):
            # The replace (or exchange) always follows keeping the original under a name of its own, and the
            # fixer's text is still (or again) at the temp path, so it is not at `path`: another process wrote it.
            # Nothing of the fixer's is there to undo.
            return "untouched", f"`{op.path}` was written by another process before the fix reached it"
    if not os.path.lexists(here):
        return "conflict", f"`{op.path}` was removed after the fix"
    now = held if held is not None else digest(here)  # a read error is raised, as before
    if now.same(op.after):
        tmp = abs_path(abs_root, op.temp(txid))
        if (
            op.status != "done"
            and os.path.lexists(tmp)
            and not still_holds(tmp, op.before)
            and not still_holds(tmp, op.after)
        ):
            # Killed between the exchange and its check: what came out is another process's write, not the original.
            return "raced", f"`{op.path}` was written by another process while the fix exchanged it"
        return "applied", ""
    if now.same(op.before):
        return "pending", ""
    return "conflict", f"`{op.path}` changed after the fix ({now.size:,} bytes, sha256 {now.sha256[:12]}…)"


def _digest_or_none(path: str) -> Digest | None:
    """What ``path`` holds, or None when it cannot be hashed (gone, unreadable): ``still_holds`` of any digest is
    False."""
    try:
        return digest(path)
    except OSError:
        return None


def _links_on_the_way(abs_root: str, j: Journal) -> list[str]:
    """Links (or files) where the journal's paths and their quarantine places need plain folders: a journal may
    come with a downloaded folder, and a link there would lead the fixer's moves and writes out of the root."""
    found = (link_on_the_way(abs_root, rel) for op in j.ops for rel in (op.path, op.quarantine(j.txid)))
    return list(dict.fromkeys(why for why in found if why is not None))


def _op_states(abs_root: str, j: Journal) -> tuple[list[tuple[JournalOp, str, str]], list[str]]:
    """Each operation with its state on disk and the reason (``_op_state``), and the problems found so far: the links
    on the way, when there are any (then no state is looked at: nothing is followed through a link)."""
    problems = _links_on_the_way(abs_root, j)
    return ([] if problems else [(op, *_op_state(abs_root, j.txid, op)) for op in j.ops]), problems


def check_undo(abs_root: str, j: Journal) -> list[str]:
    """Each operation's state, checked so the whole undo can succeed; a refusal lists every obstacle."""
    checked, problems = _op_states(abs_root, j)
    for op, state, why in checked:
        if state in ("both", "conflict"):
            problems.append(why)
        elif state == "applied":
            kept = abs_path(abs_root, op.quarantine(j.txid))
            if not os.path.lexists(kept):
                problems.append(f"the original of `{op.path}` is missing from `{op.quarantine(j.txid)}`")
            elif not (now := digest(kept)).same(op.before):
                problems.append(
                    f"`{op.quarantine(j.txid)}` (the original of `{op.path}`) changed after the fix, so it is no "
                    f"longer what the fix moved there ({now.size:,} bytes, sha256 {now.sha256[:12]}…; a process may "
                    "still have it open); it stays there as written"
                )
            parent = abs_path(abs_root, parent_rel(op.path))
            if not os.path.isdir(parent) or os.path.islink(parent):
                problems.append(f"`{parent_rel(op.path)}` (where `{op.path}` goes back) is gone")
    if problems:
        raise FixRefused(f"cannot undo transaction {j.txid}: " + "; ".join(problems) + ". Nothing was changed.")
    return [state for _, state, _ in checked]


def check_redo(abs_root: str, j: Journal) -> list[str]:
    """Each operation's state, checked so an interrupted transaction can be completed; a refusal lists every
    obstacle and says how to roll it back instead."""
    checked, problems = _op_states(abs_root, j)
    for op, state, why in checked:
        if state in ("conflict", "untouched"):
            problems.append(why)
        elif state == "raced":
            problems.append(f"{why} (`ckptdoctor undo` puts its bytes back)")
        elif (
            state == "pending"
            and op.kind == OpKind.QUARANTINE
            and not digest(abs_path(abs_root, op.path)).same(op.before)
        ):
            problems.append(f"`{op.path}` changed after the fix was planned")
    if problems:
        raise FixRefused(
            f"cannot complete interrupted transaction {j.txid}: "
            + "; ".join(problems)
            + f". Run `ckptdoctor undo --txid {j.txid}` to roll it back."
        )
    return ["applied" if state == "both" else state for _, state, _ in checked]


def undo_op(abs_root: str, txid: str, op: JournalOp, state: str) -> None:
    """Undo one operation found in ``state`` (from the undo's check)."""
    if state == "raced":
        give_back(abs_root, txid, op, None)
    elif state == "applied":
        if op.kind == OpKind.QUARANTINE:
            move_path(abs_root, op.quarantine(txid), op.path, op.times)
        else:
            # written since the undo checked it: keep those bytes
            if not still_holds(abs_path(abs_root, op.path), op.after):
                raise ConcurrentChange(f"{changed_msg(op.path)}; run `ckptdoctor undo` again to see what is left")
            settle_temp(abs_root, txid, op)
            calls.CALLS.replace(abs_path(abs_root, op.quarantine(txid)), abs_path(abs_root, op.path))
            fsync_dir(os.path.dirname(abs_path(abs_root, op.path)))
    elif op.kind != OpKind.QUARANTINE:
        # Not applied: only the fixer's own temp file and the kept copy of the (still present) original remain.
        for rel in (op.temp(txid), op.quarantine(txid)):
            if os.path.lexists(abs_path(abs_root, rel)):
                calls.CALLS.unlink(abs_path(abs_root, rel))


def settle_temp(abs_root: str, txid: str, op: JournalOp) -> None:
    """An applied rewrite's leftover temp file (a kill came after the exchange): the original that came out there
    is kept in the quarantine, the fixer's own text is dropped, anything else stays (``_op_state`` reports it)."""
    tmp = abs_path(abs_root, op.temp(txid))
    if not os.path.lexists(tmp):
        return
    if still_holds(tmp, op.before):
        keep_original(tmp, abs_path(abs_root, op.quarantine(txid)))
    elif still_holds(tmp, op.after):
        calls.CALLS.unlink(tmp)
