"""The ``ckptdoctor`` command line: scan | fix | undo | gate | inspect | rules | explain.

``scan``, ``inspect``, ``rules`` and ``explain`` live here; ``fix`` and ``undo`` (``ckptdoctor.fix``) and ``gate``
(``ckptdoctor.gate``) are imported only when used. stdout carries the report (and nothing else with
``--format json``); stderr carries progress, notes and usage errors. Exit codes: 0 clean, 1 findings at or above
``--fail-on``, 2 usage error, bad settings file, or a root that is missing or not a folder or regular file.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import click

from ckptdoctor import __version__

if TYPE_CHECKING:
    from ckptdoctor.model import Tree
    from ckptdoctor.rules import Selection
    from ckptdoctor.scanner import Report

_EPILOG_SCAN = """\b
Examples:
  ckptdoctor scan runs/my-run/                 # before resume_from_checkpoint=True
  ckptdoctor scan runs/my-run/checkpoint-800   # before resume_from_checkpoint="...checkpoint-800"
  ckptdoctor scan --format json runs/ | jq '.findings[] | select(.severity == "error")'
  ckptdoctor scan --select CKD2 --fail-on warning model/
  ckptdoctor scan --ignore CKD206,CKD404 runs/my-run/
  ckptdoctor scan --format sarif --fail-on never runs/my-run/ > ckptdoctor.sarif   # report, never fail
  ckptdoctor scan s3://bucket/runs/my-run/     # object storage through fsspec (pip install "ckptdoctor[remote]")
  ckptdoctor scan --deep --checksums write runs/a/checkpoint-800   # then, on the copy:
  ckptdoctor scan --deep --checksums verify /mnt/copy/checkpoint-800

\b
Exit codes: 0 nothing at or above --fail-on, 1 findings at or above it, 2 usage error, bad settings file, or a
root that is missing or not a folder or regular file (a FIFO, socket or device). A corrupt file inside a root is
a finding, not 2.

\b
Settings: each root may hold a .ckptdoctor.toml (keys at the top level) or a pyproject.toml with the same keys
under [tool.ckptdoctor]; .ckptdoctor.toml wins when both exist, and each root is judged by its own:
  select = ["CKD1", "CKD2"]   ignore = ["CKD206"]   fail-on = "warning"   [severity] CKD404 = "warning"
An unknown code there is exit 2, as on the command line. A settings file cannot turn off or lower the security
rules (CKD6xx), nor let their errors pass with fail-on = "never"; --ignore and --fail-on here can.
"""


class UsageProblem(click.ClickException):
    """A usage error or unusable input: printed without a traceback, exit code 2 (findings use 1)."""

    exit_code = 2


class ScanRoot(click.Path):
    """A local path that must exist, or a URL root (``s3://``, ``gs://``, ``hf://``...) passed on for fsspec."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from ckptdoctor.sources import is_remote  # only when a command parses its roots: --version stays instant

        if isinstance(value, str) and is_remote(value):
            return value
        return super().convert(value, param, ctx)


def split_codes(values: Sequence[str]) -> tuple[str, ...]:
    """Rule codes from repeated and comma-separated ``--select``/``--ignore`` values, upper-cased; a rule's name
    (``stub-weights-shadow-adapter``, as ``ckptdoctor explain`` takes it) stands for its code."""
    from ckptdoctor.config import rule_codes

    return rule_codes(p for v in values for p in v.split(",") if p.strip())


def _check_codes(codes: Sequence[str], option: str) -> None:
    """A usage error (exit 2) for a code or prefix that matches no rule (``config.rule_patterns`` decides)."""
    from ckptdoctor.config import UnknownRule, rule_patterns

    try:
        rule_patterns(codes)
    except UnknownRule as exc:
        c = exc.pattern
        raise UsageProblem(f"{option} {c}: no rule code starts with {c!r} (see `ckptdoctor rules`)") from None


def selection_groups(
    paths: Sequence[str], select: Sequence[str], ignore: Sequence[str], no_config: bool
) -> list[tuple[list[str], Selection, str | None]]:
    """The roots grouped by the selection and fail-on their own settings files give (``resolve_selection``).

    Each root is judged by its own settings file: one may travel with each checkpoint, so the first root's must not
    decide what the others are checked or fixed for. Neighbouring roots with the same settings share a group.
    """
    groups: list[tuple[list[str], Selection, str | None]] = []
    for p in paths:
        selection, cfg_fail_on = resolve_selection([p], select, ignore, no_config)
        if groups and groups[-1][1:] == (selection, cfg_fail_on):
            groups[-1][0].append(p)
        else:
            groups.append(([p], selection, cfg_fail_on))
    return groups


def resolve_selection(
    paths: Sequence[str],
    select: Sequence[str],
    ignore: Sequence[str],
    no_config: bool,
    *,
    on_kept: Callable[[str, Sequence[str]], None] | None = None,
) -> tuple[Selection, str | None]:
    """The rule selection from --select/--ignore plus the settings file at ``paths[0]``, and that file's fail-on.

    Shared by every command that runs rules, so they all read options and configuration the same way. When the
    settings file tries to turn off or lower security rules, ``on_kept(source, codes)`` is told which stay on (the
    Python API words its own warning); without it the command-line note goes to stderr.
    """
    from ckptdoctor.config import Config, ConfigError, load_config, rule_codes
    from ckptdoctor.rules import Selection, keep_security_rules

    sel_codes, ign_codes = split_codes(select), split_codes(ignore)
    for option, given, parsed in (("--select", select, sel_codes), ("--ignore", ignore, ign_codes)):
        if given and not parsed:  # `--select ""` (an unset variable in a script) must not mean every rule
            raise UsageProblem(f"{option} was given no rule code")
    _check_codes(sel_codes, "--select")
    _check_codes(ign_codes, "--ignore")
    try:
        cfg = Config() if no_config else load_config(paths[0])
    except ConfigError as exc:
        raise UsageProblem(str(exc)) from None
    # A typo in a settings file must not select nothing (a clean scan that checked nothing): as on the command line.
    cfg = dataclasses.replace(cfg, select=rule_codes(cfg.select), ignore=rule_codes(cfg.ignore))
    _check_codes(cfg.select, f"{cfg.source}: select")
    _check_codes(cfg.ignore, f"{cfg.source}: ignore")
    from ckptdoctor.rules import all_rules

    codes = {r.code for r in all_rules()}
    for code in cfg.severity:
        if code not in codes:  # overrides apply to exact codes only: a prefix would silently change nothing
            raise UsageProblem(f"{cfg.source}: severity {code}: not a rule code (see `ckptdoctor rules`)")
    selection = Selection(select=sel_codes or cfg.select, ignore=ign_codes + cfg.ignore, severity=dict(cfg.severity))
    if cfg.source is not None:
        selection, kept = keep_security_rules(selection, Selection(select=sel_codes, ignore=ign_codes))
        if kept and on_kept is not None:
            on_kept(str(cfg.source), kept)
        elif kept:
            click.echo(
                f"ckptdoctor: {cfg.source} may not turn off or lower security rules ({', '.join(kept)}): they stay "
                "on (a settings file in a scanned folder can come from whoever made the checkpoint); use --ignore "
                "on the command line to turn one off.",
                err=True,
            )
    return selection, cfg.fail_on


# Set by a command that wrote nothing, once its output is out: ``run`` may then end the process without tearing
# down the interpreter (see ``run``).
_fast_exit = False


def _read_only_done() -> None:
    global _fast_exit
    _fast_exit = True


def run() -> None:
    """The console entry point (``ckptdoctor``, ``python -m ckptdoctor``): ``main``, then a fast exit.

    A big scan leaves millions of small frozen objects; freeing them one by one at interpreter exit took 0.25 s of
    a 2 s scan of a 100-checkpoint 7B run. After a read-only command the exit handlers run, the output is flushed
    and the process ends at once (no file of ours is open); after anything else, or an error, Python exits as
    usual.
    """
    try:
        main(prog_name="ckptdoctor")
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code
        if not _fast_exit or not isinstance(code, int):
            raise
        atexit._run_exitfuncs()  # what Python runs at exit (logging, coverage.py ...), without the teardown
        for stream in (sys.stdout, sys.stderr):
            if stream is None:  # started with the descriptor closed (`ckptdoctor scan run >&-`)
                continue
            with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more can be said
                stream.flush()
        os._exit(code)


def text_or_json(help_text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The ``--format text|json`` option (default text, passed as ``fmt``) with its own help."""
    return click.option(
        "--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True, help=help_text
    )


def rule_options(
    *, never_runs: str, every_rule: str, root: str = "the root", each_root: str = "each root"
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--fail-on``, ``--select``, ``--ignore`` and ``--no-config`` (passed as ``fail_on``, ``select``, ``ignore``,
    ``no_config``) of a command that runs rules under a root's settings file (``resolve_selection``).

    ``never_runs`` says which selections are usage errors for the command, ``every_rule`` what runs by default;
    ``root`` and ``each_root`` name the folder whose settings file counts.
    """
    options = (
        click.option(
            "--fail-on",
            type=click.Choice(["error", "warning", "info", "never"]),
            default=None,
            help="Exit 1 when a finding has this severity or worse; never: always exit 0 unless the input is "
            f"unusable.  [default: {root}'s settings file's fail-on, else error]",
        ),
        click.option(
            "--select",
            multiple=True,
            metavar="CODES",
            help="Run only these rules: codes, prefixes or names, comma-separated or repeated (CKD2,CKD601). "
            f"{never_runs}  [default: the settings file's select, else {every_rule}]",
        ),
        click.option(
            "--ignore",
            multiple=True,
            metavar="CODES",
            help="Skip these rules (codes or prefixes), added to the settings file's ignore; unlike a settings file, "
            "this can turn off security rules (CKD6xx).  [default: none]",
        ),
        click.option(
            "--no-config",
            is_flag=True,
            help=f"Ignore the settings file at {each_root} (.ckptdoctor.toml, or [tool.ckptdoctor] in "
            "pyproject.toml).",
        ),
    )

    def apply(func: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):  # decorators apply bottom-up: this keeps the listed order in --help
            func = option(func)
        return func

    return apply


class LazyGroup(click.Group):
    """A click group whose heavier subcommands are imported only when used, so start-up stays instant."""

    lazy: ClassVar[dict[str, str]] = {
        "fix": "ckptdoctor.fix:fix_command",
        "undo": "ckptdoctor.fix:undo_command",
        "gate": "ckptdoctor.gate:gate_command",
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy])

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            # click would say "Aborted!" and exit 1, which scripts read as "findings": 130 is the shell's code for
            # SIGINT. The interrupt has unwound through every cleanup (the fixer's lock and journal) by now.
            click.echo("Interrupted.", err=True)
            ctx.exit(130)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy:
            import importlib

            module, attr = self.lazy[cmd_name].split(":")
            cmd = getattr(importlib.import_module(module), attr)
            assert isinstance(cmd, click.Command)
            return cmd
        return super().get_command(ctx, cmd_name)


def _use_color(stream: Any) -> bool:
    """Colour only on a terminal that can show it: not with NO_COLOR set (no-color.org), nor with TERM=dumb."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


_EPILOG_MAIN = """\b
Examples:
  ckptdoctor scan runs/my-run/                      # what would go wrong if you resumed now?
  ckptdoctor fix --dry-run runs/my-run/             # what fix would change (writes nothing)
  ckptdoctor gate runs/my-run --num-train-epochs 3  # what will this resume load, train, and at which LRs?
  ckptdoctor explain CKD201                         # why a finding matters and how to fix it

\b
Exit codes: 0 nothing at or above --fail-on, 1 findings at or above it, 2 usage error or unusable input.
"""


@click.group(
    cls=LazyGroup,
    epilog=_EPILOG_MAIN,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
)
@click.version_option(__version__, "-V", "--version", prog_name="ckptdoctor")
def main() -> None:
    """An fsck for training checkpoints: find what would make a resume go silently wrong.

    Reading never executes: pickles are walked opcode by opcode, never loaded, and only headers are read.
    Start with `ckptdoctor scan OUTPUT_DIR`; `ckptdoctor rules` lists what is checked. `COMMAND --help` shows a
    command's options, defaults and examples.
    """


@main.command(epilog=_EPILOG_SCAN, short_help="Check checkpoint folders, files or URLs for resume hazards.")
@click.argument("paths", nargs=-1, required=True, type=ScanRoot(exists=True, file_okay=True, dir_okay=True))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json", "sarif", "github"]),
    default="text",
    show_default=True,
    help="text: tables and findings for people; json: one ckptdoctor.report/1 document for scripts; "
    "sarif: SARIF 2.1.0 for code scanning; github: workflow annotation lines.",
)
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
def scan(
    paths: tuple[str, ...],
    fmt: str,
    fail_on: str | None,
    select: tuple[str, ...],
    ignore: tuple[str, ...],
    no_config: bool,
    jobs: int | None,
    deep: bool,
    checksums: str | None,
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
    from ckptdoctor.discover import unique_roots
    from ckptdoctor.report import printable, render_json, render_text
    from ckptdoctor.scanner import Report

    paths = tuple(unique_roots(paths))  # `scan X X` (or `X ./X/`) scans X once, as ruff does
    _check_remote_roots(paths, deep)
    _check_special_roots(paths)
    check_runnable(split_codes(select), deep)
    groups = selection_groups(paths, select, ignore, no_config)
    if checksums is not None:
        _check_checksums(paths, checksums, deep)
    parts = [(_scan_roots(ps, sel, jobs, deep, checksums), cfg) for ps, sel, cfg in groups]
    report = Report(
        tuple(t for r, _ in parts for t in r.trees),
        tuple(f for r, _ in parts for f in r.findings),
        sum(r.seconds for r, _ in parts),
    )
    if fmt == "json":
        click.echo(render_json(report))
    elif fmt == "sarif":
        from ckptdoctor.sarif import render_sarif

        click.echo(render_sarif(report.findings))
    elif fmt == "github":
        from ckptdoctor.report import summary_line
        from ckptdoctor.sarif import render_github

        click.echo(render_github(report.findings, notice=summary_line(report)))
    else:
        click.echo(render_text(report, color=_use_color(sys.stdout)))
    for tree in report.trees:
        if not any(True for _ in tree.all_files()):  # a mistyped $OUTPUT_DIR must not pass a CI gate unnoticed
            click.echo(f"ckptdoctor: warning: no files under {printable(tree.root)}: nothing was checked", err=True)
    if checksums == "write":
        _write_manifests(report.trees)
    code = max(_exit_code(r, fail_on, cfg) for r, cfg in parts)
    if checksums != "write":
        _read_only_done()
    sys.exit(code)


def _scan_roots(
    paths: Sequence[str], selection: Selection, jobs: int | None, deep: bool, checksums: str | None
) -> Report:
    """One scan of ``paths`` with one selection; a missing numpy for ``--deep`` is a usage error."""
    from ckptdoctor.progress import progress_stream
    from ckptdoctor.scanner import scan as run_scan

    if not deep:
        return run_scan(list(paths), selection=selection, jobs=jobs, progress=progress_stream())
    from ckptdoctor.deep import DeepUnavailable  # only --deep pays for this import (numpy)

    try:
        return run_scan(
            list(paths), selection=selection, jobs=jobs, deep=True, progress=progress_stream(), checksums=checksums
        )
    except DeepUnavailable as exc:
        raise UsageProblem(str(exc)) from None


def _exit_code(report: Report, fail_on: str | None, cfg_fail_on: str | None) -> int:
    """The exit code of ``report`` under the command line's ``--fail-on``, else its settings file's."""
    code = report.exit_code(fail_on or cfg_fail_on or "error")
    if code == 0 and fail_on is None and cfg_fail_on == "never":
        from ckptdoctor.findings import Severity
        from ckptdoctor.rules import security_codes

        # As with keep_security_rules: a settings file from the scanned folder cannot wave a malicious pickle through.
        security = security_codes()
        if any(f.rule in security and f.severity is Severity.ERROR for f in report.findings):
            click.echo(
                'ckptdoctor: security errors fail the scan even with fail-on = "never" in a settings file; pass '
                "--fail-on never on the command line to override.",
                err=True,
            )
            code = 1
    return code


def check_runnable(codes: Sequence[str], deep: bool) -> None:
    """``--select`` of rules a scan (or fix) never runs (gate-only, or deep-only without ``--deep``) would pass
    silently: a usage error instead."""
    from ckptdoctor.rules import all_rules

    for c in codes:
        matched = [r for r in all_rules() if r.code.startswith(c)]
        if matched and all(r.gate_only for r in matched):
            raise UsageProblem(f"--select {c}: `ckptdoctor gate` runs {c}, a scan never does")
        if matched and not deep and all(r.deep_only or r.gate_only for r in matched):
            raise UsageProblem(f"--select {c}: {c} reads tensor data and runs only with --deep")


def _check_special_roots(paths: Sequence[str]) -> None:
    """A root that is a FIFO, socket or device is a usage error (exit 2), not a checkpoint with a finding in it:
    ``scanner.check_roots``, whose refusals are said as usage errors."""
    from ckptdoctor.scanner import check_roots

    try:
        check_roots(paths)
    except OSError as exc:  # removed since click checked it, or unreadable: the root cannot be scanned
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise UsageProblem(f"{exc.filename}: {why}") from None
    except ValueError as exc:  # its message names the root
        raise UsageProblem(str(exc)) from None


def _check_checksums(paths: Sequence[str], mode: str, deep: bool) -> None:
    """Usage errors of ``--checksums``, raised before a long ``--deep`` read rather than after it."""
    if not deep:
        raise UsageProblem(f"--checksums {mode} needs --deep: checksums are computed while --deep reads every byte")
    for p in paths:
        if not os.path.isdir(p):
            raise UsageProblem(f"--checksums {mode}: {p} is not a folder (the manifest lives at a folder's root)")
    if mode == "write":
        from ckptdoctor.fix import manifest_refusal

        for p in paths:
            why = manifest_refusal(p)
            if why is not None:
                raise UsageProblem(f"--checksums write: {why}")
    else:
        from ckptdoctor.deep import MANIFEST_PATH, manifest_exists

        for p in paths:
            if not manifest_exists(p):
                raise UsageProblem(
                    f"--checksums verify: {p} has no {MANIFEST_PATH}; write one with `--deep --checksums write`"
                )


def _write_manifests(trees: Sequence[Tree]) -> None:
    """Write each root's manifest (through the fixer, the only writer) and say so on stderr."""
    from ckptdoctor.deep import manifest_document
    from ckptdoctor.fix import write_manifest

    for tree in trees:
        doc, missed = manifest_document(tree, __version__)
        where = write_manifest(tree.root, doc)
        click.echo(f"wrote {where}: sha256 of {len(doc['files'])} files", err=True)
        if missed:
            shown = ", ".join(missed[:5]) + (f" and {len(missed) - 5} more" if len(missed) > 5 else "")
            click.echo(f"not in the manifest (could not be read whole, see CKD213): {shown}", err=True)


def _check_remote_roots(paths: Sequence[str], deep: bool) -> None:
    """Stand in for click's existence check on URL roots (one listing request each): exit 2 with the reason."""
    from ckptdoctor.sources import is_remote
    from ckptdoctor.sources.fsspec import check_remote_root, log_on_one_line

    for p in paths:
        if not is_remote(p):
            continue
        log_on_one_line()
        if deep:
            raise UsageProblem(f"{p}: --deep reads every tensor byte and works on local files only; drop --deep")
        from ckptdoctor.progress import Waiting, progress_stream

        with Waiting(progress_stream(), f"listing {p} (a backend may retry for a while)"):
            why = check_remote_root(p)
        if why is not None:
            raise UsageProblem(why)


_EPILOG_INSPECT = """\b
Examples:
  ckptdoctor inspect runs/my-run/checkpoint-8/model.safetensors   # tensor names, dtypes, shapes, metadata
  ckptdoctor inspect runs/my-run/checkpoint-8/scheduler.pt        # the pickled values (last_epoch, base_lrs...)
  ckptdoctor inspect --format json runs/my-run/checkpoint-8/optimizer.pt | jq '.globals'

\b
Exit codes: 0 the file was read (what could not be decoded is listed under "problems"), 2 usage error (no such
file, a folder: scan folders, or not a regular file).
"""


@main.command(
    epilog=_EPILOG_INSPECT, short_help="Show what the readers see in one file (tensors, pickle values)."
)
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@text_or_json(
    "text: a tensor table, or the pickle's values and globals, then any problems; json: the same as one document."
)
def inspect(file: str, fmt: str) -> None:
    """Show what the readers see in one FILE: tensors, or a pickle's plain values and imported globals.

    Nothing is loaded or executed: safetensors headers are parsed, pickles are walked statically. Use it to see
    why a finding was raised; `ckptdoctor scan` does the checking.
    """
    from ckptdoctor.inspection import inspect_file, render_inspect_text
    from ckptdoctor.report import printable

    if not os.path.isfile(file):  # a FIFO or device: opening it could block, and there is nothing to describe
        raise click.BadParameter(f"'{printable(file)}' is not a regular file.", param_hint="'FILE'")
    data = inspect_file(file)
    if fmt == "json":
        click.echo(json.dumps(data, indent=2, allow_nan=False, default=str))
    else:
        click.echo(render_inspect_text(data))


_EPILOG_RULES = """\b
Examples:
  ckptdoctor rules
  ckptdoctor rules --format json | jq -r '.[] | select(.fixable) | .code'
  ckptdoctor explain CKD201                    # one rule's full document
"""


@main.command(name="rules", epilog=_EPILOG_RULES, short_help="List every rule: code, name, severity, fix safety.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json", "markdown"]),
    default="text",
    show_default=True,
    help="text: a table; json: a list of {code, name, severity, fixable, fix (safe, unsafe or null), deep_only, "
    "gate_only, summary}; markdown: the table the README embeds (it also marks the --deep and gate-only rules).",
)
def rules_cmd(fmt: str) -> None:
    """List every rule: code, name, default severity, whether `ckptdoctor fix` can repair it, and a summary.

    `ckptdoctor explain CODE` prints a rule's full document.
    """
    from ckptdoctor.rules import all_rules, rules_markdown

    rules = all_rules()
    if fmt == "markdown":
        click.echo(rules_markdown())
        return
    if fmt == "json":
        data = [
            {
                "code": r.code,
                "name": r.name,
                "severity": r.severity.value,
                "fixable": r.fixable,
                "fix": r.fix or None,
                "deep_only": r.deep_only,
                "gate_only": r.gate_only,
                "summary": r.summary,
            }
            for r in rules
        ]
        click.echo(json.dumps(data, indent=2))
        return
    from tabulate import tabulate

    rows = [[r.code, r.name, r.severity.value, r.fix, r.summary] for r in rules]
    click.echo(tabulate(rows, headers=["code", "name", "severity", "fix", "summary"], tablefmt="simple"))


_EPILOG_EXPLAIN = """\b
Examples:
  ckptdoctor explain CKD201
  ckptdoctor explain stub-weights-shadow-adapter

\b
Exit codes: 0 printed, 2 no such rule.
"""


@main.command(epilog=_EPILOG_EXPLAIN, short_help="Print one rule's document (by code, e.g. CKD201, or by name).")
@click.argument("rule")
def explain(rule: str) -> None:
    """Print RULE's document (by code, e.g. CKD201, or by name): what it does, why, an example, fix safety.

    Codes and names match in any case; `ckptdoctor rules` lists them all.
    """
    from ckptdoctor.rules import get_rule

    r = get_rule(rule)
    if r is None:
        raise UsageProblem(f"no rule {rule!r} (see `ckptdoctor rules`)")
    import inspect as _inspect

    header = f"{r.code} {r.name} ({r.severity.value}{f', {r.fix} fix' if r.fix else ''})"
    click.echo(header)
    click.echo("=" * len(header))
    click.echo(_inspect.cleandoc(r.doc))


if __name__ == "__main__":  # pragma: no cover
    main()
