"""Judging a statically walked pickle: which of its globals would run code on load, including nested pickles."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import itertools
from collections.abc import Iterator
from typing import Any

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import (
    ArchiveFacts,
    DcpMetadataFacts,
    FileFacts,
    GlobalRef,
    NumpyFacts,
    Opaque,
    PickleFacts,
    PickleValue,
    PickleVerdict,
    TorchFacts,
    Tree,
)
from ckptdoctor.pickle_verdict.policy import (
    IMPORTS_UNLOADED,
    JOBLIB_ARRAY,
    Allowance,
    FileStandings,
    Standing,
    in_own_package,
    may_call,
    rebuilt_as_data,
)
from ckptdoctor.readers.pickle_walk import UNRESOLVED_CALL, merge_pickles, walk_pickle
from ckptdoctor.readers.sniff import HEAD_BYTES, pickled_head

__all__ = ["TRAINING_ARGS_FIELDS", "Verdict", "describe", "file_pickle", "judge", "tree_verdicts", "with_verdicts"]

_MAX_NESTED = 64  # nested pickles walked per file
_MAX_NESTED_DEPTH = 3  # pickle in bytes in a pickle in bytes ...
_MAX_VALUES = 2_000_000  # values visited per stream while looking for nested pickles
_MIN_B64 = 16  # shorter strings cannot hold a pickle that calls anything


Verdict = PickleVerdict  # the verdict is a value of the model: the tree carries it, the rules report it


def describe(g: GlobalRef) -> str:
    """A global as the user should read it; unresolved stand-ins spelled out."""
    if g == UNRESOLVED_CALL:
        return "a call of an object computed at load time"
    if g.module == "<limit>":  # a bound of the walk (``pickle_walk.PAST_BUDGET``): its name says what was not judged
        return g.name
    if g.module == "<extension>":
        return f"extension code {g.name} (resolved from the copyreg registry at load time)"
    if g.module.startswith("<") or g.name.startswith("<"):
        return f"`{g.dotted}` (a name computed at load time)"
    return f"`{g.dotted}`"


# Fields every TrainingArguments since transformers 4.0 has (and so every subclass: TRL configs, Seq2Seq, in-house
# ones). A stream that NEWOBJs a class with no arguments and BUILDs a dict holding all of them rebuilds
# TrainingArguments data: ``__new__`` then ``__dict__.update`` (transformers/training_args.py, ``TrainingArguments``).
TRAINING_ARGS_FIELDS = frozenset(
    {"output_dir", "per_device_train_batch_size", "learning_rate", "num_train_epochs", "max_steps", "seed",
     "lr_scheduler_type", "warmup_steps", "logging_steps", "save_steps", "gradient_accumulation_steps",
     "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm"}
)  # fmt: skip


class _Judge:
    """Judges the globals of one file's streams under one set of user allowances."""

    def __init__(self, allow: tuple[Allowance, ...], standing: FileStandings, torchscript: bool = False) -> None:
        self.allow = allow
        self.standing = standing
        self.torchscript = torchscript  # the file's own streams are read by TorchScript's unpickler only
        self.limit = ""  # the LIMIT note, when a global the limit left unjudged by source is unsafe
        self.unsafe: dict[str, None] = {}
        self.unknown: dict[str, None] = {}
        self.by_user: dict[tuple[str, str, str], None] = {}
        self.admitted: dict[tuple[str, str], None] = {}

    def globals_of(self, pf: PickleFacts, where: str, clean: bool = True) -> None:
        called = set(pf.calls)
        rebuilt = set(pf.rebuilt)
        # Globals handed to any call: searched once, on first need; None when the search ran past its budget.
        passed: set[GlobalRef] | None = None
        searched = False
        demoted: set[GlobalRef] = set()  # proved names that the stream calls: never TrainingArguments data
        pending: list[tuple[GlobalRef, Standing, str]] = []
        for g in (*pf.globals, *pf.calls):
            if self.torchscript and not where and _torchscript_own(g):
                self.admitted[(g.dotted, _TORCHSCRIPT_WHY)] = None
                continue
            st, why = self.standing(g)
            if st is Standing.ALLOWED:
                # A name is what the allowlist or the source proves; a call runs code the proof says nothing about.
                if g in rebuilt:
                    if rebuilt_as_data(g) and (g != JOBLIB_ARRAY or _joblib_arrays_are_data(pf.value)):
                        if why != "allowlist":
                            self.admitted[(g.dotted, f"{why}, rebuilt without arguments")] = None
                        continue
                    st, why = Standing.UNPROVEN, "rebuilt, but defines a hook the rebuild calls"
                elif g in called:
                    if may_call(g):
                        continue
                    st, why = Standing.UNPROVEN, "called, and not reviewed harmless for any arguments"
                elif why != "allowlist":
                    if not searched:
                        passed, searched = _passed_anywhere(pf.value), True
                    if passed is not None and g not in passed:
                        self.admitted[(g.dotted, why)] = None
                        continue
                    st, why = Standing.UNPROVEN, (
                        "handed to a call, and not reviewed harmless for any arguments"
                        if passed is not None
                        else "may be handed to a call (values past the search budget)"
                    )
                else:
                    continue
                demoted.add(g)
            if st is not Standing.UNSAFE:
                user = next((a for a in self.allow if a.admits(g)), None)
                if user is not None:
                    self.by_user[(g.dotted, user.pattern, user.origin)] = None
                    continue
            pending.append((g, st, why))
        if not pending:
            return
        data = _training_args_classes(pf.value) if any(st is Standing.UNPROVEN for _, st, _ in pending) else set()
        if not searched and any(g not in called for g, _, _ in pending):
            passed, searched = _passed_anywhere(pf.value), True
        if searched and passed is None:
            self.unsafe[f"values past the first {_MAX_PASSED:,} (not searched for globals handed to calls)"] = None
        for g, st, why in pending:
            text = where + describe(g)
            if why.startswith(IMPORTS_UNLOADED) and (g not in called or g in rebuilt):
                text += f" ({why})"  # a class proved by its source, whose module the load would import
            own = not why.startswith(IMPORTS_UNLOADED) or in_own_package(g)  # not torch._inductor as TrainingArguments
            if st is Standing.UNPROVEN and g in data and g in rebuilt and g not in demoted and own:
                self.admitted[(g.dotted, "rebuilt as TrainingArguments data (NEWOBJ + BUILD of its fields)")] = None
            elif st is Standing.UNKNOWN and g not in called and passed is not None and g not in passed:
                if clean:
                    self.unknown[text] = None
            elif clean or "computed" not in text:
                # A stream that does not walk cleanly may be random bytes that happen to start like a pickle: only
                # what is dangerous counts then (a payload may break its stream after the call on purpose).
                self.unsafe[text] = None
                if why == self.standing.note():
                    self.limit = why


# torch.jit.load's unpickler (torch/csrc/jit/serialization/unpickler.cpp ``Unpickler::readGlobal``) never imports a
# Python global: `__torch__.*` names resolve to the archive's own TorchScript classes, compiled from its `code/`
# records, and torch/jit/_pickle.py's list builders are read natively. Python's unpickler never reads these streams:
# torch.load hands the archive to torch.jit.load (torch/serialization.py).
_TORCHSCRIPT_BUILDERS = frozenset({"build_intlist", "build_tensorlist", "build_doublelist", "build_boollist",
                                   "build_tensor_from_id", "restore_type_tag"})  # fmt: skip
_TORCHSCRIPT_WHY = "read by torch.jit.load's TorchScript unpickler, which imports no Python (a TorchScript archive)"


def _torchscript_own(g: GlobalRef) -> bool:
    return (g.module == "__torch__" or g.module.startswith("__torch__.")) or (
        g.module == "torch.jit._pickle" and g.name in _TORCHSCRIPT_BUILDERS
    )


def judge(
    pf: PickleFacts, limits: Limits = DEFAULT_LIMITS, allow: tuple[Allowance, ...] = (), torchscript: bool = False
) -> Verdict:
    """Judge every global ``pf`` imports or calls, then the pickles nested in its values (see ``policy``).

    Unsafe: anything dangerous or computed (imported or called), attribute chains outside the allowlist, any global
    no fact proves to be a class (deny by default), a class outside the known packages that is called or passed to
    a call (in its arguments, dict keys and sets included). ``allow`` are the user's allowances.
    """
    j = _Judge(allow, FileStandings(limits.pickle_source_globals), torchscript)
    j.globals_of(pf, "")
    calls_unsafe = any(describe(g) in j.unsafe for g in pf.calls)
    budget = [_MAX_NESTED, limits.pickle_bytes]
    nested = _nested(pf, limits, j, 1, budget)
    admitted = tuple(sorted(j.admitted))
    return Verdict(tuple(j.unsafe), tuple(j.unknown), nested, calls_unsafe, tuple(j.by_user), admitted, j.limit)


def file_pickle(f: FileFacts) -> PickleFacts | None:
    """Every stream a loader could unpickle from the file (raw, torch zip or legacy, DCP, numpy object arrays, tar
    and compressed members): its own, and those another loader reads (polyglots), merged into one."""
    c = f.content
    own: PickleFacts | None = None
    if isinstance(c, PickleFacts):
        own = c
    elif isinstance(c, (TorchFacts, DcpMetadataFacts, NumpyFacts, ArchiveFacts)):
        own = c.pickle
    if f.alt_pickle is None or own is None:
        return own or f.alt_pickle
    return merge_pickles(own, [f.alt_pickle])


def tree_verdicts(tree: Tree, allow: tuple[Allowance, ...] = ()) -> tuple[tuple[str, Verdict], ...]:
    """The verdict of every file of ``tree`` holding pickle streams, by path: what ``with_verdicts`` attaches."""
    return tuple(
        (f.path, judge(pf, allow=allow, torchscript=_torchscript(f)))
        for f in tree.all_files()
        if (pf := file_pickle(f)) is not None
    )


def _torchscript(f: FileFacts) -> bool:
    """A TorchScript archive that no other loader reads as a pickle (no polyglot stream)."""
    return isinstance(f.content, TorchFacts) and f.content.torchscript and f.alt_pickle is None


def with_verdicts(tree: Tree, allow: tuple[tuple[str, str], ...] = ()) -> Tree:
    """``tree`` carrying its pickle verdicts, judged once under the user's allowances ((pattern, origin) pairs)."""
    allowances = tuple(Allowance(p, o) for p, o in allow)
    return dataclasses.replace(tree, pickle_verdicts=tree_verdicts(tree, allowances))


def _training_args_classes(value: PickleValue) -> set[GlobalRef]:
    """Classes the stream rebuilds as TrainingArguments data: the root value, or a value of a root dict or list.

    Only NEWOBJ counts (``cls.__new__(cls)``: the unpickler refuses a non-class there); a REDUCE of the same name
    with no arguments calls whatever callable the loader's environment holds under it, so it stays an error."""
    roots = [value]
    if type(value) is dict:
        roots.extend(list(value.values())[:64])
    elif type(value) in (list, tuple):
        roots.extend(value[:64])
    out: set[GlobalRef] = set()
    for v in roots:
        if (
            type(v) is Opaque
            and v.new
            and v.func is not None
            and v.args == ()
            and type(v.state) is dict
            and v.state.keys() >= TRAINING_ARGS_FIELDS
        ):
            out.add(v.func)
    return out


_NUMPY_ARRAY_CLASSES = frozenset({GlobalRef("numpy", "ndarray"), GlobalRef("numpy", "memmap")})


def _joblib_arrays_are_data(value: PickleValue) -> bool:
    """Whether every joblib array wrapper in ``value`` has the state ``joblib.dump`` writes: a dict whose
    ``subclass`` is ``numpy.ndarray`` or ``numpy.memmap`` (``read`` hands any other subclass to numpy's
    ``_reconstruct``, a call of that class)."""
    todo: list[Any] = [value]
    seen: set[int] = set()
    count = 0
    while todo and count < _MAX_PASSED:
        v = todo.pop()
        count += 1
        t = type(v)
        if t is Opaque:
            if v.func == JOBLIB_ARRAY:
                state = v.state
                if type(state) is not dict or state.get("subclass") not in _NUMPY_ARRAY_CLASSES:
                    return False
            if id(v) not in seen:
                seen.add(id(v))
                todo.append(v.args)
                todo.append(v.state)
        elif t is dict and id(v) not in seen:
            seen.add(id(v))
            todo.extend(v.values())
        elif (t is list or t is tuple) and id(v) not in seen:
            seen.add(id(v))
            todo.extend(v)
    return not todo  # past the budget, not proved


_MAX_PASSED = 100_000  # values looked at for globals handed to calls


def _passed_anywhere(value: PickleValue) -> set[GlobalRef] | None:
    """Globals inside any call's arguments or state, dict keys and sets included: the callee (or a ``__setstate__``)
    may call them, and hashing a key calls its ``__hash__``. None when the value holds more than ``_MAX_PASSED``
    values that could hold a global: past that budget any global may be handed to a call (never a silent cut)."""
    out: set[GlobalRef] = set()
    todo: list[tuple[Any, bool]] = [(value, False)]
    seen: set[int] = set()
    count = 0
    while todo:
        if count >= _MAX_PASSED:
            return None
        v, inside = todo.pop()
        count += 1
        t = type(v)
        if t is GlobalRef:
            if inside:
                out.add(v)
            continue
        if t in _HOLDERS:
            if id(v) in seen:
                continue
            seen.add(id(v))
        if t is dict:
            # a key that is not a plain scalar is hashed and compared while the dict is built
            todo.extend((k, inside or type(k) is not str) for k in v if type(k) in _HOLDERS_OR_GLOBAL)
            todo.extend((x, inside) for x in v.values() if type(x) in _HOLDERS_OR_GLOBAL)
        elif t is set or t is frozenset:
            todo.extend((x, True) for x in v if type(x) in _HOLDERS_OR_GLOBAL)
        elif t is list or t is tuple:
            todo.extend((x, inside) for x in v if type(x) in _HOLDERS_OR_GLOBAL)
        elif t is Opaque:
            todo.append((v.args, True))
            todo.append((v.state, True))
    return out


# What ``_passed_anywhere`` looks into, and what it records: a value of any other type (a number, a string, a
# tensor) holds no global, so it is passed over without counting against the budget.
_HOLDERS = frozenset({dict, list, tuple, set, frozenset, Opaque})
_HOLDERS_OR_GLOBAL = _HOLDERS | {GlobalRef}


def _nested(pf: PickleFacts, limits: Limits, j: _Judge, depth: int, budget: list[int]) -> int:
    """Walk pickles hidden in ``pf``'s bytes and strings (raw of any protocol, base64, torch zip); returns how many
    were walked. Every bound is a finding: a nested pickle past the count, bytes or depth bound, or values past the
    search's budget, is reported unsafe (not judged), never dropped."""
    if pf.value is None:
        return 0
    count = 0
    for _, v in _texts(pf.value):
        if v is _CUT:
            _past_bound(j, f"values past the first {_MAX_VALUES:,} (not searched for nested pickles)")
            break
        blob = _candidate(v)
        if blob is None:
            continue
        if len(blob) > budget[1]:
            _past_bound(j, f"nested pickles past {limits.pickle_bytes:,} bytes in all (not judged)")
            break
        inner = _walk_blob(blob, limits)
        if inner is None:
            continue
        facts, clean = inner
        if not (clean or facts.globals or facts.calls):
            continue  # bytes that merely start like a pickle: pickle.loads stops where the walk stopped
        if depth > _MAX_NESTED_DEPTH:
            _past_bound(j, f"a pickle nested more than {_MAX_NESTED_DEPTH} deep (not judged)")
            break
        if budget[0] <= 0:
            _past_bound(j, f"nested pickles past the first {_MAX_NESTED} (not judged)")
            break
        budget[0] -= 1
        budget[1] -= len(blob)
        count += 1
        j.globals_of(facts, "nested pickle: ", clean)
        count += _nested(facts, limits, j, depth + 1, budget)
    return count


def _past_bound(j: _Judge, what: str) -> None:
    """Report a bound of the nested search as unsafe: what it did not look at is not proved harmless."""
    j.unsafe[what] = None


# Values ``_texts`` looks into (the containers ``iter_values`` enters) or yields (what ``_candidate`` reads).
_OPEN = frozenset({dict, list, tuple, Opaque, bytes, str})
_CUT: Any = object()  # yielded by ``_texts`` when its budget ends the search with values left unsearched


def _texts(value: PickleValue) -> Iterator[tuple[int, Any]]:
    """The bytes and strings long enough to hold a serialized object, with the number of values visited so far.

    The same walk as ``iter_values`` (root first, children in order, a shared container entered once) without
    building paths, so the per-file budget cuts at the same values. A container whose children are all closed values
    (tensors, numbers, globals: most of a state dict) is counted without visiting them one by one. Past
    ``_MAX_VALUES`` values, ``_CUT`` is yielded when anything that could hold a pickle is left unsearched.
    """
    seen: set[int] = set()
    todo: list[Any] = [value]
    i = 0
    while todo:
        v = todo.pop()
        index = i
        if index >= _MAX_VALUES:
            todo.append(v)
            if any(type(x) in _OPEN for x in todo):
                yield index, _CUT
            return
        i += 1
        t = type(v)
        if t is bytes or (t is str and len(v) >= _MIN_B64):
            yield index, v
            continue
        if not (t is dict or t is list or t is tuple or t is Opaque) or id(v) in seen:
            continue
        seen.add(id(v))
        kids: list[Any] | tuple[Any, ...]
        if t is dict:
            kids = list(v.values())
        elif t is Opaque:
            kids = list(v.args) if type(v.args) is tuple else []
            if type(v.state) is dict:
                kids.extend(v.state.values())
            elif v.state is not None:
                kids.append(v.state)
        else:
            kids = v
        kinds = set(map(type, kids))
        if _OPEN.isdisjoint(kinds):
            i += len(kids)  # visited right after their parent, and nothing in them can hold a pickle
        elif kinds == {dict} and _closed_dicts(kids, seen):
            i += len(kids) + sum(map(len, kids))  # optimizer ``state``: {param: {step, exp_avg, exp_avg_sq}}
        else:
            todo.extend(reversed(kids))


def _closed_dicts(dicts: list[Any] | tuple[Any, ...], seen: set[int]) -> bool:
    """Whether ``dicts`` (all plain dicts) are distinct, not entered before, and hold only closed values; marks
    them entered when they are. Each is then visited once followed by its values, as ``iter_values`` would."""
    ids = set(map(id, dicts))
    if len(ids) != len(dicts) or not seen.isdisjoint(ids):
        return False
    if not _OPEN.isdisjoint(map(type, itertools.chain.from_iterable(map(dict.values, dicts)))):
        return False
    seen.update(ids)
    return True


def _candidate(v: object) -> bytes | None:
    """Bytes that may be a serialized object: a pickle, a torch zip, or base64 text of either."""
    if type(v) is bytes:
        if _is_serialized(v):
            return v
        return _unbase64(v)
    if type(v) is str and len(v) >= _MIN_B64:
        try:
            return _unbase64(v.encode("ascii"))
        except UnicodeEncodeError:
            return None
    return None


def _is_serialized(b: bytes) -> bool:
    """A pickle of any protocol (0 and 1 have no PROTO opcode: their head must walk as one) or a torch zip."""
    return b[:4] == b"PK\x03\x04" or pickled_head(b[:HEAD_BYTES])


def _unbase64(b: bytes) -> bytes | None:
    if len(b) < _MIN_B64:
        return None
    text = b.strip()
    for alt in (b"+/", b"-_"):
        try:
            raw = base64.b64decode(text, altchars=alt, validate=True)
        except (binascii.Error, ValueError):
            continue
        if _is_serialized(raw):
            return raw
    return None


def _walk_blob(blob: bytes, limits: Limits) -> tuple[PickleFacts, bool] | None:
    """The facts of a nested pickle or torch zip, and whether it walked without problems."""
    if blob[:4] == b"PK\x03\x04":
        from ckptdoctor.readers.torchzip import read_torch

        outcome = read_torch(io.BytesIO(blob), len(blob), limits)
        content = outcome.content
        if isinstance(content, TorchFacts) and content.pickle is not None:
            return content.pickle, not outcome.problems
        return None
    facts, problems, _ = walk_pickle(blob, limits=limits)
    if facts is None:
        return None
    return facts, not problems
