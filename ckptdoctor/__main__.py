"""``python -m ckptdoctor`` runs the command line."""

from __future__ import annotations

from ckptdoctor.cli import main

main(prog_name="ckptdoctor")
