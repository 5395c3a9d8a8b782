"""Decide what a file is from its first bytes first and its name second, without reading further."""

from __future__ import annotations

import functools
import io
import re
import struct
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ckptdoctor.model import FileKind
from ckptdoctor.readers.pickle_walk import c_load_float, c_load_int, c_load_long, c_memo_index

if TYPE_CHECKING:
    import pickletools

# Enough for the 8-byte safetensors length plus some header padding, the 14-byte legacy torch magic, a few
# protocol-0 pickle opcodes, and a tar header block.
HEAD_BYTES: int = 512
TAR_BLOCK = 512
# The members torch.load's legacy tar format reads (torch/serialization.py ``_legacy_load.legacy_load``).
_TORCH_TAR_MEMBERS = (b"storages", b"tensors", b"pickle")

_ZIP_MAGIC = b"PK\x03\x04"
# torch/serialization.py MAGIC_NUMBER, pickled first by the legacy format: PROTO 2, LONG1 with 10 bytes.
LEGACY_MAGIC = b"\x80\x02\x8a\x0a" + (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
_JSON_WS = b" \t\r\n"
NPY_MAGIC = b"\x93NUMPY"  # numpy/lib/format.py MAGIC_PREFIX

# Names whose files are pickles when their content looks like a pickle at all (protocol 0/1 need this hint).
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt", ".p", ".pck", ".joblib")
# Names whose own readers keep them whatever archive their bytes look like: torch.load tries a tar itself (and the
# torch reader judges every member of one), and a safetensors name that holds something else is CKD202's.
_KEEP_NAMED = (".bin", ".pt", ".pth", ".ckpt", ".safetensors")
# Text formats that may begin with `[` or `{` (a Markdown link, a YAML flow map) and are not JSON documents: also
# JSON Lines (LLaMA-Factory's `trainer_log.jsonl`, one document per line) and Jinja templates (`chat_template.jinja`,
# which transformers' `PreTrainedTokenizerBase.save_pretrained` writes beside every tokenizer with a chat template).
_TEXT_SUFFIXES = (".md", ".txt", ".py", ".yaml", ".yml", ".cfg", ".ini", ".toml", ".sh", ".csv", ".tsv", ".html",
                  ".jinja", ".jinja2", ".j2", ".jsonl", ".rst", ".log")
# Text formats no loader unpickles (what real runs hold beside their checkpoints: README.md, training_args.yaml,
# chat_template.jinja, trainer_log.jsonl, ...): their bytes are a pickle only when they call something.
_TEXT_NAMES = (*_TEXT_SUFFIXES, ".json")
# Names only pickle loaders read (pickle.load, joblib.load): any opcode first is a pickle for them.
_PICKLE_ONLY_SUFFIXES = (".pkl", ".pickle", ".p", ".pck", ".joblib")
# A protocol 0/1 stream must decode this many opcodes from the head before content alone calls it a pickle.
_MIN_PICKLE_OPS = 3
# Every opcode's byte (``pickletools.opcodes``, protocols 0-5), spelled out so that sniffing a file imports neither
# ``pickletools`` nor ``pickle`` (start-up; a test holds it equal to the table). Protocol 0/1 heads, which need
# each opcode's stack effect, load the table itself (``_opcode_table``).
OPCODE_CODES = frozenset(
    "().012BCFGIJKLMNPQRSTUVX]abcdeghijlopqrstu}"
    "\x80\x81\x82\x83\x84\x85\x86\x87\x88\x89\x8a\x8b\x8c\x8d\x8e\x8f\x90\x91\x92\x93\x94\x95\x96\x97\x98"
)
# Opcodes that import a global or call one: a stream that reaches one is dangerous, hence a pickle.
_CALL_OPS = frozenset({"GLOBAL", "STACK_GLOBAL", "INST", "OBJ", "REDUCE", "NEWOBJ", "NEWOBJ_EX", "BUILD"})
# Opcodes that call something (not merely import it): what makes a text-named file a pickle.
_CALL_ONLY_OPS = _CALL_OPS - {"GLOBAL", "STACK_GLOBAL"}


# Names torch.save'd files carry in Trainer checkpoints (weights, optimizer, scheduler, RNG, args, DeepSpeed states).
_TORCH_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")

# Other frameworks' files, recognised only with ``frameworks=True`` (discovery and rules do not know their kinds
# yet; until they do, these files keep the kinds they always had).
# The last bytes of a LevelDB-format table (a TensorFlow `.index`): the footer's magic, 0xdb4775248b80fb57.
TAIL_BYTES = 8
TF_TABLE_MAGIC = (0xDB4775248B80FB57).to_bytes(8, "little")
_TF_DATA_NAME = re.compile(r"\.data-\d{5}-of-\d{5}$", re.ASCII)
_HDF5_SUFFIXES = (".h5", ".hdf5")
# MindNLP's weights file when save_safetensors=False (`WEIGHTS_NAME` in mindnlp/configs.py).
_MINDSPORE_WEIGHTS = "mindspore_model.ckpt"
# Field names that open a CheckpointState in text format (what tf.train.CheckpointManager writes to `checkpoint`).
_CHECKPOINT_STATE_FIELDS = (b"model_checkpoint_path", b"all_model_checkpoint_", b"last_preserved_timestamp", b"#")


def wants_tail(name: str) -> bool:
    """Whether sniffing ``name`` with ``frameworks=True`` needs its last ``TAIL_BYTES`` bytes (a TensorFlow index)."""
    return name.lower().endswith(".index")


def sniff(
    head: bytes, name: str, size: int, in_dcp_dir: bool = False, frameworks: bool = False, tail: bytes = b""
) -> FileKind:
    """Classify a file from ``head`` (its first ``HEAD_BYTES`` bytes), its base ``name`` and its real ``size``.

    Content wins over the name: a pickle named ``model.safetensors`` is a ``PICKLE`` and safetensors bytes named
    ``pytorch_model.bin`` are ``SAFETENSORS``. ``in_dcp_dir`` says the file sits in a folder holding ``.metadata``
    or ``*.distcp`` files (a ``torch.distributed.checkpoint`` directory). ``frameworks`` also recognises MindSpore,
    TensorFlow and HDF5 files among those the torch kinds leave (the other kinds never change); ``tail`` is then
    the file's last ``TAIL_BYTES`` bytes when ``wants_tail(name)``.
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
        return FileKind.NUMPY if lower.endswith(".npz") else FileKind.TORCH_ZIP
    if head.startswith(NPY_MAGIC):
        return FileKind.NUMPY  # np.load reads it by this magic whatever the name
    if head.startswith(LEGACY_MAGIC):
        return FileKind.TORCH_LEGACY
    if head[:1] in (b"s", b"t", b"p") and head[:100].split(b"\0", 1)[0] in _TORCH_TAR_MEMBERS and looks_like_tar(head):
        return FileKind.TORCH_LEGACY  # torch.load reads it as its oldest (tar) format, whatever the name
    codec = compression(head)
    if codec in _JOBLIB_CODECS and lower.endswith(_TEXT_NAMES):
        codec = None  # a text file whose first bytes happen to inflate: joblib.load is not what reads `notes.txt`
    if (looks_like_tar(head) or codec is not None) and not lower.endswith(_KEEP_NAMED):
        return FileKind.ARCHIVE  # extracted and its members unpickled by whoever unpacks it
    if _looks_like_safetensors(head, size):
        return FileKind.SAFETENSORS
    if protocol_header(head):
        return FileKind.PICKLE
    if looks_like_old_pickle(head, lower.endswith(PICKLE_SUFFIXES), lower.endswith(_TEXT_NAMES)):
        return FileKind.PICKLE
    if lower.endswith(_PICKLE_ONLY_SUFFIXES) and head[:1].decode("latin-1") in OPCODE_CODES:
        # pickle.load / joblib.load read whatever such a file holds from its first opcode on, however long that
        # opcode's argument runs past the head: the pickle reader walks the whole stream and judges it.
        return FileKind.PICKLE
    if lower.endswith(".json"):
        return FileKind.JSON
    # Content matched nothing: a name that promises a format goes to that format's reader, which then says exactly
    # why the bytes are not what the loader expects (a zeroed `model.safetensors` must be a finding, not "other").
    if lower.endswith(".safetensors"):
        return FileKind.SAFETENSORS
    if frameworks:
        other = _framework_kind(head, lower, tail)
        if other is not None:
            return other
    if lower.endswith(_TORCH_SUFFIXES):
        return FileKind.TORCH_ZIP
    if lower == "latest":
        return FileKind.TEXT
    if head.lstrip(_JSON_WS)[:1] in (b"{", b"[") and not lower.endswith(_TEXT_SUFFIXES):
        return FileKind.JSON
    return FileKind.OTHER


def compression(head: bytes) -> str | None:
    """The codec of the compressed stream ``head`` opens, else None: ``gz``, ``bz2`` or ``xz`` by their magic numbers
    (RFC 1952 with deflate, bzip2's ``BZh`` + block size + block magic, the xz stream header); and the other streams
    ``joblib.load`` decompresses whatever the file's name (joblib/numpy_pickle_utils.py ``_detect_compressor``):
    ``zlib`` (joblib's default codec, an RFC 1950 stream), ``lzma`` (the legacy ``.lzma`` format, ``]\\x00``) and
    ``zf`` (joblib < 0.10's ``ZF`` + hex length header before a zlib stream). Those three have short magic numbers,
    so their first bytes must also decompress (a text that starts ``x^`` is no zlib stream)."""
    if head.startswith(b"\x1f\x8b\x08"):
        return "gz"
    if head[:3] == b"BZh" and head[3:4] in b"123456789" and head[4:10] in (b"1AY&SY", b"\x17rE8P\x90"):
        return "bz2"
    if head.startswith(b"\xfd7zXZ\x00"):
        return "xz"
    if head[:1] == b"\x78" and _inflates(head):
        return "zlib"
    if head.startswith(b"ZF") and _zf_start(head) is not None:
        return "zf"
    if head.startswith(b"]\x00") and _unlzmas(head):
        return "lzma"
    return None


# The codecs only joblib.load reads whatever the name (their magic numbers are one or two bytes).
_JOBLIB_CODECS = frozenset({"zlib", "zf", "lzma"})
# joblib/numpy_pickle_compat.py: ``ZF``, then ``hex_str(length).ljust(_MAX_LEN)`` with _MAX_LEN = len(hex(2**64)).
_ZF_LENGTH = len(hex(2**64))


def _zf_start(head: bytes) -> int | None:
    """Where the zlib stream of a joblib ``ZF`` file starts (``read_zfile``: one space may follow the length)."""
    try:
        int(head[2 : 2 + _ZF_LENGTH], 16)
    except ValueError:
        return None
    at = 2 + _ZF_LENGTH
    if head[at : at + 1] == b" ":
        at += 1
    return at if head[at : at + 1] == b"\x78" and _inflates(head[at:]) else None


def _inflates(head: bytes) -> bool:
    """``head`` opens a zlib stream: a valid RFC 1950 header (deflate, check bits, no preset dictionary) whose
    first bytes inflate without error."""
    if len(head) < 3 or (head[0] << 8 | head[1]) % 31 or head[1] & 0x20:
        return False
    import zlib

    try:
        zlib.decompressobj().decompress(head, 64)
    except zlib.error:
        return False
    return True


def _unlzmas(head: bytes) -> bool:
    """``head`` opens a legacy ``.lzma`` (LZMA_Alone) stream whose first bytes decompress without error."""
    import lzma

    try:
        lzma.LZMADecompressor(lzma.FORMAT_ALONE).decompress(head, 64)
    except lzma.LZMAError:
        return False
    return True


def tar_number(raw: bytes) -> int | None:
    """A tar number field as ``tarfile.nti`` reads it; None where nti raises (an invalid header)."""
    if raw[:1] in (b"\x80", b"\xff"):
        n = int.from_bytes(raw[1:], "big")
        return n - 256 ** (len(raw) - 1) if raw[0] == 0xFF else n
    try:
        return int(raw.split(b"\0", 1)[0].decode("ascii").strip() or "0", 8)
    except (UnicodeDecodeError, ValueError):
        return None


def looks_like_tar(head: bytes) -> bool:
    """Whether ``tarfile`` accepts the first ``TAR_BLOCK`` bytes of ``head`` as a first header: not all zeros,
    and a checksum field matching the header's unsigned or signed byte sum (``tarfile.TarInfo.frombuf``)."""
    block = head[:TAR_BLOCK]
    if len(block) != TAR_BLOCK or block.count(0) == TAR_BLOCK:
        return False
    chksum = tar_number(block[148:156])
    if chksum is None:
        return False
    body = block[:148] + b" " * 8 + block[156:]
    unsigned = 256 + sum(block[:148]) + sum(block[156:])
    signed = unsigned - 256 * sum(1 for b in body if b > 127)
    return chksum in (unsigned, signed)


def _framework_kind(head: bytes, lower: str, tail: bytes) -> FileKind | None:
    """The kind of a MindSpore, TensorFlow or HDF5 file by content and name (``lower``); None for anything else.

    A torch name (``.bin``, ``.pt`` ...) stays torch's whatever its bytes, so that torch.load's refusal is what the
    rules report, except a ``.ckpt`` holding a MindSpore protobuf (MindSpore's own suffix).
    """
    from ckptdoctor.readers.hdf5 import SIGNATURE as _HDF5_SIGNATURE  # only a framework sniff pays for these

    if lower.endswith(".ckpt") and (_looks_like_mindspore(head) or lower == _MINDSPORE_WEIGHTS):
        return FileKind.MINDSPORE
    if lower.endswith(_TORCH_SUFFIXES):
        return None
    if lower.endswith(".index") and (tail == TF_TABLE_MAGIC or looks_like_tf_index_head(head)):
        return FileKind.TF_INDEX
    if _TF_DATA_NAME.search(lower):
        return FileKind.TF_DATA
    if head.startswith(_HDF5_SIGNATURE) or lower.endswith(_HDF5_SUFFIXES):
        return FileKind.HDF5
    if lower == "checkpoint" and head.lstrip(_JSON_WS).startswith(_CHECKPOINT_STATE_FIELDS):
        return FileKind.TF_CHECKPOINT_STATE
    return None


def _looks_like_mindspore(head: bytes) -> bool:
    """A protobuf ``Checkpoint``: field 1 (a Value) whose first field is its tag (field 1), then a tensor (field 2).

    Checked as far as the head reaches: the two keys, the lengths (the tag inside its value), the tag as UTF-8.
    """
    if head[:1] != b"\x0a":
        return False
    from ckptdoctor.readers.protowire import WireError, varint

    try:
        value_len, pos = varint(head, 1, len(head))
        if head[pos : pos + 1] != b"\x0a":
            return False
        tag_len, pos = varint(head, pos + 1, len(head))
    except WireError:
        return False
    if tag_len >= value_len:
        return False
    tag = head[pos : pos + tag_len]
    try:
        tag.decode("utf-8")
    except UnicodeDecodeError as e:
        if e.reason != "unexpected end of data":  # only a tag cut by the end of the head may end mid-character
            return False
    after = head[pos + tag_len : pos + tag_len + 1]
    return after in (b"", b"\x12")


def looks_like_tf_index_head(head: bytes) -> bool:
    """Whether ``head`` starts like a TensorFlow bundle index: an uncompressed first block whose first entry has
    the empty key (shared and non-shared lengths 0) and a ``BundleHeaderProto`` value (empty, or field 1, 2 or 3)."""
    if len(head) < 4 or head[0] != 0 or head[1] != 0:
        return False
    from ckptdoctor.readers.protowire import WireError, varint

    try:
        n, pos = varint(head, 2, len(head))
    except WireError:
        return False
    return n == 0 or head[pos : pos + 1] in (b"\x08", b"\x10", b"\x1a")


def _looks_like_safetensors(head: bytes, size: int) -> bool:
    """An 8-byte little-endian header length of at least 2 that fits in the file, then a JSON object (after optional
    whitespace). A length past the file's end is no file ``safe_open`` reads: JSON text such as LLaMA-Factory's
    ``dataset_info.json`` (``{"tiny": {...``) has that shape, its first eight bytes read as a length past 2**56; a
    ``*.safetensors`` name still goes to the safetensors reader, which reports the bad length."""
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    if n < 2 or n > size - 8:
        return False
    rest = head[8 : 8 + n].lstrip(_JSON_WS)
    if not rest.startswith(b"{"):
        return False
    # An object continues with a key or closes; this keeps a pickle whose 9th byte happens to be `{` out.
    after = rest[1:].lstrip(_JSON_WS)
    return after[:1] in (b"", b'"', b"}")


def protocol_header(head: bytes) -> bool:
    """Whether ``head`` starts with a pickle protocol 2-5 header (``PROTO`` and its version byte)."""
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def pickled_head(head: bytes, name_hint: bool = False) -> bool:
    """Whether a pickle loader reading these first bytes would unpickle something: a protocol 2-5 header, or a
    protocol 0/1 stream as the sniffer recognises one (``name_hint``: the name promises a pickle)."""
    return protocol_header(head) or looks_like_old_pickle(head, name_hint)


def shifted_head(head: bytes) -> bool:
    """``head``'s first byte is no pickle opcode and a pickle starts right after it: a protocol 2-5 header, or a
    protocol 0/1 stream that imports or calls something (``looks_like_old_pickle``)."""
    if len(head) <= 2 or chr(head[0]) in OPCODE_CODES:
        return False
    return pickled_head(head[1:])


def looks_like_old_pickle(head: bytes, name_hint: bool, text_name: bool = False) -> bool:
    """A protocol 0/1 pickle: the head decodes as pickle opcodes with consistent stack effects.

    Parsed opcode by opcode, never executed, with each text argument read as CPython's C unpickler reads it
    (``_pickle.c``: INT in base 0, FLOAT without whitespace, GLOBAL's lines as UTF-8 module and attribute names).
    Simulating what each opcode takes from the stack, and requiring the head to decode to its end, keeps text such
    as ``Notes ...`` or ``(draft)`` (opcode letters, impossible as a stream) out; so does a GLOBAL or INST whose
    module or name is no dotted Python name (``cutoff_len: 1024`` in a YAML file that starts with ``c``): the
    unpickler's import fails right there, so nothing after it runs. A stream that imports or calls something is a
    pickle whatever follows: the unpickler would have run the call before meeting the garbage. ``text_name``: the
    name is a text format's (``.yaml``, ``.md`` ...), which no loader unpickles: only a real call (REDUCE, BUILD,
    INST, OBJ, NEWOBJ) counts then, not the import of a name alone.
    """
    if head[:1].decode("latin-1") not in OPCODE_CODES:
        return False  # what the walk below says of a head that is empty or starts with no opcode, without pickletools
    import pickletools

    ops = 0
    depth = 0  # items on the simulated stack
    marks: list[int] = []  # stack depth at each MARK
    calls = False
    call_ops = _CALL_ONLY_OPS if text_name else _CALL_OPS
    try:
        for opcode in _old_ops(head):
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
            calls = calls or opcode.name in call_ops
            if opcode.name == "STOP":
                # A complete stream inside the head.
                return ops >= 2 or name_hint
    except _CutShort:
        pass  # a known opcode whose argument runs past the head: what came before is what there is to judge
    except _Dead:
        return calls or (name_hint and ops > 0)  # the unpickler stops here: nothing after this opcode runs
    return calls or ops >= _MIN_PICKLE_OPS or (name_hint and ops > 0)


class _CutShort(Exception):
    """Internal: the head ends inside an opcode's argument."""


class _Dead(Exception):
    """Internal: the unpickler raises at this opcode (no opcode, or an argument it refuses)."""


# Opcodes whose argument is one or two text lines, read here as _pickle.c reads them (pickletools' own readers
# use Python's int() and float(), which accept other text than the C unpickler does).
_LINE_OPS = frozenset({"INT", "LONG", "FLOAT", "PUT", "GET", "STRING", "UNICODE", "PERSID", "GLOBAL", "INST"})


@functools.cache
def _opcode_table() -> dict[str, pickletools.OpcodeInfo]:
    """Each opcode's byte and its description (read on the first protocol 0/1 head)."""
    import pickletools

    return {op.code: op for op in pickletools.opcodes}


def _old_ops(head: bytes) -> Iterator[pickletools.OpcodeInfo]:
    """Each opcode of ``head`` in turn; ``_CutShort`` or ``_Dead`` where that ends."""
    code2op = _opcode_table()
    stream = io.BytesIO(head)
    n = len(head)
    while True:
        at = stream.tell()
        if at >= n:
            raise _CutShort
        opcode = code2op.get(head[at : at + 1].decode("latin-1"))
        if opcode is None:
            raise _Dead
        stream.seek(at + 1)
        if opcode.name in _LINE_OPS:
            lines = 2 if opcode.name in ("GLOBAL", "INST") else 1
            got: list[bytes] = []
            for _ in range(lines):
                line = stream.readline()
                if not line.endswith(b"\n"):
                    raise _CutShort
                got.append(line[:-1])
            try:
                _check_line_arg(opcode.name, got)
            except Exception:
                raise _Dead from None
        elif opcode.arg is not None:
            try:
                opcode.arg.reader(stream)
            except ValueError:
                raise _CutShort from None  # fixed-size and counted arguments fail only at the end of the head
        yield opcode
        if opcode.name == "STOP":
            return


def _check_line_arg(name: str, lines: list[bytes]) -> None:
    """Raise unless the C unpickler accepts the text argument ``lines`` of opcode ``name``."""
    line = lines[0]
    if name == "INT":
        c_load_int(line)
    elif name == "LONG":
        c_load_long(line)
    elif name == "FLOAT":
        c_load_float(line)
    elif name == "PUT" or name == "GET":
        if c_memo_index(line) < 0:
            raise ValueError("negative memo index")
    elif name == "STRING":
        if len(line) < 2 or line[0] != line[-1] or line[:1] not in (b"'", b'"'):
            raise ValueError("unquoted STRING")
    elif name == "UNICODE":
        line.decode("raw-unicode-escape")
    elif name == "PERSID":
        line.decode("ascii")
    elif not all(_dotted_name(x) for x in lines):  # GLOBAL, INST: a module to import and a name in it
        raise ValueError("no importable name")


def _dotted_name(raw: bytes) -> bool:
    """``raw`` is UTF-8 for a dotted Python name (``torch._utils``, ``OrderedDict``): what a pickler ever writes
    for a module or a qualified name, and what an import can find."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(part.isidentifier() for part in text.split("."))
