"""Judging a statically walked pickle: which of its globals would run code on load, including nested pickles."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import (
    BYTES_LOADER,
    UNRESOLVED_CALL,
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

__all__ = [
    "TRAINING_ARGS_FIELDS", "Verdict", "VerdictMemo", "describe", "file_pickle", "judge", "tree_verdicts",
    "with_verdicts",
]

# ``torch.storage._load_from_bytes`` is ``torch.load(weights_only=False)`` of its argument: admitted only in a stream
# where every call of it hands it literal bytes that the reader read as ``torch.load`` does (``readers.nested``) and
# that read cleanly; what those bytes import and call is judged as a nested pickle of the same file.
_LOADS_WHY = "called on literal bytes, each read as torch.load reads them and judged as a nested pickle"


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
            if g.name == "_load_from_bytes" and g == BYTES_LOADER and g not in rebuilt and _loads_read(pf):
                self.admitted[(g.dotted, _LOADS_WHY)] = None
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


class VerdictMemo(Protocol):
    """Verdicts known from an earlier scan (the verdict cache, ``ckptdoctor.cache.FactsCache``): asked before a file
    is judged, and told each verdict that depends on the file alone."""

    def known(self, f: FileFacts, allow: tuple[Allowance, ...]) -> Verdict | None:
        """The verdict of ``f`` under ``allow``, when known."""
        ...

    def learn(self, f: FileFacts, allow: tuple[Allowance, ...], verdict: Verdict) -> None:
        """``verdict`` was judged from ``f`` alone under ``allow``."""
        ...


def judge(
    pf: PickleFacts, limits: Limits = DEFAULT_LIMITS, allow: tuple[Allowance, ...] = (), torchscript: bool = False
) -> Verdict:
    """Judge every global ``pf`` imports or calls, then the pickles nested in its values (see ``policy``).

    Unsafe: anything dangerous or computed (imported or called), attribute chains outside the allowlist, any global
    no fact proves to be a class (deny by default), a class outside the known packages that is called or passed to
    a call (in its arguments, dict keys and sets included). ``allow`` are the user's allowances.
    """
    return _judged(pf, limits, allow, torchscript)[0]


def _judged(
    pf: PickleFacts, limits: Limits, allow: tuple[Allowance, ...], torchscript: bool
) -> tuple[Verdict, bool]:
    """``judge``'s verdict, and whether it read an installed package's source (or met the limit on doing so)."""
    j = _Judge(allow, FileStandings(limits.pickle_source_globals), torchscript)
    if any(part.nested is None for part in pf.streams or (pf,)):
        from ckptdoctor.readers.nested import NestedBudget, search_nested  # a reader: only for a file judged here

        pf = search_nested(pf, NestedBudget(limits))  # facts that did not come from a reader
    nested = 0
    for part in pf.streams or (pf,):  # each stream a loader unpickles, with its own values
        j.globals_of(part, "")
        nested += _judge_nested(part, j)
    calls_unsafe = any(describe(g) in j.unsafe for g in pf.calls)
    admitted = tuple(sorted(j.admitted))
    verdict = Verdict(tuple(j.unsafe), tuple(j.unknown), nested, calls_unsafe, tuple(j.by_user), admitted, j.limit)
    return verdict, j.standing.sourced


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
    from ckptdoctor.readers.pickle_walk import merge_pickles  # as in _judged

    return merge_pickles(own, [f.alt_pickle])


def tree_verdicts(
    tree: Tree, allow: tuple[Allowance, ...] = (), memo: VerdictMemo | None = None
) -> tuple[tuple[str, Verdict], ...]:
    """The verdict of every file of ``tree`` holding pickle streams, by path: what ``with_verdicts`` attaches.
    ``memo`` gives the verdicts an earlier scan judged of the same bytes under the same allowances, and keeps the
    new ones that depend on the file alone."""
    out: list[tuple[str, Verdict]] = []
    for f in tree.all_files():
        pf = file_pickle(f)
        if pf is None:
            continue
        verdict = None if memo is None else memo.known(f, allow)
        if verdict is None:
            verdict, sourced = _judged(pf, DEFAULT_LIMITS, allow, _torchscript(f))
            if memo is not None and not sourced:
                memo.learn(f, allow, verdict)
        out.append((f.path, verdict))
    return tuple(out)


def _torchscript(f: FileFacts) -> bool:
    """A TorchScript archive that no other loader reads as a pickle (no polyglot stream)."""
    return isinstance(f.content, TorchFacts) and f.content.torchscript and f.alt_pickle is None


def with_verdicts(
    tree: Tree, allow: tuple[tuple[str, str], ...] = (), memo: VerdictMemo | None = None
) -> Tree:
    """``tree`` carrying its pickle verdicts, judged once under the user's allowances ((pattern, origin) pairs),
    those ``memo`` knows taken from it."""
    allowances = tuple(Allowance(p, o) for p, o in allow)
    return dataclasses.replace(tree, pickle_verdicts=tree_verdicts(tree, allowances, memo))


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


def _loads_read(pf: PickleFacts) -> bool:
    """Whether every call of ``BYTES_LOADER`` in ``pf`` hands it literal bytes that were read cleanly as a nested
    ``torch.save`` file."""
    if not pf.loads or any(b is None for b in pf.loads) or pf.nested is None:
        return False
    read = {n.load for n in pf.nested if n.clean}
    return all(i in read for i in range(len(pf.loads)))


def _judge_nested(pf: PickleFacts, j: _Judge) -> int:
    """Judge the pickles the readers found nested in ``pf``'s values (``readers.nested``); returns how many there
    were. What that search did not look at (a bound it reached) is unsafe: it is not proved harmless."""
    for what in pf.unsearched:
        j.unsafe[what] = None  # a bound of the search: what it did not look at is not proved harmless
    count = 0
    for n in pf.nested or ():
        count += 1
        for part in n.facts.streams or (n.facts,):
            j.globals_of(part, "nested pickle: ", n.clean)
            count += _judge_nested(part, j)
    return count
