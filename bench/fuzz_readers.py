"""Fuzz campaign for every reader: mutated real files and hostile bytes; no crash, no hang, bounded memory.

Usage (the numbers in bench/SECURITY.md come from this command)::

    python bench/fuzz_readers.py --inputs 1000000 --workers 2 --time-limit 2.0 --rss-mb 1024 --seed 1

Seeds are real files written by torch, safetensors, transformers and torch.distributed.checkpoint into a temporary
folder, plus the hostile pickles of tests/helpers/payloads.py. Each input is a seed mutated by byte flips, truncation,
insertion, duplication of a slice, splicing two seeds, or length-field smashing. Each worker enforces an address
space cap (RLIMIT_AS) and a per-input wall-clock bound (SIGALRM); a reader that raises, overruns the bound or dies
is recorded with the input that did it (written to --crash-dir).
"""

from __future__ import annotations

import argparse
import io
import json
import random
import resource
import signal
import struct
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing import Pool
from pathlib import Path
from typing import Any, BinaryIO

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptdoctor.limits import Limits
from ckptdoctor.model import ReadOutcome

# Limits small enough that a mutated length field hits them quickly, large enough for every seed.
LIMITS = Limits(pickle_bytes=8_000_000, json_bytes=8_000_000, safetensors_header_bytes=8_000_000,
                pickle_opcodes=2_000_000, pickle_memo_entries=200_000, zip_entries=100_000,
                dcp_data_bytes=64_000_000)  # fmt: skip


class Hang(Exception):
    """Raised by the alarm handler when one input takes longer than the bound."""


def _readers() -> dict[str, Callable[[BinaryIO, int, Limits], Any]]:
    from ckptdoctor.pickle_verdict.judge import judge
    from ckptdoctor.readers.dcp import read_dcp_data, read_dcp_metadata
    from ckptdoctor.readers.deepspeed import read_latest
    from ckptdoctor.readers.jsonfiles import read_json
    from ckptdoctor.readers.pickle_walk import walk_pickle
    from ckptdoctor.readers.rawpickle import read_raw_pickle
    from ckptdoctor.readers.safetensors import read_safetensors
    from ckptdoctor.readers.sniff import HEAD_BYTES, sniff
    from ckptdoctor.readers.torchzip import read_archive, read_torch

    def walk(f: BinaryIO, size: int, limits: Limits) -> Any:
        facts, problems, _ = walk_pickle(f.read(), limits=limits)
        if facts is not None:
            judge(facts, limits)  # the rule-side analysis (nested pickles, base64) gets the same inputs
        return ReadOutcome(facts, problems)

    def sniffer(f: BinaryIO, size: int, limits: Limits) -> Any:
        sniff(f.read(HEAD_BYTES), "x.bin", size)
        return ReadOutcome(None)

    return {
        "walk_pickle": walk,
        "torch": read_torch,
        "raw_pickle": read_raw_pickle,
        "dcp_metadata": read_dcp_metadata,
        "dcp_data": read_dcp_data,
        "safetensors": read_safetensors,
        "json": read_json,
        "latest": read_latest,
        "archive": read_archive,
        "sniff": sniffer,
    }


def make_seeds(folder: Path) -> dict[str, bytes]:
    """Real files from the real libraries plus the hostile payloads; name -> bytes."""
    import torch
    from safetensors.torch import save_file

    from tests.helpers import payloads

    payloads.save_model_state(folder / "model.bin")
    payloads.save_model_state(folder / "legacy.bin", legacy=True)
    payloads.save_training_files(folder)
    payloads.save_dcp(folder / "dcp")
    save_file({"w": torch.zeros(3, 2), "b": torch.ones(4, dtype=torch.bfloat16)}, str(folder / "m.safetensors"))
    (folder / "state.json").write_text(json.dumps({"global_step": 8, "log_history": [{"loss": 1.5}] * 4}))
    seeds = {p.name: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file() and p.stat().st_size < 2_000_000}
    for name, (data, _) in payloads.hostile_payloads(Path("/nonexistent/canary")).items():
        seeds[f"payload:{name}"] = data
    seeds["latest"] = b"global_step12"
    from bench.peer_corpus import _tar

    members = {"run/model.bin": seeds["model.bin"], "run/args.pkl": seeds["payload:" + next(
        n for n in payloads.hostile_payloads(Path("/nonexistent/canary")))]}  # fmt: skip
    seeds["archive.tar"] = _tar({**members, "inner.tar.xz": _tar(members, "w:xz")})
    seeds["archive.tar.gz"] = _tar(members, "w:gz")
    seeds["archive.tar.bz2"] = _tar(members, "w:bz2")
    return seeds


def mutate(rnd: random.Random, seeds: list[bytes]) -> bytes:
    """One mutated input: a few random operations on a random seed."""
    data = bytearray(rnd.choice(seeds))
    for _ in range(rnd.choice((1, 1, 2, 3, 6))):
        op = rnd.randrange(7)
        n = len(data)
        if op == 0 and n:  # flip bytes
            for _ in range(rnd.randrange(1, 9)):
                data[rnd.randrange(n)] = rnd.randrange(256)
        elif op == 1:  # truncate
            del data[rnd.randrange(n + 1) :]
        elif op == 2:  # insert random bytes
            at = rnd.randrange(n + 1)
            data[at:at] = rnd.randbytes(rnd.randrange(1, 64))
        elif op == 3 and n:  # duplicate a slice (repeated records, repeated opcodes)
            a = rnd.randrange(n)
            b = min(n, a + rnd.randrange(1, 512))
            at = rnd.randrange(n + 1)
            data[at:at] = data[a:b] * rnd.randrange(1, 4)
        elif op == 4:  # splice another seed in
            other = rnd.choice(seeds)
            at = rnd.randrange(n + 1)
            data[at:] = other[rnd.randrange(len(other) + 1) :]
        elif op == 5 and n >= 8:  # smash a length-looking field with a huge or boundary value
            at = rnd.randrange(n - 7)
            value = rnd.choice((0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 2**63 - 1, 2**64 - 1, n, n + 1, n * 1000))
            struct.pack_into("<Q", data, at, value)
        elif op == 6 and n:  # delete a slice
            a = rnd.randrange(n)
            del data[a : a + rnd.randrange(1, 256)]
    return bytes(data)


_STATE: dict[str, Any] = {}


def _init(seed_blob: dict[str, bytes], rss_mb: int, time_limit: float) -> None:
    cap = rss_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    _STATE.update(seeds=list(seed_blob.values()), readers=_readers(), time_limit=time_limit)

    def on_alarm(signum: int, frame: Any) -> None:
        raise Hang()

    signal.signal(signal.SIGALRM, on_alarm)


def _work(job: tuple[int, int, int, str]) -> dict[str, Any]:
    """Run ``count`` inputs from ``start`` with RNG seed ``seed``; return counts and failures."""
    start, count, seed, crash_dir = job
    readers: dict[str, Any] = _STATE["readers"]
    names = sorted(readers)
    seeds: list[bytes] = _STATE["seeds"]
    limit: float = _STATE["time_limit"]
    out: dict[str, Any] = {"inputs": 0, "per_reader": dict.fromkeys(names, 0), "failures": [], "max_seconds": 0.0,
                           "bytes": 0, "not_outcome": 0}  # fmt: skip
    for i in range(start, start + count):
        rnd = random.Random(seed * 1_000_003 + i)
        data = mutate(rnd, seeds) if rnd.random() < 0.97 else rnd.randbytes(rnd.randrange(4096))
        name = names[i % len(names)]
        t0 = time.perf_counter()
        failure = None
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            result = readers[name](io.BytesIO(data), len(data), LIMITS)
            if not isinstance(result, ReadOutcome):
                out["not_outcome"] += 1
                failure = f"returned {type(result).__name__}"
        except Hang:
            failure = f"hang: over {limit} s"
        except MemoryError:
            failure = "MemoryError: over the address-space cap"
        except BaseException as exc:  # the point: readers must not raise anything
            failure = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        took = time.perf_counter() - t0
        out["max_seconds"] = max(out["max_seconds"], took)
        out["inputs"] += 1
        out["bytes"] += len(data)
        out["per_reader"][name] += 1
        if failure is not None:
            path = Path(crash_dir) / f"{name}-{seed}-{i}.bin"
            path.write_bytes(data)
            out["failures"].append({"reader": name, "input": str(path), "error": failure[:500]})
    out["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def _probe(kind: str) -> str:
    """Prove the caps bite in a worker: a reader that sleeps past the bound, one that allocates past the cap."""
    signal.setitimer(signal.ITIMER_REAL, _STATE["time_limit"])
    try:
        if kind == "hang":
            time.sleep(_STATE["time_limit"] * 3)
        else:
            blob = bytearray(8 << 30)  # 8 GiB: above any cap we run with
            del blob
        return "not caught"
    except Hang:
        return "hang caught"
    except MemoryError:
        return "memory caught"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", type=int, default=1_000_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--time-limit", type=float, default=2.0, help="seconds allowed per input")
    ap.add_argument("--rss-mb", type=int, default=1024, help="address-space cap per worker (RLIMIT_AS)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch", type=int, default=5000)
    ap.add_argument("--crash-dir", default="bench/fuzz-crashes")
    ap.add_argument("--json", default="", help="write the summary here too")
    args = ap.parse_args()
    Path(args.crash_dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        seeds = make_seeds(Path(tmp))
    jobs = [(s, min(args.batch, args.inputs - s), args.seed, args.crash_dir) for s in range(0, args.inputs, args.batch)]
    total: dict[str, Any] = {"inputs": 0, "bytes": 0, "failures": [], "max_seconds": 0.0, "max_rss_mb": 0.0,
                             "per_reader": {}, "not_outcome": 0}  # fmt: skip
    t0 = time.time()
    with Pool(args.workers, initializer=_init, initargs=(seeds, args.rss_mb, args.time_limit)) as pool:
        total["cap_checks"] = pool.map(_probe, ["hang", "memory"])
        assert total["cap_checks"] == ["hang caught", "memory caught"], total["cap_checks"]
        for res in pool.imap_unordered(_work, jobs):
            total["inputs"] += res["inputs"]
            total["bytes"] += res["bytes"]
            total["not_outcome"] += res["not_outcome"]
            total["failures"].extend(res["failures"])
            total["max_seconds"] = max(total["max_seconds"], res["max_seconds"])
            total["max_rss_mb"] = max(total["max_rss_mb"], res["max_rss_mb"])
            for k, v in res["per_reader"].items():
                total["per_reader"][k] = total["per_reader"].get(k, 0) + v
            print(f"{total['inputs']:>9} inputs  {len(total['failures'])} failures  {time.time() - t0:7.0f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
    total["seconds"] = round(time.time() - t0, 1)
    total["seeds"] = len(seeds)
    total["command"] = " ".join(sys.argv)
    total["failures"] = total["failures"][:50]
    text = json.dumps(total, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()
