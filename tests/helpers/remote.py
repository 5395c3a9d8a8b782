"""fsspec settings for the remote-root tests: a backend pointed at a server on loopback for the length of a block."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def fsspec_setting(protocol: str, value: dict[str, Any], fs_class: Any) -> Iterator[None]:
    """fsspec's settings for ``protocol`` set to ``value`` (as a user points a backend at an endpoint), and the
    backend's cached file systems (``fs_class``'s) dropped on the way in and out, so none built under the settings
    outlives the block; the settings before are put back."""
    import fsspec.config

    old = fsspec.config.conf.get(protocol)
    fsspec.config.conf[protocol] = value
    fs_class.clear_instance_cache()
    try:
        yield
    finally:
        if old is None:
            fsspec.config.conf.pop(protocol, None)
        else:
            fsspec.config.conf[protocol] = old
        fs_class.clear_instance_cache()
