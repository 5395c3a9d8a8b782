"""CI-facing output: SARIF locations GitHub accepts, security severities, the py.typed marker, the --deep meter."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import urllib.parse
import zipfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckptdoctor import progress
from ckptdoctor.cli import main
from ckptdoctor.findings import Finding, Severity
from ckptdoctor.render import sarif
from ckptdoctor.rules import all_rules
from tests.helpers.builders import make_checkpoint
from tests.helpers.paths import REPO


def _finding(root: str, path: str = "checkpoint-4/model.safetensors") -> Finding:
    return Finding("CKD102", "incomplete-checkpoint", Severity.WARNING, path, "msg", root=root)


def _location(doc: dict) -> dict:  # type: ignore[type-arg]
    return doc["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"]  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------------------------------
# SARIF and annotation locations


def test_a_root_under_the_working_directory_is_relative_to_srcroot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for root in ("./mal", "mal", str(tmp_path / "mal"), "other/../mal"):
        assert _location(sarif.to_sarif([_finding(root)])) == {
            "uri": "mal/checkpoint-4/model.safetensors",
            "uriBaseId": "%SRCROOT%",
        }, root
        assert "file=mal/checkpoint-4/model.safetensors," in sarif.render_github([_finding(root)]), root


def test_an_annotation_points_at_the_file_at_fault(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder finding that names its file (``Finding.file``) is annotated on that file, as SARIF anchors it:
    GitHub shows annotations on files, not on folders. One with no file stays at its folder."""
    monkeypatch.chdir(tmp_path)
    at_folder = Finding("CKD217", "untied-head-not-saved", Severity.ERROR, "checkpoint-4", "msg", root="mal",
                        file="checkpoint-4/config.json")  # fmt: skip
    assert "file=mal/checkpoint-4/config.json," in sarif.render_github([at_folder])
    assert "file=mal/checkpoint-4," in sarif.render_github([_finding("mal", "checkpoint-4")])


def test_a_root_outside_the_working_directory_is_an_absolute_file_uri(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SARIF §3.4.4: an absolute URI carries no uriBaseId; `../x` against %SRCROOT% would leave the repository."""
    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(tmp_path / "repo")
    target = tmp_path / "review 2" / "checkpoint-4" / "model.safetensors"
    for root in ("../review 2", str(tmp_path / "review 2")):
        loc = _location(sarif.to_sarif([_finding(root)]))
        assert set(loc) == {"uri"}, root
        parsed = urllib.parse.urlsplit(loc["uri"])
        assert parsed.scheme == "file" and parsed.netloc == "" and " " not in loc["uri"]
        assert urllib.parse.unquote(parsed.path) == target.as_posix()
        line = sarif.render_github([_finding(root)])
        assert f"file={sarif._escape_property(target.as_posix())}," in line


def test_remote_roots_keep_their_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    loc = _location(sarif.to_sarif([_finding("s3://bucket/run")]))
    assert loc == {"uri": "s3://bucket/run/checkpoint-4/model.safetensors"}


def test_undecodable_file_names_render(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    name = os.fsdecode(b"ck\xff")
    loc = _location(sarif.to_sarif([_finding(".", name)]))
    assert loc == {"uri": "ck%FF", "uriBaseId": "%SRCROOT%"}
    json.dumps(sarif.to_sarif([_finding(str(tmp_path.parent / "x"), name)]), allow_nan=False)


def test_cli_sarif_and_github_name_the_same_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reviewer's layout: a run inside the repository (`./mal/...`) and one beside it (`../review2/...`)."""
    inside = make_checkpoint(tmp_path / "repo" / "mal" / "checkpoint-4")
    beside = make_checkpoint(tmp_path / "review2" / "checkpoint-4")
    for ck in (inside, beside):
        (ck / "trainer_state.json").unlink()  # CKD102
    monkeypatch.chdir(tmp_path / "repo")
    runner = CliRunner()
    outside = (tmp_path / "review2" / "checkpoint-4").as_posix()
    for root, want in (("./mal", "mal/checkpoint-4"), ("../review2", outside)):
        doc = json.loads(runner.invoke(main, ["scan", "--format", "sarif", root]).stdout)
        result = next(r for r in doc["runs"][0]["results"] if r["ruleId"] == "CKD102")
        loc = result["locations"][0]["physicalLocation"]["artifactLocation"]
        if want.startswith("/"):
            assert loc == {"uri": Path(want).as_uri()}
        else:
            assert loc == {"uri": want, "uriBaseId": "%SRCROOT%"}
        annotations = runner.invoke(main, ["scan", "--format", "github", root]).stdout
        assert f"file={sarif._escape_property(want)},title=CKD102" in annotations
        assert "file=./" not in annotations and "file=.." not in annotations


# ---------------------------------------------------------------------------------------------------------------
# Security severities


def test_every_security_rule_has_a_security_severity_and_tag() -> None:
    security = {r.code for r in all_rules() if r.security}
    assert security == {r.code for r in all_rules() if r.code.startswith("CKD6")}
    findings = [Finding(r.code, r.name, r.severity, "x", "m", root=".") for r in all_rules()]
    rules = {d["id"]: d for d in sarif.to_sarif(findings)["runs"][0]["tool"]["driver"]["rules"]}
    for r in all_rules():
        props = rules[r.code]["properties"]
        if r.code in security:
            assert props["tags"][0] == "security" and "checkpoint" in props["tags"]
            score = props["security-severity"]
            assert isinstance(score, str) and 0.1 <= float(score) <= 10.0
            # an error is at least "high" (>= 7.0), a warning at most "medium" (< 7.0)
            assert (float(score) >= 7.0) == (r.severity == Severity.ERROR), r.code
        else:
            assert "security" not in props["tags"] and "security-severity" not in props, r.code
    assert rules["CKD601"]["properties"]["security-severity"] == "9.0"  # code execution on load: critical


# ---------------------------------------------------------------------------------------------------------------
# Packaging


def test_py_typed_is_shipped_in_the_wheel(tmp_path: Path) -> None:
    """PEP 561: without the marker, a downstream `mypy --strict` treats ckptdoctor as untyped.

    The wheel is built from a copy of the sources (a build writes build/ and egg-info next to them).
    """
    assert (REPO / "ckptdoctor" / "py.typed").is_file()
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "ckptdoctor", src / "ckptdoctor", ignore=shutil.ignore_patterns("__pycache__"))
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "whl"),
           str(src)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    (wheel,) = (tmp_path / "whl").glob("ckptdoctor-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "ckptdoctor/py.typed" in names and "ckptdoctor/pickle_verdict/allowlist.json" in names


# ---------------------------------------------------------------------------------------------------------------
# The --deep meter


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(progress, "_clock", c)
    return c


def test_the_meter_waits_half_a_second_then_shows_no_eta_until_it_can_estimate(clock: _Clock) -> None:
    stream = io.StringIO()
    quick, meter = progress.Meter(stream, 1, 100_000), progress.Meter(stream, 3, 100_000_000)
    clock.now = 0.3
    for m in (quick, meter):
        m.advance(100_000)
        m.file_done()
    quick.close()  # a read done within DELAY: nothing drawn, nothing to erase
    assert stream.getvalue() == ""  # the reviewer's scan drew from its first file
    clock.now = 0.6
    meter.advance(100_000)
    first = stream.getvalue()
    assert first == "\rdeep: 1/3 files, 200.0 KB/100.0 MB" and "ETA" not in first  # was "ETA 7h42m"
    clock.now = 5.0
    meter.advance(100_000)  # 0.3% read after 5 s: still too little to extrapolate
    assert "ETA" not in stream.getvalue()
    clock.now = 10.0
    meter.advance(49_700_000)
    last = stream.getvalue().rsplit("\r", 1)[1]
    assert last == "deep: 1/3 files, 50.0 MB/100.0 MB, 5.0 MB/s, ETA 0m10s"
    meter.close()
    assert stream.getvalue().endswith("\r" + " " * len(last) + "\r")  # erased: the report starts on a clean line


def test_the_meter_redraws_at_most_ten_times_a_second(clock: _Clock) -> None:
    stream = io.StringIO()
    meter = progress.Meter(stream, 2000, 2000 * 1_000_000)
    for i in range(2000):  # the reviewer's 2,000 files in 2 s: one redraw per file before
        clock.now = (i + 1) * 0.001
        meter.advance(1_000_000)
        meter.file_done()
    meter.close()
    draws = stream.getvalue().count("\rdeep:")
    assert 1 <= draws <= 10 * 2


def test_a_shorter_line_overwrites_the_longer_one(clock: _Clock) -> None:
    stream = io.StringIO()
    meter = progress.Meter(stream, 1, 10**12)
    clock.now = 2.0
    meter.advance(10**11)  # with a rate and ETA
    long = stream.getvalue()
    meter.total = 10**15  # the fraction drops under 1%: the ETA goes, the line gets shorter
    clock.now = 3.0
    meter.advance(1)
    short = stream.getvalue()[len(long):]
    assert len(short) == len(long) and "ETA" not in short and short.endswith(" ")  # no tail of the longer line


def test_progress_is_quiet_off_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert progress.progress_stream() is None

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert progress.progress_stream() is tty


def test_sizes_and_durations() -> None:
    assert [progress.human_size(n) for n in (0, 999, 65_600, 1_200_000_000, 3 * 10**12)] == [
        "0 B", "999 B", "65.6 KB", "1.2 GB", "3.0 TB"
    ]
    assert [progress.human_duration(s) for s in (0, 9.9, 249, 7500)] == ["0m00s", "0m09s", "4m09s", "2h05m"]
