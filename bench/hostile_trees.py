"""Time the hostile trees whose cost tests/discovery/test_hostile_trees.py bounds by work (bytes read, files opened),
never by the clock. Run by hand, never in CI:

    python bench/hostile_trees.py [--checkout PATH] [--repeat N]

Trees: ``sparse`` (four 1 TiB holes named like checkpoint files, a safetensors header length past any limit) and
``empty-100k`` (100,000 empty files in one checkpoint folder). Each scan runs in a fresh interpreter through
bench/probe.py: wall time includes start-up; rchar is the process's bytes through ``read()``.
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


def sparse(root: Path) -> None:
    """The tree of ``test_sparse_files_with_absurd_sizes``."""
    ck = root / "checkpoint-1"
    (ck / "optimizer_0").mkdir(parents=True)
    for name in ("model.safetensors", "pytorch_model.bin", "optimizer.pt", "optimizer_0/__0_0.distcp"):
        with open(ck / name, "wb") as f:
            f.truncate(1 << 40)
    (ck / "optimizer_0" / ".metadata").write_bytes(b"")
    with open(ck / "model.safetensors", "r+b") as f:
        f.write((1 << 40).to_bytes(8, "little") + b'{"w": ')


def empty_100k(root: Path) -> None:
    """The tree of ``test_100k_empty_files``."""
    ck = root / "checkpoint-1"
    ck.mkdir(parents=True)
    for i in range(100_000):
        (ck / f"f{i}.bin").touch()


def measure(checkout: Path, root: Path, repeat: int) -> dict[str, float]:
    """Best wall of ``repeat`` scans of ``root`` with the ckptdoctor in ``checkout``, and that run's rchar."""
    best: dict[str, float] = {}
    for _ in range(repeat):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            env = {**os.environ, "PROBE_OUT": out.name, "PYTHONPATH": str(checkout)}
            t0 = time.perf_counter()
            subprocess.run([sys.executable, str(HERE / "probe.py"), "module", "ckptdoctor", "scan", "--format", "json",
                            str(root)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
            wall = time.perf_counter() - t0
            r = json.loads(Path(out.name).read_text())
        if not best or wall < best["wall"]:
            best = {"wall": wall, "rchar": r.get("rchar", 0)}
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--checkout", type=Path, default=HERE.parent, help="the ckptdoctor checkout to time")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print("| tree | wall (incl. start-up) | rchar |\n| --- | --- | --- |")
    for name, build in (("sparse", sparse), ("empty-100k", empty_100k)):
        with tempfile.TemporaryDirectory() as tmp:
            build(Path(tmp))
            r = measure(args.checkout, Path(tmp), args.repeat)
            print(f"| {name} | {r['wall']:.2f} s | {r['rchar'] / 1e6:.1f} MB |")


if __name__ == "__main__":
    main()
