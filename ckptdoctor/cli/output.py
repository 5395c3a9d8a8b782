"""Where a command's report goes: stdout, or the file ``--output-file`` names (the one file a read-only command
writes, as a shell's ``> PATH`` would; never a checkpoint's)."""

from __future__ import annotations

import os

import click

from ckptdoctor.cli.options import UsageProblem


def emit(text: str, output_file: str | None, silent: bool) -> None:
    """The report to ``output_file`` (UTF-8, with a final newline, as stdout gets it), else to stdout unless
    ``silent``; an empty report (``-q`` with nothing found) is no line at all. A file that cannot be written is a
    usage error (exit 2)."""
    if output_file is not None:
        try:
            with open(output_file, "w", encoding="utf-8") as out:
                out.write(text + "\n" if text else "")
        except OSError as exc:
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            raise UsageProblem(f"--output-file {output_file}: {why}") from None
    elif text and not silent:
        click.echo(text)
