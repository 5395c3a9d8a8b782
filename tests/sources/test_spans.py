"""The remote object the readers see (``ckptdoctor.sources.fsspec._Spans``): bytes read twice are fetched once, reads
past a miss fetch a bounded read-ahead, and what an open object keeps is bounded. No server: a file over bytes
counts the requests the object makes."""

from __future__ import annotations

import io
import itertools
import random
from typing import Any

import pytest

from ckptdoctor.sources import fsspec as remote


class _Counting(io.BytesIO):
    """Bytes behind a file that records each read as the (start, end) request it would be."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.requests: list[tuple[int, int]] = []

    def read(self, n: int | None = -1) -> bytes:
        at = self.tell()
        out = super().read(n)
        self.requests.append((at, at + len(out)))
        return out


def _spans(data: bytes) -> tuple[Any, _Counting]:
    raw = _Counting(data)
    return remote._Spans(raw, len(data)), raw  # type: ignore[arg-type]


def test_every_read_matches_the_bytes_and_no_byte_is_fetched_twice() -> None:
    data = random.Random(0).randbytes(300_000)
    f, raw = _spans(data)
    rng = random.Random(1)
    for _ in range(400):
        at = rng.randrange(len(data) + 10)
        n = rng.choice([0, 1, 8, 30, 1000, 5000, -1]) if rng.random() < 0.98 else -1
        f.seek(at)
        want = data[at:] if n < 0 else data[at : at + n]
        assert f.read(n) == want
        assert f.tell() == at + len(want)
    spans = sorted(raw.requests)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start


def test_a_miss_fetches_the_read_ahead_and_a_small_object_whole() -> None:
    f, raw = _spans(bytes(range(256)) * 1000)
    f.seek(1000)
    f.read(30)
    assert raw.requests == [(1000, 1030 + remote.READAHEAD)]
    f.seek(-64, 2)
    f.read(10)
    assert raw.requests[-1] == (256_000 - 64, 256_000)
    small, raw_small = _spans(b"x" * remote.WHOLE_FILE)
    small.seek(100)
    assert small.read(4) == b"xxxx"
    assert raw_small.requests == [(0, remote.WHOLE_FILE)]


def test_what_is_kept_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remote, "KEEP_BYTES", 10_000)
    f, raw = _spans(bytes(1_000_000))
    for at in range(0, 1_000_000, 50_000):
        f.seek(at)
        f.read(3000)
    assert sum(len(d) for _, d, _ in f._spans) <= 10_000
    f.keep(999_000, bytes(500), pinned=True)  # a prefetched span stays whatever is read afterwards
    for at in range(25_000, 900_000, 50_000):
        f.seek(at)
        f.read(3000)
    assert (999_000, bytes(500), True) in f._spans
    f.close()
    assert f._spans == [] and raw.closed
