"""The data files shipped inside the package (``[tool.setuptools.package-data]`` in pyproject.toml), read as text."""

from __future__ import annotations

import os
import sys


def read_text(package: str, name: str) -> str:
    """The UTF-8 text of the data file ``name`` of ``package`` (an imported package); ``OSError`` when it is missing.

    Read from the folder the package was imported from, as ``importlib.resources`` does for a package on disk, but
    without importing it: ``importlib.resources`` brings ``tempfile``, ``shutil``, ``zipfile``, ``bz2`` and ``lzma``
    into every scan that judges a pickle. A package imported from elsewhere (a zip) goes through it.
    """
    where = getattr(sys.modules[package], "__file__", None)
    folder = os.path.dirname(where) if where else ""
    if folder and os.path.isdir(folder):
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            return f.read()
    from importlib import resources

    return resources.files(package).joinpath(name).read_text("utf-8")
