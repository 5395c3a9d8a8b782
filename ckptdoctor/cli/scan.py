"""The ``scan`` command: check roots under their settings files, render the report, exit by the exit policy."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import click

from ckptdoctor.cli.options import (
    ScanRoot,
    UsageProblem,
    allow_empty_option,
    cache_option,
    note_security,
    output_options,
    read_only_done,
    request_options,
    rule_options,
    show_settings_option,
    text_width,
    use_color,
)
from ckptdoctor.cli.output import Lines, emit, emit_chunks, print_settings
from ckptdoctor.version import __version__

if TYPE_CHECKING:
    from ckptdoctor.api import PartSink
    from ckptdoctor.fanout import DaskFanOut
    from ckptdoctor.findings import Finding
    from ckptdoctor.model import Tree
    from ckptdoctor.render.report import RunPieces
    from ckptdoctor.roots import Roots
    from ckptdoctor.scanner import Report
    from ckptdoctor.settings.selection import Options

_EPILOG_SCAN = """\b
Examples:
  ckptdoctor scan runs/my-run/                 # before resume_from_checkpoint=True
  ckptdoctor scan runs/my-run/checkpoint-800   # before resume_from_checkpoint="...checkpoint-800"
  ckptdoctor scan --format json runs/ | jq '.findings[].rule'
  ckptdoctor scan --format jsonl /fleet/ | jq -c 'select(.severity == "error")'
  ckptdoctor scan --select CKD2 --fail-on warning model/
  ckptdoctor scan --ignore CKD206,CKD404 runs/my-run/
  ckptdoctor scan --format sarif --fail-on never run/ > out.sarif   # report, never fail
  ckptdoctor scan s3://bucket/runs/my-run/     # object storage through fsspec (pip install "ckptdoctor[remote]")
  ckptdoctor scan --deep --checksums write runs/a/checkpoint-800   # then, on the copy:
  ckptdoctor scan --deep --checksums verify /mnt/copy/checkpoint-800
  ckptdoctor scan --statistics runs/           # how many findings of each rule
  ckptdoctor scan -q -o report.txt runs/       # the findings only, to a file
  ckptdoctor scan --dask tcp://scheduler:8786 s3://bucket/fleet/   # one Dask task per run (ckptdoctor[dask])

Exit codes: 0 nothing at or above --fail-on, 1 findings at or above it, 2 usage error, bad settings file, or a
root that is missing, unreadable or not a folder or regular file (a FIFO, socket, device or symbolic link loop).
A corrupt file inside a root is a finding, not 2; so is a root holding no checkpoint at all (CKD002, an error,
unless --allow-empty).

Settings: each run and checkpoint folder is checked under the closest .ckptdoctor.toml, or pyproject.toml with
[tool.ckptdoctor], from that folder upward (as ruff finds its configuration; .ckptdoctor.toml wins in one folder),
else under the user configuration (~/.config/ckptdoctor/config.toml); --show-settings shows which file applies
where. In a settings file:

\b
  select = ["CKD1", "CKD2"]
  ignore = ["CKD206"]
  fail-on = "warning"
  [severity] CKD404 = "warning"

An unknown code there is exit 2, as on the command line. A project file cannot turn off or lower the security
rules (CKD6xx), nor let their errors pass with fail-on = "never"; --ignore and --fail-on here, and the user
configuration, can.
"""


@click.command(epilog=_EPILOG_SCAN, short_help="Check checkpoint folders, files or URLs for resume hazards.")
@click.argument("paths", nargs=-1, required=True, type=ScanRoot(file_okay=True, dir_okay=True))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json", "jsonl", "sarif", "github"]),
    default="text",
    show_default=True,
    help="text: tables and findings for people; json: one ckptdoctor.report/1 document for scripts; "
    "jsonl: one ckptdoctor.finding/1 line per finding as each run is judged, then one ckptdoctor.summary/1 line, "
    "for pipelines that stream; sarif: SARIF 2.1.0 for code scanning; github: workflow annotation lines.",
)
@click.option(
    "--statistics",
    is_flag=True,
    help="Print the number of findings per rule (and the summary) instead of the report, as text or, with "
    "--format json, as one ckptdoctor.statistics/1 document.",
)
@output_options("Print the findings only: no tables, no summary line (text; other formats are unchanged).")
@rule_options(
    never_runs="Selecting only gate rules, or only --deep rules without --deep, is a usage error (they would never "
    "run).",
    every_rule="every rule a scan runs",
)
@click.option(
    "--jobs",
    "-j",
    type=click.IntRange(min=1, max=256),
    default=None,
    metavar="N",
    help="Read up to N files at once (helps on network file systems and object storage; on a local disk parsing "
    "is the cost and one is fastest).  [default: 1 on a local disk, else min(8, 2 x CPUs)]",
)
@click.option(
    "--deep",
    is_flag=True,
    help="Also stream all tensor data (in bounded chunks) for NaN/Inf, all-zero tensors and untrained adapters. "
    "Needs numpy; reads every byte, so it takes as long as reading the files.",
)
@click.option(
    "--checksums",
    type=click.Choice(["write", "verify"]),
    default=None,
    help="With --deep: also sha256 every file in the same read. write: record them in "
    "<root>/.ckptdoctor/manifest.json (the only thing scan writes); verify: compare with that manifest (CKD214). "
    "Roots must be folders.  [default: no checksums, even when a manifest exists]",
)
@click.option(
    "--dask",
    "dask_address",
    metavar="SCHEDULER_ADDRESS",
    default=None,
    help="Read the runs on a Dask cluster, one task per run, through the scheduler at SCHEDULER_ADDRESS "
    "(tcp://host:8786). Each root is listed here, each run read on a worker; the rules, settings files and report "
    "stay here, the same byte for byte as without --dask. A run whose task still fails after Dask's retries is "
    "CKD001 (an error: exit 1), never left out. Workers need this ckptdoctor version and the roots at the same "
    'paths (a URL root: credentials of their own). Not with --deep. Needs pip install "ckptdoctor[dask]".',
)
@cache_option
@show_settings_option
@allow_empty_option("CKD002 is not reported (as with --ignore CKD002)")
def scan(
    paths: tuple[str, ...],
    fmt: str,
    statistics: bool,
    output_file: str | None,
    quiet: bool,
    silent: bool,
    fail_on: str | None,
    select: tuple[str, ...],
    ignore: tuple[str, ...],
    no_config: bool,
    jobs: int | None,
    deep: bool,
    checksums: str | None,
    allow_global: tuple[str, ...],
    cache: bool | None,
    show_settings: bool,
    allow_empty: bool,
    dask_address: str | None,
) -> None:
    """Check checkpoint folders or files and report hazards for a resume.

    PATHS may be an output_dir with checkpoint-N folders, one checkpoint folder, a save_pretrained model folder,
    a folder of many runs, or a single file, on disk or at a URL (s3://, gs://, hf://... through fsspec: only
    headers are fetched, with ranged requests). Nothing is loaded, executed or written (except the manifest of
    --checksums write).

    The report goes to stdout: one table per run (the checkpoint resume_from_checkpoint=True picks is marked),
    then one line per finding with its fix, then a summary. Names with control characters are shown escaped
    (\\x1b); --format json gives them exactly.
    """
    from ckptdoctor.render.report import RunPieces, json_chunks, render_text
    from ckptdoctor.roots import Roots

    if statistics and fmt in ("sarif", "github", "jsonl"):
        raise UsageProblem(f"--statistics prints text or json, not {fmt}")
    roots = Roots.of(paths)  # `scan X X` (or `X ./X/`) scans X once, as ruff does
    options = request_options(select, ignore, fail_on, no_config, allow_global, allow_empty)
    if show_settings:
        print_settings(roots.paths, "json" if fmt == "jsonl" else fmt, options, output_file=output_file, silent=silent)
    if dask_address is not None and deep:
        raise UsageProblem("--dask reads each run's headers on the workers, --deep every byte here: drop one of them")
    check_remote_roots(roots, deep)
    roots = _check_special_roots(roots)
    width = text_width(output_file, sys.stdout)
    color = output_file is None and use_color(sys.stdout)
    # What the report keeps of each run as the scan goes (its table, or its JSON entry): the facts are released.
    kept = "none" if statistics else "text" if fmt == "text" and not quiet else fmt
    pieces = RunPieces(kept, color=color, width=width)
    if fmt == "jsonl":
        with Lines(output_file, silent) as lines:
            sink = _sink(lines, pieces)
            report = _scan(roots, options, jobs, deep, checksums, None if deep else sink, dask_address, cache)
            if deep:  # --deep judges each root whole (and --checksums write needs it): its lines come after
                for i, tree in enumerate(report.trees):
                    sink(i, tree, [f for f in report.findings if f.root == tree.root])
            report = dataclasses.replace(report, seconds=_elapsed())
            lines.write(_summary_json(report, pieces))
        if checksums == "write":
            _write_manifests(report.trees)
        _exit(report, checksums)
    report = _scan(roots, options, jobs, deep, checksums, None if deep else pieces.add, dask_address, cache)
    if deep:  # the trees were kept whole (--deep hands each root whole; --checksums write needs them)
        pieces = RunPieces.of(report, kept, color=color, width=width)
    if fmt != "text" or statistics:  # a document says the time up to its rendering; the text, through its end
        report = dataclasses.replace(report, seconds=_elapsed())
    text = ""
    if statistics:
        from ckptdoctor.render.report import render_statistics, statistics_json

        if fmt == "json":
            import json

            text = json.dumps(statistics_json(report, pieces), indent=2, allow_nan=False)
        else:
            text = render_statistics(report, width)
    elif fmt == "json":  # written as it is made: a fleet's document is never held whole
        emit_chunks(json_chunks(report, pieces), output_file, silent)
    elif fmt == "sarif":
        from ckptdoctor.render.sarif import render_sarif

        text = render_sarif(report.findings)
    elif fmt == "github":
        from ckptdoctor.render.report import summary_line
        from ckptdoctor.render.sarif import render_github

        text = render_github(report.findings, notice=summary_line(report))
    else:
        text = render_text(report, color=color, width=width, quiet=quiet, clock=_elapsed, pieces=pieces)
    if statistics or fmt != "json":
        emit(text, output_file, silent)
    if checksums == "write":
        _write_manifests(report.trees)
    _exit(report, checksums)


def _exit(report: Report, checksums: str | None) -> NoReturn:
    """Exit with the report's code, under its exit policy."""
    code = report.exit_status(on_security_kept=note_security)
    if checksums != "write":
        read_only_done()
    sys.exit(code)


def _summary_json(report: Report, pieces: RunPieces) -> str:
    """The last line of ``--format jsonl``: the ``ckptdoctor.summary/1`` object (the JSON report without its runs
    and findings, which came before it)."""
    import json

    from ckptdoctor.render.report import SUMMARY_SCHEMA, to_json

    doc = to_json(report, pieces)
    del doc["runs"], doc["findings"]
    return json.dumps({**doc, "schema": SUMMARY_SCHEMA}, allow_nan=False)


def _sink(lines: Lines, pieces: RunPieces) -> PartSink:
    """``api.scan_roots``'s ``on_part`` for ``--format jsonl``: each part's findings written as
    ``ckptdoctor.finding/1`` lines as the part is judged, and its runs kept in ``pieces``."""
    import json

    from ckptdoctor.findings import finding_json
    from ckptdoctor.render.report import FINDING_SCHEMA

    def take(index: int, tree: Tree, findings: list[Finding]) -> None:
        pieces.add(index, tree, findings)
        for f in findings:
            lines.write(json.dumps({"schema": FINDING_SCHEMA, **finding_json(f)}, allow_nan=False))

    return take


def _elapsed() -> float:
    """Seconds since the command began (``cli.started``): what the report says the scan took."""
    from ckptdoctor.cli import started

    return time.monotonic() - started()


def _scan(
    roots: Roots,
    options: Options,
    jobs: int | None,
    deep: bool,
    checksums: str | None,
    on_part: PartSink | None = None,
    dask_address: str | None = None,
    cache: bool | None = False,
) -> Report:
    """``api.scan_roots`` with the command line's progress; a missing numpy for ``--deep`` is a usage error.
    ``on_part`` keeps what the report needs of each run as the scan goes (``api.scan_roots``); ``dask_address``
    reads the runs on that Dask scheduler's workers (``fanout.DaskFanOut``)."""
    from ckptdoctor.api import scan_roots
    from ckptdoctor.progress import progress_stream

    def run(fanout: DaskFanOut | None = None) -> Report:
        return scan_roots(
            roots, options, deep=deep, jobs=jobs, checksums=checksums, progress=progress_stream(), on_part=on_part,
            fanout=fanout, cache=cache,
        )

    if dask_address is not None:
        from ckptdoctor.fanout import DaskFanOut

        client = _dask_client(dask_address)
        try:
            return run(DaskFanOut(client))
        finally:
            client.close()
    if not deep:
        return run()
    from ckptdoctor.deep import DeepUnavailable  # only --deep pays for this import

    try:
        return run()
    except DeepUnavailable as exc:
        raise UsageProblem(str(exc)) from None


def _dask_client(address: str) -> Any:
    """A ``distributed.Client`` of the scheduler at ``address``; exit 2 when Dask is missing or the scheduler cannot
    be reached (within ``distributed.comm.timeouts.connect``, 30 s unless Dask's configuration says otherwise)."""
    try:
        from distributed import Client
    except ImportError:
        raise UsageProblem('--dask needs Dask\'s distributed: pip install "ckptdoctor[dask]"') from None
    try:
        return Client(address, set_as_default=False)  # type: ignore[no-untyped-call]
    except (OSError, TimeoutError, ValueError) as exc:  # refused, unknown host, timed out, not an address
        raise UsageProblem(f"--dask {address}: cannot reach the Dask scheduler: {exc}") from None


def _check_special_roots(roots: Roots) -> Roots:
    """A root that is a FIFO, socket or device is a usage error (exit 2), not a checkpoint with a finding in it:
    ``scanner.check_roots``, whose refusals are said as usage errors; the roots come back checked."""
    from ckptdoctor.scanner import check_roots

    try:
        return check_roots(roots)
    except OSError as exc:  # removed since click checked it, or unreadable: the root cannot be scanned
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise UsageProblem(f"{exc.filename}: {why}") from None
    except ValueError as exc:  # its message names the root
        raise UsageProblem(str(exc)) from None


def _write_manifests(trees: Sequence[Tree]) -> None:
    """Write each root's manifest (through the fixer, the only writer) and say so on stderr."""
    from ckptdoctor.deep import manifest_document
    from ckptdoctor.fixer import write_manifest

    for tree in trees:
        doc, missed = manifest_document(tree, __version__)
        where = write_manifest(tree.root, doc)
        click.echo(f"wrote {where}: sha256 of {len(doc['files'])} files", err=True)
        if missed:
            shown = ", ".join(missed[:5]) + (f" and {len(missed) - 5} more" if len(missed) > 5 else "")
            click.echo(f"not in the manifest (could not be read whole, see CKD213): {shown}", err=True)


def check_remote_roots(roots: Roots, deep: bool) -> None:
    """Stand in for click's existence check on URL roots (one listing request each): exit 2 with the reason."""
    for p in roots:
        if not roots.url(p):
            continue
        from ckptdoctor.sources.fsspec import check_remote_root, log_on_one_line  # only a URL root pays for it

        log_on_one_line()
        if deep:
            raise UsageProblem(f"{p}: --deep reads every tensor byte and works on local files only; drop --deep")
        from ckptdoctor.progress import Waiting, progress_stream

        with Waiting(progress_stream(), f"listing {p} (a backend may retry for a while)"):
            why = check_remote_root(p)
        if why is not None:
            raise UsageProblem(why)
