"""Remote roots at ``gs://``: gcsfs against a real GCS JSON-API server (gcp-storage-emulator) on loopback.

tests/sources/test_remote.py proves the remote path against S3 in depth (request and byte counts); this module proves
the same code is backend-neutral: a second fsspec backend, reached only through its URL scheme, gives the same report
as the local tree, reading headers only.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.paths import REPO

pytest.importorskip("gcp_storage_emulator")
# gcsfs >= 2026.x first asks the storage-control gRPC API for the bucket's layout, which the emulator does not
# serve (a 60 s timeout per bucket); its plain JSON-API filesystem is what every GCS bucket answers.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
gcsfs = pytest.importorskip("gcsfs")

import fsspec  # noqa: E402  (only once the skips and the setting above have run)
from gcp_storage_emulator.server import create_server  # noqa: E402

from ckptdoctor.scanner import scan  # noqa: E402
from tests.helpers.builders import comparable_report  # noqa: E402

FIXTURES = REPO / "fixtures"
BUCKET = "ckpts"
# Findings that compare file times: an object's time is when it was uploaded, not when the trainer wrote it.
_TIME_FIXTURES = {"stale-higher"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def gcs() -> Iterator[str]:
    """An in-memory GCS emulator on 127.0.0.1 with ``fixtures/`` uploaded; yields the ``gs://`` URL of the copy."""
    port = _free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    old = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    gcsfs.GCSFileSystem.clear_instance_cache()
    try:
        fs = fsspec.filesystem("gs", token="anon")
        # One simple upload per file (fs.put and batched fs.pipe take 30-120 s against the emulator).
        for p in sorted(FIXTURES.rglob("*")):
            if p.is_file():
                fs.pipe_file(f"{BUCKET}/fixtures/{p.relative_to(FIXTURES).as_posix()}", p.read_bytes())
        fs.invalidate_cache()
        yield f"gs://{BUCKET}/fixtures/"
    finally:
        server.stop()
        if old is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = old
        gcsfs.GCSFileSystem.clear_instance_cache()




def _fetched(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of the ranged reads gcsfs makes for file objects (``GCSFile._fetch_range``)."""
    sizes: list[int] = []
    real = gcsfs.core.GCSFile._fetch_range

    def counting(self: Any, start: int | None = None, end: int | None = None) -> bytes:
        data: bytes = real(self, start, end)
        sizes.append(len(data))
        return data

    monkeypatch.setattr(gcsfs.core.GCSFile, "_fetch_range", counting)
    return sizes


@pytest.mark.parametrize("name", ["stub-shadow", "fsdp"])
def test_gcs_scan_matches_local(gcs: str, name: str) -> None:
    remote = scan(gcs + name + "/", jobs=4)
    local = scan(str(FIXTURES / name), jobs=4)
    assert comparable_report(remote) == comparable_report(local)
    assert remote.files == local.files > 0


def test_gcs_scan_of_every_fixture(gcs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fetched = _fetched(monkeypatch)
    remote = scan(gcs, jobs=2)
    local = scan(str(FIXTURES), jobs=2)
    a, b = comparable_report(remote), comparable_report(local)
    assert [r["resume_pick"] for r in a["runs"]] == [r["resume_pick"] for r in b["runs"]]
    time_paths = tuple(f"{n}/" for n in _TIME_FIXTURES)
    keep = [f for f in a["findings"] if not f["path"].startswith(time_paths)]
    assert keep == [f for f in b["findings"] if not f["path"].startswith(time_paths)]
    assert {f["rule"] for f in keep} >= {"CKD201", "CKD102"}  # the broken fixtures are found there too
    # Whatever gcsfs fetched through file objects stays within the tree's size (small objects are read whole).
    total = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
    assert sum(fetched) <= total


def test_settings_file_at_a_url_root_applies(gcs: str) -> None:
    """`.ckptdoctor.toml` at a remote root is read like a local one (here: CKD201 ignored, so stub-shadow passes)."""
    from click.testing import CliRunner

    from ckptdoctor.cli import main

    # JSON is parsed from stdout alone: the emulator's server thread may print to stderr, which CliRunner captures.

    fs = fsspec.filesystem("gs", token="anon")
    root = f"{BUCKET}/configured/"
    for p in sorted((FIXTURES / "stub-shadow").rglob("*")):
        if p.is_file():
            fs.pipe_file(root + p.relative_to(FIXTURES / "stub-shadow").as_posix(), p.read_bytes())
    url = f"gs://{root}"
    before = CliRunner().invoke(main, ["scan", "--format", "json", url])

    assert before.exit_code == 1 and "CKD201" in {f["rule"] for f in json.loads(before.stdout)["findings"]}
    fs.pipe_file(root + ".ckptdoctor.toml", b'ignore = ["CKD201"]\n')
    fs.invalidate_cache()
    after = CliRunner().invoke(main, ["scan", "--format", "json", url])
    assert "CKD201" not in {f["rule"] for f in json.loads(after.stdout)["findings"]}
    fs.pipe_file(root + ".ckptdoctor.toml", b"ignore = [\n")
    fs.invalidate_cache()
    broken = CliRunner().invoke(main, ["scan", url])
    assert broken.exit_code == 2 and ".ckptdoctor.toml" in broken.output


def test_a_second_scan_in_the_same_process_sees_new_objects(gcs: str) -> None:
    """fsspec caches listings per file system instance; a launcher that gates every resume must not see old ones."""
    fs = fsspec.filesystem("gs", token="anon")
    root = f"{BUCKET}/growing/"
    src = FIXTURES / "stub-shadow" / "checkpoint-4"
    for p in sorted(src.rglob("*")):
        if p.is_file():
            fs.pipe_file(root + "checkpoint-4/" + p.relative_to(src).as_posix(), p.read_bytes())
    first = scan(f"gs://{root}")
    assert [r.resume_pick for r in first.trees[0].runs] == ["checkpoint-4"]
    for p in sorted(src.rglob("*")):
        if p.is_file():
            fs.pipe_file(root + "checkpoint-6/" + p.relative_to(src).as_posix(), p.read_bytes())
    second = scan(f"gs://{root}")
    assert [r.resume_pick for r in second.trees[0].runs] == ["checkpoint-6"]
