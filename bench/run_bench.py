"""Run the benchmarks of bench/RESULTS.md and print their tables (Markdown). Run by hand, never in CI:

    python bench/synth.py /tmp/ckb/7b-100 --model llama-7b --checkpoints 100     # and the other trees
    python bench/run_bench.py --trees /tmp/ckb --scanners /tmp/scanners/bin/python

Each workload runs in a fresh interpreter (bench/probe.py): wall time includes interpreter start-up and imports;
bytes read are that process's /proc/self/io counters (rchar: bytes through read(); read_bytes: from the disk).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PY = sys.executable


def probe(python: str, *argv: str, repeat: int = 3, timeout: float = 600) -> dict[str, float]:
    """Best of ``repeat`` runs (warm page cache: the headers stay cached, sparse data never hits the disk).

    A run still going after ``timeout`` seconds is stopped and reported as not finished (no further repeats).
    """
    best: dict[str, float] | None = None
    for _ in range(repeat):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            env = {**os.environ, "PROBE_OUT": out.name}
            # As after `pip install` (which compiles every module): this machine sets PYTHONDONTWRITEBYTECODE, and
            # recompiling ckptdoctor's sources on every start would add ~70 ms to each run.
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            t0 = time.perf_counter()
            try:
                subprocess.run(
                    [python, str(HERE / "probe.py"), *argv],
                    env=env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    check=False,
                    timeout=timeout,
                )
            except subprocess.TimeoutExpired:
                return {"failed": 1, "timeout": timeout, "wall": time.perf_counter() - t0}
            wall = time.perf_counter() - t0
            try:
                r = json.loads(Path(out.name).read_text())
            except ValueError:
                r = {"failed": 1}
        r["wall"] = wall
        if best is None or wall < best["wall"]:
            best = r
    assert best is not None
    return best


def ckd(*args: str) -> tuple[str, ...]:
    return ("module", "ckptdoctor", *args)


def row(label: str, r: dict[str, float], checkpoints: int, ref: float | None = None) -> str:
    if r.get("timeout"):
        return f"| {label} | did not finish in {r['timeout']:.0f} s (stopped) | | | | | |"
    if r.get("failed"):
        return f"| {label} | failed | | | | | |"
    per = r["rchar"] / checkpoints / 1e6
    speed = f"{r['wall'] / ref:.1f}x" if ref else ""
    return (
        f"| {label} | {r['wall']:.2f} s | {r['rchar'] / 1e6:.1f} MB | {per:.2f} MB | "
        f"{r['read_bytes'] / 1e6:.1f} MB | {r['maxrss_mb']:.0f} MB | {speed} |"
    )


HEAD = (
    "| workload | wall (incl. start-up) | rchar | rchar / checkpoint | read_bytes (disk) | peak RSS | "
    "time vs ckptdoctor |\n| --- | --- | --- | --- | --- | --- | --- |"
)


def compare(root: str, checkpoints: int, scanners: str | None, naive: bool, repeat: int) -> None:
    print(f"\n### `{root}` ({checkpoints} checkpoint(s))\n")
    print(HEAD)
    base = probe(PY, *ckd("scan", "--format", "json", root), repeat=repeat)
    print(row("`ckptdoctor scan --format json`", base, checkpoints))
    print(
        row(
            "`ckptdoctor scan --jobs 1`",
            probe(PY, *ckd("scan", "--jobs", "1", "--format", "json", root), repeat=repeat),
            checkpoints,
            base["wall"],
        )
    )
    for name in ("safe_open_walk", "safe_open_walk_np", "json_load", "torch_mmap", "metadata_walk"):
        print(
            row(
                f"baselines.{name}",
                probe(PY, "call", f"baselines:{name}", root, repeat=repeat),
                checkpoints,
                base["wall"],
            )
        )
    if naive:
        print(
            row(
                "baselines.naive (load_file + torch.load)",
                probe(PY, "call", "baselines:naive", root, repeat=1),
                checkpoints,
                base["wall"],
            )
        )
    if scanners:
        print(
            row(
                "picklescan --path",
                probe(scanners, "module", "picklescan.cli", "--path", root, repeat=repeat),
                checkpoints,
                base["wall"],
            )
        )
        print(
            row(
                "modelscan -p",
                probe(scanners, "module", "modelscan.cli", "scan", "-p", root, repeat=repeat, timeout=300),
                checkpoints,
                base["wall"],
            )
        )


def startup(repeat: int) -> None:
    print("\n### Start-up\n")
    print("| command | wall (best of 10) |\n| --- | --- |")
    empty = tempfile.mkdtemp()
    for label, argv in (
        ("`python -c pass` (interpreter alone)", ("call", "baselines:plain_read", empty)),
        ("`ckptdoctor --version`", ckd("--version")),
        ("`ckptdoctor scan EMPTY_DIR`", ckd("scan", empty)),
    ):
        print(f"| {label} | {probe(PY, *argv, repeat=10)['wall'] * 1000:.0f} ms |")


def scaling(trees: Path, repeat: int) -> None:
    print("\n### Scaling (7B-class run, full Trainer checkpoints)\n")
    print("| checkpoints | files | wall | rchar | rchar / checkpoint | wall / checkpoint |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, n in (("7b-10", 10), ("7b-100", 100), ("7b-1000", 1000)):
        root = trees / name
        if not root.exists():
            continue
        files = sum(len(f) for _, _, f in os.walk(root))
        r = probe(PY, *ckd("scan", "--format", "json", str(root)), repeat=repeat)
        print(
            f"| {n} | {files} | {r['wall']:.2f} s | {r['rchar'] / 1e6:.1f} MB | {r['rchar'] / n / 1e6:.2f} MB | "
            f"{r['wall'] / n * 1000:.1f} ms |"
        )


def deep(data_root: str, big_root: str | None) -> None:
    print("\n### `--deep` throughput (page-cached files)\n")
    print("| workload | wall | GB/s | peak RSS |\n| --- | --- | --- | --- |")
    size = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(data_root) for n in ns)
    probe(PY, "call", "baselines:plain_read", data_root, repeat=1)  # warm the page cache
    for label, argv in (
        ("plain sequential read (1 MiB readinto)", ("call", "baselines:plain_read", data_root)),
        ("`ckptdoctor scan --deep --jobs 1`", ckd("scan", "--deep", "--jobs", "1", data_root)),
        ("`ckptdoctor scan --deep --jobs 2`", ckd("scan", "--deep", "--jobs", "2", data_root)),
    ):
        r = probe(PY, *argv, repeat=3)
        print(f"| {label} | {r['wall']:.2f} s | {size / r['wall'] / 1e9:.2f} | {r['maxrss_mb']:.0f} MB |")
    # The same, in one process with imports done, so start-up (numpy is ~0.1 s) does not dilute the rate.
    code = f"""
import time, sys
sys.path.insert(0, {str(HERE)!r})
import numpy, baselines
from ckptdoctor.discover import discover
from ckptdoctor.deep import check_tree
tree = discover({data_root!r})
def best(f):
    times = []
    for _ in range(5):
        t = time.perf_counter(); f(); times.append(time.perf_counter() - t)
    return min(times)
plain = best(lambda: baselines.plain_read({data_root!r}))
print(f"| in-process: plain sequential read | {{plain:.3f}} s | {{{size} / plain / 1e9:.2f}} | |")
for jobs in (1, 2):
    t = best(lambda: check_tree(tree, jobs))
    print(f"| in-process: `deep.check_tree`, jobs={{jobs}} | {{t:.3f}} s | {{{size} / t / 1e9:.2f}} "
          f"({{plain / t:.0%}} of plain read) | |")
import hashlib
def sha_only():
    buf = bytearray(1 << 20)
    for path in baselines._files({data_root!r}, ("",)):
        h = hashlib.sha256()
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(memoryview(buf)[:n])
t = best(sha_only)
print(f"| in-process: plain read + sha256 (the floor for --checksums) | {{t:.3f}} s | {{{size} / t / 1e9:.2f}} | |")
for jobs in (1, 2):
    t = best(lambda: check_tree(tree, jobs, checksums=True))
    print(f"| in-process: `deep.check_tree(checksums=True)` (`--checksums`), jobs={{jobs}} | {{t:.3f}} s | "
          f"{{{size} / t / 1e9:.2f}} | |")
"""
    print(subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True).stdout, end="")
    if big_root:
        size = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(big_root) for n in ns)
        r = probe(PY, *ckd("scan", "--deep", big_root), repeat=1)
        print(
            f"| `ckptdoctor scan --deep` 70B weights ({size / 1e9:.0f} GB, sparse) | {r['wall']:.1f} s | "
            f"{size / r['wall'] / 1e9:.2f} | {r['maxrss_mb']:.0f} MB |"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", type=Path, default=Path("/tmp/ckb"))
    ap.add_argument("--scanners", help="a python that has picklescan and modelscan installed")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", choices=["startup", "compare", "compare-1b", "scaling", "deep"], action="append")
    args = ap.parse_args()
    t = args.trees
    only = set(args.only or ["startup", "compare", "compare-1b", "scaling", "deep"])
    if "startup" in only:
        startup(args.repeat)
    if "compare" in only:
        compare(str(t / "70b" / "checkpoint-500"), 1, args.scanners, False, args.repeat)
        compare(str(t / "7b-100"), 100, args.scanners, False, args.repeat)
    if "compare-1b" in only:  # the only size where torch.load of the optimizer fits in RAM (and in mmap's commit)
        compare(str(t / "1b" / "checkpoint-500"), 1, None, True, args.repeat)
    if "scaling" in only:
        scaling(t, args.repeat)
    if "deep" in only:
        deep(str(t / "deepdata"), str(t / "70b-weights") if (t / "70b-weights").exists() else None)


if __name__ == "__main__":
    main()
