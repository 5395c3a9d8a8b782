"""Time one ckptdoctor command from several checkouts, alternately, as bench/RESULTS.md's comparisons do.

Usage::

    python bench/compare_checkouts.py CHECKOUT[,CHECKOUT...] RUNS -- ARGS...
    python bench/compare_checkouts.py /tmp/wt-base,. 15 -- scan --format json /tmp/ckb/7b-100

Each round runs ``PYTHONPATH=<checkout> python -m ckptdoctor ARGS`` once per checkout from ``/tmp``, the order
reversed every other round, with bytecode cached per checkout (``PYTHONPYCACHEPREFIX``; a first warm-up round writes
the caches and is not counted). Prints each checkout's median wall time and the child's median CPU time (user+sys).

Every run is a cold scan: it gets an empty verdict cache folder of its own (``XDG_CACHE_HOME`` in a new temporary
folder, removed after it) and no ``CKPTDOCTOR_CACHE``, so a checkout whose cache is on (``--cache`` in ARGS, or a
default that writes it) never finds in a later round what an earlier one kept. Measure a warm rescan with
bench/cache_bench.py.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def main(argv: list[str]) -> None:
    """Parse ``CHECKOUTS RUNS -- ARGS`` and print the medians."""
    if len(argv) < 4 or argv[2] != "--":
        raise SystemExit(__doc__)
    checkouts = [os.path.abspath(c) for c in argv[0].split(",")]
    runs, args = int(argv[1]), argv[3:]
    wall: dict[str, list[float]] = {c: [] for c in checkouts}
    cpu: dict[str, list[float]] = {c: [] for c in checkouts}
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "CKPTDOCTOR_CACHE")}
    for i in range(runs + 1):
        for c in checkouts if i % 2 == 0 else checkouts[::-1]:
            xdg = tempfile.mkdtemp(prefix="compare-xdg-")  # an empty cache folder: every round is a cold scan
            env = {**base, "PYTHONPATH": c, "PYTHONPYCACHEPREFIX": "/tmp/pyc" + c.replace("/", "_"),
                   "XDG_CACHE_HOME": xdg}  # fmt: skip
            start = time.perf_counter()
            proc = subprocess.Popen([sys.executable, "-m", "ckptdoctor", *args], env=env, cwd="/tmp",
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            _, _, usage = os.wait4(proc.pid, 0)
            shutil.rmtree(xdg, ignore_errors=True)
            if i:  # round 0 writes the bytecode caches
                wall[c].append(time.perf_counter() - start)
                cpu[c].append(usage.ru_utime + usage.ru_stime)
    for c in checkouts:
        print(f"{c}: wall median {statistics.median(wall[c]) * 1000:.1f} ms (min {min(wall[c]) * 1000:.1f}), "
              f"cpu median {statistics.median(cpu[c]) * 1000:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
