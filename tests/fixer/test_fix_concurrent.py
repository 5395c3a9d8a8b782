"""The fixer with a concurrent writer: another process writes a file being rewritten, a file or folder being
quarantined, or holds one open across the move. The writer's bytes are never lost, the fix stops with a clear
message (exit 2) and rolls back, and `undo` restores exactly or refuses clearly, changing nothing."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptdoctor import fixer as fixmod
from ckptdoctor.fixer import calls as fixcalls
from tests.helpers.builders import make_run, trainer_state
from tests.helpers.crash import EXCHANGE, _kill_at
from tests.helpers.fixing import age, clone, deepspeed_checkpoint, run_cli, sharded_checkpoint, stub_run, tree_state

WRITTEN = b'{"written": "by the trainer"}\n'


class Hook:
    """A ``WriteCalls`` that runs ``action`` once, just before (or after) the first call named ``name`` whose
    arguments satisfy ``match``: a writer stepping in between the fixer's check and its act, deterministically."""

    def __init__(
        self, name: str, match: Callable[..., bool], action: Callable[[], None], *, after: bool = False
    ) -> None:
        self.name, self.match, self.action, self.after = name, match, action, after
        self.fired = False

    def calls(self, base: fixmod.WriteCalls | None = None) -> fixmod.WriteCalls:
        base = base or fixmod.WriteCalls()

        def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any) -> Any:
                hit = name == self.name and not self.fired and self.match(*args)
                if hit and not self.after:
                    self.fired = True
                    self.action()
                result = fn(*args)
                if hit and self.after:
                    self.fired = True
                    self.action()
                return result

            return call

        return fixmod.WriteCalls(**{n: wrap(n, getattr(base, n)) for n in fixmod.WriteCalls.NAMES})


@pytest.fixture
def hook(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Hook, fixmod.WriteCalls | None], None]]:
    def install(h: Hook, base: fixmod.WriteCalls | None = None) -> None:
        monkeypatch.setattr(fixcalls, "CALLS", h.calls(base))

    yield install
    monkeypatch.setattr(fixcalls, "CALLS", fixmod.WriteCalls())


def _no_links() -> fixmod.WriteCalls:
    """A filesystem without hard links: the fixer keeps a verified copy of each rewritten original."""
    return _fs(links=False)


def _fs(*, links: bool = True, exchange: bool = True) -> fixmod.WriteCalls:
    """A filesystem without hard links (``EPERM``) and/or without ``RENAME_EXCHANGE`` (``EINVAL``, as an old
    kernel or a filesystem that cannot exchange answers): the fixer copies, and replaces after a last check."""

    def fail(err: int) -> Callable[[str, str], None]:
        def call(a: str, b: str) -> None:
            raise OSError(err, os.strerror(err))

        return call

    base = fixmod.WriteCalls()
    return fixmod.WriteCalls(
        link=base.link if links else fail(errno.EPERM), exchange=base.exchange if exchange else fail(errno.EINVAL)
    )


FALLBACK_WINDOW = (
    "the fixer falls back to hash-then-os.replace, and a rename over the target (or, without hard links, an "
    "in-place write) between its last hash and the replace loses the writer's bytes"
)
NO_EXCHANGE = (
    "renameat2(RENAME_EXCHANGE) is unavailable here (not Linux, a kernel before 3.15, or a filesystem answering "
    f"EINVAL): {FALLBACK_WINDOW}"
)


@pytest.fixture(scope="module")
def scenes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One scenario per fix kind: rewrite the index / trainer state / DeepSpeed `latest`, quarantine file / folder."""
    base = tmp_path_factory.mktemp("concurrent")
    sharded_checkpoint(base / "shard" / "checkpoint-4", wrong=True)
    best = make_run(base / "best", (2, 4))
    state = trainer_state(4, 8)
    state["best_model_checkpoint"] = "/home/alice/runs/best/checkpoint-2"
    (best / "checkpoint-4" / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")
    deepspeed_checkpoint(base / "ds" / "checkpoint-8")
    (base / "stub").mkdir()
    stub_run(base / "stub")
    temp = make_run(base / "temp", (2, 4))
    shutil.copytree(temp / "checkpoint-4", temp / "tmp-checkpoint-6")
    (temp / "tmp-checkpoint-6" / "trainer_state.json").unlink()
    return {p.name: age(p) for p in base.iterdir()}


REWRITES = {
    "shard": "checkpoint-4/model.safetensors.index.json",
    "best": "checkpoint-4/trainer_state.json",
    "ds": "checkpoint-8/latest",
}


def _in_place(path: Path, data: bytes) -> Callable[[], None]:
    """A writer that rewrites the same inode (truncate and write), as `open(path, "w")` does."""

    def write() -> None:
        with open(path, "r+b") as fh:
            fh.truncate(0)
            fh.write(data)

    return write


def _atomic(path: Path, data: bytes) -> Callable[[], None]:
    """A writer that saves a new file beside it and renames it over (a new inode), as careful savers do."""

    def write() -> None:
        tmp = path.with_name(path.name + ".writer")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    return write


def _append(path: Path, data: bytes) -> Callable[[], None]:
    def write() -> None:
        with open(path, "ab") as fh:
            fh.write(data)

    return write


def _same_except(root: Path, before: dict[str, Any], changed: str) -> None:
    """The tree is as before except ``changed`` (the writer's file), and nothing of the fixer's is left in it."""
    now = tree_state(root)
    assert {k: v for k, v in now.items() if k != changed} == {k: v for k, v in before.items() if k != changed}
    assert not [p for p in root.rglob("*") if ".ckptdoctor-" in p.name or p.name.endswith(".partial")]
    quarantine = root / ".ckptdoctor" / "quarantine"
    assert not quarantine.exists() or not [p for p in quarantine.rglob("*") if p.is_file()]


def _fix_meets_writer(
    root: Path, rel: str, h: Hook, expect: bytes | None, hook: Any, base: Any = None, *, subject: str | None = None
) -> None:
    """Run `fix` with the writer ``h`` installed; it must stop (exit 2), keep ``rel`` as written (``expect``) and
    leave the rest of the tree as before, rolled back, with nothing left to undo. The message names ``subject``
    (the path the fixer was moving, when that is not ``rel``)."""
    before = tree_state(root)
    hook(h, base)
    code, out = run_cli("fix", str(root))
    assert h.fired and code == 2, out
    if expect is not None:
        assert (root / rel).read_bytes() == expect
    _same_except(root, before, rel)
    _rolled_back(root, out, subject or rel)


def _rolled_back(root: Path, out: str, rel: str) -> None:
    assert f"`{rel}` was written by another process" in out, out
    assert "rolled back" in out, out
    (j,) = fixmod.load_journals(str(root))
    assert j.state == "rolled-back"
    code, out = run_cli("undo", str(root))
    assert code == 2 and "no fix transaction to undo" in out, out


def _is_temp_of(rel: str) -> Callable[..., bool]:
    name = rel.rsplit("/", 1)[-1]
    return lambda path, *_: os.path.basename(path).startswith(f".{name}.ckptdoctor-")


# ---------------------------------------------------------------------------------------------------------------
# Rewrites: a writer between the journaled hash and the replace


@pytest.mark.parametrize("name", sorted(REWRITES))
@pytest.mark.parametrize("writer", [_in_place, _atomic])
@pytest.mark.parametrize("when", ["temp", "saved", "copied"])
def test_rewrite_target_written_before_the_replace(
    scenes: dict[str, Path], tmp_path: Path, hook: Any, name: str, writer: Any, when: str
) -> None:
    root = clone(scenes[name], tmp_path / name)
    rel = REWRITES[name]
    target = root / rel
    if when == "temp":  # while the fixer writes its temp file
        h = Hook("open", _is_temp_of(rel), writer(target, WRITTEN))
    elif when == "saved":  # after the original is kept (a hard link: the same inode as an in-place writer's)
        h = Hook("link", lambda src, dst: src == str(target), writer(target, WRITTEN), after=True)
    else:  # no hard links here: after the original was copied into the quarantine
        h = Hook("rename", lambda src, dst: src.endswith(".partial"), writer(target, WRITTEN), after=True)
    _fix_meets_writer(root, rel, h, WRITTEN, hook, _no_links() if when == "copied" else None)


@pytest.mark.parametrize("name", sorted(REWRITES))
def test_rewrite_target_written_during_the_copy(scenes: dict[str, Path], tmp_path: Path, hook: Any, name: str) -> None:
    """Without hard links the copy of the original is verified: a write while copying aborts before the replace."""
    root = clone(scenes[name], tmp_path / name)
    rel = REWRITES[name]
    original = (root / rel).read_bytes()
    h = Hook("fchmod", lambda fd, mode: True, _append(root / rel, b"\n"))  # the copy is read, not yet fsynced
    _fix_meets_writer(root, rel, h, original + b"\n", hook, _no_links())


def _swap(target: Path, writer: Callable[[], None], *, exchange: bool = True, after: bool = False) -> Hook:
    """The writer's moment: just before (or after) the call that puts the new file at ``target``: the exchange,
    or the replace where there is none."""
    name = "exchange" if exchange and EXCHANGE else "replace"
    return Hook(name, lambda src, dst: dst == str(target), writer, after=after)


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "replace"])
@pytest.mark.parametrize("name", sorted(REWRITES))
def test_in_place_write_in_the_instant_before_the_replace_is_put_back(
    scenes: dict[str, Path], tmp_path: Path, hook: Any, name: str, exchange: bool
) -> None:
    """After the last check, an in-place writer lands in the original's inode: the exchange brings that inode out
    at the temp path, where the fixer sees it and swaps it back; without an exchange the quarantine holds it (a
    hard link), and the fixer sees it after the replace and puts that inode back."""
    root = clone(scenes[name], tmp_path / name)
    rel = REWRITES[name]
    h = _swap(root / rel, _in_place(root / rel, WRITTEN), exchange=exchange)
    _fix_meets_writer(root, rel, h, WRITTEN, hook, _fs(exchange=exchange))


@pytest.mark.xfail(not EXCHANGE, strict=True, reason=NO_EXCHANGE)
@pytest.mark.parametrize("links", [True, False])
def test_write_between_last_hash_and_replace_is_not_lost(
    scenes: dict[str, Path], tmp_path: Path, hook: Any, links: bool
) -> None:
    """A rename over the target (or, without hard links, an in-place write) right before the atomic exchange: what
    the exchange takes out is not the original, so the fixer swaps the writer's file back and rolls back."""
    root = clone(scenes["ds"], tmp_path / "ds")
    rel = REWRITES["ds"]
    writer = _atomic if links else _in_place
    h = _swap(root / rel, writer(root / rel, WRITTEN))
    _fix_meets_writer(root, rel, h, WRITTEN, hook, _fs(links=links))


@pytest.mark.xfail(strict=True, reason=f"known window without RENAME_EXCHANGE (EINVAL simulated): {FALLBACK_WINDOW}")
@pytest.mark.parametrize("links", [True, False])
def test_without_rename_exchange_the_window_remains(
    scenes: dict[str, Path], tmp_path: Path, hook: Any, links: bool
) -> None:
    root = clone(scenes["ds"], tmp_path / "ds")
    rel = REWRITES["ds"]
    writer = _atomic if links else _in_place
    h = _swap(root / rel, writer(root / rel, WRITTEN), exchange=False)
    hook(h, _fs(links=links, exchange=False))
    run_cli("fix", str(root))
    assert h.fired
    assert any(p.read_bytes() == WRITTEN for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize("links", [True, False])
def test_without_rename_exchange_the_rewrite_still_applies_and_undoes(
    scenes: dict[str, Path], tmp_path: Path, hook: Any, links: bool
) -> None:
    root = clone(scenes["ds"], tmp_path / "ds")
    before = tree_state(root)
    hook(Hook("open", lambda *a: False, lambda: None), _fs(links=links, exchange=False))
    code, out = run_cli("fix", str(root))
    assert code == 0, out
    assert "Fixed 1 problem" in out, out
    assert (root / REWRITES["ds"]).read_text() == "global_step8"
    assert run_cli("undo", str(root))[0] == 0
    assert tree_state(root) == before


needs_exchange = pytest.mark.skipif(not EXCHANGE, reason=NO_EXCHANGE)


@needs_exchange
def test_written_twice_around_the_exchange_keeps_both(scenes: dict[str, Path], tmp_path: Path, hook: Any) -> None:
    """One write before the exchange and another over the fixer's file right after it: the last write stays at
    the target and the one before it is set aside in the quarantine, named in the message; nothing to undo."""
    root = clone(scenes["ds"], tmp_path / "ds")
    rel = REWRITES["ds"]
    before = tree_state(root)
    first = _swap(root / rel, _atomic(root / rel, WRITTEN))
    second = _swap(root / rel, _atomic(root / rel, b"global_step12"), after=True)
    hook(second, first.calls())
    code, out = run_cli("fix", str(root))
    assert first.fired and second.fired and code == 2, out
    assert (root / rel).read_bytes() == b"global_step12"
    (j,) = fixmod.load_journals(str(root))
    aside = f"{fixmod.quarantine_path(j.txid, rel)}.written-during-fix"
    assert f"the bytes written before are in `{aside}`" in out, out
    assert (root / aside).read_bytes() == WRITTEN
    now = tree_state(root)
    assert {k: v for k, v in now.items() if k != rel and not k.startswith(".ckptdoctor")} == {
        k: v for k, v in before.items() if k != rel
    }
    assert j.state == "rolled-back" and not [p for p in root.rglob("*") if ".ckptdoctor-" in p.name]


@needs_exchange
@pytest.mark.parametrize("direction", ["undo", "fix"])
def test_killed_right_after_the_exchange_recovers(scenes: dict[str, Path], tmp_path: Path, direction: str) -> None:
    """SIGKILL between the exchange and its check: the original is at the temp path, the new text at the target."""
    src = scenes["ds"]
    before = tree_state(src)
    done = clone(src, tmp_path / "done")
    run_cli("fix", str(done))
    root = clone(src, tmp_path / "ds")
    _kill_at(root, "op:1:exchanged", "fix")
    (j,) = fixmod.load_journals(str(root))
    assert (root / j.ops[0].temp(j.txid)).read_text() == "global_step9"
    code, out = run_cli(direction, str(root))
    assert code == 0, out
    if direction == "undo":
        assert tree_state(root) == before
    else:
        assert tree_state(root) == tree_state(done)
        assert run_cli("undo", str(root))[0] == 0
        assert tree_state(root) == before


class Killed(BaseException):
    """Stands in for SIGKILL inside the test process: nothing of the fixer's catches it."""


def _kill() -> None:
    raise Killed


@needs_exchange
@pytest.mark.parametrize("links", [True, False])
def test_killed_after_exchanging_a_written_target_undo_gives_it_back(
    scenes: dict[str, Path], tmp_path: Path, hook: Any, links: bool
) -> None:
    """Killed after the exchange took out a writer's file (so the fixer's text is at the target): `fix` refuses
    to complete it, `undo` swaps the writer's bytes back and removes everything of the fixer's."""
    root = clone(scenes["ds"], tmp_path / "ds")
    rel = REWRITES["ds"]
    before = tree_state(root)
    writer = _swap(root / rel, (_atomic if links else _in_place)(root / rel, WRITTEN))
    hook(_swap(root / rel, _kill, after=True), writer.calls(_fs(links=links)))
    with pytest.raises(Killed):
        fixmod.fix(str(root))
    (j,) = fixmod.load_journals(str(root))
    assert j.state == "applying" and (root / j.ops[0].temp(j.txid)).read_bytes() == WRITTEN
    hook(Hook("open", lambda *a: False, lambda: None))
    code, out = run_cli("fix", str(root))
    assert code == 2 and f"`{rel}` was written by another process while the fix exchanged it" in out, out
    assert "`ckptdoctor undo` puts its bytes back" in out
    code, out = run_cli("undo", str(root))
    assert code == 0, out
    assert (root / rel).read_bytes() == WRITTEN
    _same_except(root, before, rel)


@pytest.mark.parametrize("links", [True, False])
def test_killed_after_a_writer_beat_the_check_undo_keeps_its_bytes(
    scenes: dict[str, Path], tmp_path: Path, hook: Any, links: bool
) -> None:
    """Killed with the original kept and the new text in the temp file, after a writer replaced the target:
    `undo` recognises the fixer never reached the target and removes only the fixer's files."""
    root = clone(scenes["ds"], tmp_path / "ds")
    rel = REWRITES["ds"]
    before = tree_state(root)

    def write_then_die() -> None:
        _atomic(root / rel, WRITTEN)()
        raise Killed

    when = Hook("link", lambda src, dst: src == str(root / rel), write_then_die, after=True)
    if not links:
        when = Hook("rename", lambda src, dst: src.endswith(".partial"), write_then_die, after=True)
    hook(when, _fs(links=links))
    with pytest.raises(Killed):
        fixmod.fix(str(root))
    hook(Hook("open", lambda *a: False, lambda: None))
    code, out = run_cli("undo", str(root))
    assert code == 0, out
    assert (root / rel).read_bytes() == WRITTEN
    _same_except(root, before, rel)


# ---------------------------------------------------------------------------------------------------------------
# Quarantine moves: the moved content is checked against the journal


def _is(path: Path) -> Callable[..., bool]:
    return lambda src, *_: src == str(path)


@pytest.mark.parametrize("after", [False, True], ids=["before-move", "during-move"])
def test_quarantined_file_written_around_the_move_goes_back(
    scenes: dict[str, Path], tmp_path: Path, hook: Any, after: bool
) -> None:
    root = clone(scenes["stub"], tmp_path / "stub")
    rel = "checkpoint-4/pytorch_model.bin"
    target = root / rel
    original = target.read_bytes()
    fd = os.open(target, os.O_WRONLY | os.O_APPEND)  # the writer's descriptor follows the inode across the move

    def write() -> None:
        os.write(fd, b"more")

    try:
        _fix_meets_writer(root, rel, Hook("rename", _is(target), write, after=after), original + b"more", hook)
    finally:
        os.close(fd)


@pytest.mark.parametrize("after", [False, True], ids=["before-move", "during-move"])
def test_new_file_in_a_quarantined_folder_goes_back_with_it(
    scenes: dict[str, Path], tmp_path: Path, hook: Any, after: bool
) -> None:
    root = clone(scenes["temp"], tmp_path / "temp")
    folder = root / "tmp-checkpoint-6"
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)  # the writer's folder handle follows it across the move

    def create() -> None:
        fd = os.open("trainer_state.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dfd)
        os.write(fd, WRITTEN)
        os.close(fd)

    try:  # the folder goes back with the new file in it, keeping its own mtime
        h = Hook("rename", _is(folder), create, after=after)
        _fix_meets_writer(root, "tmp-checkpoint-6/trainer_state.json", h, WRITTEN, hook, subject="tmp-checkpoint-6")
    finally:
        os.close(dfd)


# ---------------------------------------------------------------------------------------------------------------
# A writer that keeps the file open after the fix: its bytes land in the quarantine; undo refuses


def _holder(path: Path) -> subprocess.Popen[str]:
    """Another process that opens ``path`` now and appends a line when told to."""
    code = (
        "import os, sys\n"
        f"fd = os.open({str(path)!r}, os.O_WRONLY | os.O_APPEND)\n"
        "print('open', flush=True)\n"
        "sys.stdin.readline()\n"
        "os.write(fd, b'late bytes\\n')\n"
        "os.close(fd)\n"
        "print('wrote', flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "open\n"
    return proc


@pytest.mark.parametrize(("name", "rel"), [("stub", "checkpoint-4/pytorch_model.bin"), ("ds", REWRITES["ds"])])
def test_open_descriptor_writes_land_in_the_quarantine_and_undo_refuses(
    scenes: dict[str, Path], tmp_path: Path, name: str, rel: str
) -> None:
    root = clone(scenes[name], tmp_path / name)
    original = (root / rel).read_bytes()
    proc = _holder(root / rel)
    try:
        code, out = run_cli("fix", str(root))
        assert "Fixed 1 problem" in out, out
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline() == "wrote\n"
    finally:
        proc.kill()
        proc.wait()
    (j,) = fixmod.load_journals(str(root))
    kept = root / fixmod.quarantine_path(j.txid, rel)
    assert kept.read_bytes() == original + b"late bytes\n"  # the late bytes are where the user can find them
    after_fix = tree_state(root)
    code, out = run_cli("undo", str(root))
    assert code == 2, out
    assert f"`{fixmod.quarantine_path(j.txid, rel)}` (the original of `{rel}`) changed after the fix" in out
    assert "may still have it open" in out and "Nothing was changed" in out
    assert tree_state(root) == after_fix and kept.read_bytes() == original + b"late bytes\n"


# ---------------------------------------------------------------------------------------------------------------
# Undo with a writer between its check and its replace


def test_undo_keeps_a_write_made_after_its_check(scenes: dict[str, Path], tmp_path: Path, hook: Any) -> None:
    root = clone(scenes["ds"], tmp_path / "ds")
    rel = REWRITES["ds"]
    assert "Fixed 1 problem" in run_cli("fix", str(root))[1]
    (j,) = fixmod.load_journals(str(root))
    journal = str(root / ".ckptdoctor" / "journal" / f"{j.txid}.json")
    h = Hook("replace", lambda src, dst: dst == journal, _in_place(root / rel, b"global_step12"))  # "undoing"
    hook(h)
    code, out = run_cli("undo", str(root))
    assert h.fired and code == 2, out
    assert f"`{rel}` was written by another process" in out and "run `ckptdoctor undo` again" in out
    assert (root / rel).read_bytes() == b"global_step12"
    hook(Hook("open", lambda *a: False, lambda: None))
    code, out = run_cli("undo", str(root))
    assert code == 2 and "changed after the fix" in out, out
    assert (root / rel).read_bytes() == b"global_step12"
    assert (root / fixmod.quarantine_path(j.txid, rel)).read_text() == "global_step9"  # the original is kept
