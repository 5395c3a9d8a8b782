"""The journal: one fix transaction recorded before its first change, and saved durably as it runs."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass, field
from typing import Any

from ckptdoctor.findings import OpKind
from ckptdoctor.fixer.calls import atomic_write
from ckptdoctor.fixer.digests import Digest, sha256_of
from ckptdoctor.fixer.errors import FixRefused
from ckptdoctor.fixer.paths import CLOEXEC, NOFOLLOW, OWN_DIR, own_path, parent_rel, quarantine_path, rel_problem

JOURNAL_SCHEMA = "ckptdoctor.journal/1"
# A journal holds the new text of its rewrites (each at most ``plan.REWRITE_MAX_BYTES``); a larger file is not one
# the fixer wrote, and is refused before it is read.
JOURNAL_MAX_BYTES = 512 * 1024 * 1024
# What reading one journal back may take (``json.loads`` builds a Python object per value: 25-30 times the bytes of
# `[{},{},...]`), estimated before parsing from the bytes alone: at most 10 times its size plus a little, and 2 GiB.
# The fixer's own journals estimate at 2 (mostly the new text of rewrites) to 8.5 (many moves) times their size in
# ASCII (measured); a fix whose journal would not read back is refused before its first change.
JOURNAL_MAX_MEMORY = 2 * 1024 * 1024 * 1024
_MEMORY_PER_BYTE = 10
_MEMORY_SLACK = 64 * 1024 * 1024
# What values cost once parsed, beyond the text: a container is counted at its `{` or `[`, a value or a key at the
# `,` or `:` before it, a string's own object once (its characters are text). Measured on CPython 3.11 at the worst
# sizes (as the dict and the parser's memo of keys grow): per `{},` in a list 71 bytes, `[0],` 94, `"ab",` 56,
# `{"a":0},` 186; per pair in a dict `"k":1.5,` 176, `"k":"ab",` 202, `"k":{},` 217. The weights cover each by 14%+.
_CONTAINER_COST = 96
_VALUE_COST = 80
_STRING_COST = 40
_WIDE = re.compile(rb"[\xc4-\xef]")  # starts a character above U+00FF: the decoded text takes 2 bytes a character
_ASTRAL = re.compile(rb"[\xf0-\xf4]")  # starts one above U+FFFF: 4 bytes a character
_SPLIT_CHUNK = 1 << 20

# A journal may come with a downloaded folder, so everything in it that names a place is checked before use: a
# txid is one plain name (it becomes a file and a quarantine folder name), paths stay inside the root.
_TXID = re.compile(r"[0-9A-Za-z][0-9A-Za-z_.-]{0,127}")
_STATES = ("applying", "applied", "undoing", "undone", "rolled-back")
_STATUSES = ("pending", "done", "undone")
_DIGEST_TYPES = ("file", "dir", "link", "special")
_NS_LIMIT = 2**63  # st_*_ns and utime(ns=) hold signed 64-bit values: anything lstat returned (any year) fits


def _ns_pair(v: Any) -> tuple[int, int]:
    if isinstance(v, list) and len(v) == 2 and all(type(x) is int and -_NS_LIMIT <= x < _NS_LIMIT for x in v):
        return v[0], v[1]
    raise ValueError(f"{v!r} is not a pair of times in ns")


def _checked_rel(rel: Any, *, own_manifest: bool = False) -> str:
    why = rel_problem(rel, own_manifest=own_manifest) if isinstance(rel, str) else f"{rel!r} is not a path"
    if why is not None:
        raise ValueError(why)
    return str(rel)


@dataclass
class JournalOp:
    """One operation as the journal records it (mutable: its status advances as the transaction runs)."""

    index: int
    kind: OpKind
    path: str
    rules: list[str]
    title: str
    before: Digest
    after: Digest | None  # None: nothing is left at `path` (it moved to the quarantine)
    content: str | None = None
    times: tuple[int, int] | None = None  # a moved folder's own (atime_ns, mtime_ns), kept across the move
    status: str = "pending"  # pending | done | undone
    # `_encode`'s text of this operation for the status it was made for (an operation without new text only: a
    # rewrite's text may be large, and is encoded again). Once journaled, only the status of an operation changes.
    _text: tuple[str, str] | None = field(default=None, init=False, repr=False, compare=False)

    def quarantine(self, txid: str) -> str:
        return quarantine_path(txid, self.path)

    def temp(self, txid: str) -> str:
        """The rewrite's temp file, beside the target (same folder, so ``os.replace`` is atomic)."""
        parent, name = parent_rel(self.path), self.path.rsplit("/", 1)[-1]
        tmp = f".{name}.ckptdoctor-{txid}.tmp"
        return tmp if parent == "." else f"{parent}/{tmp}"

    def to_json(self, txid: str) -> dict[str, Any]:
        return {
            "index": self.index,
            "kind": self.kind.value,
            "path": self.path,
            "rules": self.rules,
            "title": self.title,
            "before": self.before.to_json(),
            "after": None if self.after is None else self.after.to_json(),
            "quarantine": self.quarantine(txid),
            "temp": None if self.kind == OpKind.QUARANTINE else self.temp(txid),
            "content": self.content,
            "times_ns": None if self.times is None else list(self.times),
            "status": self.status,
        }

    @staticmethod
    def from_json(d: Any) -> JournalOp:
        """The operation ``d`` records; ``ValueError`` (or ``KeyError``/``TypeError``) when it is not one the fixer
        could have written: a path outside the root or in ckptdoctor's own folder (the manifest excepted), text
        that is not text, times out of range, an unknown status."""
        kind = OpKind(d["kind"])
        times = d.get("times_ns")
        content = d.get("content")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"the new text of operation {d.get('index')!r} is not text")
        status = str(d.get("status", "pending"))
        if status not in _STATUSES:
            raise ValueError(f"unknown operation status {status!r}")
        before = Digest.from_json(d["before"])
        after = None if d.get("after") is None else Digest.from_json(d["after"])
        if before.type not in _DIGEST_TYPES:
            raise ValueError(f"operation {d.get('index')!r} records an unknown kind of path {before.type!r}")
        if kind == OpKind.QUARANTINE:
            if content is not None or after is not None:
                raise ValueError(f"quarantine operation {d.get('index')!r} carries new text")
        else:
            # A rewrite the fixer wrote records its text and the digest of exactly that text: without them it could
            # neither be applied nor undone.
            data = content.encode("utf-8") if content is not None else None  # lone surrogates: UnicodeEncodeError
            written = None if data is None else ("file", len(data), sha256_of(data))
            if after is None or (after.type, after.size, after.sha256) != written:
                raise ValueError(f"rewrite operation {d.get('index')!r} does not record the text it writes")
        return JournalOp(
            index=int(d["index"]),
            kind=kind,
            path=_checked_rel(d["path"], own_manifest=kind != OpKind.QUARANTINE),
            rules=[str(r) for r in d.get("rules", [])],
            title=str(d.get("title", "")),
            before=before,
            after=after,
            content=content,
            times=None if times is None else _ns_pair(times),
            status=status,
        )


@dataclass
class Journal:
    """One fix transaction: ``state`` is applying | applied | undoing | undone | rolled-back."""

    txid: str
    root: str
    created: float
    state: str
    ops: list[JournalOp]
    dir_times: dict[str, tuple[int, int]] = field(default_factory=dict)  # folders whose mtime the fix keeps

    def to_json(self) -> dict[str, Any]:
        return {**self._head(), "ops": [op.to_json(self.txid) for op in self.ops]}

    def _head(self) -> dict[str, Any]:
        """Everything ``to_json`` holds but the operations (the last key)."""
        from ckptdoctor.version import __version__

        return {
            "schema": JOURNAL_SCHEMA,
            "version": __version__,
            "txid": self.txid,
            "root": self.root,
            "created": self.created,
            "state": self.state,
            "dir_times_ns": {k: list(v) for k, v in sorted(self.dir_times.items())},
        }

    @staticmethod
    def from_json(d: Any) -> Journal:
        """The transaction ``d`` records; ``ValueError`` (or ``KeyError``/``TypeError``) when it is not one the
        fixer could have written (see ``JournalOp.from_json``; the txid must be one plain name; the folders whose
        times it keeps are the root, folders inside it, and ``.ckptdoctor`` itself for a manifest update)."""
        if not isinstance(d, dict) or d.get("schema") != JOURNAL_SCHEMA:
            raise ValueError(f"not a {JOURNAL_SCHEMA} document")
        txid, state, dir_times = d["txid"], str(d["state"]), d.get("dir_times_ns", {})
        if not isinstance(txid, str) or not _TXID.fullmatch(txid):
            raise ValueError(f"{txid!r} is not a transaction id")
        if state not in _STATES:
            raise ValueError(f"unknown transaction state {state!r}")
        if not isinstance(dir_times, dict) or not isinstance(d["ops"], list):
            raise ValueError("`dir_times_ns` or `ops` is not what the fixer writes")
        return Journal(
            txid=txid,
            root=str(d["root"]),
            created=float(d["created"]),
            state=state,
            ops=[JournalOp.from_json(o) for o in d["ops"]],
            dir_times={k if k in (".", OWN_DIR) else _checked_rel(k): _ns_pair(v) for k, v in dir_times.items()},
        )

    @property
    def rules(self) -> list[str]:
        return sorted({r for op in self.ops for r in op.rules})


def load_journals(path: str) -> list[Journal]:
    """Every transaction recorded under root ``path``, oldest first. Reads only; a missing folder means none.

    Raises ``FixRefused`` for a journal folder that is a link or not a folder, and for a journal the fixer could not
    have written (checked before anything acts on it: a journal may come with a downloaded folder).
    """
    root = os.path.realpath(path)
    for rel in (OWN_DIR, f"{OWN_DIR}/journal"):
        try:
            st = os.lstat(os.path.join(root, *rel.split("/")))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise FixRefused(f"cannot read {os.path.join(root, rel)}: {e.strerror or e}") from None
        if not stat.S_ISDIR(st.st_mode):  # lstat: a link is not a folder here
            raise FixRefused(
                f"{os.path.join(root, rel)} is not a plain folder (ckptdoctor never goes through links); move it away "
                "to continue"
            )
    folder = own_path(root, "journal")
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json") and not n.startswith("."))
    except OSError as e:
        raise FixRefused(f"cannot read the journal folder {folder}: {e.strerror or e}") from None
    out: list[Journal] = []
    for name in names:
        full = os.path.join(folder, name)
        try:
            j = Journal.from_json(_parse(_read_journal(full)))
            if f"{j.txid}.json" != name:
                raise ValueError(f"it records transaction {j.txid}")
        except (OSError, ValueError, LookupError, TypeError, AttributeError, ArithmeticError, RecursionError) as e:
            raise FixRefused(f"journal {full} cannot be read ({e}); move it away to continue") from None
        out.append(j)
    return sorted(out, key=lambda j: (j.created, j.txid))


def _read_journal(full: str) -> bytes:
    """A journal's bytes: a regular file (never a FIFO that would block, nor a link) of a sane size."""
    fd = os.open(full, os.O_RDONLY | NOFOLLOW | CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > JOURNAL_MAX_BYTES:
            raise ValueError(_too_large(st.st_size))
        chunks: list[bytes] = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _too_large(size: int) -> str:
    return f"{size:,} bytes, more than a journal the fixer writes"


def _parse(data: bytes) -> Any:
    """The document a journal's bytes hold, parsed only when that fits the memory a journal may take (``ValueError``
    otherwise). Takes the caller's reference: the bytes are dropped before parsing, so pass them straight in."""
    why = parse_problem(data)
    if why is not None:
        raise ValueError(why)
    text = data.decode("utf-8")  # the fixer writes UTF-8; json.loads(bytes) would keep the bytes alive meanwhile
    del data
    return json.loads(text)


def parse_problem(data: bytes, *, shrink: int = 0) -> str | None:
    """Why reading a journal of these bytes is refused (more than ``JOURNAL_MAX_BYTES``, or ``json.loads`` would
    take more memory than ``JOURNAL_MAX_MEMORY`` or 10 times its size plus 64 MiB), or None. Linear in the bytes.

    ``shrink``: bytes the journal may lose before it is read (its statuses get shorter as a fix runs), so a journal
    the fixer checked when it first wrote it passes every later save too.
    """
    if len(data) > JOURNAL_MAX_BYTES:
        return _too_large(len(data))
    limit = min(_MEMORY_PER_BYTE * max(len(data) - shrink, 0) + _MEMORY_SLACK, JOURNAL_MAX_MEMORY)
    need = parse_memory(data, limit)
    if need > limit:
        return (
            f"reading its {len(data):,} bytes would take about {need:,} bytes of memory, more than a journal the "
            "fixer writes"
        )
    return None


def parse_memory(data: bytes, limit: int | None = None) -> int:
    """An upper bound on the memory ``json.loads`` takes for ``data`` beyond the bytes themselves. With ``limit``,
    the first bound found within it is returned, or an amount past it as soon as the bound must be past it.

    The decoded text and the strings parsed out of it take 1, 2 or 4 bytes a character each (the widest character
    decides); every value adds its object. Values are counted from the characters that precede them: first over
    all the bytes (a cheap bound the fixer's journals pass), then outside strings only (a journal holds the new text
    of JSON files as strings, full of `,` and `:` that build nothing).
    """
    width = 1 if data.isascii() else 4 if _ASTRAL.search(data) else 2 if _WIDE.search(data) else 1
    text = 2 * width * len(data)
    naive = text + _values_cost(data)
    if limit is not None and naive <= limit:
        return naive
    plain = _unescaped(data)
    strings = text + _STRING_COST * (plain.count(b'"') // 2)
    if limit is not None and strings > limit:
        return strings  # refused without splitting a file made of tiny strings
    return strings + _outside_cost(plain)


def _unescaped(data: bytes) -> bytes:
    """``data`` without its escaped backslashes, then its escaped quotes: every `"` left opens or closes a string
    (escapes pair from the left in JSON as in ``bytes.replace``; outside strings valid JSON has no backslash)."""
    return data.replace(b"\\\\", b"").replace(b'\\"', b"")


def _outside_cost(plain: bytes) -> int:
    """``_values_cost`` of what lies outside the strings of ``_unescaped`` JSON text."""
    cost, outside = 0, True
    for start in range(0, len(plain), _SPLIT_CHUNK):  # chunks bound the pieces `split` makes at once
        pieces = plain[start : start + _SPLIT_CHUNK].split(b'"')
        cost += _values_cost(b"".join(pieces[0 if outside else 1 :: 2]))
        outside ^= len(pieces) % 2 == 0  # an odd number of quotes in this chunk
    return cost


def _values_cost(data: bytes) -> int:
    containers, values = data.count(b"{") + data.count(b"["), data.count(b",") + data.count(b":")
    return _CONTAINER_COST * containers + _VALUE_COST * values + _STRING_COST * data.count(b'"') // 2


def save_journal(abs_root: str, j: Journal) -> None:
    """Write the journal; its first write refuses (``FixRefused``, before any change) one that could not be read
    back: a fix must never leave a transaction that neither ``undo`` nor ``fix`` can load."""
    data = _encode(j)
    if j.state == "applying" and all(op.status == "pending" for op in j.ops):
        # Later saves only shorten statuses ("pending" -> "done") and change the state word: keep room for that.
        why = parse_problem(data, shrink=3 * len(j.ops) + 16)
        if why is not None:
            raise FixRefused(f"its journal would be one ckptdoctor refuses to read ({why}); fix fewer findings at a "
                             "time with `--select`")  # fmt: skip
    atomic_write(own_path(abs_root, "journal", f"{j.txid}.json"), data)


def _encode(j: Journal) -> bytes:
    """``json.dumps(j.to_json(), indent=2)``, byte for byte, with each operation's text made once per status: the
    indenting encoder is pure Python, and a journal is saved many times as its statuses advance."""
    if not j.ops:
        return (json.dumps(j.to_json(), indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    head = json.dumps({**j._head(), "ops": []}, indent=2, ensure_ascii=False)
    assert head.endswith('  "ops": []\n}')
    ops = ",\n".join(_op_text(op, j.txid) for op in j.ops)
    return (head.removesuffix("]\n}") + "\n" + ops + "\n  ]\n}\n").encode("utf-8")


def _op_text(op: JournalOp, txid: str) -> str:
    """One operation as it stands in the journal's list, indented by four spaces (two levels)."""
    key = f"{txid}\0{op.status}"
    if op._text is not None and op._text[0] == key:
        return op._text[1]
    # json.dumps escapes every newline inside a string, so each newline of its output is one of its own lines.
    text = "    " + json.dumps(op.to_json(txid), indent=2, ensure_ascii=False).replace("\n", "\n    ")
    if op.content is None:
        op._text = (key, text)
    return text


def save_quietly(abs_root: str, j: Journal) -> None:
    """Journal updates during a rollback after a fault: the state on disk is recognised from the hashes anyway."""
    with contextlib.suppress(OSError):
        save_journal(abs_root, j)


def new_txid() -> str:
    """A new transaction id: the UTC time and a random suffix."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)
