"""The pickle policy: which globals a stream may name and have called, decided from facts, never by importing.

Loading a pickle imports every global it names and calls the ones it REDUCEs (``cls(*args)``, ``func(*args)``),
NEWOBJs (``cls.__new__(cls)``) or BUILDs (``__setstate__``). Enums and config dataclasses are rebuilt that way as
data; code runs when a function, or a class with a hostile ``__init__``/``__reduce__``, is called. A global is:

- **allowed** when it is an exact entry of the allowlist: the generated ``allowlist.json`` (bench/make_allowlist.py
  reads files that a matrix of real stacks wrote) plus the reviewed entries below. Entries name classes, or exact
  functions proved harmless (torch's tensor rebuilders); there are no ``module.*`` entries;
- **allowed** when the installed package's source (read with ``ast``, never imported) shows it is a class of a known
  package (transformers, TRL, accelerate, peft, DeepSpeed, torch ...), or a class anywhere that derives from one,
  or from ``enum.Enum``, and defines none of the hooks unpickling calls (``__reduce__``, ``__setstate__``,
  ``__new__``...): a ``TrainingArguments`` subclass of any package;
- **allowed** when the stream itself rebuilds it as ``TrainingArguments`` data (``NEWOBJ`` with no arguments, then
  a ``BUILD`` of a dict holding TrainingArguments' own fields; see ``judge``);
- **unknown** (CKD602, a warning) when it is a proven class of an installed package outside the known ones that
  the stream only names (never calls);
- **unsafe** (CKD601, an error) otherwise: anything dangerous, computed, an attribute chain, a function, a class of
  an unknown package that is called, or a name no fact proves to be a class (deny by default).

The user's own allowances (``--allow-global``, the user-level configuration) are ``Allowance`` values applied on
top; they never admit a dangerous or computed name. docs/security.md holds the threat model.
"""

from __future__ import annotations

import ast
import enum
import functools
import json
import os
import sys
from typing import Any

from ckptdoctor.model import GlobalRef, frozen


def _generated() -> frozenset[str]:
    """The globals in the generated ``allowlist.json`` (observed in real files, and sibling classes)."""
    from importlib import resources

    try:
        doc = json.loads(resources.files("ckptdoctor.pickle_verdict").joinpath("allowlist.json").read_text("utf-8"))
        return frozenset(doc.get("observed", {})) | frozenset(doc.get("enums", ())) | frozenset(doc.get("classes", ()))
    except (OSError, ValueError):
        return frozenset()  # a missing data file makes the scan stricter, never looser


# The generated allowlist, read on first use (``_allowlist``): a scan with no pickle to judge never parses it.
GENERATED: frozenset[str]


def _allowlist() -> frozenset[str]:
    """``GENERATED``, read from ``allowlist.json`` the first time it is needed (a value set on the module wins)."""
    found: frozenset[str] | None = globals().get("GENERATED")
    if found is None:
        found = globals()["GENERATED"] = _generated()
    return found


def __getattr__(name: str) -> Any:
    """``GENERATED`` on first access (``_allowlist``); any other missing name is an ``AttributeError``."""
    if name == "GENERATED":
        return _allowlist()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

ALLOWED: frozenset[str] = frozenset(
    {
        # containers and codecs
        "collections.OrderedDict",
        "collections.Counter",
        "collections.defaultdict",
        "_codecs.encode",
        "builtins.set",
        "builtins.frozenset",
        "builtins.bytearray",
        # protocols 0-2 (torch.save's default) write b"" as a call of bytes with no argument (Lib/pickle.py
        # ``save_bytes``); like bytearray, an argument can only make it allocate zeroed memory, never run code
        "builtins.bytes",
        "builtins.complex",
        "builtins.slice",
        # the five builtins Python's own "Restricting Globals" example admits (Doc/library/pickle.rst: range,
        # complex, set, frozenset, slice); range(start, stop, step) only takes integers (``__index__``) and makes an
        # immutable object of constant size (Objects/rangeobject.c ``range_new``), however long the range
        "builtins.range",
        "builtins.float",
        "builtins.int",
        "builtins.str",
        "builtins.list",
        "builtins.dict",
        "builtins.tuple",
        "builtins.bool",
        "builtins.object",
        "copyreg._reconstructor",
        "enum.Enum",
        # plain stdlib value classes (rebuilt from their own fields)
        "datetime.datetime",
        "datetime.date",
        "datetime.timedelta",
        "datetime.timezone",
        "decimal.Decimal",
        "fractions.Fraction",
        "uuid.UUID",
        "collections.deque",
        # torch tensors, storages, dtypes
        "torch._utils._rebuild_tensor",
        "torch._utils._rebuild_tensor_v2",
        "torch._utils._rebuild_tensor_v3",
        "torch._utils._rebuild_parameter",
        "torch._utils._rebuild_parameter_with_state",
        "torch._utils._rebuild_qtensor",
        "torch._utils._rebuild_sparse_tensor",
        "torch._utils._rebuild_wrapper_subclass",
        "torch._utils._rebuild_device_tensor_from_numpy",
        "torch._tensor._rebuild_from_type_v2",
        "torch.nn.parameter.Parameter",
        "torch.Tensor",
        "torch.Size",
        "torch.device",
        "torch.serialization._get_layout",
        "torch.storage.UntypedStorage",
        "torch.storage.TypedStorage",
        "torch.per_tensor_affine",
        "torch.per_channel_affine",
        # numpy (rng_state*.pth)
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray._reconstruct",
        "numpy.core.multiarray.scalar",
        "numpy._core.multiarray.scalar",
        "numpy.dtype",
        "numpy.ndarray",
        # torch.distributed.checkpoint .metadata
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "pathlib.PosixPath",
        "pathlib.WindowsPath",
        "pathlib.PurePosixPath",
        "pathlib.PureWindowsPath",
        # transformers / accelerate objects inside training_args.bin
        "transformers.training_args.TrainingArguments",
        "transformers.training_args.OptimizerNames",
        "transformers.training_args_seq2seq.Seq2SeqTrainingArguments",
        "transformers.trainer_utils.IntervalStrategy",
        "transformers.trainer_utils.SaveStrategy",
        "transformers.trainer_utils.SchedulerType",
        "transformers.trainer_utils.HubStrategy",
        "transformers.trainer_utils.EvaluationStrategy",
        "transformers.trainer_pt_utils.AcceleratorConfig",
        "transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig",
        "transformers.debug_utils.DebugOption",
        "accelerate.state.PartialState",
        "accelerate.utils.dataclasses.DistributedType",
        "accelerate.utils.dataclasses.DeepSpeedPlugin",
        "accelerate.utils.dataclasses.FullyShardedDataParallelPlugin",
        "accelerate.utils.dataclasses.TorchDynamoPlugin",
        "accelerate.utils.dataclasses.DynamoBackend",
        "accelerate.utils.dataclasses.PrecisionType",
        "trl.trainer.sft_config.SFTConfig",
        # DeepSpeed states
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
        # MindNLP 0.4 optimizer.ckpt: MindSpore tensors pickled inline, a Tensor rebuilt from a numpy array
        # (`_reconstruct` + `_codecs.encode` bytes, allowed above) that Tensor only wraps; the resume reads them back in
        # mindnlp/engine/trainer/base.py `Trainer._load_optimizer_and_scheduler` (mindspore/common/tensor.py `Tensor`)
        "mindspore.common.tensor.Tensor",
        # Lightning keeps every ``__init__`` argument of a module in ``hyper_parameters`` (``save_hyperparameters``):
        # an ``argparse.Namespace`` argument is pickled as NEWOBJ of no arguments + BUILD of its attribute dict, a
        # rebuild that runs no code of it (Lib/argparse.py ``Namespace`` defines no ``__new__``/``__setstate__``);
        # a call of it with arguments is not admitted (``REVIEWED_CALLS``)
        "argparse.Namespace",
        # ckptdoctor's own reference trainer writes its args dataclass
        "ckptdoctor.reference.train.TrainConfig",
    }
)

# torch dtype objects (torch.float32 ...) and legacy storage classes (torch.FloatStorage ...) are plain data.
_TORCH_DATA_SUFFIXES = ("Storage",)
_TORCH_DTYPES = frozenset(
    {
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "complex64",
        "complex128",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "bool",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
        "qint8",
        "quint8",
        "qint32",
        "quint4x2",
        "half",
        "float",
        "double",
        "long",
        "int",
        "short",
        "cfloat",
        "cdouble",
        "strided",
        "sparse_coo",
        "channels_last",
        "contiguous_format",
        "preserve_format",
    }
)

# Modules and callables that execute code, spawn processes, touch the file system or the network, or load more
# pickles. Any global in these is dangerous whether or not the analysis sees it called.
DANGEROUS_MODULES: frozenset[str] = frozenset(
    {
        "os",
        "posix",
        "nt",
        "subprocess",
        "sys",
        "importlib",
        "runpy",
        "pty",
        "socket",
        "webbrowser",
        "shutil",
        "code",
        "codeop",
        "marshal",
        "pickle",
        "_pickle",
        "cPickle",
        "dill",
        "ctypes",
        "multiprocessing",
        "asyncio",
        "signal",
        "tempfile",
        "glob",
        "zipimport",
        "pdb",
        "bdb",
        "timeit",
        "trace",
        "profile",
        "cProfile",
        "http",
        "urllib",
        "requests",
        "ftplib",
        "smtplib",
        "telnetlib",
        "commands",
        "popen2",
        "platform",
        "torch.hub",
        "torch.jit",
        "torch._dynamo",
        "torch.utils.cpp_extension",
        "numpy.f2py",
        "numpy.testing",
        "joblib",
        "cloudpickle",
        "builtins.__import__",
    }
)
DANGEROUS_GLOBALS: frozenset[str] = frozenset(
    {
        "builtins.eval",
        "builtins.exec",
        "builtins.compile",
        "builtins.open",
        "builtins.getattr",
        "builtins.setattr",
        "builtins.delattr",
        "builtins.__import__",
        "builtins.input",
        "builtins.breakpoint",
        "builtins.globals",
        "builtins.locals",
        "builtins.vars",
        "builtins.apply",
        "builtins.execfile",
        "builtins.memoryview",
        "builtins.type",
        "builtins.super",
        "builtins.help",
        "__builtin__.eval",
        "__builtin__.exec",
        "__builtin__.getattr",
        "__builtin__.open",
        "__builtin__.__import__",
        "operator.methodcaller",
        "operator.attrgetter",
        "operator.itemgetter",
        "operator.call",
        "functools.partial",
        "functools.reduce",
        "types.CodeType",
        "types.FunctionType",
        "types.MethodType",
        "types.ModuleType",
        "types.LambdaType",
        "pathlib.Path",
        "pathlib.PosixPath.write_text",
        "pathlib.Path.write_bytes",
        "pathlib.Path.write_text",
        "numpy.load",
        "numpy.lib.npyio.load",
        "numpy.fromfile",
        "numpy.ctypeslib.load_library",
        "torch.load",
        "torch.from_file",
        "torch.serialization.load",
        "torch._C._jit_pass",
        "base64.b64decode",
        "base64.decodebytes",
        "codecs.decode",
        "_codecs.decode",
    }
)


# Top-level packages whose classes are rebuilt as data by the stacks that write checkpoints. A class of one of these
# (proved by its source) may be named and constructed; its functions may not (unless listed exactly above).
KNOWN_PACKAGES: frozenset[str] = frozenset(
    {"torch", "transformers", "trl", "accelerate", "peft", "deepspeed", "bitsandbytes", "numpy", "safetensors",
     "datasets", "tokenizers"}
)  # fmt: skip
# Bases that make a class of any package data when it derives from them (besides the known packages' classes).
_DATA_BASES = frozenset({"enum.Enum", "enum.IntEnum", "enum.StrEnum", "enum.Flag", "enum.IntFlag"})
# Hooks the unpickler calls on a class (NEWOBJ, REDUCE of the class, BUILD): a class defining one runs its own code.
_HOOKS = frozenset({"__reduce__", "__reduce_ex__", "__setstate__", "__new__", "__getattr__", "__getattribute__",
                    "__setattr__", "__init_subclass__", "__class_getitem__", "__dict__"})  # fmt: skip
_MAX_SOURCE = 4 << 20  # bytes of one module's source read
_MAX_HOPS = 12  # re-exports and base classes followed


def is_allowed(g: GlobalRef) -> bool:
    """True when ``g`` is an exact allowlist entry (generated or reviewed), or a torch dtype or storage class."""
    dotted = g.dotted
    if dotted in ALLOWED or dotted in _allowlist():
        return True
    return g.module == "torch" and (g.name.endswith(_TORCH_DATA_SUFFIXES) or g.name in _TORCH_DTYPES)


# What `torch.load(weights_only=True)` accepts when no safe globals were added (torch/_weights_only_unpickler.py
# `_get_allowed_globals`): these exact names, torch's dtypes, legacy tensor and storage classes, quantization schemes
# and tensor rebuild functions. Anything else makes it raise `UnpicklingError` ("Unsupported global").
_WEIGHTS_ONLY_EXACT = frozenset({
    "collections.OrderedDict", "collections.Counter", "torch.nn.parameter.Parameter",
    "torch.serialization._get_layout", "torch.Size", "torch.Tensor", "torch.device", "_codecs.encode",
    "builtins.bytearray", "builtins.set", "builtins.complex", "torch._tensor._rebuild_from_type_v2",
    "torch.storage.TypedStorage", "torch.storage.UntypedStorage", "torch.per_tensor_affine",
    "torch.per_tensor_symmetric", "torch.per_channel_affine", "torch.per_channel_symmetric",
    "torch.per_channel_affine_float_qparams",
})  # fmt: skip


def weights_only_accepts(g: GlobalRef) -> bool:
    """Whether ``torch.load(weights_only=True)``, with no safe globals added, accepts the global ``g``."""
    if g.dotted in _WEIGHTS_ONLY_EXACT:
        return True
    if g.module == "torch._utils" and g.name.startswith("_rebuild_"):
        return True
    if g.module in ("torch", "torch.cuda") and g.name.endswith(("Tensor", "Storage")):
        return True
    return g.module == "torch" and g.name in _TORCH_DTYPES


def is_dangerous(g: GlobalRef) -> bool:
    """True when ``g`` can execute code, reach the OS or the network, or load further pickles."""
    dotted = g.dotted
    if dotted in DANGEROUS_GLOBALS:
        return True
    parts = g.module.split(".")
    # At any depth of the module's path, not only from its top: ``torch.distributed.elastic.multiprocessing`` starts
    # processes as ``multiprocessing`` does, and a package may vendor ``subprocess`` helpers under any name.
    n = len(parts)
    if any(".".join(parts[i:j]) in DANGEROUS_MODULES for i in range(n) for j in range(i + 1, n + 1)):
        return True
    # An attribute chain (``torch.serialization.os.system``, ``pathlib.Path.write_text``): any step that names a
    # dangerous module or callable makes the whole chain dangerous.
    if "." not in g.name:
        return False
    chain = [*parts, *g.name.split(".")]
    for i in range(len(parts), len(chain)):
        head = chain[i:]
        if any(".".join(head[:j]) in DANGEROUS_MODULES for j in range(1, len(head) + 1)):
            return True
        if ".".join(chain[i - 1 : i + 1]) in DANGEROUS_GLOBALS or f"builtins.{chain[i]}" in DANGEROUS_GLOBALS:
            return True
    return False

# The only globals a stream may CALL with arguments (REDUCE, OBJ/INST, NEWOBJ with arguments, NEWOBJ_EX, a method
# call by SETITEM/APPEND/BUILD on an object it made, or a global handed to a call, which the callee may call): calling
# a class runs its ``__new__``/``__init__``, and being defined in torch or numpy proves nothing about what that does
# (``torch.utils.benchmark.Timer`` writes files, some constructors ``exec`` an argument). Each entry is used so by a
# real stack's files (bench/make_allowlist.py records them in ``allowlist.json`` ``called``) or by the standard
# library's own writer for its values, and was reviewed harmless for any arguments the policy lets a stream build:
# the review is docs/security.md ("Calls"), one line per entry there, and
# ``tests/pickle_verdict/test_security_calls.py`` checks both lists agree.
REVIEWED_CALLS: dict[str, str] = {
    # the standard library's own pickling of its values (Lib/pickle.py ``save_set``/``save_bytes``/..., each type's
    # ``__reduce__``): each converts or copies its arguments, calling at most their own conversion methods
    "builtins.set": "copies an iterable",
    "builtins.frozenset": "copies an iterable",
    "builtins.bytes": "copies or zero-fills",
    "builtins.bytearray": "copies or zero-fills",
    "builtins.complex": "parses numbers",
    "builtins.slice": "stores three values",
    "builtins.range": "stores three integers",
    "_codecs.encode": "encodes a value with a codec of the stdlib `encodings` package",
    "collections.OrderedDict": "copies items",
    "collections.Counter": "counts items",
    "collections.defaultdict": "stores its factory (itself judged as a call) without calling it",
    "collections.deque": "copies an iterable",
    "datetime.datetime": "parses its packed bytes",
    "datetime.date": "parses its packed bytes",
    "datetime.timedelta": "stores numbers",
    "datetime.timezone": "stores an offset and a name",
    "decimal.Decimal": "parses a number",
    "fractions.Fraction": "parses a number",
    "uuid.UUID": "stores an integer",
    "pathlib.PosixPath": "parses path text, no I/O",
    "pathlib.WindowsPath": "parses path text, no I/O",
    "pathlib.PurePosixPath": "parses path text",
    "pathlib.PureWindowsPath": "parses path text",
    # torch's tensor and storage rebuilders (torch/_utils.py, torch/_tensor.py)
    "torch._utils._rebuild_tensor": "views a storage",
    "torch._utils._rebuild_tensor_v2": "views a storage, stores the hooks dict",
    "torch._utils._rebuild_tensor_v3": "views a storage",
    "torch._utils._rebuild_parameter": "wraps a tensor",
    "torch._utils._rebuild_parameter_with_state": "wraps a tensor, sets attributes",
    "torch._utils._rebuild_qtensor": "builds a quantized tensor",
    "torch._utils._rebuild_sparse_tensor": "builds a sparse tensor",
    "torch._utils._rebuild_wrapper_subclass": "makes an empty instance of a class it is handed (itself a call)",
    "torch._utils._rebuild_device_tensor_from_numpy": "copies an array to a device",
    "torch._tensor._rebuild_from_type_v2": "calls the function and class it is handed (each itself a call)",
    "torch.Tensor": "as_subclass and __setstate__ set tensor fields",
    "torch.nn.parameter.Parameter": "wraps a tensor",
    "torch.Size": "copies integers",
    "torch.device": "parses a device name",
    "torch.serialization._get_layout": "looks a layout up by name",
    # numpy arrays and scalars (numpy/_core/multiarray: ``_reconstruct``, ``scalar``; ``ndarray.__setstate__``)
    "numpy.core.multiarray._reconstruct": "allocates an empty array of the class it is handed (itself a call)",
    "numpy._core.multiarray._reconstruct": "allocates an empty array of the class it is handed (itself a call)",
    "numpy.core.multiarray.scalar": "reads a scalar from bytes",
    "numpy._core.multiarray.scalar": "reads a scalar from bytes",
    "numpy.dtype": "parses a type descriptor",
    "numpy.ndarray": "__setstate__ copies array bytes",
}
# The Python-defined hooks a rebuild (NEWOBJ of no arguments, then BUILD) of an exact allowlist entry runs, each
# reviewed (docs/security.md, "Calls"); ``tests/pickle_verdict/test_security_calls.py`` finds every such hook of
# every installed entry here. Frozen dataclasses' generated ``__setattr__`` (it raises) is reviewed once for all.
REBUILD_HOOKS: dict[str, str] = {
    "accelerate.state.PartialState.__getattr__": "raises AttributeError",
    "torch.distributed.checkpoint.metadata.TensorProperties.__setstate__": "unpacks five fields",
    "torch.Tensor.__setstate__": "sets tensor fields",
    "torch.nn.parameter.Parameter.__new__": "an empty parameter",
    "torch.storage.TypedStorage.__new__": "an empty storage",
    "fractions.Fraction.__new__": "zero",
    "pathlib.PurePath.__new__": "the path `.`",
    "pathlib.Path.__new__": "the path `.`, no I/O",
    "uuid.UUID.__setstate__": "sets its integer",
    "uuid.UUID.__setattr__": "raises TypeError",
}
# Enum classes a real stack's files call for a value lookup (``Cls(value)``: ``Enum.__new__`` returns the member or
# raises; a second argument tries the functional API, which refuses an enum that has members). Reviewed for any
# argument by ``tests/pickle_verdict/test_security_calls.py``: ``Enum.__new__``, ``EnumType.__call__`` and an
# ``_missing_`` of ``Enum`` or transformers' ``ExplicitEnum`` (it raises ``ValueError``).
CALLED_ENUMS: frozenset[str] = frozenset(
    {
        "accelerate.utils.dataclasses.DistributedType",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING",
        "transformers.debug_utils.DebugOption",
        "transformers.trainer_utils.FSDPOption",
        "transformers.trainer_utils.HubStrategy",
        "transformers.trainer_utils.IntervalStrategy",
        "transformers.trainer_utils.SaveStrategy",
        "transformers.trainer_utils.SchedulerType",
        "transformers.training_args.OptimizerNames",
    }
)


def may_call(g: GlobalRef) -> bool:
    """Whether a stream may call ``g`` with arguments: an entry of ``REVIEWED_CALLS`` or ``CALLED_ENUMS``, or a torch
    dtype or layout constant (not callable: calling one is a ``TypeError``)."""
    dotted = g.dotted
    return dotted in REVIEWED_CALLS or dotted in CALLED_ENUMS or (g.module == "torch" and g.name in _TORCH_DTYPES)


class Standing(enum.Enum):
    """What the policy makes of one global, before the stream's own facts and the user's allowances."""

    ALLOWED = "allowed"
    UNKNOWN = "unknown"  # a proven class outside the known packages: a warning if only named, an error if called
    UNPROVEN = "unproven"  # nothing proves it a class: an error, unless the stream rebuilds it as TrainingArguments
    UNSAFE = "unsafe"  # dangerous, computed, or an attribute chain: an error whatever the stream does with it


@frozen
class Allowance:
    """One user allowance: ``pattern`` (``pkg.mod.Name``, or ``pkg.mod.*`` for that module and its submodules) and
    where it came from (``--allow-global``, or the user configuration file's path)."""

    pattern: str
    origin: str

    def admits(self, g: GlobalRef) -> bool:
        """Whether this allowance admits ``g``. Attribute chains match only an exact pattern."""
        if self.pattern == g.dotted:
            return True
        if not self.pattern.endswith(".*") or "." in g.name:
            return False
        base = self.pattern[:-2]
        return g.module == base or g.module.startswith(base + ".")


def check_pattern(pattern: str) -> str | None:
    """Why ``pattern`` cannot be an allowance (None when it can): it must be a dotted name of a module and a name,
    or ``module.*``; it may not name anything dangerous."""
    text = pattern.strip()
    parts = text.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in (parts[:-1] if parts[-1] == "*" else parts)):
        return f"`{pattern}` is not `module.Name` or `module.*`"
    module = ".".join(parts[:-1])
    if is_dangerous(GlobalRef(module, parts[-1] if parts[-1] != "*" else "_")):
        return f"`{pattern}` names a module or callable that runs code; it cannot be allowed"
    if parts[-1] == "*":
        # A wildcard names every global under its module: `builtins.*` names `builtins.eval`, `torch.*` names
        # `torch.hub`. The policy would still refuse those, but an allowance must not read as if it admitted them.
        inside = [d for d in sorted(DANGEROUS_GLOBALS | DANGEROUS_MODULES) if d.startswith(module + ".")]
        if inside:
            return (f"`{pattern}` names `{inside[0]}`, which runs code; it cannot be allowed (name each class: "
                    f"`{module}.Name`)")
    return None


# joblib's array wrapper: ``joblib.dump`` pickles each numpy array as a NEWOBJ of no arguments + BUILD of this class
# (shape, order, dtype, subclass), then writes the array's bytes; ``joblib.load``'s ``NumpyUnpickler.load_build``
# reads those bytes after the BUILD and replaces the wrapper with the array (joblib/numpy_pickle.py
# ``NumpyArrayWrapper.read_array``). The class defines no hook, and the rebuild runs only that read: data, where the
# rest of the ``joblib`` package loads files and pickles (``joblib.load``). Admitted only rebuilt so, with a plain
# numpy ``subclass`` (``judge`` checks the state); never called.
JOBLIB_ARRAY = GlobalRef("joblib.numpy_pickle", "NumpyArrayWrapper")


@functools.lru_cache(maxsize=4096)
def _settled(g: GlobalRef) -> tuple[Standing, str] | None:
    """What ``g`` is by name alone (dangerous, computed, allowlisted, an attribute chain), or None when only the
    installed source can tell."""
    if g == JOBLIB_ARRAY:
        return Standing.ALLOWED, "joblib's array wrapper, data when rebuilt as joblib.dump writes it"
    if g.module.startswith("<") or g.name.startswith("<") or is_dangerous(g):
        return Standing.UNSAFE, "runs code or is computed at load time"
    if is_allowed(g):
        return Standing.ALLOWED, "allowlist"
    if "." in g.name:
        return Standing.UNSAFE, "an attribute chain outside the allowlist"
    return None


@functools.lru_cache(maxsize=4096)
def standing(g: GlobalRef) -> tuple[Standing, str]:
    """What ``g`` is, and the fact that says so (shown by ``inspect``). Cached: the same few globals recur. Reads
    installed source for a name the allowlist does not settle: judge a file's globals through ``FileStandings``,
    which bounds how many it may look up."""
    settled = _settled(g)
    if settled is not None:
        return settled
    facts = class_facts(g.module, g.name)
    if facts is None:
        return Standing.UNPROVEN, "not proved to be a class of a known package"
    top = facts.dotted.split(".", 1)[0]
    hooks = sorted(facts.hooks)
    if top in KNOWN_PACKAGES and facts.dotted.split(".")[0] == g.module.split(".")[0]:
        return Standing.ALLOWED, f"a class of {top} (read from its source)"
    base = _data_base(facts, 0)
    if base is not None and not hooks:
        return Standing.ALLOWED, f"a class deriving from {base} (read from its source)"
    why = f" defining {', '.join(hooks)}" if hooks else ""
    return Standing.UNKNOWN, f"a class of {top}{why}, outside the known packages"


def clear_caches() -> None:
    """Forget every cached fact about installed sources (tests that add or remove packages)."""
    for cached in (_settled, standing, _module_defs, rebuilt_as_data):
        cached.cache_clear()


class FileStandings:
    """The standings of one file's globals, reading installed source for at most ``limit`` distinct globals
    (``Limits.pickle_source_globals``): each lookup searches ``sys.path`` and may parse megabytes, and a hostile
    pickle can name any number of modules. Past the limit a global is UNPROVEN (an error unless the user allows it
    or the stream rebuilds it as TrainingArguments data), and ``over`` says so. Which globals are looked up follows
    the stream's order, never the caches' state, so the verdict is the same on every run."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.looked_up: set[GlobalRef] = set()
        self.over = False  # a global went unjudged by source because of the limit

    def __call__(self, g: GlobalRef) -> tuple[Standing, str]:
        """``standing(g)``, or UNPROVEN without any lookup once ``limit`` distinct globals were looked up."""
        settled = _settled(g)
        if settled is not None:
            return settled
        if g not in self.looked_up:
            if len(self.looked_up) >= self.limit:
                self.over = True
                return Standing.UNPROVEN, self.note()
            self.looked_up.add(g)
        return standing(g)

    def note(self) -> str:
        """The LIMIT note of a file that names more globals than are looked up."""
        return f"not looked up: the file names more than {self.limit} globals the allowlist does not settle (limit)"


@frozen
class ClassFacts:
    """A class found in an installed package's source: where it is defined, its bases (dotted, as imported) and
    the unpickling hooks it defines itself."""

    dotted: str
    bases: tuple[str, ...]
    hooks: frozenset[str]
    decorators: tuple[str, ...] = ()  # dotted, as imported: a decorator may add hooks or replace the class


def class_facts(module: str, name: str, hops: int = 0) -> ClassFacts | None:
    """The class ``module.name`` as its installed source defines it (following re-exports), or None when no
    source proves it is a class. Nothing is imported: sources are located with ``PathFinder`` and parsed."""
    if hops > _MAX_HOPS:
        return None
    defs = _module_defs(module)
    if defs is None:
        return None
    d = defs.get(name)
    if d is None:
        return None
    if isinstance(d, ClassFacts):
        return d
    if d.startswith("module:"):  # ``import x.y as name``: a module is not a class
        return None
    target_mod, _, target_name = d.rpartition(".")
    if not target_mod:
        return None
    found = class_facts(target_mod, target_name, hops + 1)
    if found is None and _module_defs(d) is not None:
        return None  # the name is a submodule
    return found


# What a NEWOBJ of no arguments and a BUILD run on a class (``cls.__new__(cls)``, then ``__setstate__``, or a
# ``__dict__`` update found through ``__getattribute__``/``__getattr__``, ``setattr`` for slot state), and the
# decorators and bases that add none of them.
_REBUILD_HOOKS = frozenset({"__new__", "__setstate__", "__getattr__", "__getattribute__", "__setattr__", "__dict__",
                            "metaclass"})  # fmt: skip
_PLAIN_DECORATORS = frozenset({"dataclasses.dataclass"})
_PLAIN_BASES = frozenset({"builtins.object"})


@functools.lru_cache(maxsize=1024)
def rebuilt_as_data(g: GlobalRef) -> bool:
    """Whether a NEWOBJ of ``g`` with no arguments, then a BUILD, runs none of its own code: an exact allowlist
    entry (each observed rebuilt so by a real stack; the hooks of those defining one are reviewed in
    ``REBUILD_HOOKS``), joblib's array wrapper, or a class whose installed source, and that of every base, defines no
    hook the rebuild calls and no decorator but ``dataclass`` (``dataclass`` writes only ``__init__``, comparison and
    ``__repr__`` methods, and a frozen one a ``__setattr__`` that raises)."""
    if is_allowed(g) or g == JOBLIB_ARRAY:
        return True
    facts = class_facts(g.module, g.name)
    return facts is not None and _plain(facts, 0)


def _plain(facts: ClassFacts, hops: int) -> bool:
    if hops > _MAX_HOPS or facts.hooks & _REBUILD_HOOKS or not _PLAIN_DECORATORS.issuperset(facts.decorators):
        return False
    for b in facts.bases:
        if b in _PLAIN_BASES:
            continue
        mod, _, name = b.rpartition(".")
        parent = class_facts(mod, name) if mod else None
        if parent is None or not _plain(parent, hops + 1):
            return False
    return True


def _data_base(facts: ClassFacts, hops: int) -> str | None:
    """The base that makes ``facts`` data (a known package's class, or an enum), following bases by source."""
    if hops > _MAX_HOPS:
        return None
    for b in facts.bases:
        if b in _DATA_BASES or b.split(".", 1)[0] in KNOWN_PACKAGES:
            return b
        mod, _, name = b.rpartition(".")
        parent = class_facts(mod, name) if mod else None
        if parent is not None and not parent.hooks:
            found = _data_base(parent, hops + 1)
            if found is not None:
                return found
    return None


def _search_path() -> list[str]:
    """Where installed packages live: ``sys.path`` without the working folder, which may be the scanned one (a
    checkpoint folder holding ``evil/__init__.py`` must not vouch for ``evil.Cls``)."""
    cwd = os.getcwd()
    return [p for p in sys.path if p not in ("", ".") and os.path.abspath(p) != cwd]


@functools.lru_cache(maxsize=512)
def _module_defs(module: str) -> dict[str, ClassFacts | str] | None:
    """Top-level names of an installed module's source: classes, and re-exports as ``pkg.mod.name`` (or
    ``module:pkg.mod`` for an imported module); None when the module has no readable Python source."""
    from importlib.machinery import PathFinder

    parts = module.split(".")
    if not all(p.isidentifier() for p in parts):
        return None
    path: list[str] | None = _search_path()
    spec = None
    for i in range(len(parts)):
        try:
            spec = PathFinder.find_spec(".".join(parts[: i + 1]), path)
            if spec is None:
                return None
            locations = spec.submodule_search_locations
            path = list(locations) if locations is not None else None
        except Exception:
            # Any failure of the lookup leaves the name unproven, never a traceback: a namespace package's
            # `_NamespacePath` recomputes itself from `sys.modules[parent]` and raises KeyError when the parent
            # is not imported (as it never is in a scan).
            return None
        if path is None and i < len(parts) - 1:
            return None
    origin = spec.origin if spec is not None else None
    if not origin or not origin.endswith(".py"):
        return None
    try:
        with open(origin, "rb") as fh:
            source = fh.read(_MAX_SOURCE + 1)
        if len(source) > _MAX_SOURCE:
            return None
        tree = ast.parse(source)
    except (OSError, SyntaxError, ValueError, RecursionError):
        return None
    package = module if origin.endswith("__init__.py") else module.rpartition(".")[0]
    out: dict[str, ClassFacts | str] = {}
    conflicted: set[str] = set()

    def put(name: str, value: ClassFacts | str) -> None:
        old = out.get(name)
        if old is not None and old != value and not (isinstance(old, str) and isinstance(value, str)):
            conflicted.add(name)  # defined two ways (a class in one branch, a function in another): not proved
        out[name] = value

    def absolute(level: int, mod: str | None) -> str:
        if level == 0:
            return mod or ""
        base = package.split(".")
        base = base[: len(base) - (level - 1)] if level > 1 else base
        return ".".join([*base, mod] if mod else base)

    def dotted(expr: ast.expr) -> str | None:
        if isinstance(expr, ast.Name):
            d = out.get(expr.id)
            if isinstance(d, ClassFacts):
                return d.dotted
            if isinstance(d, str):
                return d.removeprefix("module:")
            return f"builtins.{expr.id}" if expr.id in ("object", "dict", "str", "int") else f"{module}.{expr.id}"
        if isinstance(expr, ast.Attribute):
            head = dotted(expr.value)
            return f"{head}.{expr.attr}" if head else None
        if isinstance(expr, ast.Subscript):  # Generic[T], dict[str, int]
            return dotted(expr.value)
        return None

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                bases = tuple(b for b in map(dotted, node.bases) if b)
                funcs = (n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))
                hooks = frozenset(n.name for n in funcs if n.name in _HOOKS) | frozenset(
                    t.id for n in node.body if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name) and t.id in _HOOKS
                )  # fmt: skip
                if any(k.arg == "metaclass" for k in node.keywords):
                    hooks |= {"metaclass"}
                decorators = tuple(
                    dotted(d.func if isinstance(d, ast.Call) else d) or "<expression>" for d in node.decorator_list
                )
                put(node.name, ClassFacts(f"{module}.{node.name}", bases, hooks, decorators))
            elif isinstance(node, ast.ImportFrom):
                src = absolute(node.level, node.module)
                for a in node.names:
                    if a.name != "*":
                        put(a.asname or a.name, f"{src}.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    put(a.asname or a.name.split(".")[0], "module:" + (a.name if a.asname else a.name.split(".")[0]))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                put(node.name, f"<function>.{node.name}")
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                value = node.value
                alias = dotted(value) if isinstance(value, (ast.Name, ast.Attribute)) else None
                for t in targets:
                    if isinstance(t, ast.Name):
                        put(t.id, alias if alias else f"<value>.{t.id}")
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, ast.With):
                visit(node.body)

    visit(tree.body)
    for name in conflicted:
        out[name] = f"<conflict>.{name}"
    return out
