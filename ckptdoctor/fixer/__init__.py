"""The fixer, the only code in ckptdoctor that writes: plan fixes, journal them, apply them atomically, undo them.

Every change is one operation of a transaction ``<txid>`` under a scan root:

* ``quarantine``: ``os.rename`` the file or folder to ``<root>/.ckptdoctor/quarantine/<txid>/<same relative path>``
  (same filesystem, so the move is atomic; nothing is ever deleted);
* ``rewrite-json`` / ``rewrite-text``: write the new text to a temp file beside the target, fsync it, keep the
  original in the quarantine (a hard link, else a copy), then swap the temp file and the target atomically
  (Linux ``renameat2(RENAME_EXCHANGE)``); the original comes out at the temp path and becomes the quarantined one.
  Where there is no exchange (not Linux, a kernel before 3.15, a filesystem answering EINVAL) the temp file is
  ``os.replace``d over the target instead.

Before the first change the write-ahead journal ``<root>/.ckptdoctor/journal/<txid>.json`` records every
operation with the before/after size and sha256 (and the new text of rewrites) and is fsynced; operations are
marked done in batches as they complete (``transaction.JOURNAL_SAVES``: at most 16 saves a transaction). Whatever
point a crash or an I/O error interrupts, the on-disk state of each operation can be recognised from the hashes,
so ``undo`` rolls the transaction back and ``fix`` rolls it forward.

A concurrent writer is met by checking again at the act: a rewrite re-hashes its target before the swap and then
hashes what the exchange took out (not the original: a writer got in, and its file is swapped back while the
target is still the fixer's), a move re-hashes what arrived in the quarantine. A change aborts the operation,
leaves the writer's bytes where it wrote them and rolls the transaction back (``ConcurrentChange``). Without the
exchange one window remains: a rename over the target (or, with no hard links, an in-place write) between the last
hash and the ``os.replace`` is lost.

Test hooks (never set in normal use): ``CKPTDOCTOR_TEST_CRASH=<point>`` or ``CKPTDOCTOR_TEST_CRASH_AFTER_OP=<k>``
kill the process with SIGKILL at a named point (see ``crash_points``); ``calls.CALLS`` is the one indirection through
which every write system call goes, so a test can make call k fail with ``ENOSPC`` or ``EIO``
(patch ``ckptdoctor.fixer.calls.CALLS``: it is deliberately not re-exported here, where a patch would not reach
the modules that write).

The modules, each with one job, importing only those above them:

* ``errors``: ``FixRefused`` and ``ConcurrentChange``;
* ``paths``: the fixer's own folder, the quarantine, which paths it may touch, how it opens them;
* ``calls``: the write calls (``CALLS``, the fault-injection seam) and the durable writes built on them;
* ``crash``: the crash-point test hook;
* ``digests``: what a path holds (``Digest``) and whether it still holds it;
* ``plan``: the findings' fix plans checked against the disk (``plan_root``);
* ``journal``: the write-ahead journal, its format and durable saves;
* ``guard``: the root lock and the preflight refusals;
* ``apply``: applying one operation atomically (rename exchange, checked replace, quarantine move);
* ``recover``: recognising an operation's state on disk, undoing one operation;
* ``transaction``: a transaction forward and back: ``apply_plan``, ``complete_interrupted``, ``undo``;
* ``manifest``: checksum manifests (``write_manifest``);
* ``run``: the ``fix`` API (its text and JSON output are ``render.fix``, the ``fix``/``undo`` commands ``cli.fix``).
"""

from __future__ import annotations

from ckptdoctor.fixer.calls import WriteCalls, rename_exchange
from ckptdoctor.fixer.crash import CRASH_AFTER_OP_ENV, CRASH_ENV, crash_points
from ckptdoctor.fixer.digests import Digest, digest
from ckptdoctor.fixer.errors import ConcurrentChange, FixRefused
from ckptdoctor.fixer.guard import BUSY_SECONDS, RootLock, preflight
from ckptdoctor.fixer.journal import JOURNAL_SCHEMA, Journal, JournalOp, load_journals
from ckptdoctor.fixer.manifest import MANIFEST_NAME, manifest_refusal, write_manifest
from ckptdoctor.fixer.paths import OWN_DIR, check_path, quarantine_path
from ckptdoctor.fixer.plan import REWRITE_MAX_BYTES, PlannedOp, RootPlan, Skipped, plan_root
from ckptdoctor.fixer.run import FixResult, fix
from ckptdoctor.fixer.transaction import apply_plan, complete_interrupted, undo

__all__ = [
    "BUSY_SECONDS",
    "CRASH_AFTER_OP_ENV",
    "CRASH_ENV",
    "JOURNAL_SCHEMA",
    "MANIFEST_NAME",
    "OWN_DIR",
    "REWRITE_MAX_BYTES",
    "ConcurrentChange",
    "Digest",
    "FixRefused",
    "FixResult",
    "Journal",
    "JournalOp",
    "PlannedOp",
    "RootLock",
    "RootPlan",
    "Skipped",
    "WriteCalls",
    "apply_plan",
    "check_path",
    "complete_interrupted",
    "crash_points",
    "digest",
    "fix",
    "load_journals",
    "manifest_refusal",
    "plan_root",
    "preflight",
    "quarantine_path",
    "rename_exchange",
    "undo",
    "write_manifest",
]
