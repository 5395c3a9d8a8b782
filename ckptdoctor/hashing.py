"""BLAKE2b without OpenSSL: what the readers' memo of small files and the verdict cache hash with.

``hashlib`` (and ``hmac``) load OpenSSL's library when imported: 13 M instructions, about 3 ms of every scan. The
interpreter's own BLAKE2 module is what ``hashlib.blake2b`` is on CPython; it is taken from ``hashlib`` only where
that module is missing.
"""

from __future__ import annotations

try:
    from _blake2 import blake2b
except ImportError:  # pragma: no cover - an interpreter without CPython's builtin module
    from hashlib import blake2b

__all__ = ["blake2b"]
