"""The fixer against a hostile `.ckptdoctor/` (downloaded with the checkpoints) and careless use: a crafted journal,
quarantine, lock or link never makes `fix` or `undo` write outside the root, follow a link, hang or print a
traceback; the refusal changes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptdoctor import fixer as fixmod
from ckptdoctor.findings import OpKind
from ckptdoctor.fixer import calls as fixcalls
from tests.helpers.builders import make_run
from tests.helpers.console import HANG_GUARD
from tests.helpers.fixing import age, clone, run_cli, stub_run, tree_state
from tests.helpers.journals import TXID, forge, journal_op


@pytest.fixture(scope="module")
def aged_stub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real LoRA run with a CKD201 stub (one safe quarantine), aged so no fix calls it busy."""
    src = tmp_path_factory.mktemp("adv") / "src"
    src.mkdir()
    return age(stub_run(src))


@pytest.fixture
def site(aged_stub: Path, tmp_path: Path) -> tuple[Path, Path]:
    """``home`` with a user's file, and a downloaded checkpoint folder ``home/dl/model`` (the root) inside it."""
    home = tmp_path / "home"
    (home / "dl").mkdir(parents=True)
    (home / "victim.txt").write_text("the user's own file\n")
    (home / "dl" / "victim.txt").write_text("the user's own file\n")
    return home, clone(aged_stub, home / "dl" / "model")


def snapshot(home: Path) -> dict[str, tuple[Any, ...]]:
    """Everything under ``home``, the root and its `.ckptdoctor/` included (no mtimes: the lock comes and goes)."""
    return tree_state(home, mtimes=False)


def refused(home: Path, before: dict[str, tuple[Any, ...]], *args: str) -> str:
    code, out = run_cli(*args)
    assert code == 2, out
    assert snapshot(home) == before
    return out


# ---------------------------------------------------------------------------------------------------------------
# A crafted journal never reaches outside the root


def _outside_cases(home: Path, root: Path) -> dict[str, tuple[str, list[fixmod.JournalOp], str, str]]:
    victim = fixmod.digest(str(home / "victim.txt"))
    planted = root / ".ckptdoctor" / "planted"
    planted.parent.mkdir()
    planted.write_text("attacker's text\n")
    (root / ".ckptdoctor" / "quarantine" / TXID).mkdir(parents=True)  # so that `<txid>/../..` resolves
    return {
        # undo would move the attacker's file to `home/planted`
        "undo-moves-out": (
            "undo",
            [journal_op(OpKind.QUARANTINE, "../../planted", fixmod.digest(str(planted)), status="done")],
            "applied",
            TXID,
        ),
        # fix would complete a rewrite of the user's file with the attacker's text
        "fix-rewrites-out": (
            "fix",
            [journal_op(OpKind.REWRITE_TEXT, "../../victim.txt", victim, content="pwned\n")],
            "applying",
            TXID,
        ),
        # fix would move the user's file into the downloaded folder
        "fix-moves-in": ("fix", [journal_op(OpKind.QUARANTINE, "../../victim.txt", victim)], "applying", TXID),
        # a txid with `..`: the quarantine is outside, and undo pulls `home/dl/victim.txt` into the root
        "txid-dotdot": (
            "undo",
            [journal_op(OpKind.QUARANTINE, "victim.txt", victim, status="done")],
            "applied",
            "x/../../../..",
        ),
        # an absolute path is no way out either
        "absolute": ("fix", [journal_op(OpKind.QUARANTINE, str(home / "victim.txt"), victim)], "applying", TXID),
        # ckptdoctor's own files are never an operation's target
        "own-folder": (
            "fix",
            [journal_op(OpKind.QUARANTINE, ".ckptdoctor/planted", fixmod.digest(str(planted)))],
            "applying",
            TXID,
        ),
    }


@pytest.mark.parametrize("case", ["undo-moves-out", "fix-rewrites-out", "fix-moves-in", "txid-dotdot", "absolute",
                                  "own-folder"])  # fmt: skip
def test_journal_paths_outside_the_root_are_refused(site: tuple[Path, Path], case: str) -> None:
    home, root = site
    command, ops, state, txid = _outside_cases(home, root)[case]
    (root / ".ckptdoctor" / "quarantine" / "x").mkdir()
    forge(root, ops, state=state, txid=txid, name=TXID)
    before = snapshot(home)
    out = refused(home, before, command, str(root))
    assert "journal" in out and "move it away" in out, out
    assert (home / "victim.txt").read_text() == "the user's own file\n"
    assert not (home / "planted").exists()


def test_a_link_on_the_way_to_a_journaled_path_is_refused(site: tuple[Path, Path]) -> None:
    home, root = site
    os.symlink("../..", root / "up")  # a relative link shipped in the download: `up/victim.txt` is the user's
    forge(root, [journal_op(OpKind.REWRITE_TEXT, "up/victim.txt", fixmod.digest(str(home / "victim.txt")),
                            content="pwned\n")], state="applying")  # fmt: skip
    out = refused(home, snapshot(home), "fix", str(root))
    assert "symbolic link" in out, out


def test_a_linked_quarantine_is_refused(site: tuple[Path, Path]) -> None:
    home, root = site
    stash = home / "stash" / TXID
    stash.mkdir(parents=True)
    (stash / "victim.txt").write_text("the user's own file\n")
    (root / ".ckptdoctor").mkdir()
    os.symlink(home / "stash", root / ".ckptdoctor" / "quarantine")
    forge(root, [journal_op(OpKind.QUARANTINE, "victim.txt", fixmod.digest(str(stash / "victim.txt")), status="done")])
    out = refused(home, snapshot(home), "undo", str(root))
    assert "symbolic link" in out, out


def test_undo_never_prunes_folders_through_a_linked_quarantine(site: tuple[Path, Path]) -> None:
    home, root = site
    (home / "keep" / "empty").mkdir(parents=True)
    (root / ".ckptdoctor" / "quarantine").mkdir(parents=True)
    os.symlink(home / "keep", root / ".ckptdoctor" / "quarantine" / TXID)
    forge(root, [])
    _, out = run_cli("undo", str(root))
    assert (home / "keep" / "empty").is_dir(), out


def test_a_linked_journal_folder_is_refused(site: tuple[Path, Path]) -> None:
    home, root = site
    (home / "jdir").mkdir()
    (root / ".ckptdoctor").mkdir()
    os.symlink(home / "jdir", root / ".ckptdoctor" / "journal")
    (home / "jdir" / f"{TXID}.json").write_text(
        json.dumps(fixmod.Journal(TXID, str(root), 1.0, "applied", [], {}).to_json())
    )
    before = snapshot(home)
    for args in (("undo", str(root)), ("fix", str(root)), ("undo", "--list", str(root))):
        out = refused(home, before, *args)
        assert "not a plain folder" in out, out


def test_journal_folder_times_outside_the_root_are_refused(site: tuple[Path, Path]) -> None:
    home, root = site
    mtime = (home / "dl").stat().st_mtime_ns
    forge(root, [], dir_times={"../..": (0, 0), "..": (0, 0)})
    refused(home, snapshot(home), "undo", str(root))
    assert (home / "dl").stat().st_mtime_ns == mtime


# ---------------------------------------------------------------------------------------------------------------
# A malformed journal is a refusal, never a traceback or a hang


MALFORMED: dict[str, Callable[[dict[str, Any]], None]] = {
    "dir-times-a-list": lambda d: d.update(dir_times_ns=[]),
    "index-infinite": lambda d: d["ops"][0].update(index=1e400),
    "content-not-text": lambda d: d["ops"][0].update(kind="rewrite-text", content=5),
    "times-out-of-range": lambda d: d.update(dir_times_ns={".": [10**30, 10**30]}),
    "op-times-out-of-range": lambda d: d["ops"][0].update(times_ns=[10**30, 10**30]),
    "unknown-status": lambda d: d["ops"][0].update(status="weird"),
    "txid-not-the-name": lambda d: d.update(txid="20260101T000000Z-000000"),
    # Found in review: a rewrite without its text crashed `fix` on an assert; with a digest that is not its text's
    # it was applied and could never be undone.
    "rewrite-without-text": lambda d: d["ops"][0].update(kind="rewrite-text", content=None),
    "rewrite-digest-not-its-text": lambda d: d["ops"][0].update(
        kind="rewrite-text", content="x\n", after={"type": "file", "size": 2, "sha256": "0" * 64, "mode": "644"}
    ),
    "quarantine-with-text": lambda d: d["ops"][0].update(content="x\n"),
    "unknown-kind-of-path": lambda d: d["ops"][0]["before"].update(type="weird"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_a_malformed_journal_is_a_refusal(site: tuple[Path, Path], name: str) -> None:
    home, root = site
    rel = "checkpoint-2/trainer_state.json"
    forge(root, [journal_op(OpKind.QUARANTINE, rel, fixmod.digest(str(root / rel)))], state="applying",
          edit=MALFORMED[name])  # fmt: skip
    before = snapshot(home)
    for command in ("fix", "undo"):
        out = refused(home, before, command, str(root))
        assert "cannot be read" in out and "move it away" in out, out


def test_a_deeply_nested_journal_is_a_refusal(site: tuple[Path, Path]) -> None:
    home, root = site
    forge(root, []).write_text("[" * 100_000 + "]" * 100_000)
    out = refused(home, snapshot(home), "undo", str(root))
    assert "cannot be read" in out


def test_a_huge_journal_is_refused_without_reading_it(site: tuple[Path, Path]) -> None:
    _, root = site
    path = forge(root, [])
    with open(path, "r+b") as fh:
        fh.truncate(8 << 30)  # sparse: 8 GiB that take no room and would take minutes and gigabytes to parse
    mtime = path.stat().st_mtime_ns
    code, out = run_cli("undo", str(root))
    assert code == 2 and "bytes, more than a journal" in out, out
    assert path.stat().st_mtime_ns == mtime and path.stat().st_size == 8 << 30


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckptdoctor", *args], capture_output=True, text=True, timeout=HANG_GUARD, check=False
    )


@pytest.mark.parametrize("what", ["journal", "lock"])
def test_a_fifo_in_the_own_folder_does_not_hang(site: tuple[Path, Path], what: str) -> None:
    _, root = site
    (root / ".ckptdoctor" / "journal").mkdir(parents=True)
    fifo = root / ".ckptdoctor" / ("lock" if what == "lock" else f"journal/{TXID}.json")
    os.mkfifo(fifo)
    os.utime(fifo, (0, 0))  # an old lock nobody writes: judged stale
    proc = _cli("undo", str(root))  # hung forever before
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr


def test_a_lock_linked_to_a_file_outside_is_never_written(site: tuple[Path, Path]) -> None:
    home, root = site
    run_cli("fix", str(root))
    (root / ".ckptdoctor" / "lock").symlink_to(home / "victim.txt")
    os.utime(root / ".ckptdoctor" / "lock", (0, 0), follow_symlinks=False)
    code, out = run_cli("undo", str(root))
    assert code == 0, out
    assert (home / "victim.txt").read_text() == "the user's own file\n"
    assert not os.path.lexists(root / ".ckptdoctor" / "lock")


# ---------------------------------------------------------------------------------------------------------------
# What the download holds beside the journal


def test_a_deep_folder_is_quarantined_and_undone(tmp_path: Path) -> None:
    """A torn checkpoint holding a folder nested 300 deep: hashing it took time exponential in the depth (it never
    finished), and a recursion error beyond Python's limit."""
    root = make_run(tmp_path / "run", (2, 4, 6))
    (root / "checkpoint-6" / "trainer_state.json").unlink()  # CKD102: the folder is quarantined
    deep = root / "checkpoint-6" / "/".join(["d"] * 300)
    deep.mkdir(parents=True)
    (deep / "x.bin").write_bytes(b"x" * 1000)
    age(root)
    before = tree_state(root)
    proc = _cli("fix", "--select", "CKD102", str(root))
    assert "Fixed 1 problem" in proc.stdout, (proc.stdout, proc.stderr)
    code, out = run_cli("undo", str(root))
    assert code == 0, out
    assert tree_state(root) == before


# ---------------------------------------------------------------------------------------------------------------
# Careless use


def test_undo_twice_and_a_bogus_txid(site: tuple[Path, Path]) -> None:
    _, root = site
    before = tree_state(root)
    run_cli("fix", str(root))
    (journal,) = fixmod.load_journals(str(root))
    assert run_cli("undo", str(root))[0] == 0
    assert tree_state(root) == before
    code, out = run_cli("undo", str(root))
    assert code == 2 and "no fix transaction to undo" in out
    code, out = run_cli("undo", "--txid", journal.txid, str(root))
    assert code == 2 and "already undone" in out
    for bogus in ("nope", "../../etc", "/etc/passwd", ""):
        code, out = run_cli("undo", "--txid", bogus, str(root))
        assert code == 2 and "no transaction" in out, (bogus, out)
    assert tree_state(root) == before


def test_an_own_folder_that_is_a_file(site: tuple[Path, Path]) -> None:
    home, root = site
    (root / ".ckptdoctor").write_text("not a folder\n")
    before = snapshot(home)
    for args in (("fix",), ("fix", "--dry-run"), ("undo",), ("undo", "--list")):
        refused(home, before, *args, str(root))


def test_a_root_given_through_a_link(site: tuple[Path, Path]) -> None:
    home, root = site
    before = tree_state(root)
    os.symlink(root, home / "alias")
    _, out = run_cli("fix", str(home / "alias"))
    assert "Fixed 1 problem" in out, out
    assert not (home / ".ckptdoctor").exists() and not (home / "alias" / ".ckptdoctor" / "lock").exists()
    assert run_cli("undo", str(home / "alias"))[0] == 0
    assert tree_state(root) == before


def test_ctrl_c_at_any_write_leaves_a_transaction_fix_or_undo_finishes(
    site: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT raises KeyboardInterrupt wherever the fixer is: the next `fix` completes it, or `undo` restores it."""
    _, root = site
    before = tree_state(root)
    counted: list[str] = []
    base = fixmod.WriteCalls()

    def calls(stop: int) -> fixmod.WriteCalls:
        def wrap(name: str) -> Callable[..., Any]:
            def call(*args: Any) -> Any:
                counted.append(name)
                if len(counted) == stop:
                    raise KeyboardInterrupt
                return getattr(base, name)(*args)

            return call

        return fixmod.WriteCalls(**{n: wrap(n) for n in fixmod.WriteCalls.NAMES})

    probe = clone(root, root.parent / "probe")
    monkeypatch.setattr(fixcalls, "CALLS", calls(10**9))
    run_cli("fix", str(probe))
    planned = tree_state(probe)
    total = len(counted)
    for k in range(1, total + 1):
        for finish in ("fix", "undo"):
            work = clone(root, root.parent / f"k{k}-{finish}")
            counted.clear()
            monkeypatch.setattr(fixcalls, "CALLS", calls(k))
            code, out = run_cli("fix", str(work))
            assert code == 130 and "Interrupted." in out, (k, out)  # Ctrl-C's exit code
            monkeypatch.setattr(fixcalls, "CALLS", base)
            code, out = run_cli(finish, str(work))
            if finish == "fix":
                assert tree_state(work) == planned, (k, counted[-1], out)
            else:
                assert code == 0 or "no fix transaction to undo" in out, (k, out)
                assert tree_state(work) == before, (k, counted[-1], out)


def test_a_folder_dated_past_2116_keeps_its_transaction_undoable(tmp_path: Path) -> None:
    """Found in review: the journal's time check stopped at 2**62 ns while lstat gives any signed 64-bit value, so
    the fixer refused its own journal (no undo) after fixing a tree with a far-future folder time."""
    from tests.helpers.fixing import mixed_run

    root = tmp_path / "run"
    root.mkdir()
    age(mixed_run(root))
    far = 2**62 + 10**18  # about the year 2148: a skewed clock or a bogus tar
    os.utime(root / "tmp-checkpoint-6", ns=(far, far))
    before = tree_state(root)
    code, out = run_cli("fix", "--force", str(root))
    assert "Fixed" in out, out
    code, out = run_cli("undo", str(root))
    assert code == 0, out
    assert tree_state(root) == before
