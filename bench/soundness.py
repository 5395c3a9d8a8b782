"""The soundness property of tests/pickle_verdict/test_security_policy.py, run far longer, in containers too, and
against clean files.

    python bench/soundness.py --minutes 8 --seed 1

1. **Payloads.** Hypothesis builds pickle streams from a pool of allowed, unknown, unproven and dangerous globals
   (named, called, NEWOBJ+BUILD-ed, put in dict keys and sets, handed to calls; sometimes truncated), exactly as the
   CI test does, and packs each the way a loader meets it: a raw pickle, a torch zip's ``data.pkl``, an extra zip
   record, a tar member, a ``.tar.gz`` member, a gzip'd pickle, a legacy torch file's first stream. Each file is read
   by the real readers (``readers.read_open_file``) and judged (``pickle_verdict.judge``). Whenever that verdict has no
   security finding (no unsafe or unknown global, no CKD603 or CKD605 problem), a real ``pickle.Unpickler`` whose
   ``find_class`` records every global and returns an inert stub must have seen only globals the policy allows.
2. **Clean files.** Hypothesis builds data (numbers, strings, bytes, lists, tuples, dicts, sets, OrderedDicts,
   torch tensors) saved by ``pickle.dumps`` (protocols 0-5) or ``torch.save``: none may get a security finding.

Each run goes in batches of ``--batch`` examples until its share of ``--minutes`` is spent; batch ``i`` of the payload
run is seeded ``--seed * 100000 + i`` and of the clean run ``(--seed + 1) * 100000 + i``, so a run is repeatable
(on a slower machine, fewer batches of the same sequence). The script prints the command, the counts, the time and
the outcome, and exits 1 on any counterexample (printed).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gzip
import io
import pickle
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.errors import HypothesisDeprecationWarning  # noqa: E402

from bench.peer_corpus import _tar, _torch_zip, _zip  # noqa: E402
from ckptdoctor.model import FileFacts, FileKind, ProblemKind  # noqa: E402
from ckptdoctor.pickle_verdict.judge import file_pickle, judge  # noqa: E402
from ckptdoctor.readers import read_open_file  # noqa: E402
from tests.pickle_verdict.test_security_policy import ITEM, _stream, unallowed_seen  # noqa: E402

CONTAINERS = ("raw", "torch-zip", "zip-record", "tar", "tar.gz", "gz", "legacy")
_FINDING_KINDS = (ProblemKind.MALFORMED_PICKLE, ProblemKind.SUSPICIOUS_ARCHIVE)
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


def pack(data: bytes, container: str) -> tuple[str, bytes]:
    """``data`` (one pickle stream) as a file of ``container``: (file name, bytes)."""
    if container == "torch-zip":
        return "pytorch_model.bin", _torch_zip(data)
    if container == "zip-record":
        clean = pickle.dumps({}, protocol=2)
        return "model.pt", _zip({"archive/data.pkl": clean, "archive/extra.pkl": data, "archive/version": b"3\n"})
    if container == "tar":
        return "archive.anything", _tar({"x/model.pkl": data})
    if container == "tar.gz":
        return "archive.tar.gz", _tar({"inner.tar": _tar({"m": data})}, "w:gz")
    if container == "gz":
        return "state.pkl.gz", gzip.compress(data)
    if container == "legacy":  # the magic number stream, then the hostile one where the protocol stream goes
        return "model.pt", _LEGACY_MAGIC + b"." + data
    return "state.pkl", data


def static_verdict(name: str, raw: bytes) -> Any:
    """The file's verdict as a scan reaches it, or None when the reader already has a security finding."""
    base = FileFacts(name, len(raw), 0.0, FileKind.OTHER)
    facts = read_open_file(io.BytesIO(raw), base)
    if any(p.kind in _FINDING_KINDS for p in facts.problems):
        return None
    pf = file_pickle(facts)
    if pf is None:
        return "nothing"  # no stream found: the loader must then see no global either
    return judge(pf)


class _Tally:
    def __init__(self) -> None:
        self.cases = 0
        self.checked = 0  # clean verdicts compared with the unpickler
        self.by_container: collections.Counter[str] = collections.Counter()
        self.failures: list[str] = []


def batches(run: Any, batch: int, base_seed: int, tally: _Tally, deadline: float) -> int:
    """Run ``run(examples, seed, tally)`` in batches until ``deadline``; the number of batches."""
    i = 0
    while time.monotonic() < deadline:
        run(batch, base_seed * 100_000 + i, tally)
        i += 1
    return i


def payload_run(examples: int, run_seed: int, tally: _Tally) -> None:
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @seed(run_seed)
    @given(st.lists(ITEM, min_size=1, max_size=8), st.integers(0, 3), st.sampled_from(CONTAINERS))
    def prop(items: list[tuple[int, bool, str]], cut: int, container: str) -> None:
        data = _stream(items)
        data = data[: len(data) - cut] if cut else data
        tally.cases += 1
        tally.by_container[container] += 1
        name, raw = pack(data, container)
        verdict = static_verdict(name, raw)
        if verdict is None:
            return
        if verdict == "nothing":
            from tests.pickle_verdict.test_security_policy import _Recorder

            rec = _Recorder(data)
            with contextlib.suppress(Exception):  # what it saw before a refusal still counts
                rec.load()
            if rec.seen:
                tally.failures.append(f"{container}: no stream found, the unpickler saw {rec.seen}: {items} cut={cut}")
            return
        tally.checked += 1
        bad = unallowed_seen(data, verdict)
        if bad:
            tally.failures.append(f"{container}: clean verdict, the unpickler saw {bad}: {items} cut={cut}")

    prop()


_LEAF = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
         | st.binary(max_size=40))  # fmt: skip


def _data() -> st.SearchStrategy[Any]:
    # Hypothesis warns that ``extend`` ignores its argument (its check feeds it an empty strategy, and a list or dict
    # of nothing is still a value); it does recurse: values four containers deep are drawn.
    warnings.filterwarnings("ignore", message="extend=", category=HypothesisDeprecationWarning)
    return st.recursive(
        _LEAF,
        lambda kids: st.lists(kids, max_size=5)
        | st.tuples(kids, kids)
        | st.dictionaries(st.text(max_size=8), kids, max_size=5)
        | st.frozensets(st.integers(), max_size=4)
        | st.builds(collections.OrderedDict, st.dictionaries(st.text(max_size=8), kids, max_size=4)),
        max_leaves=25,
    )


def clean_run(examples: int, run_seed: int, tally: _Tally) -> None:
    import torch

    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @seed(run_seed)
    @given(_data(), st.integers(-1, 5), st.lists(st.integers(1, 4), max_size=3))
    def prop(value: Any, protocol: int, shape: list[int]) -> None:
        tally.cases += 1
        if protocol < 0:
            buf = io.BytesIO()
            torch.save({"state": value, "t": torch.zeros(shape)}, buf)
            name, raw = "optimizer.pt", buf.getvalue()
            tally.by_container["torch.save"] += 1
        else:
            name, raw = "state.pkl", pickle.dumps(value, protocol=protocol)
            tally.by_container[f"protocol {protocol}"] += 1
        base = FileFacts(name, len(raw), 0.0, FileKind.OTHER)
        facts = read_open_file(io.BytesIO(raw), base)
        pf = file_pickle(facts)
        verdict = judge(pf) if pf is not None else None
        tally.checked += 1
        if any(p.kind in _FINDING_KINDS for p in facts.problems) or (verdict and (verdict.unsafe or verdict.unknown)):
            tally.failures.append(f"clean {name} flagged: {facts.problems} {verdict}: {value!r:.200}")

    prop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=8.0, help="wall time for both runs (payloads get 3/4)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch", type=int, default=500, help="examples per hypothesis run")
    args = ap.parse_args()
    start = time.monotonic()
    budget = args.minutes * 60
    payloads, clean = _Tally(), _Tally()
    n1 = batches(payload_run, args.batch, args.seed, payloads, start + budget * 0.75)
    mid = time.monotonic()
    n2 = batches(clean_run, args.batch, args.seed + 1, clean, start + budget)
    end = time.monotonic()
    print(f"command: python bench/soundness.py --minutes {args.minutes:g} --seed {args.seed} --batch {args.batch}")
    print(f"payloads: {payloads.cases} cases ({n1} batches) in {mid - start:.0f} s; {payloads.checked} clean "
          f"verdicts compared with the unpickler; by container {dict(sorted(payloads.by_container.items()))}")
    print(f"clean files: {clean.cases} ({n2} batches) in {end - mid:.0f} s; "
          f"by kind {dict(sorted(clean.by_container.items()))}")
    failures = payloads.failures + clean.failures
    print(f"outcome: {'no counterexample' if not failures else f'{len(failures)} counterexamples'}")
    for f in failures[:20]:
        print("  " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
