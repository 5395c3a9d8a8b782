"""Applying one journaled operation atomically: quarantine move, rewrite by rename exchange, give-back to a writer."""

from __future__ import annotations

import errno
import os
import stat

from ckptdoctor.findings import OpKind
from ckptdoctor.fixer import calls
from ckptdoctor.fixer.calls import NO_EXCHANGE, ensure_dir, fsync_dir, quietly, write_all
from ckptdoctor.fixer.crash import crash_point
from ckptdoctor.fixer.digests import digest, same_inode, still_holds
from ckptdoctor.fixer.errors import ConcurrentChange, FixRefused, changed_msg
from ckptdoctor.fixer.journal import JournalOp
from ckptdoctor.fixer.paths import CHUNK, CLOEXEC, NOFOLLOW, abs_path, parent_rel

# errnos meaning "this filesystem has no hard links here": fall back to copying the original into the quarantine.
_NO_LINK = {errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}


def _save_original(abs_root: str, txid: str, op: JournalOp) -> None:
    """Keep the original of a rewrite in the quarantine: a hard link (same inode, mode and times), else a copy."""
    target, keep = abs_path(abs_root, op.path), abs_path(abs_root, op.quarantine(txid))
    if os.path.lexists(keep):
        if digest(keep).same(op.before):
            return  # a previous, interrupted attempt already kept it
        raise FixRefused(f"`{op.quarantine(txid)}` exists and is not the original of `{op.path}`")
    ensure_dir(abs_root, parent_rel(op.quarantine(txid)))
    try:
        calls.CALLS.link(target, keep)
    except OSError as e:
        if e.errno not in _NO_LINK:
            raise
        _copy_file(target, keep)
        if not digest(keep).same(op.before):  # a writer changed the file while it was copied
            calls.CALLS.unlink(keep)
            raise ConcurrentChange(changed_msg(op.path)) from None
    fsync_dir(os.path.dirname(keep))


def _copy_file(src: str, dst: str) -> None:
    st = os.lstat(src)
    tmp = dst + ".partial"
    if os.path.lexists(tmp):
        calls.CALLS.unlink(tmp)
    rfd = os.open(src, os.O_RDONLY | NOFOLLOW | CLOEXEC)
    try:
        wfd = calls.CALLS.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o600)
        try:
            while chunk := os.read(rfd, CHUNK):
                write_all(wfd, chunk)
            calls.CALLS.fchmod(wfd, stat.S_IMODE(st.st_mode))
            calls.CALLS.fsync(wfd)
        finally:
            os.close(wfd)
    finally:
        os.close(rfd)
    calls.CALLS.utime(tmp, (st.st_atime_ns, st.st_mtime_ns))
    calls.CALLS.rename(tmp, dst)


def _apply_rewrite(abs_root: str, txid: str, op: JournalOp, k: int) -> None:
    target, tmp = abs_path(abs_root, op.path), abs_path(abs_root, op.temp(txid))
    assert op.content is not None
    st = os.lstat(target)
    if os.path.lexists(tmp):
        calls.CALLS.unlink(tmp)  # our own temp file from an interrupted attempt
    fd = calls.CALLS.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o600)
    try:
        write_all(fd, op.content.encode("utf-8"))
        calls.CALLS.fchmod(fd, stat.S_IMODE(st.st_mode))
        if os.geteuid() == 0:  # keep the owner when root rewrites another user's file
            os.fchown(fd, st.st_uid, st.st_gid)
        calls.CALLS.fsync(fd)
    finally:
        os.close(fd)
    # The new file keeps the original's mtime: rotation and stale-run detection order checkpoints by time.
    calls.CALLS.utime(tmp, (st.st_atime_ns, st.st_mtime_ns))
    crash_point(f"op:{k}:temp")
    keep = abs_path(abs_root, op.quarantine(txid))
    try:
        _save_original(abs_root, txid, op)
        # Re-hash right before the replace: a writer since the journaled hash keeps its bytes and the op aborts.
        if not still_holds(target, op.before):
            # The kept name is ours: another name of the writer's inode, or an original the writer replaced.
            quietly(calls.CALLS.unlink, keep)
            raise ConcurrentChange(changed_msg(op.path))
    except ConcurrentChange:
        quietly(calls.CALLS.unlink, tmp)
        raise
    crash_point(f"op:{k}:saved")
    ours = os.lstat(tmp)
    try:
        # Swap the new file and the target in one step, then judge what came out: no write can fall between a
        # check and the act, since the check is made on what the act took away.
        calls.CALLS.exchange(tmp, target)
    except OSError as e:
        if e.errno == errno.ENOENT and os.path.lexists(tmp) and not os.path.lexists(target):
            quietly(calls.CALLS.unlink, keep)  # removed by another process since the check: the removal stands
            quietly(calls.CALLS.unlink, tmp)
            raise ConcurrentChange(changed_msg(op.path)) from None
        if e.errno not in NO_EXCHANGE:
            raise
        _replace_checked(abs_root, txid, op)  # no atomic exchange here: check, then replace
        return
    fsync_dir(os.path.dirname(target))
    crash_point(f"op:{k}:exchanged")
    if still_holds(tmp, op.before):
        keep_original(tmp, keep)
        return
    raise ConcurrentChange(give_back(abs_root, txid, op, ours))


def keep_original(tmp: str, keep: str) -> None:
    """The original came out at the temp path after the exchange: it becomes the quarantined original (its own
    inode, so a process still writing through an open descriptor writes there); when the quarantine already holds
    that inode (a hard link) the extra name goes. Another filesystem (no link, no rename) keeps the verified copy."""
    if same_inode(tmp, keep):
        calls.CALLS.unlink(tmp)
    else:
        try:
            calls.CALLS.replace(tmp, keep)
        except OSError as e:
            if e.errno != errno.EXDEV:
                raise
            calls.CALLS.unlink(tmp)
        fsync_dir(os.path.dirname(keep))
    fsync_dir(os.path.dirname(tmp))


def give_back(abs_root: str, txid: str, op: JournalOp, ours: os.stat_result | None) -> str:
    """A writer got to the target before the exchange, so its bytes came out at the temp path: swap them back
    while the target is still the fixer's file (``ours``: its inode; None when recovering after a crash), drop the
    fixer's files, and return the message. Bytes written again meanwhile are set aside, never removed."""
    target, tmp = abs_path(abs_root, op.path), abs_path(abs_root, op.temp(txid))
    keep = abs_path(abs_root, op.quarantine(txid))

    def is_ours(path: str) -> bool:
        if ours is not None and not _same_inode_as(path, ours):
            return False
        return still_holds(path, op.after)

    if is_ours(target):
        calls.CALLS.exchange(tmp, target)
        fsync_dir(os.path.dirname(target))
    # The kept original is the fixer's: another name of the writer's inode, or an original the writer replaced.
    quietly(calls.CALLS.unlink, keep)
    if is_ours(tmp):
        calls.CALLS.unlink(tmp)
        return changed_msg(op.path)
    # Written twice (or the target changed again before the swap back): both writes are kept as written.
    aside = f"{op.quarantine(txid)}.written-during-fix"
    calls.CALLS.rename(tmp, abs_path(abs_root, aside))
    fsync_dir(os.path.dirname(abs_path(abs_root, aside)))
    fsync_dir(os.path.dirname(tmp))
    return (
        f"`{op.path}` was written by another process more than once during the fix; it is left as last written "
        f"and the bytes written before are in `{aside}`"
    )


def _same_inode_as(path: str, st: os.stat_result) -> bool:
    try:
        return os.path.samestat(os.lstat(path), st)
    except OSError:
        return False


def _replace_checked(abs_root: str, txid: str, op: JournalOp) -> None:
    """The fallback where ``renameat2(RENAME_EXCHANGE)`` is missing (not Linux, a kernel before 3.15, a filesystem
    answering EINVAL): ``os.replace`` right after the last hash check, then a check of the kept original.

    The window it leaves: a writer that renames a new file over the target (or, without hard links, writes in
    place) between that last check and the replace loses its bytes.
    """
    target, tmp = abs_path(abs_root, op.path), abs_path(abs_root, op.temp(txid))
    keep = abs_path(abs_root, op.quarantine(txid))
    linked = same_inode(keep, target)
    calls.CALLS.replace(tmp, target)
    fsync_dir(os.path.dirname(target))
    if linked and not still_holds(keep, op.before):
        # A writer got into the original's inode in the instant before the replace (or writes through an open
        # descriptor): its bytes are in the kept original. Put that inode back unless someone wrote ours too.
        if still_holds(target, op.after):
            calls.CALLS.replace(keep, target)
            fsync_dir(os.path.dirname(target))
            raise ConcurrentChange(changed_msg(op.path))
        raise ConcurrentChange(
            f"`{op.path}` and its original in `{op.quarantine(txid)}` were both written by another process during "
            "the fix; both are kept as written"
        )


def move_path(abs_root: str, src_rel: str, dst_rel: str, times: tuple[int, int] | None) -> None:
    """Rename ``src_rel`` to ``dst_rel`` under the root, durably, keeping its times."""
    src, dst = abs_path(abs_root, src_rel), abs_path(abs_root, dst_rel)
    calls.CALLS.rename(src, dst)
    fsync_dir(os.path.dirname(dst))
    if os.path.dirname(dst) != os.path.dirname(src):
        fsync_dir(os.path.dirname(src))
    if times is not None:
        calls.CALLS.utime(dst, times)


def apply_op(abs_root: str, txid: str, op: JournalOp, k: int) -> None:
    """Apply the ``k``-th journaled operation of ``txid`` atomically."""
    if op.kind == OpKind.QUARANTINE:
        ensure_dir(abs_root, parent_rel(op.quarantine(txid)))
        move_path(abs_root, op.path, op.quarantine(txid), op.times)
        if not still_holds(abs_path(abs_root, op.quarantine(txid)), op.before):
            # Written since it was journaled (the rename keeps every byte): give it back to its writer.
            if os.path.lexists(abs_path(abs_root, op.path)):
                raise ConcurrentChange(
                    f"`{op.path}` was written by another process while it moved to `{op.quarantine(txid)}`, and "
                    f"`{op.path}` was created again; both are kept as written"
                )
            move_path(abs_root, op.quarantine(txid), op.path, op.times)
            raise ConcurrentChange(changed_msg(op.path))
    else:
        _apply_rewrite(abs_root, txid, op, k)
