"""Optional integrations with training libraries; each imports its library lazily, only when used."""

from __future__ import annotations
