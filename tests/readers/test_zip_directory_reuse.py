"""A central directory parsed once is reused only for one equal in every byte the parse reads (``zipdir``'s
``_DIRECTORIES``), and a torch zip's record layout only for equal records (``torchzip``'s ``_LAYOUTS``)."""

from __future__ import annotations

import io
import zipfile

from ckptdoctor.limits import DEFAULT_LIMITS
from ckptdoctor.readers.zipdir import read_directory


def _zip(records: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name, data in records.items():
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            z.writestr(info, data)
    return buf.getvalue()


def _members(raw: bytes) -> list[tuple[str, int, int]]:
    d, problems = read_directory(io.BytesIO(raw), len(raw), DEFAULT_LIMITS)
    assert d is not None and not problems
    return [(m.name, m.offset, m.size) for m in d.members]


def test_a_directory_differing_only_in_crcs_parses_the_same_and_a_renamed_one_does_not() -> None:
    first = _zip({"a/data.pkl": b"x" * 10, "a/data/0": b"0123"})
    second = _zip({"a/data.pkl": b"y" * 10, "a/data/0": b"4567"})  # same layout, other CRCs
    renamed = _zip({"a/data.pkl": b"y" * 10, "a/data/1": b"4567"})  # one name byte differs
    assert first != second and len(renamed) == len(second)
    assert _members(first) == _members(second) == [("a/data.pkl", 0, 10), ("a/data/0", 50, 4)]
    assert _members(renamed) == [("a/data.pkl", 0, 10), ("a/data/1", 50, 4)]
    assert _members(second) == _members(first)  # and back: the cache held the renamed one in between
