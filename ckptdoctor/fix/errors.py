"""The fixer's refusals: ``FixRefused`` (exit code 2, no traceback) and ``ConcurrentChange``."""

from __future__ import annotations

import click


class FixRefused(click.ClickException):
    """The fixer will not (or could not) act: printed without a traceback, exit code 2 like a usage error."""

    exit_code = 2


class ConcurrentChange(FixRefused):
    """Another process wrote a path while the fixer was changing it; the fixer left that process's bytes alone."""


def _changed_msg(rel: str) -> str:
    return f"`{rel}` was written by another process during the fix; it is left as that process wrote it"
