"""Decide what a file is from its first bytes first and its name second, without reading further."""

from __future__ import annotations

import io
import pickletools
import struct

from ckptdoctor.model import FileKind

# Enough for the 8-byte safetensors length plus some header padding, the 14-byte legacy torch magic, and a few
# protocol-0 pickle opcodes.
HEAD_BYTES: int = 256

_ZIP_MAGIC = b"PK\x03\x04"
# torch/serialization.py MAGIC_NUMBER, pickled first by the legacy format: PROTO 2, LONG1 with 10 bytes.
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
_JSON_WS = b" \t\r\n"

# Names whose files are pickles when their content looks like a pickle at all (protocol 0/1 need this hint).
_PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt", ".p", ".pck")
# Text formats that may begin with `[` or `{` (a Markdown link, a YAML flow map) and are not JSON documents.
_TEXT_SUFFIXES = (".md", ".txt", ".py", ".yaml", ".yml", ".cfg", ".ini", ".toml", ".sh", ".csv", ".tsv", ".html")
# A protocol 0/1 stream must decode this many opcodes from the head before content alone calls it a pickle.
_MIN_PICKLE_OPS = 3
_OPCODE_CODES = frozenset(op.code for op in pickletools.opcodes)
# Opcodes that import a global or call one: a stream that reaches one is dangerous, hence a pickle.
_CALL_OPS = frozenset({"GLOBAL", "STACK_GLOBAL", "INST", "OBJ", "REDUCE", "NEWOBJ", "NEWOBJ_EX", "BUILD"})


# Names torch.save'd files carry in Trainer checkpoints (weights, optimizer, scheduler, RNG, args, DeepSpeed states).
_TORCH_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def sniff(head: bytes, name: str, size: int, in_dcp_dir: bool = False) -> FileKind:
    """Classify a file from ``head`` (its first ``HEAD_BYTES`` bytes), its base ``name`` and its real ``size``.

    Content wins over the name: a pickle named ``model.safetensors`` is a ``PICKLE`` and safetensors bytes named
    ``pytorch_model.bin`` are ``SAFETENSORS``. ``in_dcp_dir`` says the file sits in a folder holding ``.metadata``
    or ``*.distcp`` files (a ``torch.distributed.checkpoint`` directory).
    """
    if size == 0:
        return FileKind.EMPTY
    lower = name.lower()
    # DCP files are recognised by place and name: `.metadata` is a plain pickle and `.distcp` a run of torch zip
    # blobs, and each needs its own reader rather than the generic one their bytes suggest.
    if lower.endswith(".distcp"):
        return FileKind.DCP_DATA
    if in_dcp_dir and lower.endswith(".metadata"):
        return FileKind.DCP_METADATA
    if head.startswith(_ZIP_MAGIC):
        return FileKind.TORCH_ZIP
    if head.startswith(_LEGACY_MAGIC):
        return FileKind.TORCH_LEGACY
    if _looks_like_safetensors(head):
        return FileKind.SAFETENSORS
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        return FileKind.PICKLE
    if _looks_like_old_pickle(head, lower.endswith(_PICKLE_SUFFIXES)):
        return FileKind.PICKLE
    if lower.endswith(".json"):
        return FileKind.JSON
    # Content matched nothing: a name that promises a format goes to that format's reader, which then says exactly
    # why the bytes are not what the loader expects (a zeroed `model.safetensors` must be a finding, not "other").
    if lower.endswith(".safetensors"):
        return FileKind.SAFETENSORS
    if lower.endswith(_TORCH_SUFFIXES):
        return FileKind.TORCH_ZIP
    if lower == "latest":
        return FileKind.TEXT
    if head.lstrip(_JSON_WS)[:1] in (b"{", b"[") and not lower.endswith(_TEXT_SUFFIXES):
        return FileKind.JSON
    return FileKind.OTHER


def _looks_like_safetensors(head: bytes) -> bool:
    """An 8-byte little-endian header length of at least 2, then a JSON object (after optional whitespace)."""
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    if n < 2:
        return False
    rest = head[8 : 8 + n].lstrip(_JSON_WS)
    if not rest.startswith(b"{"):
        return False
    # An object continues with a key or closes; this keeps a pickle whose 9th byte happens to be `{` out.
    after = rest[1:].lstrip(_JSON_WS)
    return after[:1] in (b"", b'"', b"}")


def _looks_like_old_pickle(head: bytes, name_hint: bool) -> bool:
    """A protocol 0/1 pickle: the head decodes as pickle opcodes with consistent stack effects.

    Parsed with ``pickletools.genops``, never executed. Simulating what each opcode takes from the stack, and
    requiring the head to decode to its end, keeps text such as ``Notes ...`` or ``(draft)`` (opcode letters,
    impossible as a stream) out. A stream that imports or calls something is a pickle whatever follows: the
    unpickler would have run the call before meeting the garbage.
    """
    ops = 0
    depth = 0  # items on the simulated stack
    marks: list[int] = []  # stack depth at each MARK
    calls = False
    stream = io.BytesIO(head)
    end = 0  # where the last complete opcode ended
    try:
        for opcode, _arg, _pos in pickletools.genops(stream):
            end = stream.tell()
            before = opcode.stack_before
            if pickletools.markobject in before:
                k = before.index(pickletools.markobject)
                below, above = k, len(before) - k - 1 - before.count(pickletools.stackslice)
                if not marks or depth - marks[-1] < above or marks[-1] < below:
                    return calls or (name_hint and ops > 0)
                depth = marks.pop() - below
            else:
                if depth < len(before):
                    return calls or (name_hint and ops > 0)
                depth -= len(before)
            if opcode.stack_after == [pickletools.markobject]:
                marks.append(depth)
            else:
                depth += len(opcode.stack_after)
            ops += 1
            calls = calls or opcode.name in _CALL_OPS
            if opcode.name == "STOP":
                # A complete stream inside the head.
                return ops >= 2 or name_hint
    except Exception:
        # genops raises ValueError (and friends) at the end of the head or on a byte that is no opcode. Only the
        # first is a pickle cut short: a known opcode whose argument runs past the head, or nothing left at all.
        if end < len(head) and head[end : end + 1].decode("latin-1") not in _OPCODE_CODES:
            return calls or (name_hint and ops > 0)
    return calls or ops >= _MIN_PICKLE_OPS or (name_hint and ops > 0)
