"""The journal: one fix transaction recorded before its first change, and saved durably as it runs."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from ckptdoctor.findings import OpKind
from ckptdoctor.fix.calls import _atomic_write
from ckptdoctor.fix.digests import Digest
from ckptdoctor.fix.errors import FixRefused
from ckptdoctor.fix.paths import _own, _parent, quarantine_path

JOURNAL_SCHEMA = "ckptdoctor.journal/1"


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

    def quarantine(self, txid: str) -> str:
        return quarantine_path(txid, self.path)

    def temp(self, txid: str) -> str:
        """The rewrite's temp file, beside the target (same folder, so ``os.replace`` is atomic)."""
        parent, name = _parent(self.path), self.path.rsplit("/", 1)[-1]
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
        times = d.get("times_ns")
        return JournalOp(
            index=int(d["index"]),
            kind=OpKind(d["kind"]),
            path=str(d["path"]),
            rules=[str(r) for r in d.get("rules", [])],
            title=str(d.get("title", "")),
            before=Digest.from_json(d["before"]),
            after=None if d.get("after") is None else Digest.from_json(d["after"]),
            content=d.get("content"),
            times=None if times is None else (int(times[0]), int(times[1])),
            status=str(d.get("status", "pending")),
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
        from ckptdoctor import __version__

        return {
            "schema": JOURNAL_SCHEMA,
            "version": __version__,
            "txid": self.txid,
            "root": self.root,
            "created": self.created,
            "state": self.state,
            "dir_times_ns": {k: list(v) for k, v in sorted(self.dir_times.items())},
            "ops": [op.to_json(self.txid) for op in self.ops],
        }

    @staticmethod
    def from_json(d: Any) -> Journal:
        if not isinstance(d, dict) or d.get("schema") != JOURNAL_SCHEMA:
            raise ValueError(f"not a {JOURNAL_SCHEMA} document")
        return Journal(
            txid=str(d["txid"]),
            root=str(d["root"]),
            created=float(d["created"]),
            state=str(d["state"]),
            ops=[JournalOp.from_json(o) for o in d["ops"]],
            dir_times={str(k): (int(v[0]), int(v[1])) for k, v in d.get("dir_times_ns", {}).items()},
        )

    @property
    def rules(self) -> list[str]:
        return sorted({r for op in self.ops for r in op.rules})


def load_journals(path: str) -> list[Journal]:
    """Every transaction recorded under root ``path``, oldest first. Reads only; a missing folder means none."""
    folder = _own(os.path.realpath(path), "journal")
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".json") and not n.startswith("."))
    except FileNotFoundError:
        return []
    except OSError as e:
        raise FixRefused(f"cannot read the journal folder {folder}: {e.strerror or e}") from None
    out: list[Journal] = []
    for name in names:
        full = os.path.join(folder, name)
        try:
            with open(full, encoding="utf-8") as fh:
                out.append(Journal.from_json(json.load(fh)))
        except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
            raise FixRefused(f"journal {full} cannot be read ({e}); move it away to continue") from None
    return sorted(out, key=lambda j: (j.created, j.txid))


def _save(abs_root: str, j: Journal) -> None:
    data = (json.dumps(j.to_json(), indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    _atomic_write(_own(abs_root, "journal", f"{j.txid}.json"), data)


def _save_quietly(abs_root: str, j: Journal) -> None:
    """Journal updates during a rollback after a fault: the state on disk is recognised from the hashes anyway."""
    with contextlib.suppress(OSError):
        _save(abs_root, j)


def _new_txid() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)
