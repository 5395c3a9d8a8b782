"""Which pickle globals genuine checkpoint files import (allowed), and which can run code (dangerous).

The allowlist holds what torch, transformers, accelerate, peft, numpy and DeepSpeed really write: the generated
``allowlist.json`` (bench/make_allowlist.py reads files those libraries wrote) plus the reviewed entries below
(ANATOMY §1.7, §1.9, §4, §5). A global matches an entry exactly, or a ``module.*`` entry by module prefix (only for
modules that define nothing but data classes). A name with a dot (``Path.write_text``) is an attribute chain the
unpickler follows from the module (protocol 4+): it matches exact entries only.
"""

from __future__ import annotations

import json
from importlib import resources

from ckptdoctor.model import GlobalRef


def _generated() -> frozenset[str]:
    """The globals in the generated ``allowlist.json`` (observed in real files, and sibling enum classes)."""
    try:
        doc = json.loads(resources.files("ckptdoctor.rules").joinpath("allowlist.json").read_text("utf-8"))
        return frozenset(doc.get("observed", {})) | frozenset(doc.get("enums", ()))
    except (OSError, ValueError):
        return frozenset()  # a missing data file makes the scan stricter, never looser


GENERATED: frozenset[str] = _generated()

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
        "builtins.complex",
        "builtins.slice",
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
        "numpy.dtypes.*",
        # torch.distributed.checkpoint .metadata
        "torch.distributed.checkpoint.metadata.*",
        "torch.distributed.checkpoint.filesystem._StorageInfo",
        "torch.distributed.checkpoint.planner.*",
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


def is_allowed(g: GlobalRef) -> bool:
    """True when ``g`` is something genuine checkpoint files import."""
    dotted = g.dotted
    if dotted in ALLOWED or dotted in GENERATED:
        return True
    if "." in g.name or g.module.startswith("<"):
        return False  # attribute chains and unresolved names match nothing by pattern
    if g.module == "torch" and (g.name.endswith(_TORCH_DATA_SUFFIXES) or g.name in _TORCH_DTYPES):
        return True
    parts = g.module.split(".")
    return any(".".join(parts[:i]) + ".*" in ALLOWED for i in range(1, len(parts) + 1))


def is_dangerous(g: GlobalRef) -> bool:
    """True when ``g`` can execute code, reach the OS or the network, or load further pickles."""
    dotted = g.dotted
    if dotted in DANGEROUS_GLOBALS:
        return True
    parts = g.module.split(".")
    if any(".".join(parts[:i]) in DANGEROUS_MODULES for i in range(1, len(parts) + 1)):
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
