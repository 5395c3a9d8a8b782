"""The ``fix`` and ``undo`` commands: each root fixed under its closest settings file; undo restores a transaction."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from ckptdoctor.cli.options import (
    ScanRoot,
    allow_empty_option,
    note_security,
    output_options,
    request_options,
    rule_options,
    show_settings_option,
    text_or_json,
    text_width,
)

# ScanRoot lets URL roots through to the fixer's root check (`fixer.run.check_fix_roots`), which refuses them clearly.
from ckptdoctor.cli.output import emit, print_settings
from ckptdoctor.fixer.journal import load_journals
from ckptdoctor.fixer.transaction import undo
from ckptdoctor.render.fix import fix_json, render_fix_text, render_undo_list, undo_json, undo_list_json

_EPILOG_FIX = """\b
Examples:
  ckptdoctor fix --dry-run runs/my-run/        # every operation and diff, what would remain; writes nothing
  ckptdoctor fix runs/my-run/                  # apply the safe fixes, rescan, report what is left
  ckptdoctor fix --unsafe-fixes --select CKD101 runs/my-run/
  ckptdoctor undo runs/my-run/                 # restore the last fix byte for byte

Nothing is deleted: files and folders move to <root>/.ckptdoctor/quarantine/<txid>/ and rewritten files keep their
original there; a checksum manifest at the root is updated in the same transaction. Each root is fixed under its own
settings file; a folder named twice (X ./X/) is fixed once. A .ckptdoctor/ folder that came with a download
(journals, quarantine, lock) is checked and refused unless it is what the fixer itself writes. A dry run also lists
what would remain after the fix (predicted from the plan; the real run rescans), where resume_from_checkpoint=True
would pick up when the fix quarantines the checkpoint it picks (the real run says where it now picks up; JSON: each
root's "resume": [{"run", "before", "after"}]), and says when the real run would be refused now (a run written in
the last 60 seconds, a read-only tree): that is shown, not exit 2. Exit codes: 0 nothing left at or above --fail-on
(dry run: nothing to change and nothing at or above it would remain), 1 findings remain (dry run: it would change
something, or findings at or above --fail-on would remain), 2 usage error or refusal (read-only, busy, locked,
changed files, a .ckptdoctor/ the fixer did not write), 130 interrupted.
"""

_EPILOG_UNDO = """\b
Examples:
  ckptdoctor undo --list runs/my-run/          # the transactions recorded under the root
  ckptdoctor undo runs/my-run/                 # restore the last one byte for byte, modes and times included
  ckptdoctor undo --txid 20261121T101500Z-ab12cd runs/my-run/
  ckptdoctor undo --format json runs/my-run/   # what was restored, as one JSON document

--format json prints one ckptdoctor.undo/1 document (also when refused; the error line still goes to stderr):

\b
  {"schema": "ckptdoctor.undo/1", "version": "...",
   "action": "list" | "undo", "root": PATH,
   "refused": null | "why nothing was done",
   --list: "transactions": [{"txid", "state",
             "created" (Unix seconds), "created_utc" (ISO 8601),
             "operations" (how many), "rules": [...]}, ...]
           (oldest first)
   undo:   "txid": the transaction undone
             (refused: the --txid asked for, else null),
           "operations": how many it holds (refused: null),
           "restored": how many were put back}
  ckptdoctor undo --list --format json run/ | jq '.transactions[-1]'

Exit codes: 0 restored (or listed), 2 nothing to undo, no such transaction, or refused because a file changed since
the fix (nothing is changed then), 130 interrupted.
"""


@click.command("fix", epilog=_EPILOG_FIX, short_help="Repair what scan finds: planned, journaled, atomic, undoable.")
@click.argument("paths", nargs=-1, required=True, type=ScanRoot(file_okay=True, dir_okay=True))
@click.option(
    "--dry-run",
    is_flag=True,
    help="Print the plan and what would remain, and write nothing at all; exit 1 when it would change something or "
    "when the real run would exit 1.",
)
@click.option("--unsafe-fixes", is_flag=True, help="Also apply fixes marked unsafe (e.g. quarantining stale runs).")
@rule_options(
    select_help="Fix only what these rules find: codes or prefixes, comma-separated or repeated (CKD2,CKD101).",
    never_runs="Selecting only gate or --deep rules is a usage error (fix never runs them).",
    every_rule="every rule",
    ignore_help="Leave what these rules find (codes or prefixes), added to the settings file's ignore.",
    fail_on_help="Exit 1 when a finding this severe remains after the fix.",
)
@text_or_json("text: the plan and what is left; json: one ckptdoctor.fix/1 document.")
@output_options("Print only what remains (dry run: what would remain), not the plan nor the summary (text).")
@click.option("--force", is_flag=True, help="Act even on a run written in the last 60 seconds.")
@show_settings_option
@allow_empty_option("CKD002 does not remain (a run whose only folders the fix quarantines is left empty)")
def fix_command(
    paths: tuple[str, ...],
    dry_run: bool,
    unsafe_fixes: bool,
    select: tuple[str, ...],
    ignore: tuple[str, ...],
    fmt: str,
    output_file: str | None,
    quiet: bool,
    silent: bool,
    fail_on: str | None,
    force: bool,
    no_config: bool,
    allow_global: tuple[str, ...],
    show_settings: bool,
    allow_empty: bool,
) -> None:
    """Repair what the scan finds, safely: plan, journal, apply atomically; undo restores byte for byte.

    Safe fixes are applied; unsafe ones only with --unsafe-fixes; manual ones are only described.
    """
    from ckptdoctor.api import fix_roots
    from ckptdoctor.roots import Roots

    options = request_options(select, ignore, fail_on, no_config, allow_global, allow_empty)
    if show_settings:  # fix applies each root's closest file and the files below it, as scan does
        print_settings(paths, fmt, options, output_file=output_file, silent=silent)
    # Each root is fixed under its closest settings file (from it upward), as `scan` checks it.
    result = fix_roots(Roots.of(paths), options, unsafe=unsafe_fixes, dry_run=dry_run, force=force)
    if fmt == "json":
        text = json.dumps(fix_json(result), indent=2, allow_nan=False)
    else:
        text = render_fix_text(result, width=text_width(output_file, sys.stdout), quiet=quiet)
    emit(text, output_file, silent)
    # As `scan` and `gate`: a settings file's fail-on = "never" came with the checkpoint and cannot wave through a
    # security error that remains (or, in a dry run, would remain); the note goes to stderr.
    sys.exit(result.exit_status(on_security_kept=note_security))


@click.command("undo", epilog=_EPILOG_UNDO, short_help="Restore a fix transaction byte for byte.")
@click.argument("path", type=ScanRoot(remote=False, file_okay=False))
@click.option("--list", "list_", is_flag=True, help="List the fix transactions recorded under PATH.")
@click.option("--txid", default=None, metavar="ID", help="Undo this transaction instead of the last one.")
@text_or_json("text: a table (--list) or one line; json: one ckptdoctor.undo/1 document.")
def undo_command(path: str, list_: bool, txid: str | None, fmt: str) -> None:
    """Restore the last (or the named) fix transaction under PATH byte for byte, modes included.

    Refuses, changing nothing, when a file changed since the fix.
    """
    from ckptdoctor.fixer.errors import FixRefused

    try:
        if list_:
            journals = load_journals(path)
            click.echo(_dumps(undo_list_json(path, journals)) if fmt == "json" else render_undo_list(path, journals))
            return
        j, restored = undo(path, txid)
    except FixRefused as e:
        if fmt == "json":  # the document says why on stdout; the error line and exit 2 stay as in text
            doc = undo_list_json(path, (), str(e)) if list_ else undo_json(path, txid, refused=str(e))
            click.echo(_dumps(doc))
        raise
    if fmt == "json":
        click.echo(_dumps(undo_json(path, j.txid, restored=restored, operations=len(j.ops))))
        return
    from ckptdoctor.facts import plural

    click.echo(f"Undid transaction {j.txid}: restored {plural(restored, 'operation')} under {path}.")


def _dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2, allow_nan=False)
