"""ckptdoctor: an fsck for machine-learning training checkpoints."""

from __future__ import annotations

__version__ = "0.1.0"
