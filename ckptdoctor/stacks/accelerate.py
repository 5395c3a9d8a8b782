"""accelerate's ``Accelerator.save_state`` / ``load_state`` as a stack: the layout of its folders and what
``load_state()`` picks.

``save_state(output_dir)`` (src/accelerate/accelerator.py ``Accelerator.save_state``, src/accelerate/checkpointing.py
``save_accelerator_state``) writes each prepared model (``model.safetensors``, ``model_1.safetensors`` ...), then
each optimizer (``optimizer.bin``, ``optimizer_1.bin``), scheduler (``scheduler.bin``), sampler and dataloader
states, the grad scaler (``scaler.pt``), and last the RNG states of each process (``random_states_<rank>.pkl``),
then each object given to ``register_for_checkpointing`` (``custom_checkpoint_<i>.pkl``). It writes no training
state of the Trainer's kind (no ``trainer_state.json``): a folder without one is no interrupted save.

With ``ProjectConfiguration(automatic_checkpoint_naming=True)``, ``save_state()`` writes into
``project_dir/checkpoints/checkpoint_<save_iteration>`` and ``load_state()`` with no folder lists
``project_dir/checkpoints``, sorts every entry by the first run of digits in its name (``_inner``: an entry with no
digit raises ``IndexError``) and loads the last. ``load_state()`` never restores
``project_configuration.iteration``: a program that resumes and saves again writes ``checkpoint_0``,
``checkpoint_1`` ... beside the older, higher-numbered folders, and rotation (``total_limit``) deletes by the same
number, so the newest state is deleted first and the next ``load_state()`` picks an older one.

What ``load_state(input_dir)`` loads (``Accelerator.load_state``, ``checkpointing.load_accelerator_state``), in
order, for what the resuming program prepared and registered:

- each model ``i``: ``model{_i}.safetensors``, else ``pytorch_model{_i}.bin`` (``FileNotFoundError`` when neither);
- each optimizer ``optimizer{_i}.bin`` and scheduler ``scheduler{_i}.bin`` (``FileNotFoundError`` when missing);
- ``sampler{_i}.bin`` for a dataloader with a seedable sampler over an ``IterableDatasetShard``,
  ``dl_state_dict{_i}.bin`` for a stateful dataloader when present;
- ``scaler.pt`` when the accelerator has a GradScaler (fp16 off CPU);
- ``random_states_<process_index>.pkl`` inside a ``try``: a missing or broken one is logged ("Could not load random
  states") and neither the RNG states nor ``Accelerator.step`` are restored;
- then it counts the ``custom_checkpoint_<i>.pkl`` files, raises ``RuntimeError`` unless there are exactly as many
  as objects given to ``register_for_checkpointing``, and loads ``custom_checkpoint_0.pkl`` ... in order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ckptdoctor.model import Checkpoint, FileFacts, FileKind, Opaque, ProblemKind, Run, Stack, TorchFacts, frozen
from ckptdoctor.patterns import lazy

# `RNG_STATE_NAME` in src/accelerate/utils/constants.py: every process writes its own, last, at every save.
_SIGNATURE_RE = lazy(r"^random_states_\d+\.pkl$")
# The folder automatic naming writes under `project_dir/checkpoints` (`Accelerator.save_state`).
AUTOMATIC_RE = lazy(r"^checkpoint_(\d+)$")
AUTOMATIC_PARENT = "checkpoints"
# The Trainer's rotation pattern (`sort_checkpoints` in src/transformers/trainer_utils.py).
_TRAINER_RE = lazy(r"checkpoint-\d+")
# `_inner` in `Accelerator.load_state`: the digit runs of the last path component; the first is the sort key.
_DIGITS_RE = lazy(r"[0-9]+")
# The files `save_accelerator_state` writes per prepared object, `<stem>.<ext>` for the first, `<stem>_<i>.<ext>`
# after (src/accelerate/utils/constants.py names the stems).
_INDEXED_RE = lazy(
    r"^(model|pytorch_model|optimizer|scheduler|sampler|dl_state_dict)(?:_(\d+))?\.(safetensors|bin)$")
_CUSTOM_RE = lazy(r"^custom_checkpoint_(\d+)\.pkl$")  # `load_state`'s own pattern for the count
_RNG_RE = lazy(r"^random_states_(\d+)\.pkl$")
SCALER = "scaler.pt"


def signed(names: Iterable[str]) -> bool:
    """Whether a folder holding top-level ``names`` holds the RNG state file ``save_state`` writes at every save."""
    return any(_SIGNATURE_RE.match(n) for n in names)


def is_automatic_layout(name: str, subfolders: Iterable[str]) -> bool:
    """Whether a folder called ``name`` with these ``subfolders`` is automatic naming's ``checkpoints`` folder: some
    ``checkpoint_<i>`` and no Trainer ``checkpoint-<n>`` (where a ``checkpoint_30`` is a renamed Trainer folder)."""
    subfolders = list(subfolders)
    return (
        name == AUTOMATIC_PARENT
        and any(AUTOMATIC_RE.match(d) for d in subfolders)
        and not any(_TRAINER_RE.search(d) for d in subfolders)
    )


def load_state_pick(entries: Iterable[str]) -> str | None:
    """The entry of ``project_dir/checkpoints`` that ``load_state()`` with no folder loads: the last when sorted by
    the first number in each name (a stable sort, so ties keep the listing's order, here the names' order). None
    when there is no entry, or when one has no digit (``load_state()`` raises ``IndexError`` then)."""
    keyed = []
    for e in sorted(entries):
        m = _DIGITS_RE.search(e)
        if m is None:
            return None
        keyed.append((int(m.group()), e))
    if not keyed:
        return None
    keyed.sort(key=lambda k: k[0])
    return keyed[-1][1]


def resume_text(run: Run) -> str:
    """What resuming ``run`` (an accelerate run) loads, in the words of accelerate's own call."""
    if is_automatic(run) and not run.standalone:
        # every entry `load_state()` lists, files and others too (`Run.entries`), else the saves found
        pick = load_state_pick(run.entries or [ck.path.rsplit("/", 1)[-1] for ck in run.checkpoints])
        text = f"accelerate; `load_state()` loads `{pick}`" if pick else "accelerate; `load_state()` raises"
        return text + _unshown_steps(run)
    return "accelerate `save_state` folders; `load_state(folder)` loads the folder named"


def digitless(entries: Iterable[str]) -> list[str]:
    """The entries of ``project_dir/checkpoints`` with no digit in their name: ``load_state()`` (and ``save_state()``'s
    rotation, once ``total_limit`` is reached) sorts every entry by ``int`` of its first digit run and raises
    ``IndexError`` on these."""
    return sorted(e for e in entries if _DIGITS_RE.search(e) is None)


def could_be_torn(names: Iterable[str]) -> bool:
    """Whether a folder holding only top-level ``names`` is what an interrupted ``save_state`` leaves: files it
    writes before the RNG states only, among them an optimizer or scheduler state (a weights file alone is as much
    the Trainer's ``save_model``)."""
    kinds = []
    for n in names:
        m = _INDEXED_RE.match(n)
        if m is None and n != SCALER:
            return False
        kinds.append(m.group(1) if m else "scaler")
    # every kind is one `save_state` writes first (the loop above already refused anything else)
    return any(k in ("optimizer", "scheduler") for k in kinds)


@frozen
class Saved:
    """What one ``save_state`` folder holds, by what ``load_state`` loads: the indices of each prepared object's
    file, the ranks of the RNG states and the custom objects' indices."""

    models: frozenset[int]  # `model{_i}.safetensors` or `pytorch_model{_i}.bin`
    optimizers: frozenset[int]
    schedulers: frozenset[int]
    samplers: frozenset[int]
    scaler: bool
    ranks: frozenset[int]  # `random_states_<rank>.pkl`
    custom: frozenset[int]  # `custom_checkpoint_<i>.pkl`


def saved(names: Iterable[str]) -> Saved:
    """``Saved`` of a folder whose top-level file names are ``names``."""
    found: dict[str, set[int]] = {k: set() for k in ("model", "optimizer", "scheduler", "sampler")}
    ranks: set[int] = set()
    custom: set[int] = set()
    scaler = False
    for n in names:
        if (m := _INDEXED_RE.match(n)) is not None:
            stem, ext = m.group(1), m.group(3)
            kind = "model" if stem == "pytorch_model" else stem
            safe_model = stem == "model" and ext == "safetensors"
            if kind in found and (safe_model or (ext == "bin" and stem != "model")):
                found[kind].add(int(m.group(2) or 0))
        elif (m := _RNG_RE.match(n)) is not None:
            ranks.add(int(m.group(1)))
        elif (m := _CUSTOM_RE.match(n)) is not None:
            custom.add(int(m.group(1)))
        scaler = scaler or n == SCALER
    return Saved(frozenset(found["model"]), frozenset(found["optimizer"]), frozenset(found["scheduler"]),
                 frozenset(found["sampler"]), scaler, frozenset(ranks), frozenset(custom))


def top_names(ck: Checkpoint) -> list[str]:
    """The names of the files directly in ``ck``'s folder (what ``load_state`` opens by name)."""
    return [ck.relname(f) for f in ck.files if "/" not in ck.relname(f)]


def expected(checkpoints: Sequence[Checkpoint]) -> Saved:
    """What the run's complete saves hold (those with the RNG state of rank 0, written after every state file):
    the objects the program prepared and registered, as far as the folders show them (the union over them)."""
    whole = [saved(top_names(ck)) for ck in checkpoints]
    whole = [s for s in whole if 0 in s.ranks] or whole[:0]

    def union(attr: str) -> frozenset[int]:
        out: set[int] = set()
        for s in whole:
            out |= getattr(s, attr)
        return frozenset(out)

    # only what complete saves hold: under DeepSpeed or FSDP the model and optimizer are saved by other names
    # rank 0's RNG state only: each process writes its own, and another world size leaves other ranks' files
    return Saved(union("models"), union("optimizers"), union("schedulers"), union("samplers"),
                 any(s.scaler for s in whole), frozenset({0}), frozenset())


def _name(stem: str, i: int, ext: str) -> str:
    return f"{stem}.{ext}" if i == 0 else f"{stem}_{i}.{ext}"


def missing(names: Iterable[str], want: Saved) -> list[tuple[str, bool]]:
    """The files ``load_state`` would look for in a folder holding ``names`` and not find, for a program that
    prepared what ``want`` says: ``(name, raises)``, ``raises`` False for an RNG state (caught and logged)."""
    have = saved(names)
    out: list[tuple[str, bool]] = []
    out += [(_name("model", i, "safetensors"), True) for i in sorted(want.models - have.models)]
    out += [(_name("optimizer", i, "bin"), True) for i in sorted(want.optimizers - have.optimizers)]
    out += [(_name("scheduler", i, "bin"), True) for i in sorted(want.schedulers - have.schedulers)]
    out += [(_name("sampler", i, "bin"), True) for i in sorted(want.samplers - have.samplers)]
    if want.scaler and not have.scaler:
        out.append((SCALER, True))
    out += [(f"random_states_{r}.pkl", False) for r in sorted(want.ranks - have.ranks)]
    return out


def custom_gaps(names: Iterable[str]) -> list[int]:
    """The indices ``load_state`` opens that are missing: it counts the ``custom_checkpoint_<i>.pkl`` files (n) and
    loads ``custom_checkpoint_0.pkl`` to ``custom_checkpoint_<n-1>.pkl``."""
    have = saved(names).custom
    return [i for i in range(len(have)) if i not in have]


def scheduler_step(ck: Checkpoint) -> int | None:
    """``last_epoch`` of the first scheduler's state in ``scheduler.bin`` (the steps it was stepped), read from the
    pickle stream's plain rebuild; None when absent or not readable."""
    f = ck.file("scheduler.bin")
    value = f.content.pickle.value if f is not None and isinstance(f.content, TorchFacts) and f.content.pickle else None
    if isinstance(value, Opaque):
        value = value.state
    step = value.get("last_epoch") if isinstance(value, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def shown_step(ck: Checkpoint) -> int | None:
    """The step a report shows for an accelerate save whose folder name holds none: automatic naming's
    ``checkpoint_<i>`` counts saves (``project_configuration.iteration``), not steps, and the RNG files' ``step``
    is ``Accelerator.step``, the gradient-accumulation counter ``accumulate()`` resets, so neither is one. What
    the folder proves is its scheduler's count (``scheduler_step``), and that is the optimizer steps only when one
    process saved it (one ``random_states_<rank>.pkl``): ``AcceleratedScheduler.step`` steps the scheduler once per
    optimizer step on one process but ``num_processes`` times on more unless ``split_batches``, which no file
    records. None otherwise (more processes, no scheduler, a save cut before its RNG file)."""
    ranks = [f for f in ck.files if "/" not in ck.relname(f) and _RNG_RE.match(f.name)]
    return scheduler_step(ck) if len(ranks) == 1 else None


def _unshown_steps(run: Run) -> str:
    """Why the report shows no step for some of an automatic-naming ``run``'s saves (``shown_step``); empty when
    it shows every one's."""
    blank = [ck for ck in run.checkpoints if ck.step is None and shown_step(ck) is None]
    if not blank:
        return ""
    ranks = max(sum(1 for f in ck.files if "/" not in ck.relname(f) and _RNG_RE.match(f.name)) for ck in blank)
    why = (f"saved by {ranks} processes, and `AcceleratedScheduler` steps the scheduler {ranks} times per "
           "optimizer step unless `split_batches`, which no file records" if ranks > 1
           else "no readable `scheduler.bin` or RNG file to tell it")
    saves = "save" if len(blank) == 1 else "saves"
    return f"; no step shown for {len(blank)} `checkpoint_<i>` {saves} (the number counts saves, not steps): {why}"


def is_automatic(run: Run) -> bool:
    """Whether ``run`` is automatic naming's ``project_dir/checkpoints`` folder (``load_state()`` picks in it)."""
    return bool(run.entries) or (
        run.path.rsplit("/", 1)[-1] == AUTOMATIC_PARENT
        and any(AUTOMATIC_RE.match(ck.path.rsplit("/", 1)[-1]) for ck in run.checkpoints)
    )


def picked(run: Run) -> Checkpoint | None:
    """The checkpoint of an accelerate ``run`` that resuming loads: ``load_state()``'s pick in automatic naming's
    folder; in a folder of ``checkpoint-N`` (the diffusers scripts' ``--resume_from_checkpoint latest``, which passes
    the highest N to ``load_state``) the highest; the folder itself when it was scanned alone."""
    if run.standalone:
        return run.checkpoints[0] if run.checkpoints else None
    if is_automatic(run):
        names = list(run.entries) or [ck.path.rsplit("/", 1)[-1] for ck in run.checkpoints]
        pick = load_state_pick(names)
        return next((ck for ck in run.checkpoints if ck.path.rsplit("/", 1)[-1] == pick), None)
    return next((ck for ck in run.checkpoints if ck.path == run.resume_pick), None)


def folder_files(ck: Checkpoint) -> list[FileFacts]:
    """The files of ``ck`` that ``load_state`` opens by name: every top-level file it knows."""
    return [f for f in ck.files if "/" not in ck.relname(f) and (
        _INDEXED_RE.match(f.name) or _RNG_RE.match(f.name) or _CUSTOM_RE.match(f.name) or f.name == SCALER)]


@frozen
class Registered:
    """What the resuming program prepared and registered, as far as it is known (None: not known, then taken from
    what the run's complete saves hold): ``load_state`` opens one file per prepared object."""

    models: int | None = None
    optimizers: int | None = None
    schedulers: int | None = None
    scaler: bool | None = None  # whether the accelerator has a GradScaler (fp16 off CPU)
    custom: int | None = None  # objects given to `register_for_checkpointing`
    process_index: int = 0  # the rank whose `random_states_<rank>.pkl` is loaded


@frozen
class LoadState:
    """What ``load_state`` does with one run: the folder it loads, the files it opens there (in order), why it
    raises (empty: it does not), what it silently leaves unrestored, and the steps the loaded scheduler holds."""

    folder: str | None
    reads: tuple[str, ...]
    raises: tuple[str, ...]
    unrestored: tuple[str, ...]
    step: int | None


def _want(run: Run, reg: Registered) -> Saved:
    """What ``load_state`` looks for: the registered counts where known, else the run's complete saves'."""
    saves = expected([ck for ck in run.checkpoints if ck.stack is Stack.ACCELERATE] or list(run.checkpoints))

    def count(n: int | None, seen: frozenset[int]) -> frozenset[int]:
        return seen if n is None else frozenset(range(n))

    return Saved(count(reg.models, saves.models), count(reg.optimizers, saves.optimizers),
                 count(reg.schedulers, saves.schedulers), saves.samplers,
                 saves.scaler if reg.scaler is None else reg.scaler, frozenset({reg.process_index}), frozenset())


def load_state(run: Run | None, reg: Registered | None = None) -> LoadState:
    """Predict ``load_state()`` (automatic naming) or ``load_state(folder)`` (a folder scanned alone, or the
    highest ``checkpoint-N``) for ``run``, an accelerate run, or None when the scan found none."""
    reg = reg or Registered()
    if run is None:
        why = "`load_state()` finds no save: with automatic naming it lists `project_dir/checkpoints` " \
              "(`FileNotFoundError` when missing, `IndexError` when empty)"
        return LoadState(None, (), (why,), (), None)
    if is_automatic(run) and not run.standalone:
        bad = digitless(run.entries)
        if bad:
            return LoadState(None, (), (f"`load_state()` raises `IndexError` sorting `{run.path}`: `{bad[0]}` has no "
                                        "digit",), (), None)
    ck = picked(run)
    if ck is None and is_automatic(run) and not run.standalone:
        last = load_state_pick(run.entries)
        why = f"`load_state()` picks `{last}` (the highest number in `{run.path}`), which is no save folder"
        return LoadState(None, (), (why if last else "`load_state()` finds no save to load",), (), None)
    if ck is None:
        return LoadState(None, (), ("`load_state()` finds no save to load",), (), None)
    names = top_names(ck)
    have = saved(names)
    want = _want(run, reg)
    reads: list[str] = []
    for i in sorted(want.models):
        safe, bin_ = _name("model", i, "safetensors"), _name("pytorch_model", i, "bin")
        reads.append(safe if safe in names or bin_ not in names else bin_)
    reads += [_name("optimizer", i, "bin") for i in sorted(want.optimizers)]
    reads += [_name("scheduler", i, "bin") for i in sorted(want.schedulers)]
    reads += [_name("sampler", i, "bin") for i in sorted(want.samplers)]
    reads += [SCALER] if want.scaler else []
    rng = f"random_states_{reg.process_index}.pkl"
    raises = [f"no `{n}`: `load_state()` raises `FileNotFoundError`" for n, hard in missing(names, want) if hard]
    damaged = {f.name for f in folder_files(ck) if f.kind is FileKind.EMPTY or any(
        p.kind is ProblemKind.TRUNCATED for p in f.problems)}
    raises += [f"`{n}` is cut short: `load_state()` raises in `torch.load`" for n in reads if n in damaged]
    unrestored = [] if rng in names and rng not in damaged else [
        f"no readable `{rng}`: the RNG states and `Accelerator.step` are not restored"]
    reads += [rng] if rng in names else []
    count = len(have.custom)
    if reg.custom is not None and count != reg.custom:
        raises.append(f"{count} `custom_checkpoint_<i>.pkl` files for {reg.custom} registered objects: "
                      "`load_state()` raises `RuntimeError`")
    elif gaps := custom_gaps(names):
        raises.append(f"no `custom_checkpoint_{gaps[0]}.pkl`: `load_state()` raises `FileNotFoundError`")
    reads += [f"custom_checkpoint_{i}.pkl" for i in range(count)]
    return LoadState(ck.path, tuple(reads), tuple(raises), tuple(unrestored), scheduler_step(ck))
