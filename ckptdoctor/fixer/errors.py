"""The fixer's refusals: ``FixRefused`` (a ``UsageError``: the command line exits 2) and ``ConcurrentChange``."""

from __future__ import annotations

from ckptdoctor.errors import UsageError


class FixRefused(UsageError):
    """The fixer will not (or could not) act; ``str()`` says why. The command line prints it as a usage error and
    exits 2."""


class ConcurrentChange(FixRefused):
    """Another process wrote a path while the fixer was changing it; the fixer left that process's bytes alone."""


def changed_msg(rel: str) -> str:
    """The message for a path another process wrote during the fix."""
    return f"`{rel}` was written by another process during the fix; it is left as that process wrote it"
