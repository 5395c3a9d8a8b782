"""The ``ckptdoctor`` command line: scan | fix | undo | gate | inspect | rules | explain | cache.

The commands parse, call the library, render and map exits; each lives in its module (``cli.scan``, ``cli.inspect``,
``cli.rules``: rules and explain, ``cli.fix``: fix and undo), what they share in ``cli.options``. A command's module
is imported only when it runs (or ``--help`` lists it). stdout carries the report (and nothing else with ``--format
json``); stderr carries progress, notes and usage errors. Exit codes: 0 clean, 1 findings at or above ``--fail-on``,
2 usage error (the library's ``UsageError``), bad settings file, or a root that is missing, unreadable or not a
folder or regular file (``scanner.check_roots``, through ``cli.options.ScanRoot``).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
import time
from typing import Any, ClassVar

import click

from ckptdoctor.cli import options
from ckptdoctor.cli.options import UsageProblem
from ckptdoctor.errors import UsageError
from ckptdoctor.version import __version__

# The time a command reports is the whole of it, through the last line rendered (a 5,000-checkpoint table took
# longer to print than the scan), not the library's scan alone: it starts when this module was imported for the
# first command of a process (the console script), at the command's own start for any later one (tests, in-process
# callers). ``started()`` gives it to the command.
_IMPORTED: float | None = time.monotonic()
STARTED_KEY = "ckptdoctor.started"


def started() -> float:
    """When the running command began (``time.monotonic()``), as ``LazyGroup.invoke`` noted it."""
    ctx = click.get_current_context(silent=True)
    value = None if ctx is None else ctx.find_root().meta.get(STARTED_KEY)
    return time.monotonic() if value is None else float(value)

__all__ = ["LazyGroup", "main", "run"]


def run() -> None:
    """The console entry point (``ckptdoctor``, ``python -m ckptdoctor``): ``main``, then a fast exit.

    A big scan leaves millions of small frozen objects; freeing them one by one at interpreter exit took 0.25 s of
    a 2 s scan of a 100-checkpoint 7B run. After a read-only command the exit handlers run, the output is flushed
    and the process ends at once (no file of ours is open); after anything else, or an error, Python exits as
    usual.

    The cyclic garbage collector is off for the command's process: a scan pauses it anyway (``scanner``), and the
    passes it made over the modules a command imports and the report it renders were 4 % of a warm rescan of a
    100-checkpoint run (bench/RESULTS.md). Reference counting frees what a command drops; what must collect cycles
    while a scan runs (the S3 source's request garbage) calls ``gc.collect`` itself. Only this entry point does it:
    a library caller's collector is left as it is.
    """
    gc.disable()
    try:
        main(prog_name="ckptdoctor")
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code
        if not options.fast_exit or not isinstance(code, int):
            raise
        atexit._run_exitfuncs()  # what Python runs at exit (logging, coverage.py ...), without the teardown
        for stream in (sys.stdout, sys.stderr):
            if stream is None:  # started with the descriptor closed (`ckptdoctor scan run >&-`)
                continue
            with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more can be said
                stream.flush()
        os._exit(code)

class LazyGroup(click.Group):
    """A click group whose heavier subcommands are imported only when used, so start-up stays instant."""

    # Every command: `ckptdoctor --version` (and a command's parsing) builds only the command it runs.
    lazy: ClassVar[dict[str, str]] = {
        "scan": "ckptdoctor.cli.scan:scan",
        "inspect": "ckptdoctor.cli.inspect:inspect",
        "rules": "ckptdoctor.cli.rules:rules_cmd",
        "explain": "ckptdoctor.cli.rules:explain",
        "fix": "ckptdoctor.cli.fix:fix_command",
        "undo": "ckptdoctor.cli.fix:undo_command",
        "gate": "ckptdoctor.cli.gate:gate_command",
        "cache": "ckptdoctor.cli.cache:cache_group",
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy])

    def invoke(self, ctx: click.Context) -> Any:
        global _IMPORTED
        ctx.meta[STARTED_KEY] = _IMPORTED if _IMPORTED is not None else time.monotonic()
        _IMPORTED = None
        try:
            return super().invoke(ctx)
        except UsageError as exc:  # the library's plain error: said as click says a usage problem, exit 2
            raise UsageProblem(str(exc)) from None
        except KeyboardInterrupt:
            # click would say "Aborted!" and exit 1, which scripts read as "findings": 130 is the shell's code for
            # SIGINT. The interrupt has unwound through every cleanup (the fixer's lock and journal) by now.
            click.echo("Interrupted.", err=True)
            ctx.exit(130)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        cmd: click.Command | None
        if cmd_name in self.lazy:
            import importlib

            module, attr = self.lazy[cmd_name].split(":")
            cmd = getattr(importlib.import_module(module), attr)
            assert isinstance(cmd, click.Command)
        else:
            cmd = super().get_command(ctx, cmd_name)
        if cmd is not None:  # its --help fits the terminal as the group's does
            cmd.context_class = options.FittingContext
        return cmd

_EPILOG_MAIN = """\b
Examples:
  ckptdoctor scan runs/my-run/                      # what would go wrong if you resumed now?
  ckptdoctor fix --dry-run runs/my-run/             # what fix would change (writes nothing)
  ckptdoctor gate runs/my-run --num-train-epochs 3  # what will this resume load, train, and at which LRs?
  ckptdoctor explain CKD201                         # why a finding matters and how to fix it

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

main.context_class = options.FittingContext





if __name__ == "__main__":  # pragma: no cover
    main()
