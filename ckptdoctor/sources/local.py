"""The local source: a folder or file on disk, listed with ``os.scandir``, one stat per entry, links kept inside."""

from __future__ import annotations

import copy
import dataclasses
import errno
import os
import stat
from collections.abc import Hashable
from typing import Any

from ckptdoctor.limits import Limits
from ckptdoctor.model import DcpItem, FileFacts, PathProblem, ProblemKind, ReadProblem
from ckptdoctor.readers import VANISHED, read_dcp_items_of, read_file
from ckptdoctor.sources.interface import Entry, display


class LocalSource:
    """``root`` on a local or mounted file system: never follows a link out of the root (``LINK_ESCAPES_ROOT``
    records it), never opens FIFOs or devices (``read_file``), and counts entries while listing, so a folder with
    millions of them stops the walk at ``limits.dir_entries``, not in memory."""

    def __init__(self, root: str, limits: Limits) -> None:
        self.given = root
        self.limits = limits
        self.real_root = os.path.realpath(root)
        self.abs_root = ""
        self.where = self.real_root
        self.stopped = False
        self.entries = 0  # listed so far, over the whole walk

    def root(self, problems: list[PathProblem]) -> Entry[os.stat_result] | PathProblem:
        """The root, stat'ed through links (a root given as a link is scanned; ``is_link`` says so for a file)."""
        try:
            st = os.stat(self.given)
        except OSError as e:
            return os_problem(".", e)
        name = os.path.basename(os.path.abspath(self.given))
        is_dir = stat.S_ISDIR(st.st_mode)
        is_link = not is_dir and os.path.islink(self.given)
        return Entry(name, self.real_root, is_dir, st.st_mtime, (st.st_dev, st.st_ino), st, is_link)

    def listdir(
        self, folder: Entry[os.stat_result], rel: str, problems: list[PathProblem]
    ) -> list[os.DirEntry[str]] | None:
        """The entries of ``folder``, as far as the entry limit allows (sets ``stopped`` when it is hit)."""
        entries: list[os.DirEntry[str]] = []
        try:
            with os.scandir(folder.path) as it:
                # Count while listing, so a folder with millions of entries stops at the limit, not in memory.
                for entry in it:
                    self.entries += 1
                    if self.entries > self.limits.dir_entries:
                        msg = f"more than {self.limits.dir_entries} entries under the root; the walk stopped here"
                        problems.append(PathProblem(rel, ReadProblem(ProblemKind.LIMIT, msg)))
                        self.stopped = True
                        break
                    entries.append(entry)
        except OSError as e:
            problems.append(os_problem(rel, e, listed=rel != ".", folder=True))
            return None
        return entries

    def entry(self, listed: os.DirEntry[str], rel: str, problems: list[PathProblem]) -> Entry[os.stat_result] | None:
        """Stat one listed entry (a link: its target, which must be inside the root to be followed).

        Returns None (and records why) when the entry cannot be stat'ed at all.
        """
        try:
            if not listed.is_symlink():
                st = listed.stat(follow_symlinks=False)
                is_dir = stat.S_ISDIR(st.st_mode)
                return Entry(listed.name, listed.path, is_dir, st.st_mtime, (st.st_dev, st.st_ino), st)
            target = os.path.realpath(listed.path)
            st = os.stat(listed.path)
        except OSError as e:
            problems.append(os_problem(rel, e, link=listed.is_symlink(), listed=True))
            return None
        is_dir = stat.S_ISDIR(st.st_mode)
        key = (st.st_dev, st.st_ino)
        if not self._inside(target):
            # Never read: the target is outside what the user asked to check, and a checkpoint folder may come from
            # anyone. Followed, a link to ~/.ssh/id_ed25519 named `latest` put the key into the report (CKD503 quotes
            # a tag), a link to /usr walked 135k files, twenty such links 4.6 GB, and mounts under a followed folder
            # led into /proc. The link is reported instead (CKD604, an error when the resume loads through it), and
            # still counts as a folder for get_last_checkpoint, which only asks os.path.isdir.
            msg = "symbolic link points outside the scan root; not followed"
            problems.append(PathProblem(rel, ReadProblem(ProblemKind.LINK_ESCAPES_ROOT, msg), display(target)))
            return Entry(listed.name, listed.path, is_dir, st.st_mtime, key, st, True, followed=False)
        return Entry(listed.name, target, is_dir, st.st_mtime, key, st, True)

    def read(self, entry: Entry[os.stat_result], rel: str, in_dcp: bool) -> FileFacts:
        """Read one file with ``read_file`` (which opens it without following links, never a FIFO or a device)."""
        facts = read_file(entry.path, rel, entry.meta, self.limits, in_dcp, True)  # frameworks: MindSpore, TF, HDF5 too
        return dataclasses.replace(facts, is_link=True) if entry.is_link else facts

    def read_dcp_items(self, path: str, facts: FileFacts, items: list[DcpItem] | None) -> FileFacts:
        """``read_dcp_items_of`` the local file at ``path``."""
        return read_dcp_items_of(path, facts, items, self.limits)

    def shown_target(self, path: str) -> str:
        """The real path of ``path``, printable."""
        return display(os.path.realpath(path))

    def key(self, path: str) -> Hashable:
        """The device and inode of the folder at ``path`` (a folder gone since: a key no other folder has)."""
        try:
            st = os.stat(path)
        except OSError:
            return ("gone", path)
        return (st.st_dev, st.st_ino)

    def part(self, path: str) -> LocalSource:
        """This source with its own count of entries listed (links are still judged against the whole root)."""
        out = copy.copy(self)
        out.entries = 0
        out.stopped = False
        return out

    def identity(self, entry: Entry[os.stat_result]) -> list[Any] | None:
        """Size, modification and change times (nanoseconds), inode and device, and whether it was reached through
        a link. The change time is what a copy or ``touch -d`` cannot set back: a file rewritten and given its old
        modification time again still shows a new one."""
        st = entry.meta
        return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev, entry.is_link]

    def settled(self, entry: Entry[os.stat_result], facts: FileFacts, before_ns: int) -> bool:
        """The file read is the one listed (``read_file`` stats what it opened) and its last change is older than
        ``before_ns``."""
        st = entry.meta
        return facts.size == st.st_size and facts.mtime == st.st_mtime and st.st_ctime_ns < before_ns

    def _inside(self, real: str) -> bool:
        root = self.real_root
        return real == root or real.startswith(root if root.endswith(os.sep) else root + os.sep)


# What a link whose target does not exist is reported as (CKD001; CKD441 knows a dangling Lightning `last.ckpt` by it)
BROKEN_LINK = "broken symbolic link: target does not exist"


def os_problem(rel: str, e: OSError, link: bool = False, listed: bool = False, folder: bool = False) -> PathProblem:
    """A PathProblem for an OSError met while listing or stat'ing ``rel``: ``listed`` when a listing showed it a
    moment ago (so ENOENT means it vanished), ``folder`` when it is a folder that could not be listed."""
    if e.errno == errno.ELOOP:
        return PathProblem(rel, ReadProblem(ProblemKind.SYMLINK_LOOP, "symbolic link loop"))
    if link and e.errno == errno.ENOENT:
        return PathProblem(rel, ReadProblem(ProblemKind.UNREADABLE, BROKEN_LINK))
    if listed and e.errno == errno.ENOENT:
        return PathProblem(rel, ReadProblem(ProblemKind.UNREADABLE, VANISHED))
    if folder:  # it holds files nobody could check: not an empty folder
        msg = f"cannot list this folder ({e.strerror or e}): what it holds was not checked"
        return PathProblem(rel, ReadProblem(ProblemKind.UNREADABLE, msg))
    return PathProblem(rel, ReadProblem(ProblemKind.UNREADABLE, f"cannot read: {e.strerror or e}"))


# File systems on a local block device or in memory (Linux names, as /proc/self/mountinfo gives them).
_LOCAL_FILE_SYSTEMS = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "bcachefs", "zfs", "f2fs", "jfs", "reiserfs", "nilfs2", "tmpfs",
     "ramfs", "overlay", "squashfs", "erofs", "vfat", "exfat", "ntfs", "ntfs3", "hfsplus", "apfs"}
)  # fmt: skip


def on_local_disk(path: str) -> bool:
    """Whether ``path`` is on a local block device or in memory (not a network file system, not unknown)."""
    return _file_system_type(path) in _LOCAL_FILE_SYSTEMS


def _file_system_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """The type of the file system holding ``path`` (the longest mount point above it), or None when unknown."""
    try:
        target = os.path.realpath(path)
        with open(mountinfo, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    best, fs_type = -1, None
    for line in lines:
        fields = line.split(" ")
        try:
            sep = fields.index("-")
            point = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
            kind = fields[sep + 1]
        except (ValueError, IndexError):
            continue
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, fs_type = len(point), kind
    return fs_type
