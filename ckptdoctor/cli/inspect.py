"""The ``inspect`` command: what the readers see in one file."""

from __future__ import annotations

import json
import os

import click

from ckptdoctor.cli.options import ScanRoot, text_or_json

_EPILOG_INSPECT = """\b
Examples:
  ckptdoctor inspect runs/my-run/checkpoint-8/model.safetensors   # tensor names, dtypes, shapes, metadata
  ckptdoctor inspect runs/my-run/checkpoint-8/scheduler.pt        # the pickled values (last_epoch, base_lrs...)
  ckptdoctor inspect --format json runs/my-run/checkpoint-8/optimizer.pt | jq '.globals'

Exit codes: 0 the file was read (what could not be decoded is listed under "problems"), 2 usage error (no such
file, a folder: scan folders, or not a regular file).
"""


@click.command(
    epilog=_EPILOG_INSPECT, short_help="Show what the readers see in one file (tensors, pickle values)."
)
@click.argument("file", type=ScanRoot(remote=False, dir_okay=False))
@text_or_json(
    "text: a tensor table, or the pickle's values and globals, then any problems; json: the same as one document."
)
def inspect(file: str, fmt: str) -> None:
    """Show what the readers see in one FILE: tensors, or a pickle's plain values and imported globals.

    Nothing is loaded or executed: safetensors headers are parsed, pickles are walked statically. Use it to see
    why a finding was raised; `ckptdoctor scan` does the checking.
    """
    from ckptdoctor.inspection import inspect_file
    from ckptdoctor.render.inspect import render_inspect_text
    from ckptdoctor.render.report import printable

    if not os.path.isfile(file):  # a FIFO or device: opening it could block, and there is nothing to describe
        raise click.BadParameter(f"'{printable(file)}' is not a regular file.", param_hint="'FILE'")
    data = inspect_file(file)
    if fmt == "json":
        click.echo(json.dumps(data, indent=2, allow_nan=False, default=str))
    else:
        import sys

        from ckptdoctor.cli.options import terminal_width

        click.echo(render_inspect_text(data, terminal_width(sys.stdout)))
