"""The verdict cache's cost and gain (issue 27 §2): ``ckptdoctor scan`` of one root, in fresh processes, with
``--no-cache``, with ``--cache`` and an empty cache (cold: the scan reads everything and keeps every file's facts),
with the cache warm, after one file changed, and three scans with neither flag (the default: the first sights the
files, the second keeps their facts, the third takes them). Rounds interleave them, so a busy machine slows each
alike; medians are printed.

    python bench/cache_bench.py /tmp/cache-ckb/7b-100 --rounds 5
    python bench/cache_bench.py /tmp/cache-ckb/7b-100 --rounds 5 --python /tmp/venv/bin/python  # a regular install

Each scan runs as ``python -m ckptdoctor scan --format json ROOT`` with ``XDG_CACHE_HOME`` in a folder of its own;
``cpu`` is the child's user + system time (``os.wait4``), ``rss`` its peak resident memory; bytecode is cached (a
first scan, not counted, writes it). "one changed" rewrites one checkpoint's ``trainer_state.json`` (a space added
at its end: the same JSON) and waits out the cache's racy window first, as a nightly rescan finds a file changed
hours ago.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PYTHON = sys.executable  # ``--python``


def run(root: str, xdg: str, *extra: str) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, peak RSS in MB) of one scan in a fresh interpreter."""
    env = {**os.environ, "XDG_CACHE_HOME": xdg}
    env.pop("CKPTDOCTOR_CACHE", None)  # on or off as the command line says
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # bytecode cached, as after `pip install` (bench/RESULTS.md)
    cmd = [PYTHON, "-m", "ckptdoctor", "scan", "--format", "json", *extra, root]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} exited {code}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss // 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--python", default=sys.executable,
        help="the interpreter that runs the scans (default: this one); e.g. a virtual environment's with ckptdoctor "
        "installed as users install it (`python -m venv V && V/bin/pip install .`), not from a development checkout",
    )  # fmt: skip
    args = parser.parse_args()
    global PYTHON
    PYTHON = args.python
    root = Path(args.root)
    states = sorted(root.rglob("trainer_state.json"))
    if not states:
        raise SystemExit(f"{root}: no trainer_state.json to change")
    target = states[len(states) // 2]
    original = target.read_bytes()
    results: dict[str, list[tuple[float, float, int]]] = {
        "--no-cache": [], "cold": [], "warm": [], "one changed": [],
        "default 1st": [], "default 2nd": [], "default 3rd": [],
    }  # fmt: skip
    work = tempfile.mkdtemp(prefix="cache-bench-")
    try:
        run(str(root), os.path.join(work, "prime"))  # writes the bytecode caches; not counted
        for _ in range(args.rounds):
            xdg = os.path.join(work, "xdg")
            shutil.rmtree(xdg, ignore_errors=True)
            results["--no-cache"].append(run(str(root), xdg, "--no-cache"))
            results["cold"].append(run(str(root), xdg, "--cache"))
            results["warm"].append(run(str(root), xdg, "--cache"))
            target.write_bytes(original + b" " if target.read_bytes() == original else original)
            time.sleep(2.1)  # past the racy window: the changed file is kept, as a nightly rescan's would be
            results["one changed"].append(run(str(root), xdg, "--cache"))
            # the default (neither flag): the first scan sights the files, the second keeps their facts, the third
            # takes them (past the racy window, as the changed file above)
            shutil.rmtree(xdg, ignore_errors=True)
            for name in ("default 1st", "default 2nd", "default 3rd"):
                results[name].append(run(str(root), xdg))
        cache_bytes = sum(p.stat().st_size for p in Path(work, "xdg", "ckptdoctor", "facts").iterdir())
    finally:
        target.write_bytes(original)
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(c for _, c, _ in results["--no-cache"])
    rows = []
    for name, runs in results.items():
        wall = statistics.median(w for w, _, _ in runs)
        cpu = statistics.median(c for _, c, _ in runs)
        rss = max(r for _, _, r in runs)
        # each round's scan against the same round's --no-cache scan, then the median: a load that comes and goes
        # between rounds moves both alike
        paired = statistics.median(c / n for (_, c, _), (_, n, _) in zip(runs, results["--no-cache"], strict=True))
        rows.append({"scan": name, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                     "cpu_vs_no_cache": round(cpu / base, 3), "cpu_vs_no_cache_paired": round(paired, 3),
                     "peak_rss_mb": rss})  # fmt: skip
    print(json.dumps({"root": str(root), "python": PYTHON, "rounds": args.rounds, "cache_bytes": cache_bytes,
                      "rows": rows}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
