"""Reading a ``--training-args`` file (``training_args.bin`` read statically, its pickle judged as a scan judges it;
JSON; YAML with PyYAML) into the mapping ``plan.plan_from_training_args`` takes. Nothing is loaded or executed."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from dataclasses import dataclass
from typing import Any

from ckptdoctor import trainer_view
from ckptdoctor.model import FileFacts, FileKind, JsonFacts
from ckptdoctor.resume_gate.plan import GateInputError

_YAML_NUMBERS = ("num_train_epochs", "learning_rate", "warmup_steps", "warmup_ratio")


@dataclass(frozen=True)
class ArgsFile:
    """A ``--training-args`` file as read: its ``TrainingArguments`` mapping, and its ``FileFacts`` when it holds
    pickle streams (a ``training_args.bin``), whose verdict the gate reports as a scan would (None for JSON/YAML)."""

    args: dict[str, Any]
    facts: FileFacts | None = None


# What ``torch.load`` unpickles: the kinds a ``training_args.bin`` can be (and a bare pickle of the arguments).
_PICKLE_KINDS = frozenset({FileKind.TORCH_ZIP, FileKind.TORCH_LEGACY, FileKind.PICKLE})


_OPEN = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def read_training_args(path: str) -> ArgsFile:
    """The ``TrainingArguments`` a launcher holds in the file ``path``, as a mapping for ``plan_from_training_args``.

    The file is opened once and sniffed and read by ``ckptdoctor.readers``, as a scan reads it. A
    ``training_args.bin`` (``torch.save`` of ``TrainingArguments``, what ``Trainer._save`` writes) is read exactly
    as a scan reads the checkpoint's own: its pickle walked opcode by opcode, never loaded
    (``trainer_view.training_args``); its facts are kept (path: ``path`` as given) for the gate to judge.
    Anything else is JSON (``args.to_json_string()``), or YAML when PyYAML is importable (a YAML 1.1 parser reads
    ``2e-5`` as a string: such strings of the float fields become numbers, as ``HfArgumentParser`` makes them).
    Raises ``GateInputError`` saying why the file cannot be used.
    """
    from ckptdoctor.readers import read_open_file

    try:
        fd = os.open(os.path.realpath(path), _OPEN)
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode):  # click checked it exists; a FIFO or device is never read
                raise GateInputError(f"{path}: not a regular file")
            facts = read_open_file(fh, FileFacts(path, st.st_size, st.st_mtime, FileKind.OTHER))
            if facts.kind in _PICKLE_KINDS:
                args = trainer_view.training_args_value(facts)
                if args is None:
                    why = facts.problems[0].message if facts.problems else "it holds no TrainingArguments state"
                    raise GateInputError(f"{path}: cannot read it as a training_args.bin: {why}{_unsafe(facts)}")
                return ArgsFile(args, facts)
            if isinstance(facts.content, JsonFacts) and isinstance(facts.content.value, dict):
                return ArgsFile(facts.content.value)  # parsed by the JSON reader already
            fh.seek(0)
            data = fh.read(_ARGS_FILE_CAP + 1)
    except OSError as exc:
        raise GateInputError(f"{path}: {exc.strerror or exc}") from None
    if len(data) > _ARGS_FILE_CAP:
        raise GateInputError(f"{path}: over {_ARGS_FILE_CAP // 2**20} MiB: not a TrainingArguments file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise GateInputError(f"{path}: neither a training_args.bin nor UTF-8 JSON or YAML") from None
    try:
        loaded = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: arrays nested 10^5 deep
        loaded = _yaml(path, text, exc)
    if not isinstance(loaded, dict):
        raise GateInputError(f"{path}: not a mapping of TrainingArguments (a JSON or YAML object)")
    return ArgsFile(loaded)


def _unsafe(facts: FileFacts) -> str:
    """What loading a file that is no TrainingArguments could run, as CKD601 says it (empty when nothing): an
    unusable --training-args is a usage error, and the user should not try ``torch.load`` on it to see why."""
    from ckptdoctor.pickle_verdict.judge import file_pickle, judge

    pf = file_pickle(facts)
    unsafe = judge(pf).unsafe if pf is not None else ()
    return f"; and loading it can run code: its pickle names {', '.join(unsafe[:8])}" if unsafe else ""


_ARGS_FILE_CAP = 16 * 2**20  # a TrainingArguments JSON is a few KiB


def _yaml(path: str, text: str, json_error: BaseException) -> Any:
    """``text`` read as YAML when PyYAML is importable (never a dependency of ckptdoctor), else the JSON error."""
    try:
        import yaml  # type: ignore[import-untyped]
    except ImportError:
        raise GateInputError(f"{path}: not JSON ({json_error or type(json_error).__name__}); YAML is read only when "
                             "PyYAML is installed") from None
    try:
        loaded = yaml.safe_load(text)  # safe_load builds plain values only: no tags that construct objects
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        raise GateInputError(f"{path}: neither JSON nor YAML ({_first_line(exc)})") from None
    if isinstance(loaded, dict):
        for key in _YAML_NUMBERS:
            v = loaded.get(key)
            if isinstance(v, str):
                with contextlib.suppress(ValueError):  # else left as is: the strict check names it
                    loaded[key] = float(v)
    return loaded


def _first_line(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__).splitlines()[0]
