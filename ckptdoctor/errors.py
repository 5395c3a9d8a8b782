"""The library's plain exceptions. Only the command line maps them to exit codes (``UsageError``: 2)."""

from __future__ import annotations


class CkptdoctorError(Exception):
    """Base of every error ckptdoctor raises on purpose (not a bug): the message is for the user, whole."""


class UsageError(CkptdoctorError, ValueError):
    """Unusable input or arguments: a bad option value, settings file, root or plan. The command line exits 2."""
