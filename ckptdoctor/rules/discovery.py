"""Discovery and resume-selection rules: paths the scan could not read, which checkpoint a resume would pick,
and whether it should."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator

from ckptdoctor import trainer_view
from ckptdoctor.facts import (
    PATH_KINDS,
    common_steps,
    history_divergence,
    holds_checkpoint,
    run_identity_difference,
)
from ckptdoctor.findings import Applicability, FixOp, FixPlan, OpKind, Severity
from ckptdoctor.model import (
    Checkpoint,
    FileKind,
    FolderRole,
    ProblemKind,
    Run,
    Stack,
    Tree,
    frozen,
)
from ckptdoctor.rules import Hit, rule
from ckptdoctor.sources.interface import OWN_DIR
from ckptdoctor.stacks import TRAINER_SAVES, accelerate

JIT_SENTINEL = "checkpoint-is-incomplete.txt"


# Paths a resume cannot open: in the checkpoint it picks, one of them is an error.
_BLOCKING_KINDS = (ProblemKind.UNREADABLE, ProblemKind.SPECIAL_FILE, ProblemKind.SYMLINK_LOOP)


def _resume_picks(tree: Tree) -> list[Checkpoint]:
    """The checkpoints `resume_from_checkpoint=True` picks, one per run, and standalone checkpoints."""
    out = [ck for run in tree.runs if run.resume_pick is not None for ck in run.checkpoints
           if ck.path == run.resume_pick]  # fmt: skip
    out.extend(ck for run in tree.runs if run.standalone for ck in run.checkpoints)
    return out


def _severity(path: str, kind: ProblemKind, picked: list[Checkpoint]) -> Severity:
    """Error when the resume would open ``path``: the folder it picks, or a file there a loader opens
    (``trainer_view.resume_reads``; an entry without a suffix may be a subfolder, which a loader reads whole)."""
    if kind is ProblemKind.NOT_CHECKED:  # nothing in it was checked: a gate must not pass it
        return Severity.ERROR
    if kind not in _BLOCKING_KINDS:
        return Severity.WARNING
    for ck in picked:
        if ck.path in (".", ""):
            rel = "" if path in (".", "") else path
        elif path == ck.path or path.startswith(f"{ck.path}/"):
            rel = path[len(ck.path) + 1 :]
        else:
            continue
        if trainer_view.resume_reads(ck, rel) or "." not in rel:
            return Severity.ERROR
    return Severity.WARNING


ALLOW_EMPTY_HINT = "--allow-empty where no save is expected yet"


@rule("CKD002", "no-checkpoint-found", Severity.ERROR, unless_ignored=True)
def no_checkpoint_found(tree: Tree) -> Iterator[Hit]:
    """A scanned root holds no checkpoint at all: no checkpoint or model folder, no weights or state file.

    ## What it does
    Reports a root (a folder, or a file given by name) in which discovery found no `checkpoint-N` folder, no model
    or adapter folder and no file of a checkpoint format (safetensors, `torch.save` archives, pickles, DCP,
    MindSpore, TensorFlow and HDF5 files, or a format CKD216 names): an empty folder, a folder of logs, or a remote
    root that could not be listed. It runs whatever `--select` says (`--select CKD6` must not pass a mistyped path
    either); `--allow-empty` (`allow_empty=True` in the Python API) or an explicit `--ignore CKD002` turns it off.

    ## Why is this bad?
    A gate that checks nothing must not pass. `ckptdoctor scan --fail-on error "$OUTPUT_DIR"` with a mistyped or
    unset variable, or an output_dir on a volume that was not mounted, would otherwise report "No problems found
    in 0 files" and exit 0, and the job would go on to resume from nothing or train from scratch. pytest exits 5
    when it collects no test for the same reason.

    ## Example
    `ckptdoctor scan runs/my-rnu` where `runs/my-rnu/` exists but is empty, or holds only `logs/` and
    `README.md`. A launcher that gates before the first save passes `--allow-empty` to accept exactly that.

    ## Fix safety
    No fix: point the scan at the folder the checkpoints are in, or pass `--allow-empty` when none is expected
    yet. A local root that does not exist or that you may not read is a usage error (exit 2), not this finding.

    ## References
    `src/transformers/trainer_utils.py` `get_last_checkpoint` (returns None for such a folder, and
    `train(resume_from_checkpoint=True)` raises "No valid checkpoint found in output directory").
    """
    if holds_checkpoint(tree):
        return
    n = tree.files_seen
    if n:
        what = f"none of its {n:,} file{'s' if n != 1 else ''} is a weights, optimizer or other state file"
    elif any(pp.path in (".", "") for pp in tree.path_problems):
        what = "it could not be read"
    else:
        what = "it is empty"
    yield Hit(".", f"no checkpoint here: {what} (a mistyped path?); pass {ALLOW_EMPTY_HINT}")


@rule(
    "CKD001",
    "unreadable-path",
    Severity.WARNING,
    severity_when=(
        (
            Severity.ERROR,
            "the resume would open it: in the checkpoint it picks, a file a loader reads; or nothing in it was "
            "checked (a `scan --dask` task that failed)",
        ),
    ),
)
def unreadable_path(tree: Tree) -> Iterator[Hit]:
    """A file or folder the scan could not read: permission denied, symlink loop, undecodable name, device file,
    a resource limit reached, or a run a `--dask` worker never checked.

    ## What it does
    Reports every path discovery or a reader could not open or fully analyse. The scan goes on with the rest.
    It is an error when the path is in the checkpoint `resume_from_checkpoint=True` picks (the folder itself, or a
    file there a loader opens: weights, optimizer, scheduler and RNG states, `trainer_state.json`, `config.json`,
    anything in its subfolders), a warning otherwise. A folder (or a whole root) whose task failed on a Dask
    cluster after Dask's retries (`scan --dask`, `ckptdoctor.scan_many(client=...)`: a worker lost again and again,
    an error in the task) is an error too: nothing in it was checked. The message says why.

    ## Why is this bad?
    What ckptdoctor could not read, it could not check: a hazard may hide there. A resume that needs the file will
    fail, or (for a name the Trainer's pattern does not match) silently ignore it. A file that vanished while
    being scanned is not corrupt: a save or the Trainer's rotation (`save_total_limit`) was at work; scan again.

    ## Example
    `checkpoint-8/optimizer.pt` with mode 000 owned by another user.

    ## Fix safety
    No automatic fix: fix permissions or names by hand, then scan again.

    ## References
    `src/transformers/trainer_utils.py` `get_last_checkpoint` (`os.listdir` on the output folder raises on an
    unreadable one, so the resume fails where the scan reports); ckptdoctor's README, "Exit codes" (bad input is
    a finding, never a traceback).
    """
    picked = _resume_picks(tree)
    for pp in tree.path_problems:
        if pp.problem.kind in PATH_KINDS:
            yield Hit(pp.path, pp.problem.message, _severity(pp.path, pp.problem.kind, picked))
    for f in tree.all_files():
        for p in f.problems:
            if p.kind in PATH_KINDS:
                yield Hit(f.path, p.message, _severity(f.path, p.kind, picked))


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t > 0 else "unknown time"


def _gap(seconds: float) -> str:
    """A duration in the largest unit that keeps it at least 1 (``4 s``, ``12 min``, ``3 h``, ``2 days``)."""
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{int(seconds // size)} {unit}"
    return f"{int(seconds)} s"


def _picked(run: Run) -> Checkpoint | None:
    for ck in run.checkpoints:
        if ck.path == run.resume_pick:
            return ck
    return None


@frozen
class StaleVerdict:
    """Resume's pick belongs to another run than lower-numbered checkpoints of the same folder.

    ``newest`` is the other run's most recent checkpoint, ``stale`` the pick's run's checkpoints above it, ``why``
    the evidence, and ``certain`` whether file times confirm the other run is the newer one (copies and git
    checkouts reset times, and then only the disagreement itself is known).
    """

    newest: Checkpoint
    stale: tuple[Checkpoint, ...]
    why: str
    certain: bool


def stale_verdict(run: Run) -> StaleVerdict | None:
    """Whether ``resume_from_checkpoint=True``'s pick is left over from an older run in the same output_dir."""
    pick = _picked(run)
    ts_pick = trainer_view.trainer_state(pick) if pick is not None else None
    if pick is None or ts_pick is None or pick.step is None:
        return None
    candidates = [c for c in run.checkpoints if c.role == FolderRole.CHECKPOINT and c.step is not None]
    disagree: list[tuple[Checkpoint, str]] = []
    for c in candidates:
        ts = trainer_view.trainer_state(c)
        if c is pick or ts is None or c.step is None or c.step >= pick.step:
            continue
        why = history_divergence(ts, ts_pick)
        if why is None and c.mtime > pick.mtime + 1.0 and not common_steps(ts, ts_pick):
            why = run_identity_difference(ts, ts_pick)
        if why is not None:
            extra = run_identity_difference(ts, ts_pick)
            disagree.append((c, why + (f"; {extra}" if extra and extra not in why else "")))
    if not disagree:
        return None
    newest, why = max(disagree, key=lambda cw: (cw[0].mtime, cw[0].step or 0))
    if pick.mtime > newest.mtime + 1.0:
        return None  # the pick is the newer run's; the lower folders are an older run's leftovers
    top = max(c.step or 0 for c, _ in disagree)
    stale = tuple(
        c
        for c in candidates
        if (c.step or 0) > top
        and (ts := trainer_view.trainer_state(c)) is not None
        and history_divergence(ts, ts_pick) is None
    )
    return StaleVerdict(newest, stale or (pick,), why, newest.mtime > pick.mtime + 1.0)


def stale_checkpoints(run: Run) -> tuple[Checkpoint, list[Checkpoint], str] | None:
    """When resume's pick belongs to an older run: (the other run's newest checkpoint, the stale ones, evidence)."""
    v = stale_verdict(run)
    return None if v is None else (v.newest, list(v.stale), v.why)


@rule("CKD101", "stale-checkpoint-selected", Severity.ERROR, fix=Applicability.UNSAFE)
def stale_checkpoint_selected(tree: Tree) -> Iterator[Hit]:
    """The checkpoint `resume_from_checkpoint=True` would pick belongs to an older run than the newest checkpoints.

    ## What it does
    Compares the highest-numbered `checkpoint-N` (what `get_last_checkpoint` returns) with the most recently
    written checkpoint of the folder. When the newest one was written later but tells another story (different
    `max_steps` / `num_train_epochs` / batch size, or a `log_history` that diverges at a step both logged), the
    pick is left over from an earlier run.

    ## Why is this bad?
    A second run started in the same `output_dir` restarts numbering and overwrites the lower folders, but leaves
    the first run's higher ones. `get_last_checkpoint` picks by number only, so the resume loads the old run's
    weights and step: it trains zero steps (`global_step` > `max_steps`) or continues the wrong run, with no warning.

    ## Example
    Run A saved `checkpoint-4/8/12`; run B (new settings, same folder) saved `checkpoint-4/8`. Resuming B picks
    A's `checkpoint-12`.

    ## Fix safety
    Unsafe: quarantines the stale checkpoints (moved, not deleted; `ckptdoctor undo` restores them). It is a
    judgement about which run you mean to continue, so it only runs with `--unsafe-fixes`.

    ## References
    `src/transformers/trainer_utils.py` `get_last_checkpoint` (highest folder number, no content check);
    `src/transformers/trainer.py` `Trainer._save_checkpoint` (writes `checkpoint-{global_step}` over what is there).
    """
    for run in tree.runs:
        v = stale_verdict(run)
        pick = _picked(run)
        if v is None or pick is None:
            continue
        names = ", ".join(f"`{c.path}`" for c in v.stale)
        ops = tuple(FixOp(OpKind.QUARANTINE, c.path) for c in v.stale)
        if v.certain:
            # ``certain`` means over a second apart, so the times differ at the seconds shown; the gap says by how much.
            msg = (
                f"resume_from_checkpoint=True picks `{pick.path}` (written {_when(pick.mtime)}), but the newer "
                f"checkpoint `{v.newest.path}` (written {_when(v.newest.mtime)}, "
                f"{_gap(v.newest.mtime - pick.mtime)} later) belongs to another run: {v.why}"
            )
            noun = "checkpoint" if len(v.stale) == 1 else "checkpoints"
            plan = FixPlan(f"Quarantine the stale {noun} {names}", Applicability.UNSAFE, ops)
        else:
            # Copies and checkouts reset file times: the disagreement is certain, its direction is not.
            msg = (
                f"resume_from_checkpoint=True picks `{pick.path}`, but `{v.newest.path}` belongs to another run "
                f"({v.why}); file times cannot tell which run is newer (copied or checked out?)"
            )
            title = f"Decide which run to continue; if it is `{v.newest.path}`'s, quarantine {names}"
            plan = FixPlan(title, Applicability.MANUAL, ops)
        yield Hit(pick.path, msg, fix=plan)


def linked_out(tree: Tree) -> frozenset[str]:
    """Paths that are links leaving the scan root: not read, but a resume follows them, so they count as present."""
    return frozenset(p.path for p in tree.path_problems if p.problem.kind == ProblemKind.LINK_ESCAPES_ROOT)


def unread_paths(tree: Tree) -> frozenset[str]:
    """Paths discovery saw but could not take: folders it could not list, entries that vanished or could not be
    stat'ed. They exist (a listing showed them), so nothing about them is evidence of a missing file."""
    kinds = (ProblemKind.UNREADABLE, ProblemKind.LIMIT)
    return frozenset(p.path for p in tree.path_problems if p.problem.kind in kinds)


def torn_evidence(
    ck: Checkpoint, links_out: frozenset[str] = frozenset(), unread: frozenset[str] = frozenset()
) -> list[tuple[str, str | None]]:
    """Signs of an interrupted save: what the Trainer writes last is missing, a sentinel, empty or cut files; each
    with the path of the file it is about (None for a missing file or folder).

    ``links_out`` (from ``linked_out(tree)``) names links out of the root: a resume follows them, so a
    `trainer_state.json` linked elsewhere is not missing (CKD604 reports the link). ``unread`` (from
    ``unread_paths(tree)``) names paths that exist but could not be read: a folder that could not be listed is
    not empty, and proves nothing (CKD001 reports it)."""
    if ck.path in unread:
        return []
    out: list[tuple[str, str | None]] = []
    state_path = trainer_view.TRAINER_STATE if ck.path in ("", ".") else f"{ck.path}/{trainer_view.TRAINER_STATE}"
    has_state = ck.file(trainer_view.TRAINER_STATE) is not None or state_path in links_out or state_path in unread
    if not has_state:
        present = sorted(name for name, _ in ck.top_files())
        inside = "" if ck.path in ("", ".") else f"{ck.path}/"
        hidden = any(p.startswith(inside) for p in unread)
        out.append((
            "no `trainer_state.json` (the Trainer writes it last)"
            + (
                f"; it holds {', '.join(f'`{p}`' for p in present[:6])}"
                if present
                else "; what it holds could not all be read"
                if hidden
                else "; the folder is empty"
            ),
            None,
        ))
    sentinel = ck.file(JIT_SENTINEL)
    if sentinel is not None:
        out.append((f"`{JIT_SENTINEL}` is present (a JIT checkpoint that never finished)", sentinel.path))
    dcp_dirs = {rel.rsplit("/", 1)[0] for rel, f in ck.entries() if f.kind == FileKind.DCP_DATA}
    for d in sorted(dcp_dirs):
        if ck.file(f"{d}/.metadata") is None:
            what = f"`{d}/` has data files but no `.metadata` (written last by torch.distributed.checkpoint)"
            out.append((what, None))
    for rel, f in ck.entries():
        empty = f.kind == FileKind.EMPTY and rel.endswith((".safetensors", ".bin", ".pt", ".pth", ".json", ".distcp"))
        if not empty and not f.problems:
            continue  # no sign of a torn save in it: whether the resume reads it does not matter
        if not trainer_view.resume_reads(ck, rel):
            continue  # damage the resume never meets is that file's own finding (CKD202, CKD203), not a torn save
        if empty:
            out.append((f"`{rel}` is empty (0 bytes)", f.path))
        elif cut := [p.message for p in f.problems if p.kind == ProblemKind.TRUNCATED]:
            # its reader says where: "JSON ends mid-document at line L column C: ..."
            if rel == trainer_view.TRAINER_STATE:
                out.append((f"`{rel}` (the Trainer writes it last) is cut short: {cut[0]}", f.path))
            else:
                out.append((f"`{rel}` is truncated", f.path))
    return out


@rule(
    "CKD102",
    "incomplete-checkpoint",
    Severity.WARNING,
    fix=Applicability.SAFE,
    severity_when=((Severity.ERROR, "it is the checkpoint the resume picks, or a checkpoint scanned alone"),),
)
def incomplete_checkpoint(tree: Tree) -> Iterator[Hit]:
    """A checkpoint folder left by an interrupted save: what is written last is missing, or files are cut short.

    ## What it does
    Flags checkpoint folders without `trainer_state.json` (the Trainer writes it last), with a `trainer_state.json`
    cut short (invalid JSON that stops mid-document; one that is complete but wrong is CKD402's alone), with the JIT
    sentinel `checkpoint-is-incomplete.txt`, with a DCP folder lacking `.metadata`, or with empty or truncated files
    that a resume opens (weights, shards, adapter files, `config.json`, optimizer, scheduler, scaler and RNG states,
    anything in a sub-folder). A damaged side file no resume opens (`ema_backup.safetensors`, `training_args.bin`)
    does not condemn the folder: it is that file's own finding (CKD202, CKD203), which quarantines the file alone.
    It is an error when `resume_from_checkpoint=True` would pick the folder, a warning otherwise.

    ## Why is this bad?
    `get_last_checkpoint` checks nothing but the folder name, so a torn save is picked: resume fails with
    `FileNotFoundError: .../trainer_state.json`, `JSONDecodeError` in `TrainerState.load_from_json` or
    `SafetensorError`, or silently resumes half a state.

    ## Example
    The job was preempted while saving `checkpoint-1500/`: weights and `optimizer.pt` are there, `rng_state.pth`
    and `trainer_state.json` are not, or `trainer_state.json` stops in the middle of `log_history` (it is written
    in place with `open(..., "w")`).

    ## Fix safety
    Safe: the folder is quarantined (moved into `.ckptdoctor/quarantine/`, restorable with `ckptdoctor undo`), so
    resume picks the last complete checkpoint.

    ## References
    `src/transformers/trainer.py` `_save_checkpoint` (write order), `train` (`TrainerState.load_from_json`),
    `_load_from_checkpoint`, `_load_optimizer_and_scheduler`, `_load_rng_state` (the files a resume opens);
    `trainer_utils.get_last_checkpoint`.
    """
    links_out = linked_out(tree)
    unread = unread_paths(tree)
    for run in tree.runs:
        for ck in run.checkpoints:
            # Only the Trainer's folders: another stack writes no `trainer_state.json` by design (ckptdoctor.stacks)
            if ck.role not in (FolderRole.CHECKPOINT,) or ck.stack not in TRAINER_SAVES:
                continue
            evidence = torn_evidence(ck, links_out, unread)
            if not evidence:
                continue
            picked = run.resume_pick == ck.path or run.standalone
            sev = Severity.ERROR if picked else Severity.WARNING
            lead = "resume_from_checkpoint=True picks this interrupted save: " if run.resume_pick == ck.path else ""
            plan = FixPlan(f"Quarantine `{ck.path}`", Applicability.SAFE, (FixOp(OpKind.QUARANTINE, ck.path),))
            at_fault = next((path for _, path in evidence if path is not None), None)
            message = lead + "; ".join(text for text, _ in evidence)
            yield Hit(ck.path, message, sev, None if run.standalone else plan, file=at_fault)


@rule("CKD103", "leftover-temp-checkpoint", Severity.WARNING, fix=Applicability.SAFE)
def leftover_temp_checkpoint(tree: Tree) -> Iterator[Hit]:
    """A `tmp-checkpoint-N` staging folder (or similar) was left behind.

    ## What it does
    Reports staging folders that transformers 4.36-4.38 wrote before renaming them to `checkpoint-N`.

    ## Why is this bad?
    The save that made it never finished. Resume ignores the folder, but it holds a partial copy of the state and
    misleads anyone picking a checkpoint by hand; it also uses disk.

    ## Example
    `tmp-checkpoint-600/` next to `checkpoint-500/` after a crash during the save at step 600.

    ## Fix safety
    Safe: the folder is quarantined, not deleted.

    ## References
    `src/transformers/trainer.py` `Trainer._save_checkpoint` in transformers 4.36-4.38 (writes into
    `tmp-checkpoint-N`, then `os.rename`); `src/transformers/trainer_utils.py` `get_last_checkpoint` (its
    `checkpoint-<digits>` pattern never picks a staging folder, so nothing cleans it up).
    """
    for run in tree.runs:
        for ck in run.checkpoints:
            if ck.role == FolderRole.TEMP:
                plan = FixPlan(f"Quarantine `{ck.path}`", Applicability.SAFE, (FixOp(OpKind.QUARANTINE, ck.path),))
                yield Hit(ck.path, f"`{ck.path}` is a leftover staging folder of an unfinished save", fix=plan)


@rule("CKD104", "step-mismatch", Severity.WARNING)
def step_mismatch(tree: Tree) -> Iterator[Hit]:
    """A checkpoint folder's number differs from the `global_step` in its `trainer_state.json`.

    ## What it does
    Compares `checkpoint-N`'s N with `trainer_state.json`'s `global_step`.

    ## Why is this bad?
    Resume selects by the folder number but continues from `global_step`, and names new folders by it: a renamed
    or copied folder makes resume pick one step and continue from another, and later saves overwrite other folders.

    ## Example
    `checkpoint-1000/` renamed by hand from `checkpoint-800/`.

    ## Fix safety
    No automatic fix: rename the folder to match `global_step` if that is what it holds.

    ## References
    `src/transformers/trainer_utils.py` `get_last_checkpoint` (picks by the folder's number);
    `src/transformers/trainer.py` `Trainer._save_checkpoint` (folder name from `state.global_step`).
    """
    for run in tree.runs:
        for ck in run.checkpoints:
            ts = trainer_view.trainer_state(ck)
            if ck.role != FolderRole.CHECKPOINT or ck.step is None or ts is None or ts.global_step is None:
                continue
            if ts.global_step != ck.step:
                yield Hit(
                    ck.path,
                    f"folder says step {ck.step} but `trainer_state.json` has global_step {ts.global_step}",
                    file=state.path if (state := ck.file(trainer_view.TRAINER_STATE)) is not None else None,
                )


def _best_target(tree: Tree, run: Run, best: str) -> Checkpoint | None:
    name = re.split(r"[\\/]", best.rstrip("/\\"))[-1]
    for ck in run.checkpoints:
        if ck.path.rsplit("/", 1)[-1] == name and ck.role == FolderRole.CHECKPOINT:
            return ck
    return None


@rule("CKD105", "best-checkpoint-missing", Severity.WARNING, fix=Applicability.SAFE)
def best_checkpoint_missing(tree: Tree) -> Iterator[Hit]:
    """`best_model_checkpoint` names a folder that does not exist in this run.

    ## What it does
    Reads `best_model_checkpoint` from each `trainer_state.json` and checks the folder it names is a checkpoint of
    the same run (an absolute path from another machine counts as missing).

    ## Why is this bad?
    transformers 5 drops the value on resume with a warning but keeps `best_metric`, so no later evaluation can
    become the best and `load_best_model_at_end` loads nothing; transformers 4 keeps the stale path and, with
    `save_total_limit=1`, fails at the end of training in `os.path.samefile`.

    ## Example
    `"best_model_checkpoint": "/home/alice/runs/x/checkpoint-400"` in a run copied to another machine, or a best
    checkpoint deleted to save space.

    ## Fix safety
    Safe: `best_model_checkpoint` is rewritten in that `trainer_state.json` (the original kept in quarantine), every
    other value and the Trainer's formatting (`indent=2`, sorted keys, trailing newline) unchanged. When the named
    folder is a checkpoint of this run, the new value is its path relative to the run's parent folder
    (`run/checkpoint-400`), what the Trainer stores for a relative `output_dir` given from there (the `output_dir`
    the original value was built from cannot be known); otherwise it becomes null, as transformers 5 does on resume.

    ## References
    `src/transformers/trainer.py` `Trainer._init_training_state` (drops a `best_model_checkpoint` that is no
    folder, with a warning), `Trainer._load_best_model`; `src/transformers/trainer_utils.py` `rotate_checkpoints`
    (keeps the best checkpoint only while it exists).
    """
    for run in tree.runs:
        for ck in run.checkpoints:
            ts = trainer_view.trainer_state(ck)
            if ts is None or not ts.best_model_checkpoint:
                continue
            best = ts.best_model_checkpoint
            target = _best_target(tree, run, best)
            where = ck.path + "/trainer_state.json" if ck.path != "." else "trainer_state.json"
            if target is not None and not (
                os.path.isabs(best) and tree.abs_root and not best.startswith(tree.abs_root)
            ):
                continue
            # The Trainer's value is os.path.join(output_dir, name); relative to the run's parent is the form it
            # takes for a relative output_dir, the only one that does not depend on this machine's layout.
            run_name = os.path.basename(tree.abs_root or os.path.abspath(tree.root)) if run.path == "." else (
                run.path.rsplit("/", 1)[-1]
            )
            new = None if target is None else f"{run_name}/{target.path.rsplit('/', 1)[-1]}"
            title = f"Set best_model_checkpoint in `{where}` to " + ("null" if new is None else f"`{new}`")
            if ts.complete:
                # Same layout as TrainerState.save_to_json, so only this value's line changes.
                text = json.dumps({**ts.raw, "best_model_checkpoint": new}, indent=2, sort_keys=True) + "\n"
                plan = FixPlan(title, Applicability.SAFE, (FixOp(OpKind.REWRITE_JSON, where, text),))
            else:  # read in pieces (too large to hold whole): there is no whole value to write back
                plan = FixPlan(f"{title} by hand (the file is too large to rewrite)", Applicability.MANUAL)
            if target is None:
                msg = f"best_model_checkpoint `{best}` names a folder that does not exist in this run"
            else:
                msg = (
                    f"best_model_checkpoint `{best}` is an absolute path outside this folder "
                    f"(another machine or a moved run); the same checkpoint here is `{target.path}`"
                )
            yield Hit(where, msg, fix=plan)


def _links_out(tree: Tree, ck: Checkpoint) -> bool:
    """Whether a link directly inside ``ck`` points outside the scan root (its target is unknown to the scan)."""
    return any(
        pp.problem.kind == ProblemKind.LINK_ESCAPES_ROOT
        and (pp.path.rsplit("/", 1)[0] if "/" in pp.path else ".") == (ck.path or ".")
        for pp in tree.path_problems
    )


@rule("CKD106", "no-resumable-checkpoint", Severity.ERROR)
def no_resumable_checkpoint(tree: Tree) -> Iterator[Hit]:
    """A checkpoint folder holds none of the weight files the Trainer looks for.

    ## What it does
    Checks each `checkpoint-N` for `model.safetensors`, `pytorch_model.bin`, their shard indexes, adapter files
    (also in sub-folders), an FSDP folder or a DeepSpeed `global_step*/` folder.

    ## Why is this bad?
    Resuming from it raises `ValueError: Can't find a valid checkpoint at ...`, and when it is the highest-numbered
    folder, `resume_from_checkpoint=True` always picks it.

    ## Example
    A checkpoint whose weights were deleted to save space, keeping only `optimizer.pt`.

    ## Fix safety
    No automatic fix; restore the weights or quarantine the folder.

    ## References
    `src/transformers/trainer.py` `_load_from_checkpoint`.
    """
    for run in tree.runs:
        for ck in run.checkpoints:
            if ck.role != FolderRole.CHECKPOINT or not ck.files or _links_out(tree, ck) or ck.stack is Stack.TORCHTITAN:
                continue  # a link out of the root is not followed, but a resume follows it (CKD604 reports it)
            if trainer_view.weights_branch(ck) == "none":
                picked = " and resume_from_checkpoint=True picks it" if run.resume_pick == ck.path else ""
                yield Hit(ck.path, f'no weights file a resume could load{picked} ("Can\'t find a valid checkpoint")')


def _tf_prefix(folder: str, abs_folder: str, path: str) -> str | None:
    """The root-relative bundle prefix a `checkpoint` entry names (None: an absolute path outside its folder)."""
    if path.startswith("/") or (len(path) > 2 and path[1] == ":"):
        if not abs_folder or not path.startswith(abs_folder.rstrip("/") + "/"):
            return None
        path = path[len(abs_folder.rstrip("/")) + 1 :]
    return f"{folder}/{path}" if folder else path


@rule("CKD107", "tf-checkpoint-dangling", Severity.ERROR)
def tf_checkpoint_dangling(tree: Tree) -> Iterator[Hit]:
    """A TensorFlow `checkpoint` file names a checkpoint whose `.index` does not exist.

    ## What it does
    Reads the text `checkpoint` file `tf.train.CheckpointManager` keeps and checks that `model_checkpoint_path` (the
    checkpoint a restart restores) and every `all_model_checkpoint_paths` entry name a `<prefix>.index` beside it.

    ## Why is this bad?
    `CheckpointManager.__init__` takes `latest_checkpoint` from this file as written, and the TFTrainer restored
    `latest_checkpoint` at every start: `Checkpoint.restore` of a prefix with no files raises `NotFoundError`, so
    training cannot start. A dangling older entry makes the manager's rotation delete nothing it expects.

    ## Example
    `ckpt-3.index` and its data deleted to free space, while `checkpoint` still says `model_checkpoint_path:
    "ckpt-3"`.

    ## Fix safety
    No automatic fix: edit `checkpoint` to name the newest bundle that exists, or restore the missing one.

    ## References
    `tensorflow/python/checkpoint/checkpoint_management.py` (`CheckpointManager.__init__`, `latest_checkpoint`,
    `get_checkpoint_state`); transformers 4.x `src/transformers/trainer_tf.py` (`TFTrainer.train`).
    """
    from ckptdoctor.model import TfCheckpointStateFacts

    files = {f.path for f in tree.all_files()}
    for f in tree.all_files():
        c = f.content
        if f.kind is not FileKind.TF_CHECKPOINT_STATE or not isinstance(c, TfCheckpointStateFacts):
            continue
        folder = f.path.rsplit("/", 1)[0] if "/" in f.path else ""
        abs_folder = os.path.join(tree.abs_root, folder) if tree.abs_root else ""
        wanted = [("model_checkpoint_path", c.model_checkpoint_path)] if c.model_checkpoint_path else []
        wanted += [("all_model_checkpoint_paths", p) for p in c.all_model_checkpoint_paths
                   if p != c.model_checkpoint_path]
        for field, path in wanted:
            prefix = _tf_prefix(folder, abs_folder, path)
            if prefix is not None and f"{prefix}.index" in files:
                continue
            where = "an absolute path outside this folder" if prefix is None else f"but `{path}.index` does not exist"
            effect = ("restoring `latest_checkpoint` raises NotFoundError" if field == "model_checkpoint_path"
                      else "an older checkpoint the manager still lists is gone")
            yield Hit(f.path, f'{field} names "{path}", {where}: {effect}')


@rule("CKD108", "checkpoint-of-unknown-make", Severity.INFO)
def checkpoint_of_unknown_make(tree: Tree) -> Iterator[Hit]:
    """A checkpoint folder whose files match no training program ckptdoctor knows, so it is not judged as one.

    ## What it does
    Reports `checkpoint-N` folders (and accelerate's `checkpoints/checkpoint_N`) that hold none of the files the
    transformers Trainer or accelerate's `save_state` always write, nothing else in their run says which program
    wrote them, and they hold files a Trainer save never writes first (so they are no Trainer save cut short).

    ## Why is this bad?
    It may not be: many scripts save their own `checkpoint-N` folders. But ckptdoctor cannot tell what a resume
    of it needs, so it checks only what holds for any file (formats, pickles) and never proposes to quarantine it,
    where judging it by the Trainer's rules would call every such folder an interrupted save.

    ## Example
    A custom loop's `checkpoint-500/` holding `model.safetensors` and `state.pkl`.

    ## Fix safety
    No fix: a folder of unknown make is never moved.

    ## References
    `src/transformers/trainer.py` `Trainer._save_checkpoint` (what the Trainer writes);
    `src/accelerate/checkpointing.py` `save_accelerator_state` (what `Accelerator.save_state` writes).
    """
    for run in tree.runs:
        for ck in run.checkpoints:
            if ck.stack is Stack.UNKNOWN:
                held = sorted({ck.relname(f).split("/", 1)[0] for f in ck.files})
                names = ", ".join(f"`{n}`" for n in held[:6]) + (", ..." if len(held) > 6 else "")
                yield Hit(ck.path, f"no known training program wrote this folder (it holds {names}); "
                                   "judged only as files, never quarantined")


def _in_run(run: Run, name: str) -> str:
    return name if run.path in ("", ".") else f"{run.path}/{name}"


@rule("CKD120", "accelerate-stray-entry", Severity.ERROR, fix=Applicability.SAFE)
def accelerate_stray_entry(tree: Tree) -> Iterator[Hit]:
    """An entry of accelerate's `checkpoints/` folder that is no save makes `Accelerator.load_state()` raise.

    ## What it does
    Flags, in automatic checkpoint naming's `project_dir/checkpoints/` (a folder of `checkpoint_<i>` saves written
    by `Accelerator.save_state()`), each file or folder whose name holds no digit (`notes.txt`, `best/`, `.DS_Store`,
    ckptdoctor's own `.ckptdoctor/` when a fix once ran with this folder as its root), and an entry that is no save
    but holds the highest number there (`events.out.tfevents.1764201600.host`, `best_9/`).

    ## Why is this bad?
    `load_state()` with no folder lists `project_dir/checkpoints` and sorts every entry by the first number in its
    name: a name without one raises `IndexError: list index out of range` before anything loads (`save_state()`
    sorts the same listing to delete the oldest saves once `total_limit` is reached, and raises there too), and the
    entry with the highest number is loaded as the save, whatever it is: a file or a foreign folder raises
    `FileNotFoundError` or `NotADirectoryError` looking for `model.safetensors` in it.

    ## Example
    `checkpoints/` holds `checkpoint_0/`, `checkpoint_1/` and a `README.md` someone added.

    ## Fix safety
    Safe: the entry is quarantined (moved into `.ckptdoctor/quarantine/` at the scan root, restorable with
    `ckptdoctor undo`), so `load_state()` finds the saves only. No fix is offered when the root scanned is the
    `checkpoints/` folder itself (the quarantine would be one more entry without a digit there: scan the project
    folder above it), nor for ckptdoctor's own folder.

    ## References
    `src/accelerate/accelerator.py` `Accelerator.load_state` (`_inner`: `re.findall(r"[\\/]?([0-9]+)(?=[^\\/]*$)",
    folder)[0]`, then `folders[-1]`), `Accelerator.save_state` (the same sort for `total_limit`).
    """
    for run in tree.runs:
        if not run.entries:
            continue
        at_root = run.path in ("", ".")
        saves = {ck.path.rsplit("/", 1)[-1] for ck in run.checkpoints}
        stray = [(n, f"raises `IndexError` on `{n}`, which has none") for n in accelerate.digitless(run.entries)]
        last = accelerate.load_state_pick(run.entries)
        if last is not None and last not in saves:
            stray.append((last, f"takes `{last}`, the highest, as the save to load: it is none"))
        for name, effect in stray:
            path = _in_run(run, name)
            plan = None if at_root or name == OWN_DIR else FixPlan(
                f"Quarantine `{path}`", Applicability.SAFE, (FixOp(OpKind.QUARANTINE, path),))
            yield Hit(path, f"`load_state()` sorts `{run.path}` by the number in each entry's name and {effect}",
                      fix=plan)


def accelerate_torn(ck: Checkpoint, want: accelerate.Saved, unread: frozenset[str]) -> list[tuple[str, str | None]]:
    """Signs that the accelerate save ``ck`` was cut short, as ``load_state`` meets them: files it opens that are
    missing (against ``want``, what the run's complete saves hold), empty or truncated; each with the file at fault
    (None when missing)."""
    if ck.path in unread:
        return []
    out: list[tuple[str, str | None]] = []
    for name, raises in accelerate.missing(accelerate.top_names(ck), want):
        effect = "`load_state()` raises `FileNotFoundError`" if raises else (
            "`load_state()` restores no RNG state and no `step` (it logs \"Could not load random states\")")
        out.append((f"no `{name}`: {effect}", None))
    for f in accelerate.folder_files(ck):
        if f.kind == FileKind.EMPTY:
            out.append((f"`{f.name}` is empty (0 bytes)", f.path))
        elif any(p.kind == ProblemKind.TRUNCATED for p in f.problems):
            out.append((f"`{f.name}` is truncated", f.path))
    return out


@rule(
    "CKD121",
    "accelerate-interrupted-save",
    Severity.WARNING,
    fix=Applicability.SAFE,
    severity_when=((Severity.ERROR, "it is the folder `load_state()` picks, or a folder scanned alone"),),
)
def accelerate_interrupted_save(tree: Tree) -> Iterator[Hit]:
    """An `Accelerator.save_state()` folder that was cut short: a file `load_state()` opens is missing or damaged.

    ## What it does
    Judges accelerate's folders (`ckptdoctor.stacks`: they hold `random_states_<rank>.pkl`, or only what `save_state`
    writes before it) by what `Accelerator.load_state()` opens in them: each model's `model{_i}.safetensors` (or
    `pytorch_model{_i}.bin`), `optimizer{_i}.bin`, `scheduler{_i}.bin`, `sampler{_i}.bin` and `scaler.pt` as the
    run's complete saves hold them, and `random_states_<rank>.pkl` (written after all of those, so a folder without
    it is a save that stopped). Empty and truncated files count too. It is an error in the folder `load_state()`
    picks (the highest `checkpoint_<i>` under automatic naming; the highest `checkpoint-N`, which the diffusers
    scripts' `--resume_from_checkpoint latest` passes to it) or a folder scanned alone, a warning elsewhere.

    ## Why is this bad?
    `load_state()` checks nothing before loading: a missing optimizer or scheduler file raises `FileNotFoundError`
    halfway through the restore (the model is already overwritten), a truncated one raises in `torch.load`, and a
    missing RNG state is only logged at info level: the run goes on with neither the RNG states nor
    `Accelerator.step` restored.

    ## Example
    The job was preempted while `save_state()` wrote `checkpoints/checkpoint_3/`: `model.safetensors` is there,
    `optimizer.bin` is cut short, `scheduler.bin` and `random_states_0.pkl` are not.

    ## Fix safety
    Safe: the folder is quarantined (moved into `.ckptdoctor/quarantine/`, restorable with `ckptdoctor undo`), so
    `load_state()` picks the last complete save. No fix when the scan root is the `checkpoints/` folder itself (the
    quarantine would be a stray entry there: CKD120) or the folder alone.

    ## References
    `src/accelerate/checkpointing.py` `save_accelerator_state` (write order), `load_accelerator_state` (what is
    loaded, the `try` around the RNG states); `src/accelerate/accelerator.py` `Accelerator.load_state`.
    """
    unread = unread_paths(tree)
    for run in tree.runs:
        folders = [ck for ck in run.checkpoints if ck.stack is Stack.ACCELERATE]
        if not folders:
            continue
        want = accelerate.expected(folders)
        pick = accelerate.picked(run)
        for ck in folders:
            evidence = accelerate_torn(ck, want, unread)
            if not evidence:
                continue
            is_pick = pick is not None and pick.path == ck.path
            sev = Severity.ERROR if is_pick or run.standalone else Severity.WARNING
            lead = ("`load_state()` picks this interrupted save: " if is_pick and accelerate.is_automatic(run)
                    else "`load_state()` of the highest `checkpoint-N` (the diffusers scripts' "
                    "`--resume_from_checkpoint latest`) loads this interrupted save: "
                    if is_pick and not run.standalone else "")
            plan = None if run.standalone or (run.path in ("", ".") and accelerate.is_automatic(run)) else FixPlan(
                f"Quarantine `{ck.path}`", Applicability.SAFE, (FixOp(OpKind.QUARANTINE, ck.path),))
            at_fault = next((path for _, path in evidence if path is not None), None)
            yield Hit(ck.path, lead + "; ".join(text for text, _ in evidence), sev, plan, file=at_fault)
