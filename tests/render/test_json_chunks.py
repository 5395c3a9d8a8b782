"""The JSON report is written a run entry at a time (``render.report.json_chunks``, ``cli.output.emit_chunks``), so
a fleet's document is never held whole: the text is ``json.dumps(to_json(report), indent=2)``'s, byte for byte,
with no run, one, or many, and names that JSON escapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptdoctor.cli.output import emit, emit_chunks
from ckptdoctor.render.report import RunPieces, _indented, json_chunks, to_json
from ckptdoctor.scanner import scan
from tests.helpers.builders import make_run
from tests.helpers.paths import REPO, TESTS


def _whole(report_root: Path) -> tuple[str, str]:
    report = scan(str(report_root))
    pieces = RunPieces.of(report, "json")
    return "".join(json_chunks(report, pieces)), json.dumps(to_json(report, pieces), indent=2, allow_nan=False)


@pytest.mark.parametrize("root", [REPO / "fixtures", TESTS / "data"], ids=["fixtures", "data"])
def test_the_document_made_in_pieces_is_the_one_dumped_whole(root: Path) -> None:
    made, whole = _whole(root)
    assert made == whole and json.loads(made)["runs"]


def test_no_run_one_run_and_names_json_escapes(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    made, whole = _whole(empty)
    assert made == whole and '"runs": []' in made
    odd = tmp_path / 'odd "runs": [] \\ é'  # the key's text inside a name, a backslash, a non-ASCII letter
    make_run(odd / "run")
    made, whole = _whole(odd)
    assert made == whole and len(json.loads(made)["runs"]) == 1


def test_emit_chunks_writes_what_emit_writes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chunks = ["x" * 700_000, "y" * 700_000, "", "z", *["w" * 1000] * 100]  # more than it writes at a time
    for parts in (chunks, [], [""]):
        emit_chunks(parts, None, False)
        by_chunks = capsys.readouterr().out
        emit("".join(parts), None, False)
        assert by_chunks == capsys.readouterr().out
        emit_chunks(parts, str(tmp_path / "a"), False)
        emit("".join(parts), str(tmp_path / "b"), False)
        assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    emit_chunks(chunks, None, True)
    assert capsys.readouterr().out == ""


def test_a_report_is_written_a_batch_at_a_time() -> None:
    """The text is handed to the stream in batches of about ``BATCH`` characters (a chunk larger than that whole),
    so what is joined at once stays small however large the report."""
    from ckptdoctor.cli.output import BATCH, _write

    writes: list[str] = []
    chunks = ["a" * 1000] * 1000 + ["b" * (3 * BATCH)] + ["c" * 10] * 10
    _write(chunks, writes.append)
    assert "".join(writes) == "".join(chunks) + "\n"
    assert max(map(len, writes)) < 3 * BATCH + BATCH  # the large chunk with what preceded it, no more
    assert sum(len(w) >= BATCH for w in writes) >= 1_000_000 // BATCH


_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@given(_JSON_VALUES, st.sampled_from(["\n", "\n    "]))
@settings(max_examples=300, deadline=None)
def test_an_entry_is_indented_as_json_dumps_indents_it(value: object, pad: str) -> None:
    """``_indented`` (each run's entry, built without the pure-Python encoder's generators) writes what
    ``json.dumps(indent=2)`` writes, each line break followed by the entry's indentation."""
    assert _indented(value, pad) == json.dumps(value, indent=2, allow_nan=False).replace("\n", pad)


def test_what_json_loads_never_gives_is_json_dumps_own() -> None:
    assert _indented({1: [1.5, (2,)]}, "\n  ") == json.dumps({1: [1.5, (2,)]}, indent=2).replace("\n", "\n  ")
    with pytest.raises(ValueError, match="Out of range float"):
        _indented([float("nan")], "\n")
