"""How an S3 scan's memory grows per run: resident memory, live objects and garbage-collector passes at every tenth
part of one scan (``api.scan_roots`` with ``on_part``, as ``scan --format jsonl`` streams), in a fresh interpreter,
against bench/fleet_s3.py's moto bucket. Run by hand:

    python bench/fleet_s3_slope.py --runs 40 --checkpoints 10                  # this checkout
    python bench/fleet_s3_slope.py --runs 40 --checkpoints 10 --no-collect     # the request garbage left alone
    python bench/fleet_s3_slope.py --runs 40 --checkpoints 10 --types          # which objects grow (20th -> 40th)
    python bench/fleet_s3_slope.py --runs 100 --listing                        # the listing's index alone

Prints one JSON line per variant: ``kb_per_run`` (the resident memory's growth per run from the 20th part to the
last), the peak (``VmHWM``), the scan's CPU, the collector's passes and CPU (``gc.callbacks``), and with ``--types``
the object types whose count grew most between the 20th and 40th part. ``--no-collect`` sets the remote source's
``COLLECT_EVERY`` out of reach: the scan then keeps every request's reference cycles, as before it collected them.
``--shared N`` makes the readers' memo of equal containers (``readers.pickle_values._SHARED``, 16,384 entries,
cleared when full) hold N: what a full memo adds to the peak. ``--listing`` lists the root only, as a scan's walk
does (every folder in walk order, no file read), and gives the resident memory that added at its peak
(``listing_peak_mb``) and the most listing entries the index held at once (``most_held``; ``--whole`` lists with
s3fs's ``find``, every entry kept to the end, as before ``_S3Stream``): run at two sizes, the difference over the
objects added is what the listing costs per object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _status(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def listing(root: str, out: str, whole: bool) -> None:
    """In a fresh process: the resident memory that listing ``root`` adds as a scan's walk lists it (every folder
    in walk order, each told when left, no file read), at its peak (sampled at each folder), and the most entries
    the source's index held at once (the backend's client made first, so its own start-up is not counted)."""
    import ckptdoctor.sources.fsspec as remote
    from ckptdoctor.limits import Limits

    if whole:
        remote._S3Stream.open = classmethod(lambda cls, fs, path: None)  # type: ignore[assignment,method-assign]
    fs, path = remote._filesystem(root)
    fs.exists(path)  # the client, its service model and its connection: made before the figure starts
    gc.collect()
    before = _status("VmRSS")
    source = remote.FsspecSource(root, Limits())
    top = source.root([])
    peak = {"rss": 0.0, "held": 0, "objects": 0}

    def walk(folder: Any) -> None:
        listed = source.listdir(folder, "", [])
        held = sum(f.size() for f in source._folders.values())
        peak["held"] = max(peak["held"], held + len(listed or ()))
        peak["rss"] = max(peak["rss"], _status("VmRSS"))
        for entry in sorted(listed or (), key=lambda e: e.name):
            if entry.is_dir:
                walk(entry)
            else:
                peak["objects"] += 1
        source.walked(folder.path)

    walk(top)
    doc = {
        "objects": peak["objects"], "listing_peak_mb": round(peak["rss"] - before, 1), "most_held": peak["held"],
        "whole": whole,
    }  # fmt: skip
    Path(out).write_text(json.dumps(doc))


def child(root: str, out: str, no_collect: bool, types: bool, shared: int | None) -> None:
    """In the scan's process: scan ``root`` part by part, sampling every tenth part; write the figures to ``out``."""
    if shared is not None:  # the readers' memo of equal containers (``pickle_values._SHARED``), at another size
        import ckptdoctor.readers.pickle_values as values
        from ckptdoctor.readers.seen import Seen

        values._SHARED = Seen(shared)
    if no_collect:
        import ckptdoctor.sources.fsspec as remote

        remote.COLLECT_EVERY = 10**12
    from ckptdoctor.api import scan_roots
    from ckptdoctor.roots import Roots
    from ckptdoctor.settings.selection import Options

    spent = {"cpu": 0.0, "passes": 0, "start": 0.0}

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            spent["start"] = time.process_time()
        else:
            spent["cpu"] += time.process_time() - spent["start"]
            spent["passes"] += 1

    gc.callbacks.append(timed)
    rows: list[dict[str, Any]] = []
    counted: dict[int, Counter[str]] = {}

    def on_part(index: int, tree: Any, findings: Any) -> None:
        n = len(rows) + 1
        rows.append({"part": n, "rss_mb": _status("VmRSS")})
        if types and n in (20, 40):
            counted[n] = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())

    start = time.process_time()
    scan_roots(Roots.of([root]), Options.build(no_config=True), on_part=on_part)
    cpu = time.process_time() - start
    first, last = rows[min(19, len(rows) - 1)], rows[-1]
    growth = (last["rss_mb"] - first["rss_mb"]) * 1024 / max(1, last["part"] - first["part"])
    doc: dict[str, Any] = {
        "parts": len(rows), "kb_per_run": round(growth, 1), "peak_mb": round(_status("VmHWM"), 1),
        "cpu_s": round(cpu, 1), "gc_passes": spent["passes"], "gc_cpu_s": round(spent["cpu"], 2),
        "rss_mb_every_10": [round(r["rss_mb"], 1) for r in rows[9::10]],
    }  # fmt: skip
    if len(counted) == 2:
        doc["grew_20_to_40"] = (counted[40] - counted[20]).most_common(10)
    Path(out).write_text(json.dumps(doc))


def main() -> None:
    """Build the bucket, run the scan in a fresh interpreter, print its figures."""
    if sys.argv[1:2] == ["--child"]:
        if "--listing" in sys.argv:
            listing(sys.argv[2], sys.argv[3], "--whole" in sys.argv)
        else:
            shared = next((int(a.split("=", 1)[1]) for a in sys.argv if a.startswith("--shared=")), None)
            child(sys.argv[2], sys.argv[3], "--no-collect" in sys.argv, "--types" in sys.argv, shared)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--checkpoints", type=int, default=10)
    ap.add_argument("--no-collect", action="store_true", help="leave the request garbage to the end of the scan")
    ap.add_argument("--types", action="store_true", help="count the live objects by type at the 20th and 40th part")
    ap.add_argument("--listing", action="store_true", help="list and index the root only: the memory it adds")
    ap.add_argument("--shared", type=int, help="entries of the readers' memo of equal containers (16,384)")
    ap.add_argument("--whole", action="store_true", help="with --listing: s3fs's find, its entries kept to the end")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    import fleet_s3

    with tempfile.TemporaryDirectory(prefix="fleet-slope-") as tmp, fleet_s3.moto_server() as server:
        files = fleet_s3.build_run(Path(tmp) / "run", args.checkpoints)
        fleet_s3.fill(server, args.runs, files)
        out = Path(tmp) / "out.json"
        env = {**os.environ, **server.env(), "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
        chosen = (("--no-collect", args.no_collect), ("--types", args.types), ("--listing", args.listing),
                  ("--whole", args.whole))  # fmt: skip
        flags = [f for f, on in chosen if on] + ([f"--shared={args.shared}"] if args.shared is not None else [])
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", fleet_s3.root_url(), str(out), *flags]
        subprocess.run(cmd, env=env, cwd=HERE.parent, check=True)
        doc = json.loads(out.read_text())
    print(json.dumps({"runs": args.runs, "checkpoints": args.checkpoints, "flags": flags, **doc}))


if __name__ == "__main__":
    main()
