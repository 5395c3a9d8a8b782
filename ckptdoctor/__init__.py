"""ckptdoctor: an fsck for machine-learning training checkpoints.

The Python API, imported when first used (``import ckptdoctor`` loads nothing else, neither click nor tabulate)::

    import ckptdoctor

    report = ckptdoctor.scan("runs/my-run", fail_on="warning")  # as `ckptdoctor scan --fail-on warning runs/my-run`
    for finding in report.findings:
        print(finding.rule, finding.severity.value, finding.path, finding.message)
    raise SystemExit(report.exit_code())                         # the command's exit code

``scan_many(roots, client=...)`` is ``scan`` with each run read on a Dask cluster (``distributed.Client``);
``iter_scan(roots, client=...)`` is the same scan as a stream of runs (``ScannedPart``), for a fleet in bounded memory.
``scan``, ``gate`` and ``fix`` find settings files as the command line does (the closest from each folder
upward); ``undo`` restores a fix
transaction. ``Finding``, ``Severity``, ``Report``, ``GateResult`` and ``Selection`` are the types they take and
return.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptdoctor.version import __version__

__all__ = [
    "Finding", "GateResult", "Report", "ScanStream", "ScannedPart", "Selection", "Severity", "__version__", "fix",
    "gate", "iter_scan", "scan", "scan_many", "undo",
]

# name -> the module that defines it, imported on first use (PEP 562)
_LAZY = {
    "scan": "ckptdoctor.api",
    "scan_many": "ckptdoctor.api",
    "iter_scan": "ckptdoctor.api",
    "ScanStream": "ckptdoctor.api",
    "ScannedPart": "ckptdoctor.api",
    "fix": "ckptdoctor.api",
    "gate": "ckptdoctor.resume_gate.api",
    "GateResult": "ckptdoctor.resume_gate.api",
    "undo": "ckptdoctor.fixer.transaction",
    "Finding": "ckptdoctor.findings",
    "Severity": "ckptdoctor.findings",
    "Report": "ckptdoctor.scanner",
    "Selection": "ckptdoctor.rules",
}

if TYPE_CHECKING:
    from ckptdoctor.api import ScannedPart, ScanStream, fix, iter_scan, scan, scan_many
    from ckptdoctor.findings import Finding, Severity
    from ckptdoctor.fixer.transaction import undo
    from ckptdoctor.resume_gate.api import GateResult, gate
    from ckptdoctor.rules import Selection
    from ckptdoctor.scanner import Report


def __getattr__(name: str) -> Any:
    """The API's names, each imported from its module when first asked for."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
