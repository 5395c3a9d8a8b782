"""``ckptdoctor inspect``: what the readers see in one file, as plain data for JSON or ``render.inspect``'s text."""

from __future__ import annotations

import math
import os
from typing import Any

from ckptdoctor.model import (
    ArchiveFacts,
    DcpMetadataFacts,
    FileFacts,
    FileKind,
    GlobalRef,
    Hdf5Facts,
    JsonFacts,
    MindSporeFacts,
    Opaque,
    PickleFacts,
    SafetensorsFacts,
    TensorRef,
    TextFacts,
    TfCheckpointStateFacts,
    TfIndexFacts,
    TorchFacts,
)

MAX_ITEMS = 200  # per container, so a 625-int RNG state or a 1e6-entry optimizer stays readable
MAX_DEPTH = 40


def plain(value: Any, depth: int = 0) -> Any:
    """A pickled value as JSON-able data: tensors, globals and opaque calls become tagged objects."""
    if depth > MAX_DEPTH:
        return {"...": "nested deeper than shown"}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": len(value)}
    if isinstance(value, complex):
        return {"complex": [value.real, value.imag]}
    if isinstance(value, TensorRef):
        return {"tensor": value.dtype, "shape": list(value.shape), "storage": value.storage_key}
    if isinstance(value, GlobalRef):
        return {"global": value.dotted}
    if isinstance(value, Opaque):
        out: dict[str, Any] = {"call": value.func.dotted if value.func else None}
        if value.args not in ((), None):
            out["args"] = plain(value.args, depth + 1)
        if value.state is not None:
            out["state"] = plain(value.state, depth + 1)
        return out
    if isinstance(value, dict):
        items = list(value.items())
        d = {str(k) if not isinstance(k, str) else k: plain(v, depth + 1) for k, v in items[:MAX_ITEMS]}
        if len(items) > MAX_ITEMS:
            d["..."] = f"{len(items) - MAX_ITEMS} more entries"
        return d
    if isinstance(value, (list, tuple, set, frozenset)):
        seq = list(value)
        lst = [plain(v, depth + 1) for v in seq[:MAX_ITEMS]]
        if len(seq) > MAX_ITEMS:
            lst.append(f"... {len(seq) - MAX_ITEMS} more items")
        return lst
    return repr(value)


def _pickle_part(pf: PickleFacts | None, torchscript: bool = False) -> dict[str, Any]:
    if pf is None:
        return {}
    from ckptdoctor.pickle_verdict.judge import describe as shown
    from ckptdoctor.pickle_verdict.judge import judge

    # Each global carries the verdict the scan gives the stream (``judge``, with no user allowance), never what its
    # name alone would get: a class admitted by name may be called with arguments (only REVIEWED_CALLS and
    # CALLED_ENUMS entries may be), or named from a module a resuming process has not imported. So a file looked at
    # here on its own does not read as harmless where the scan flags it.
    verdict = judge(pf, torchscript=torchscript)
    verdicts: dict[str, str] = {}
    why: dict[str, str] = {}
    for g in (*pf.globals, *pf.calls):
        name = shown(g)
        hit = next((u for u in verdict.unsafe if u == name or u.startswith(name + " (")), None)
        if hit is not None:
            from ckptdoctor.pickle_verdict.policy import is_dangerous

            verdicts[g.dotted] = "dangerous" if is_dangerous(g) else "denied"
            why[g.dotted] = hit
        elif name in verdict.unknown:
            verdicts[g.dotted] = "unknown"
        else:
            verdicts[g.dotted] = "allowed"
    out = {
        "protocol": pf.protocol,
        "opcodes": pf.opcodes,
        "globals": [g.dotted for g in pf.globals],
        "verdicts": verdicts,
        "calls": [g.dotted for g in pf.calls],
        "value": plain(pf.value),
    }
    if why:
        out["why"] = why
    return out


def describe(facts: FileFacts) -> dict[str, Any]:
    """Plain data describing one file's facts and read problems."""
    out: dict[str, Any] = {"path": facts.path, "kind": facts.kind.value, "bytes": facts.size}
    c = facts.content
    if isinstance(c, (SafetensorsFacts, MindSporeFacts)):
        if isinstance(c, SafetensorsFacts):
            out["metadata"] = c.metadata
        else:
            out["values"] = c.values
        out["tensors"] = [
            {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes} for t in c.tensors
        ]
    elif isinstance(c, TorchFacts):
        out["format"] = c.format
        out["members"] = len(c.members)
        out["tensors"] = [
            {"name": n, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.storage_nbytes} for n, t in c.tensors
        ]
        out.update(_pickle_part(c.pickle, c.torchscript and facts.alt_pickle is None))
    elif isinstance(c, DcpMetadataFacts):
        out["keys"] = list(c.keys)
        out["storage"] = [
            {"fqn": s.fqn, "file": s.relative_path, "offset": s.offset, "length": s.length} for s in c.storage
        ]
        out.update(_pickle_part(c.pickle))
    elif isinstance(c, PickleFacts):
        out.update(_pickle_part(c))
    elif isinstance(c, ArchiveFacts):
        out["format"] = c.fmt
        out["members"] = c.members
        out.update(_pickle_part(c.pickle))
    elif isinstance(c, JsonFacts):
        out["value"] = plain(c.value)
        if c.partial:  # a large trainer_state.json read in pieces
            out["note"] = "log_history entries shown with step, loss and learning_rate only (a large file)"
    elif isinstance(c, TextFacts):
        out["text"] = c.text
    elif isinstance(c, TfIndexFacts):
        out["shards"] = c.num_shards
        out["tensors"] = [
            {"name": e.key, "dtype": e.dtype, "shape": list(e.shape), "bytes": e.size, "shard": e.shard_id,
             "offset": e.offset}
            for e in c.entries
        ]
    elif isinstance(c, TfCheckpointStateFacts):
        out["value"] = {"model_checkpoint_path": c.model_checkpoint_path,
                        "all_model_checkpoint_paths": list(c.all_model_checkpoint_paths)}
    elif isinstance(c, Hdf5Facts):
        out["value"] = {"superblock_offset": c.superblock_offset, "version": c.version,
                        "offset_size": c.offset_size, "length_size": c.length_size,
                        "base_address": c.base_address, "eof_address": c.eof_address}
        if c.datasets is None:
            out["value"]["datasets"] = "not listed: install h5py (pip install 'ckptdoctor[h5]')"
        else:
            out["tensors"] = [
                {"name": d.name, "dtype": d.dtype, "shape": list(d.shape), "bytes": d.storage_bytes,
                 "layout": d.layout, "offset": d.offset}
                for d in c.datasets
            ]
    out["problems"] = [{"kind": p.kind.value, "message": p.message} for p in facts.problems]
    return out


def inspect_file(path: str) -> dict[str, Any]:
    """Read one file with the scan's readers (nothing executed) and describe it."""
    from ckptdoctor.readers import read_file

    st = os.stat(path)
    real = os.path.realpath(path)
    facts = read_file(real, os.path.basename(path), st, frameworks=True)
    if facts.kind == FileKind.DCP_DATA:
        # Asked about this one file: search the whole `.distcp` for its torch.save blobs (a scan reads only the
        # items its folder's `.metadata` locates).
        from ckptdoctor.readers.dcp import read_dcp_data

        with open(real, "rb", buffering=0) as f:
            outcome = read_dcp_data(f, st.st_size)
        facts = FileFacts(facts.path, facts.size, facts.mtime, facts.kind, outcome.content, outcome.problems)
    return describe(facts)
