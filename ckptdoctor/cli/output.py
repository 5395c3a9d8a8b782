"""Where a command's report goes: stdout, or the file ``--output-file`` names (the one file a read-only command
writes, as a shell's ``> PATH`` would; never a checkpoint's)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, TextIO

import click

from ckptdoctor.cli.options import UsageProblem, read_only_done

if TYPE_CHECKING:
    from ckptdoctor.settings.selection import Options


def emit(text: str, output_file: str | None, silent: bool) -> None:
    """The report to ``output_file`` (UTF-8, with a final newline, as stdout gets it), else to stdout unless
    ``silent``; an empty report (``-q`` with nothing found) is no line at all. A file that cannot be written is a
    usage error (exit 2)."""
    emit_chunks([text] if text else [], output_file, silent)


def emit_chunks(chunks: Iterable[str], output_file: str | None, silent: bool) -> None:
    """``emit`` of a report made in pieces (``render.report.json_chunks``), written as they are made (``BATCH``
    characters at a time, about), so the whole text is never held: the same bytes as ``emit("".join(chunks), ...)``."""
    if output_file is not None:
        try:
            with open(output_file, "w", encoding="utf-8") as out:
                _write(chunks, out.write)
        except OSError as exc:
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            raise UsageProblem(f"--output-file {output_file}: {why}") from None
    elif not silent:
        _write(chunks, lambda text: click.echo(text, nl=False))


# What the report is written in: a batch joined into one string, then encoded once more by the stream, is held twice
# at the peak of a fleet's scan (measured on 1,000 runs x 10 checkpoints in S3: a 1 MB batch put the peak 2.7 MB
# above the scan's own, bench/RESULTS.md); 64 KB costs a few hundred more writes on a 30 MB report.
BATCH = 1 << 16


def _write(chunks: Iterable[str], write: Callable[[str], object]) -> None:
    """``chunks`` through ``write`` about ``BATCH`` characters at a time (one chunk larger than that whole), then a
    newline when there was any text."""
    batch: list[str] = []
    size = 0
    wrote = False
    for chunk in chunks:
        batch.append(chunk)
        size += len(chunk)
        if size >= BATCH:
            write("".join(batch))
            batch, size, wrote = [], 0, True
    if wrote or any(batch):
        write("".join(batch) + "\n")


class Lines:
    """Where ``--format jsonl`` writes its lines as they come: ``--output-file`` (a file that cannot be written is
    a usage error, before the scan), else stdout unless ``--silent``; each line is flushed, so a pipeline reads a
    run's findings while the next run is scanned."""

    def __init__(self, output_file: str | None, silent: bool) -> None:
        self.output_file = output_file
        self.silent = silent
        self.out: TextIO | None = None

    def __enter__(self) -> Lines:
        if self.output_file is not None:
            try:
                self.out = open(self.output_file, "w", encoding="utf-8")  # closed by __exit__
            except OSError as exc:
                why = os.strerror(exc.errno) if exc.errno else str(exc)
                raise UsageProblem(f"--output-file {self.output_file}: {why}") from None
        elif not self.silent:
            self.out = sys.stdout
        return self

    def __exit__(self, *exc: object) -> None:
        if self.out is not None and self.out is not sys.stdout:
            self.out.close()

    def write(self, line: str) -> None:
        if self.out is not None:
            self.out.write(line + "\n")
            self.out.flush()


def print_settings(
    paths: Sequence[str],
    fmt: str,
    options: Options,
    *,
    nested: bool = True,
    output_file: str | None = None,
    silent: bool = False,
) -> None:
    """``--show-settings``: print each root's settings (``settings.selection.show_settings``) and exit 0, written as
    every report is (``output.emit``: to ``output_file``, or nothing with ``silent``); a settings file that cannot be
    used is a usage error, as when checking."""
    import sys

    from ckptdoctor.errors import UsageError
    from ckptdoctor.render.settings import render_settings_text, settings_json
    from ckptdoctor.settings.selection import show_settings

    try:
        found = show_settings(paths, options, nested=nested)
    except UsageError as exc:
        raise UsageProblem(str(exc)) from None
    fail_on = options.fail_on
    emit(settings_json(found, fail_on) if fmt == "json" else render_settings_text(found, fail_on), output_file, silent)
    read_only_done()
    sys.exit(0)
