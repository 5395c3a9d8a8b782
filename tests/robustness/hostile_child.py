"""What ``test_hostile_numbers.py`` runs in a child process under an address-space limit (``RLIMIT_AS``, set by the
parent before this interpreter starts): the CLI's ``scan``, ``gate`` and ``fix --dry-run`` on hostile trees, a
``tracemalloc``-measured scan, and the hypothesis sweep of the JSON numbers the gate reads. It prints one JSON
document on stdout; a failed assertion exits non-zero with its traceback on stderr.

    python -m tests.robustness.hostile_child commands [--gate OPTION]... PATH...
    python -m tests.robustness.hostile_child peak PATH
    python -m tests.robustness.hostile_child sweep FIXTURE EXAMPLES
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

# Each command as the user runs it: JSON out, so a parent can read the findings; the scan reads every file.
COMMANDS: tuple[tuple[str, ...], ...] = (
    ("scan", "--no-cache", "--format", "json"),
    ("gate", "--format", "json"),
    ("fix", "--dry-run", "--format", "json"),
)
# The trainer_state.json numbers the scan and the gate read, and log_history's steps.
STATE_FIELDS = ("global_step", "max_steps", "save_steps", "logging_steps", "eval_steps", "num_train_epochs",
                "train_batch_size", "epoch", "best_global_step", "log_history.step")
HOSTILE = (0, -1, 2**31, 2**63, 10**18, 10**100)


def commands(path: str, gate: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """``{command, code, output}`` of each of ``COMMANDS`` on ``path`` (the gate with the options ``gate`` too),
    through the CLI in this process."""
    from tests.helpers.cli import invoke

    out = []
    for argv in COMMANDS:
        code, stdout, stderr = invoke(*argv, *(gate if argv[0] == "gate" else ()), path)
        out.append({"command": argv[0], "code": code, "output": stdout + stderr})
    return out


def peak(path: str) -> dict[str, Any]:
    """The scan's findings (rule, path) and the peak of the memory Python allocated while it ran."""
    from ckptdoctor.scanner import scan

    tracemalloc.start()
    report = scan(path, cache=False)
    _, top = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"findings": sorted([f.rule, f.path] for f in report.findings), "peak": top}


def _rewrite(root: Path, values: dict[str, int]) -> None:
    """Every ``trainer_state.json`` under ``root`` with ``values`` written in (``log_history.step``: each entry's)."""
    for state in root.glob("*/trainer_state.json"):
        doc = json.loads(state.read_text())
        for field, v in values.items():
            if field == "log_history.step":
                for entry in doc.get("log_history", []):
                    entry["step"] = v
            else:
                doc[field] = v
        state.write_text(json.dumps(doc))


def sweep(fixture: str, examples: int) -> dict[str, Any]:
    """Hypothesis draws hostile integers for the trainer_state.json fields; for each, scan, gate and fix --dry-run
    exit 0 or 1 and report no internal error."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    ints = st.one_of(st.sampled_from(HOSTILE), st.integers(min_value=-(10**100), max_value=10**100))
    seen: list[dict[str, int]] = []

    @settings(max_examples=examples, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(st.dictionaries(st.sampled_from(STATE_FIELDS), ints, min_size=1, max_size=3))
    def check(values: dict[str, int]) -> None:
        seen.append(values)
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "run"
            shutil.copytree(fixture, root)
            _rewrite(root, values)
            for r in commands(str(root)):
                assert r["code"] in (0, 1), (values, r)
                assert "internal error" not in r["output"], (values, r)

    check()
    return {"examples": len(seen)}


def main(argv: list[str]) -> None:
    mode, args = argv[0], argv[1:]
    if mode == "commands":
        gate: list[str] = []
        while args[0] == "--gate":
            gate.append(args[1])
            args = args[2:]
        result: Any = {p: commands(p, tuple(gate)) for p in args}
    elif mode == "peak":
        result = peak(args[0])
    else:
        result = sweep(args[0], int(args[1]))
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
