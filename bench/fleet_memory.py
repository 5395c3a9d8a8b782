"""Peak memory and time per checkpoint of `ckptdoctor scan` as a tree of 7B-class runs grows (issue 27, part 1).

Run by hand, never in CI:

    python bench/fleet_memory.py WORKDIR [--counts 100 1000 10000] [--checkout PATH ...] [--format json]

Builds, under WORKDIR, one tree per count: 100 checkpoints are one run (`bench/synth.py --model llama-7b
--checkpoints 100`), more are runs of 100 side by side (`run-000/` ...), as a fleet's bucket holds them. The first
ten runs are written by synth.py (sparse files); further runs are hard links to those ten's files (`cp -al`), so
10,000 checkpoints cost no more disk than 1,000: every file is still listed, opened and parsed on its own. Each scan
runs in a fresh interpreter through bench/probe.py (peak RSS from `getrusage`, wall time in the process, CPU time
of the process: on a loaded machine only the CPU time compares).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PER_RUN = 100


def build(workdir: Path, count: int) -> Path:
    """The tree of ``count`` checkpoints (made once; a tree already there is reused)."""
    root = workdir / f"7b-{count}"
    if root.exists():
        return root
    if count <= PER_RUN:
        cmd = [sys.executable, str(HERE / "synth.py"), str(root), "--model", "llama-7b", "--checkpoints", str(count)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return root
    runs = count // PER_RUN
    seed = workdir / "7b-seed"  # ten synthesized runs, the others linked to them
    if not seed.exists():
        cmd = [sys.executable, str(HERE / "synth.py"), str(seed), "--model", "llama-7b",
               "--checkpoints", str(PER_RUN), "--runs", "10"]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    tmp = Path(tempfile.mkdtemp(dir=workdir))
    for i in range(runs):
        subprocess.run(["cp", "-al", str(seed / f"run-{i % 10:03d}"), str(tmp / f"run-{i:03d}")], check=True)
    os.rename(tmp, root)
    return root


def measure(checkout: Path, root: Path, fmt: str) -> dict[str, float]:
    """One scan of ``root`` by ``checkout`` in a fresh interpreter: peak RSS (MB) and wall time (s)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PROBE_OUT": out.name, "PYTHONPATH": str(checkout)}
        cmd = [sys.executable, str(HERE / "probe.py"), "module", "ckptdoctor", "scan", "--format", fmt, str(root)]
        subprocess.run(cmd, cwd=checkout, env=env, stdout=subprocess.DEVNULL, check=False)
        probe = json.loads(Path(out.name).read_text())
    return {
        "maxrss_mb": round(probe["maxrss_mb"], 1),
        "seconds": round(probe["wall_in_process"], 2),
        "cpu_s": round(probe.get("cpu_s", float("nan")), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--counts", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--checkout", type=Path, action="append", help="a ckptdoctor checkout (default: this one)")
    ap.add_argument("--format", default="json")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if shutil.which("cp") is None:
        raise SystemExit("needs cp (hard links)")
    for count in args.counts:
        root = build(args.workdir, count)
        for checkout in args.checkout or [HERE.parent]:
            m = measure(checkout.resolve(), root, args.format)
            per = round(1000 * m["seconds"] / count, 1)
            cpu = round(1000 * m["cpu_s"] / count, 1)  # wall measures the machine's load; CPU the scan's work
            out = {
                "checkout": str(checkout),
                "checkpoints": count,
                **m,
                "ms_per_checkpoint": per,
                "cpu_ms_per_checkpoint": cpu,
            }
            print(json.dumps(out))


if __name__ == "__main__":
    main()
