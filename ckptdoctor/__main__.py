"""``python -m ckptdoctor`` runs the command line."""

from __future__ import annotations

from ckptdoctor.cli import run

run()
