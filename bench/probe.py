"""Run one workload in this process and write its cost (wall, /proc/self/io, peak RSS) as JSON to $PROBE_OUT.

Standard library only, so any interpreter (the project's, or a venv holding picklescan/modelscan) can run it:

    python bench/probe.py module ckptdoctor scan --format json ROOT
    python bench/probe.py call baselines:safe_open_walk ROOT
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import resource
import runpy
import sys
import time


def proc_io() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/io") as f:
        for line in f:
            key, value = line.split(":")
            out[key] = int(value)
    return out


def vmhwm_mb() -> float:
    """This program's peak resident memory (MB): ``VmHWM`` of /proc/self/status, kept per address space.

    ``getrusage``'s ``ru_maxrss`` is kept per process across ``exec``: a process started by a large one (a benchmark
    that has imported torch and runs a server) reports at least its parent's size at the fork. Where that matters
    (bench/fleet_s3.py), read this instead.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    kind, target, *args = sys.argv[1:]
    start_io, start = proc_io(), time.perf_counter()
    code = 0
    written = False

    def report(code: int) -> None:
        nonlocal written
        if written:
            return
        written = True
        wall = time.perf_counter() - start
        end_io = proc_io()
        result = {
            "wall_in_process": wall,
            "rchar": end_io["rchar"],  # bytes through read()-like calls since the process started (imports incl.)
            "rchar_workload": end_io["rchar"] - start_io["rchar"],
            "read_bytes": end_io["read_bytes"],  # bytes fetched from the block device (page-cache misses)
            "syscr": end_io["syscr"],
            "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            # CPU seconds of this process (user + system; start-up and imports included): comparable under load
            "cpu_s": (lambda r: r.ru_utime + r.ru_stime)(resource.getrusage(resource.RUSAGE_SELF)),
            "vmhwm_mb": vmhwm_mb(),
            "exit": code,
        }
        with open(os.environ["PROBE_OUT"], "w") as f:
            json.dump(result, f)

    # ckptdoctor's console entry ends read-only commands with os._exit after running the exit handlers: the
    # figures are written from one (the exit code is then read by the caller from the process itself).
    atexit.register(report, -1)
    try:
        if kind == "module":
            sys.argv = [target, *args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            mod, func = target.split(":")
            getattr(importlib.import_module(mod), func)(*args)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    report(code)


if __name__ == "__main__":
    main()
