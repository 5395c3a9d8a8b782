"""Frozen facts about what is on disk: files, checkpoints, runs. No I/O happens in this module.

Readers produce the file-level values (``SafetensorsFacts``, ``TorchFacts`` ...); discovery groups them into
``Checkpoint`` and ``Run``; rules and reports consume the result. Everything here is a value.
"""

from __future__ import annotations

import enum
import math
import operator
import sys
from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field, FrozenInstanceError, dataclass, field, fields
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, cast

if sys.version_info >= (3, 11):
    from typing import dataclass_transform
elif TYPE_CHECKING:
    from typing_extensions import dataclass_transform
else:  # pragma: no cover - Python 3.10 at run time: the marker only informs type checkers

    def dataclass_transform(**_: Any) -> Callable[[_T], _T]:
        return lambda func: func


_T = TypeVar("_T")


def frozen_value(cls: type[_T]) -> type[_T]:
    """``cls`` (a ``dataclass(frozen=True, slots=True, eq=False, repr=False)``) given the ``__eq__``, ``__hash__``
    and ``__repr__`` that ``dataclass(frozen=True)`` would generate, with the same results (fields compared as one
    tuple, ``Name(field=value, ...)``), built from closures rather than compiled per class: ``dataclass`` compiles
    each generated method with ``exec``, and these three were half of the ~13 ms that importing this module's 30+
    classes cost at every start-up."""
    for name, func in _value_methods(cls.__qualname__, fields(cls)).items():  # type: ignore[arg-type]
        setattr(cls, name, func)
    return cls


def _value_methods(qualname: str, every: Sequence[Field[Any]]) -> dict[str, Callable[..., Any]]:
    """``frozen_value``'s three methods for a class named ``qualname`` with the fields ``every``."""
    names = tuple(f.name for f in every if f.compare)
    shown_names = tuple(f.name for f in every if f.repr)
    if any(f.hash is not None for f in every):
        raise TypeError(f"{qualname}: frozen_value compares and hashes the compare=True fields only")
    key: Callable[[Any], Any]
    if not names:

        def key(self: Any) -> tuple[()]:
            return ()
    elif len(names) == 1:
        one = operator.attrgetter(names[0])

        def key(self: Any) -> tuple[Any]:
            return (one(self),)
    else:
        key = operator.attrgetter(*names)  # a tuple of the fields, in order

    def __eq__(self: Any, other: object) -> bool:
        if other.__class__ is self.__class__:
            return bool(key(self) == key(other))
        return NotImplemented

    def __hash__(self: Any) -> int:
        return hash(key(self))

    def __repr__(self: Any) -> str:
        shown = ", ".join(f"{n}={getattr(self, n)!r}" for n in shown_names)
        return f"{self.__class__.__qualname__}({shown})"

    made: dict[str, Callable[..., Any]] = {}
    for func in (__eq__, __hash__, __repr__):
        func.__qualname__ = f"{qualname}.{func.__name__}"
        made[func.__name__] = func
    return made


def _frozen_setattr(self: Any, name: str, value: Any) -> None:
    raise FrozenInstanceError(f"cannot assign to field {name!r}")


def _frozen_delattr(self: Any, name: str) -> None:
    raise FrozenInstanceError(f"cannot delete field {name!r}")


def _frozen_getstate(self: Any) -> list[Any]:
    return [getattr(self, f.name) for f in fields(self)]


def _frozen_setstate(self: Any, state: list[Any]) -> None:
    for f, value in zip(fields(self), state, strict=True):
        object.__setattr__(self, f.name, value)  # bypasses the raising __setattr__, as the generated one does


def _compile_init(cls: type) -> Callable[..., None]:
    """The ``__init__`` ``dataclass(frozen=True)`` generates for ``cls``'s fields (the same parameters, defaults and
    factories, each field set with ``object.__setattr__``: the class's own ``__setattr__`` raises), made by
    ``dataclass`` itself on a stand-in class with those fields, so this package compiles nothing."""
    space: dict[str, Any] = {"__doc__": cls.__doc__, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    annotations: dict[str, Any] = {}
    for f in fields(cls):
        annotations[f.name] = f.type
        space[f.name] = field(default=f.default, default_factory=f.default_factory, init=f.init)
    space["__annotations__"] = annotations
    make = dataclass(frozen=True, slots=True, eq=False, repr=False, match_args=False)  # slots: init=False defaults too
    stand_in: Any = make(type(cls.__name__, (), space))
    made: Callable[..., None] = stand_in.__init__
    made.__qualname__ = f"{cls.__qualname__}.__init__"
    return made


# Values of one class built with keywords or defaults before its generated ``__init__`` is made (``_frozen_init``).
# Measured with callgrind on a five-field class: making it costs about 2.7 M instructions, a build with keywords or
# defaults about 5 K more through the closures than through the generated code (11 K), an all-positional build about
# the same. Most value classes of a scan are built a few hundred times or fewer and never pay for it; those built
# per tensor or per file with keywords pay it once.
_COMPILE_AFTER = 1000


def _frozen_init(cls: type) -> Callable[..., None]:
    """``cls``'s ``__init__``: it binds its arguments as the generated one does and sets each field through its
    slot's descriptor (which the raising ``__setattr__`` does not see), without anything compiled; after
    ``_COMPILE_AFTER`` values it has ``dataclass`` make the generated one (``_compile_init``) and puts it in its
    place. A scan imports some 70 value classes and builds about 40, most of them a few times (making the generated
    ``__init__`` for each, three ``exec`` on a stand-in, was some 90 M instructions of every scan); what is built a
    million times with keywords or defaults still runs the generated code. Only those builds count: one with every
    field given by position costs the same here (its values set in one loop), so making the generated ``__init__``
    for builds by position alone is work for nothing (it was 8 M instructions of a warm rescan while the verdict
    cache's decoder built its values so; it now sets their slots itself, ``cache.codec``)."""
    every = fields(cls)
    if any(f.kw_only for f in every):
        raise TypeError(f"{cls.__qualname__}: frozen does not build keyword-only fields")
    seen_default = False
    for f in every:
        if f.init and (f.default is not MISSING or f.default_factory is not MISSING):
            seen_default = True
        elif f.init and seen_default:
            raise TypeError(f"{cls.__qualname__}: non-default argument {f.name!r} follows default argument")
    given = tuple(f for f in every if f.init)
    names = tuple(f.name for f in given)
    known = frozenset(names)
    count = len(names)
    setters = tuple(getattr(cls, f.name).__set__ for f in given)
    defaults = tuple(f.default for f in given)
    factories = tuple(f.default_factory for f in given)
    # fields left out of __init__ start at their default, as the generated __init__ of a slotted class sets them
    fixed = tuple((getattr(cls, f.name).__set__, f.default, f.default_factory) for f in every
                  if not f.init and (f.default is not MISSING or f.default_factory is not MISSING))  # fmt: skip
    where = f"{cls.__qualname__}.__init__()"
    built = 0

    def bind(self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if len(args) > count:
            raise TypeError(f"{where} takes {count + 1} positional arguments but {len(args) + 1} were given")
        for name in kwargs:
            if name not in known:
                raise TypeError(f"{where} got an unexpected keyword argument {name!r}")
        for i, name in enumerate(names):
            if i < len(args):
                if name in kwargs:
                    raise TypeError(f"{where} got multiple values for argument {name!r}")
                value = args[i]
            elif name in kwargs:
                value = kwargs[name]
            elif defaults[i] is not MISSING:
                value = defaults[i]
            elif factories[i] is not MISSING:
                value = factories[i]()  # type: ignore[operator]
            else:
                raise TypeError(f"{where} missing 1 required positional argument: {name!r}")
            setters[i](self, value)
        for setter, default, factory in fixed:
            setter(self, factory() if default is MISSING else default)  # type: ignore[operator]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        nonlocal built
        if kwargs or fixed or len(args) != count:
            built += 1  # a lost update between threads only delays the swap
            if built > _COMPILE_AFTER:
                compiled = _compile_init(cls)
                type.__setattr__(cls, "__init__", compiled)
                compiled(self, *args, **kwargs)
            else:
                bind(self, args, kwargs)
        else:
            for setter, value in zip(setters, args, strict=True):  # the same length: checked above
                setter(self, value)

    __init__.__qualname__ = f"{cls.__qualname__}.__init__"
    return __init__


def _dataclass_made(cls: type) -> Any:
    """``cls`` made by ``dataclass(init=False, slots=True, eq=False, repr=False)`` itself."""
    return dataclass(init=False, slots=True, eq=False, repr=False)(cls)


class _Sample:
    """What ``dataclass`` puts on every class ``frozen`` makes, read once from a class it made."""

    x: int = 0


_SAMPLE = _dataclass_made(_Sample)
_PARAMS = _SAMPLE.__dataclass_params__  # the same flags for every class, and dataclasses never changes them
_FIELD = fields(_SAMPLE)[0]._field_type  # type: ignore[attr-defined]  # what marks a field (not a ClassVar or InitVar); private to dataclasses
# what else this Python's dataclass sets on a class (3.13's ``__replace__``, for ``copy.replace``)
_ADDED = {name: value for name, value in vars(_SAMPLE).items()
          if name not in vars(_Sample) and name not in ("__slots__", "__dataclass_fields__", "__dataclass_params__",
                                                        "__match_args__", "x")}  # fmt: skip


def _plain(annotation: object) -> bool:
    """Whether ``annotation`` is text that cannot name ``ClassVar``, ``InitVar`` or ``KW_ONLY`` (which make an
    annotation something else than a field: ``dataclass`` itself sorts those out)."""
    return type(annotation) is str and "ClassVar" not in annotation and "InitVar" not in annotation and (
        "KW_ONLY" not in annotation)


# A class attribute naming slots that are no fields: what a value keeps of its own fields once asked (set with
# ``object.__setattr__``), not compared, hashed, shown nor pickled, and gone from a copy (``Checkpoint.file``'s index).
MEMO_SLOTS = "_memo_slots"


def _slotted(cls: type, methods: dict[str, Callable[..., Any] | None]) -> Any:
    """``cls`` as ``dataclass(init=False, slots=True, eq=False, repr=False)`` returns it (the same fields, each a
    ``dataclasses.Field`` as ``field()`` makes it, the same slots, ``__match_args__`` and flags), with
    ``frozen_value``'s equality, hash and repr and then ``methods`` (``frozen``'s or ``mutable``'s, which replace
    what ``cls`` and ``dataclass`` define under those names), made in one pass:
    ``dataclass`` tests each annotation's text three times against ``ClassVar``, ``InitVar`` and ``KW_ONLY`` (a
    regular expression and a module lookup each), and those tests and the methods set on the finished class one by
    one were most of what this package's 90-odd value classes cost every start-up. A class that is not a plain one
    (a base besides ``object``, another metaclass, annotations that are not text or may name one of those three) is
    made by ``dataclass`` itself. The names ``cls`` lists under ``MEMO_SLOTS`` are slots after the fields'."""
    space = dict(cls.__dict__)
    annotations = space.get("__annotations__")
    memo = space.pop(MEMO_SLOTS, ())
    if (cls.__bases__ != (object,) or type(cls) is not type or "__slots__" in space or annotations is None
            or not all(_plain(text) for text in annotations.values())):
        if memo:
            raise TypeError(f"{cls.__qualname__}: {MEMO_SLOTS} needs a class without bases, metaclass or ClassVar")
        made = _dataclass_made(cls)
        for name, func in (*_value_methods(cls.__qualname__, fields(made)).items(), *methods.items()):
            setattr(made, name, func)
        return made
    every: dict[str, Field[Any]] = {}
    for name, text in annotations.items():
        default = space.pop(name, MISSING)
        one: Any = default if isinstance(default, Field) else field(default=default)
        one.name = name
        one.type = text
        one._field_type = _FIELD
        if one.kw_only is MISSING:
            one.kw_only = False
        if one.default.__class__.__hash__ is None:
            raise ValueError(f"mutable default {type(one.default)} for field {name} is not allowed: use "
                             "default_factory")
        every[name] = one
    for name, value in space.items():
        if isinstance(value, Field):
            raise TypeError(f"{name!r} is a field but has no type annotation")
    space.pop("__dict__", None)
    space.pop("__weakref__", None)
    space["__qualname__"] = cls.__qualname__  # kept by the class, not its __dict__
    space["__slots__"] = (*every, *memo)
    space["__dataclass_params__"] = _PARAMS
    space["__dataclass_fields__"] = every
    space.setdefault("__match_args__", tuple(name for name, one in every.items() if one.init))
    for name, value in _ADDED.items():
        space.setdefault(name, value)
    space.update(_value_methods(cls.__qualname__, tuple(every.values())))
    space.update(methods)
    return type(cls.__name__, (object,), space)


_FROZEN_METHODS: dict[str, Callable[..., Any] | None] = {
    "__setattr__": _frozen_setattr,
    "__delattr__": _frozen_delattr,
    "__getstate__": _frozen_getstate,
    "__setstate__": _frozen_setstate,
}


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def frozen(cls: type[_T]) -> type[_T]:
    """``cls`` as a value: a slotted dataclass that behaves as ``dataclass(frozen=True, slots=True)`` would make it
    (the same ``__init__``, equality, hash and repr, ``FrozenInstanceError`` on assignment, pickling, ``replace``).
    ``dataclass`` compiles three methods per frozen class with ``exec`` when the class is made; for the 70-odd
    values a scan imports that was a third of the start-up. Here nothing is compiled at import: ``__init__`` binds
    through the slots until a class has been built many times, then ``dataclass`` makes the generated one on a
    stand-in (``_frozen_init``); the rest are shared functions and closures (``frozen_value``'s), and the slotted
    class itself is made in one pass (``_slotted``). The one decorator of every frozen value in the package."""
    if not cls.__doc__:  # dataclass would make one from inspect.signature: of object's text, through tokenize
        cls.__doc__ = cls.__qualname__
    made: Any = _slotted(cls, _FROZEN_METHODS)
    made.__init__ = _frozen_init(made)  # it sets each field through its slot: made once the slots are
    return cast("type[_T]", made)


@dataclass_transform(field_specifiers=(field,))
def mutable(cls: type[_T]) -> type[_T]:
    """``cls`` as ``dataclass(slots=True)`` would make it (the same ``__init__``, equality and repr, and no hash,
    as a mutable dataclass has), without compiling anything: ``frozen``'s ``__init__``, equality and repr, on a
    class that may be changed. For the walk's own records (``discover._Dir`` ...), whose three methods
    ``dataclass`` compiled with ``exec`` at every start-up."""
    if not cls.__doc__:  # as in frozen
        cls.__doc__ = cls.__qualname__
    made: Any = _slotted(cls, {"__hash__": None})  # equal values that may change: unhashable, as dataclass says
    made.__init__ = _frozen_init(made)
    return cast("type[_T]", made)


# ---------------------------------------------------------------------------------------------------------------
# Read problems


class ProblemKind(str, enum.Enum):
    """Why a file (or path) could not be read, or read only in part. Rules map these to finding codes."""

    UNREADABLE = "unreadable"  # permission denied, I/O error, vanished while scanning
    EMPTY = "empty"  # zero bytes where content is required
    TRUNCATED = "truncated"  # the file ends before its own structure says it should
    MALFORMED = "malformed"  # structure violates the format (bad header, bad offsets, broken zip ...)
    INVALID_JSON = "invalid-json"  # not parseable JSON, or duplicate keys; message carries line/column
    MALFORMED_PICKLE = "malformed-pickle"  # a pickle stream that is truncated, inconsistent or built to confuse
    LIMIT = "limit"  # a resource limit was reached; the file was not fully analysed
    SYMLINK_LOOP = "symlink-loop"
    LINK_ESCAPES_ROOT = "link-escapes-root"
    BAD_NAME = "bad-name"  # a name that is not valid UTF-8
    SPECIAL_FILE = "special-file"  # FIFO, socket or device: never opened
    SUSPICIOUS_ARCHIVE = "suspicious-archive"  # zip layout no honest writer produces (duplicates, hidden streams)
    NOT_CHECKED = "not-checked"  # a folder handed to another process that never came back (``scan --dask``)


@frozen
class ReadProblem:
    """One thing a reader or the walk could not accept, with a human reason (the numbers that prove it)."""

    kind: ProblemKind
    message: str


# ---------------------------------------------------------------------------------------------------------------
# Values rebuilt from pickles (never by running them)


@frozen
class GlobalRef:
    """A global the pickle imports (``GLOBAL``/``STACK_GLOBAL``/``INST``/``OBJ``), e.g. ``collections.OrderedDict``."""

    module: str
    name: str

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.name}"


# Callee stand-ins recorded in ``calls`` when the unpickler would call something that is not a named global: the
# result of another call, a persistent-id object, an out-of-band buffer. Any module in angle brackets is unresolved.
# Here, not in ``readers.pickle_walk`` (which records them), for the judge that reads them: a rescan that takes its
# verdicts from the cache imports no reader.
UNRESOLVED_CALL = GlobalRef("<unresolved>", "<call of a computed object>")
# ``torch.load(io.BytesIO(b), weights_only=False)`` of the bytes it is handed (torch/storage.py): what a plain
# ``pickle.dumps`` of a tensor writes for its storage (``TypedStorage.__reduce__``), TransformerEngine's
# ``_extra_state`` among them. The walk records what each call hands it (``PickleFacts.loads``), so those bytes can be
# read as ``torch.load`` reads them and judged.
BYTES_LOADER = GlobalRef("torch.storage", "_load_from_bytes")


@frozen
class TensorRef:
    """A tensor as ``torch._utils._rebuild_tensor_v2`` / ``_rebuild_parameter`` would build it, without its data.

    ``dtype`` uses safetensors' dtype codes (``F32``, ``BF16``, ``U8`` ...), so tensors from both formats compare.
    ``storage_nbytes`` is the size of the storage record in the archive (None when the record is absent).
    """

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    storage_key: str
    storage_numel: int
    location: str
    storage_nbytes: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@frozen
class Opaque:
    """A value the walk did not rebuild: a call to ``func`` (REDUCE/NEWOBJ/INST/OBJ) with its arguments,
    plus the state a BUILD applied. Never called. ``func`` is None when the callee was not a resolvable global.
    ``new`` is True when NEWOBJ or NEWOBJ_EX made it: ``cls.__new__(cls, *args)``, which the unpickler refuses
    unless ``func`` is a class (Modules/_pickle.c ``load_newobj``), where REDUCE calls any callable."""

    func: GlobalRef | None
    args: Any = ()
    state: Any = None
    new: bool = False


# A pickled value: None, bool, int, float, complex, str, bytes, list, tuple, dict, set/frozenset,
# GlobalRef (a class or function mentioned but not called), TensorRef, or Opaque.
PickleValue = Any


@frozen
class PickleFacts:
    """What a static walk of one pickle stream found."""

    protocol: int
    value: PickleValue
    globals: tuple[GlobalRef, ...]  # every global imported, in first-seen order, deduplicated
    calls: tuple[GlobalRef, ...]  # globals the stream calls (REDUCE/NEWOBJ/INST/OBJ targets), deduplicated
    opcodes: int
    persistent_ids: int = 0
    # the globals of ``calls`` the stream only rebuilds without arguments: every call of each is a NEWOBJ of an empty
    # tuple (``cls.__new__(cls)``) or a BUILD of an object so made; any other call of it keeps it out
    rebuilt: tuple[GlobalRef, ...] = ()
    # what each call of ``torch.storage._load_from_bytes`` hands it (a ``torch.load`` of those bytes): the literal
    # bytes of a REDUCE of a one-bytes tuple, None for any other call or use of it (``BYTES_LOADER``)
    loads: tuple[bytes | None, ...] = ()
    # the other streams a loader unpickles from the same file, when ``merge_pickles`` made this one: every stream,
    # the main one first, each with its own value (the judge reads each stream's values on its own); () otherwise
    streams: tuple[PickleFacts, ...] = ()
    # the pickles found inside this stream's values and ``loads`` when it was read (``readers.nested``); None when
    # they were not searched for yet
    nested: tuple[NestedPickle, ...] | None = None
    # what that search did not look at (a bound it reached): each is a finding, never silence
    unsearched: tuple[str, ...] = ()


@frozen
class NestedPickle:
    """A pickle (or ``torch.save`` file) found in the bytes or strings of another stream's values, or handed to
    ``torch.storage._load_from_bytes`` (``load``: its index in that stream's ``loads``; -1 otherwise). ``clean``:
    it was read without problems (bytes that merely start like a pickle stop early)."""

    facts: PickleFacts
    clean: bool
    load: int = -1


# ---------------------------------------------------------------------------------------------------------------
# Per-format file facts


@frozen
class TensorInfo:
    """One tensor in a weights file: name, safetensors dtype code, shape and the bytes it spans."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@frozen
class SafetensorsFacts:
    """The parsed header of a ``.safetensors`` file."""

    header_bytes: int
    metadata: dict[str, str] | None
    tensors: tuple[TensorInfo, ...]
    data_bytes: int  # end of the last tensor's data, as the header declares it


@frozen
class ZipMember:
    """One entry of a zip central directory."""

    name: str
    offset: int  # offset of the local header
    compressed_size: int
    size: int
    method: int  # 0 = stored (what torch writes)


@frozen
class TorchFacts:
    """A file written by ``torch.save`` (zip or legacy format): its members and the static walk of its pickle.

    ``tensors`` flattens every ``TensorRef`` reachable from the top-level value under a dotted path
    (``state.0.exp_avg``, ``model.layer.weight``) so rules can count and compare them.
    """

    format: str  # "zip" or "legacy"
    prefix: str  # the archive's top-level folder ("optimizer", "archive" ...); "" for legacy
    members: tuple[ZipMember, ...]
    pickle: PickleFacts | None
    tensors: tuple[tuple[str, TensorRef], ...]
    byteorder: str = "little"
    # a TorchScript archive (``torch.jit.save``: it holds ``constants.pkl``), which ``torch.load`` hands to
    # ``torch.jit.load``: its pickles are read by TorchScript's own unpickler, its ``code/`` records are TorchScript
    torchscript: bool = False
    lightning: LightningFacts | None = None  # what `Trainer.fit(ckpt_path=...)` reads, for a Lightning `.ckpt`


@frozen
class CheckpointCallbackState:
    """One ``ModelCheckpoint``'s state in a Lightning checkpoint (``ModelCheckpoint.state_dict``): the folder it
    wrote to and the files it tracks, as the absolute paths Lightning stored ("" or None when unset)."""

    key: str  # its key in ``callbacks``: ``ModelCheckpoint{'monitor': ..., ...}``
    dirpath: str | None
    best_model_path: str | None
    last_model_path: str | None
    kth_best_model_path: str | None
    best_k_models: tuple[str, ...]


@frozen
class SchedulerState:
    """One learning-rate scheduler's state in a Lightning checkpoint (``lr_schedulers``): its steps taken
    (``last_epoch``) and, for a ``OneCycleLR``, the ``total_steps`` it was built for (None otherwise)."""

    last_epoch: int | None
    total_steps: int | None


@frozen
class LightningFacts:
    """What ``Trainer.fit(ckpt_path=...)`` reads from a PyTorch Lightning ``.ckpt``, pulled from its pickle at read
    time (readers.lightning): the counters, whether the optimizer/scheduler/loop state is there, and each
    ``ModelCheckpoint``'s state. None for a counter that is absent or not an integer."""

    version: str  # ``pytorch-lightning_version``
    global_step: int | None
    epoch: int | None
    has_loops: bool
    loop_steps: int | None  # optimizer steps the fit loop counts: what `trainer.global_step` resumes at
    loop_epoch: int | None  # ``fit_loop.epoch_progress.current.completed``: what `trainer.current_epoch` resumes at
    # ``epoch_progress.current.processed``: epochs whose batches all ran (one above `completed` for a save in
    # `on_train_epoch_end`); `_FitLoop.done` compares it with `max_epochs`
    loop_epochs_processed: int | None
    has_optimizer: bool  # ``optimizer_states`` present (a `save_weights_only` checkpoint has none)
    has_schedulers: bool  # ``lr_schedulers`` present
    schedulers: tuple[SchedulerState, ...]
    checkpoint_callbacks: tuple[CheckpointCallbackState, ...]


@frozen
class JsonFacts:
    """A JSON document, parsed with duplicate keys rejected. ``value`` is the plain decoded value.

    ``partial``: a large `trainer_state.json` read in pieces (``readers.jsonfiles``), whose ``log_history`` entries
    keep only ``HISTORY_KEYS``; everything else is whole. Nothing may be rewritten from such a value."""

    value: Any
    partial: bool = False


# All that the rules and the gate read of a `log_history` entry: its step, and the loss and learning rate logged
# there (a large trainer_state.json keeps only these; ``trainer_view.TrainerStateView``, ``rules.discovery``).
HISTORY_KEYS = ("step", "loss", "learning_rate")


@frozen
class TextFacts:
    """A small text file read whole (DeepSpeed's ``latest``)."""

    text: str


@frozen
class DcpStorageRef:
    """Where ``torch.distributed.checkpoint`` metadata says one item's bytes live."""

    fqn: str
    relative_path: str
    offset: int
    length: int
    is_bytes: bool = False  # a BYTE_IO item (non-tensor): torch loads it with weights_only=False


class DcpItem(NamedTuple):
    """One item of a `.distcp` file that a scan reads, at the byte range `.metadata` gives it: a BYTE_IO item
    (``extra_state`` empty: torch unpickles it with weights_only=False), or the tensor of an `_extra_state` key
    (``extra_state``: its fqn), whose bytes TransformerEngine's ``set_extra_state`` unpickles."""

    offset: int
    length: int
    extra_state: str = ""


@frozen
class DcpMetadataFacts:
    """A DCP ``.metadata`` pickle, walked statically: the keys it describes and the byte ranges it references."""

    pickle: PickleFacts
    keys: tuple[str, ...]
    storage: tuple[DcpStorageRef, ...]


@frozen
class MindSporeFacts:
    """A MindSpore ``.ckpt`` (protobuf ``Checkpoint``), walked without MindSpore: its tensors in file order.

    ``tensors`` use safetensors' dtype codes; a tensor MindSpore saved as several slices under one tag is one
    entry whose ``nbytes`` sums them. ``values`` counts the ``Value`` records (slices included).
    """

    tensors: tuple[TensorInfo, ...]
    values: int


@frozen
class TfBundleEntry:
    """One ``BundleEntryProto`` of a TensorFlow ``.index`` file: where a tensor's bytes live in the data shards.

    ``dtype`` is a safetensors dtype code where one exists, else TensorFlow's name (``DT_STRING``, ``DT_7``...).
    ``sliced`` entries (partitioned variables) keep their bytes under other keys and have ``size`` 0.
    """

    key: str
    dtype: str
    shape: tuple[int, ...]
    shard_id: int
    offset: int
    size: int
    crc32c: int | None  # masked, as TensorFlow stores it (``crc32c::Mask``)
    sliced: bool = False


@frozen
class TfIndexFacts:
    """A TensorFlow checkpoint bundle index (``ckpt-N.index``, a LevelDB-format table) without TensorFlow."""

    num_shards: int
    entries: tuple[TfBundleEntry, ...]
    endianness: str = "little"
    version: int = 0  # BundleHeaderProto.version.producer


@frozen
class TfCheckpointStateFacts:
    """The text-format ``checkpoint`` file ``tf.train.CheckpointManager`` keeps beside its ``.index`` files."""

    model_checkpoint_path: str | None
    all_model_checkpoint_paths: tuple[str, ...]


@frozen
class Hdf5Dataset:
    """One dataset of an HDF5 file as h5py describes it from the file's metadata (no data is read).

    ``dtype`` is numpy's name (``float32``); ``layout`` HDF5's storage layout (``contiguous``, ``chunked``,
    ``compact``, ``virtual``); ``storage_bytes`` the bytes allocated for its data (H5Dget_storage_size), and
    ``offset`` where a contiguous dataset's bytes start in the file (None for other layouts and unallocated data).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    layout: str
    storage_bytes: int
    offset: int | None = None


@frozen
class Hdf5Facts:
    """An HDF5 file's superblock (``tf_model.h5``, ``*.weights.h5``), read without h5py, and its datasets.

    ``datasets`` is None when h5py is not installed (the ``h5`` extra) or the superblock already shows damage.
    """

    superblock_offset: int  # 0, or the size of a user block (512, 1024, 2048, ...)
    version: int
    offset_size: int
    length_size: int
    base_address: int
    eof_address: int  # relative to ``base_address``: the file must reach base + eof bytes
    datasets: tuple[Hdf5Dataset, ...] | None = None


@frozen
class NpyArray:
    """One ``.npy`` array's header as ``numpy.lib.format.read_array`` reads it (never importing numpy).

    ``name`` is its record in an `.npz` ("" for a lone `.npy`); ``descr`` the dtype as written (``'<f4'``, ``'|O'``,
    or a structured dtype's repr); ``pickled``: the body is a pickle (object dtype), unpickled by
    ``np.load(allow_pickle=True)``.
    """

    name: str
    version: tuple[int, int]
    descr: str
    fortran_order: bool
    shape: tuple[int, ...]
    pickled: bool


@frozen
class NumpyFacts:
    """A `.npy` or `.npz` file: its arrays' headers, and the pickles of its object arrays walked statically (merged)."""

    arrays: tuple[NpyArray, ...]
    pickle: PickleFacts | None


@frozen
class ArchiveFacts:
    """A tar archive (plain or gzip/bz2/xz compressed) or a compressed single file, read by headers and sniffed
    member heads, never extracted: ``fmt`` is how it is packed (``tar``, ``tar.gz``, ``gz`` ...), ``members`` how
    many members were listed (nested archives' included), and ``pickle`` every stream a loader could unpickle from
    a member (any name, by content), walked statically and merged."""

    fmt: str
    members: int
    pickle: PickleFacts | None


FileContent = (
    SafetensorsFacts
    | TorchFacts
    | PickleFacts
    | JsonFacts
    | TextFacts
    | DcpMetadataFacts
    | MindSporeFacts
    | TfIndexFacts
    | TfCheckpointStateFacts
    | Hdf5Facts
    | NumpyFacts
    | ArchiveFacts
)


class FileKind(str, enum.Enum):
    """What a file is, decided by its content first and its name second."""

    SAFETENSORS = "safetensors"
    TORCH_ZIP = "torch-zip"
    TORCH_LEGACY = "torch-legacy"
    PICKLE = "pickle"
    DCP_METADATA = "dcp-metadata"
    DCP_DATA = "dcp-data"
    JSON = "json"
    TEXT = "text"
    EMPTY = "empty"
    # Other frameworks' files, sniffed only when the caller asks for them (``frameworks=True``).
    MINDSPORE = "mindspore-ckpt"  # MindSpore protobuf `.ckpt` (mindspore_model.ckpt)
    TF_INDEX = "tf-index"  # TensorFlow bundle index, `ckpt-N.index`
    TF_DATA = "tf-data"  # TensorFlow bundle shard, `ckpt-N.data-0000K-of-0000M` (raw bytes, checked via the index)
    TF_CHECKPOINT_STATE = "tf-checkpoint-state"  # the text `checkpoint` file of tf.train.CheckpointManager
    HDF5 = "hdf5"  # `.h5` / `.hdf5` (Keras weights)
    NUMPY = "numpy"  # `.npy` (by its magic) or `.npz` (a zip of `.npy` named so): what ``np.load`` reads
    ARCHIVE = "archive"  # a tar (any name but torch's) or a gzip/bz2/xz stream: its members sniffed for pickles
    OTHER = "other"  # not a format we read (README.md, tokenizer files ...)
    SPECIAL = "special"  # FIFO, socket, device: never opened


@frozen
class ReadOutcome:
    """What a reader returns: the facts it could establish (maybe None) and the problems it met."""

    content: FileContent | None
    problems: tuple[ReadProblem, ...] = ()
    # The pickle streams another loader unpickles from the same bytes (a polyglot read another way: a safetensors
    # header after a pickle's first bytes ...), merged; judged with the file's own pickle, and None for most files.
    alt_pickle: PickleFacts | None = None


@frozen
class FileFacts:
    """One file under the scan root. ``path`` is relative to the root, with ``/`` separators."""

    path: str
    size: int
    mtime: float
    kind: FileKind
    content: FileContent | None = None
    problems: tuple[ReadProblem, ...] = ()
    is_link: bool = False
    alt_pickle: PickleFacts | None = None  # as ``ReadOutcome.alt_pickle``

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints and runs


class Framework(str, enum.Enum):
    """Which training stack wrote a checkpoint, decided by discovery from the files it holds."""

    PYTORCH = "pytorch"  # the transformers Trainer on torch (also accelerate, DeepSpeed, FSDP, TRL)
    MINDNLP = "mindnlp"  # the MindNLP 0.4 Trainer on MindSpore: optimizer.ckpt, scheduler.json, mindspore_model.ckpt
    TENSORFLOW = "tensorflow"  # tf.train.Checkpoint bundles (`checkpoint`, ckpt-N.index/.data-*) and Keras `.h5`


class Stack(str, enum.Enum):
    """Which training program wrote a folder, recognised from that program's own files (``ckptdoctor.stacks``).

    A folder is judged by the rules of the program that wrote it: an accelerate ``save_state`` folder holds no
    ``trainer_state.json`` by design, and is no interrupted Trainer save.
    """

    TRAINER = "trainer"  # the transformers Trainer, and what runs it (TRL, LLaMA-Factory, axolotl)
    ACCELERATE = "accelerate"  # accelerate's `Accelerator.save_state` (diffusers' scripts, accelerate's examples)
    LIGHTNING = "lightning"  # PyTorch Lightning's `Trainer.save_checkpoint` / `ModelCheckpoint` `.ckpt` files
    TORCHTITAN = "torchtitan"  # torchtitan's `CheckpointManager`: `checkpoint/step-N/` DCP saves
    MINDNLP = "mindnlp"  # MindNLP's Trainer (MindSpore `.ckpt` weights, `optimizer.ckpt`, `scheduler.json`)
    TENSORFLOW = "tensorflow"  # Keras / TensorFlow: `tf.train.CheckpointManager` bundles, Keras `.h5` weights
    UNKNOWN = "unknown"  # a checkpoint folder whose files match no known program's: reported, never judged


class FolderRole(str, enum.Enum):
    """How the Trainer sees a folder."""

    CHECKPOINT = "checkpoint"  # matches get_last_checkpoint's ``^checkpoint-(\\d+)$``
    TEMP = "temp"  # ``tmp-checkpoint-N`` (transformers 4.36-4.38 staging) and similar partial folders
    OTHER = "other"  # ``checkpoint-15.bak``, ``checkpoint_30`` ...: invisible to resume, seen by rotation
    MODEL = "model"  # a save_pretrained folder, the run's own root files, or a checkpoint given directly


@frozen
class DeepSpeedTag:
    """A DeepSpeed tag folder directly inside a checkpoint (``engine.save_checkpoint(dir, tag)``): `global_stepN`, or
    a folder of any name holding DeepSpeed's state files (``discover.is_deepspeed_tag``), found where discovery
    lists the checkpoint.

    ``name`` is the folder (relative to the checkpoint), ``files`` its file names, ``partitions`` the rank of each
    ZeRO optimizer partition file in it (``*zero_pp_rank_R_mp_rank_*_optim_states.pt``, sorted) and
    ``model_states`` its model-states files (``*mp_rank_*_model_states.pt``).
    """

    name: str
    files: tuple[str, ...]
    partitions: tuple[int, ...] = ()
    model_states: tuple[str, ...] = ()


@frozen
class Checkpoint:
    """A folder of training state. ``files`` holds every file under it (recursively), paths relative to the root."""

    path: str
    role: FolderRole
    step: int | None  # from the folder name (CHECKPOINT role only)
    files: tuple[FileFacts, ...]
    mtime: float = 0.0  # newest mtime among the folder and its files
    framework: Framework = Framework.PYTORCH
    deepspeed_tags: tuple[DeepSpeedTag, ...] = ()  # its DeepSpeed tag folders, as discovery found them
    stack: Stack = Stack.TRAINER  # the program that wrote it (discovery decides, from the files it holds)
    folder_mtime: float = 0.0  # the folder's own mtime: what the Trainer's checkpoint rotation orders by

    # what the rules ask of every checkpoint dozens of times, kept once asked (``MEMO_SLOTS``): its files by path
    # inside it (``file``), each file with that path (``entries``), the files directly in it (``top_files``)
    _memo_slots = ("_by_name", "_entries", "_top")

    def file(self, relname: str) -> FileFacts | None:
        """The file at ``relname`` inside this checkpoint (``"optimizer.pt"``, ``"global_step8/latest"``)."""
        try:
            by_name: dict[str, FileFacts] = self._by_name  # type: ignore[attr-defined]
        except AttributeError:
            by_name = {}
            prefix = "" if self.path in ("", ".") else f"{self.path}/"
            for rel, f in self.entries():
                if f.path.startswith(prefix):
                    by_name.setdefault(rel, f)  # the first of a path, as a walk of ``files`` finds it
            object.__setattr__(self, "_by_name", by_name)
        return by_name.get(relname)

    def relname(self, f: FileFacts) -> str:
        """``f``'s path relative to this checkpoint folder."""
        if self.path in ("", "."):
            return f.path
        return f.path[len(self.path) + 1 :]

    def entries(self) -> tuple[tuple[str, FileFacts], ...]:
        """Each of ``files``, in order, with its path inside this folder (``relname``)."""
        try:
            return self._entries  # type: ignore[attr-defined,no-any-return]
        except AttributeError:
            pass
        if self.path in ("", "."):
            made = tuple((f.path, f) for f in self.files)
        else:
            cut = len(self.path) + 1
            made = tuple((f.path[cut:], f) for f in self.files)
        object.__setattr__(self, "_entries", made)
        return made

    def top_files(self) -> tuple[tuple[str, FileFacts], ...]:
        """The files directly in this folder, in ``files``' order, each with its name (``relname``, no ``/``)."""
        try:
            return self._top  # type: ignore[attr-defined,no-any-return]
        except AttributeError:
            pass
        made = tuple(pair for pair in self.entries() if "/" not in pair[0])
        object.__setattr__(self, "_top", made)
        return made


@frozen
class Run:
    """An output_dir: the checkpoints in it and what ``resume_from_checkpoint=True`` would pick.

    ``standalone`` is True when the scan was pointed at a single checkpoint or model folder: nothing would pick it
    by itself, the user passes it as ``resume_from_checkpoint=path``. ``resume_pick`` is the Trainer's pick
    (``get_last_checkpoint``) whichever ``stack`` wrote the run; ``ckptdoctor.stacks`` says what that stack's own
    resume picks.
    """

    path: str
    checkpoints: tuple[Checkpoint, ...]
    resume_pick: str | None
    standalone: bool = False
    stack: Stack = Stack.TRAINER  # the program that wrote the run (its checkpoints' stack)
    # Every name listed in the run's folder, ckptdoctor's own included, as `os.listdir` gives them: filled only for
    # accelerate's automatic `checkpoints/` folder, whose every entry `Accelerator.load_state()` sorts by number.
    entries: tuple[str, ...] = ()


@frozen
class PathProblem:
    """A problem with a path itself (a link, a loop, a permission error), found by discovery."""

    path: str
    problem: ReadProblem
    target: str | None = None


@frozen
class TensorData:
    """What ``--deep`` found in one tensor's bytes (streamed, never loaded whole)."""

    name: str  # the tensor's name (safetensors) or dotted path in the pickled value (torch files)
    dtype: str  # safetensors dtype code
    numel: int
    nan: int  # elements that are NaN (floating dtypes only)
    inf: int  # elements that are +/-Inf (floating dtypes only)
    all_zero: bool  # every element is zero (+0.0 or -0.0 for floats)
    # blake2b of the tensor's bytes, read for files whose values are compared with another form of the same weights
    # (``deep.check_tree``'s ``values``); None when not asked for or not one contiguous run of bytes
    digest: str | None = None


@frozen
class FileData:
    """The ``--deep`` read of one file's tensor data: per-tensor results, bytes read, and what could not be read."""

    path: str  # relative to the root, as in ``FileFacts.path``
    tensors: tuple[TensorData, ...]
    bytes_read: int
    problems: tuple[ReadProblem, ...] = ()
    skipped: tuple[str, ...] = ()  # tensors not checked, e.g. dtypes the deep reader does not decode
    sha256: str | None = None  # hex digest of the whole file, with ``--checksums`` (None when not read whole)
    corrupt: tuple[ReadProblem, ...] = ()  # bytes that fail the file's own checksums (TensorFlow entries' crc32c)


@frozen
class ManifestEntry:
    """One file a checksum manifest lists: path relative to the root (``/`` separators), size and sha256 (hex)."""

    path: str
    size: int
    sha256: str


@frozen
class Manifest:
    """A checksum manifest (``<root>/.ckptdoctor/manifest.json``) as read for ``--checksums verify``."""

    path: str  # relative to the root
    entries: tuple[ManifestEntry, ...]
    version: str = ""  # the ckptdoctor version that wrote it
    created: str = ""  # when it was written (ISO 8601, UTC)
    problems: tuple[ReadProblem, ...] = ()  # why it could not be read (then ``entries`` is empty)


@frozen
class PickleVerdict:
    """What loading one file's pickle streams could do, as the pickle policy judges it
    (``ckptdoctor.pickle_verdict.judge``).

    ``unsafe``: why loading it runs code (CKD601, an error); ``unknown``: proven classes of packages outside the known
    ones that the streams only name (CKD602, a warning); ``allowed_by_user``: (global, pattern, origin) for each
    global only a user allowance let through; ``admitted``: (global, fact) for each global a fact admitted rather
    than the allowlist; ``nested``: pickles found inside its values; ``limit``: the LIMIT note of a file naming more
    globals than the policy looks up.
    """

    unsafe: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    nested: int = 0
    calls_unsafe: bool = False  # an unsafe global is called (not only imported) by the outer stream
    allowed_by_user: tuple[tuple[str, str, str], ...] = ()
    admitted: tuple[tuple[str, str], ...] = ()
    # the LIMIT note when the file names more globals than are judged by source (``Limits.pickle_source_globals``)
    # and one left unjudged is unsafe; empty otherwise
    limit: str = ""


@frozen
class ShardProblem:
    """A data shard of a TensorFlow bundle that its index (``ckpt-N.index``) does not find whole: missing
    (``MALFORMED``) or shorter than the bytes the index places in it (``TRUNCATED``). ``index`` and ``shard`` are
    root-relative paths; found where discovery has read every file (``readers.tfbundle.shard_problems``)."""

    index: str
    shard: str
    problem: ReadProblem


@frozen
class RunHistory:
    """What one run's newest checkpoint shows of where the run started, kept when the run itself is released: its
    ``path`` in the root, the file a finding about it names (``where``), its newest checkpoint's folder time, the
    oldest folder time of its checkpoints, the weights' layout ((name, shape) pairs; None when unread), whether the
    newest checkpoint holds ``config.json``, the checkpoint its ``config.json``'s ``_name_or_path`` names when that is
    another run's (``named``), and the first and last ``(step, loss)`` training logs of its ``log_history``."""

    path: str
    where: str
    newest_mtime: float
    oldest_mtime: float
    layout: frozenset[tuple[str, tuple[int, ...]]] | None
    has_config: bool
    named: str | None
    losses: tuple[tuple[int, float], ...]


@frozen
class Tree:
    """Everything one scan root holds, as discovered and read."""

    root: str  # the root as the user gave it
    runs: tuple[Run, ...]
    loose_files: tuple[FileFacts, ...] = ()  # files that belong to no checkpoint (still read and checked)
    path_problems: tuple[PathProblem, ...] = ()
    files_seen: int = 0
    abs_root: str = ""  # the root's absolute path (to judge absolute paths stored in files)
    data: tuple[FileData, ...] = ()  # tensor-data results, filled by ``--deep`` only, sorted by path
    manifest: Manifest | None = None  # the checksum manifest to verify against (``--checksums verify`` only)
    # each TensorFlow bundle index's data shards checked against it, where discovery read them (``ShardProblem``)
    tf_shard_problems: tuple[ShardProblem, ...] = ()
    # file path -> the pickle verdict of each file holding pickle streams, judged once per scan before the rules run
    # (``pickle_verdict.judge.with_verdicts``); None when not judged yet
    pickle_verdicts: tuple[tuple[str, PickleVerdict], ...] | None = None
    # what the rules that compare sibling runs need of the runs of the same root judged before this tree, when a
    # scan judges a root run by run (``scanner.scan_root``): their ``RunHistory`` (no file facts kept), in order; the
    # scan hands a ``facts.SiblingRuns``, which CKD422 looks up without comparing every pair
    siblings: Sequence[RunHistory] = field(default=(), compare=False)

    # ``all_files`` once asked (``MEMO_SLOTS``): a scan's rules walk every file a dozen times
    _memo_slots = ("_all_files",)

    def all_files(self) -> tuple[FileFacts, ...]:
        """Every file: each checkpoint's, in order, then the loose ones."""
        try:
            return self._all_files  # type: ignore[attr-defined,no-any-return]
        except AttributeError:
            pass
        out: list[FileFacts] = []
        for run in self.runs:
            for ck in run.checkpoints:
                out.extend(ck.files)
        out.extend(self.loose_files)
        made = tuple(out)
        object.__setattr__(self, "_all_files", made)
        return made
