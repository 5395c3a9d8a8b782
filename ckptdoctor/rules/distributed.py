"""Distributed-checkpoint rules: FSDP and torchtitan (torch.distributed.checkpoint) saves, DeepSpeed partitions."""

from __future__ import annotations

import re
from collections.abc import Iterator

from ckptdoctor.findings import Applicability, FixOp, FixPlan, OpKind, Severity
from ckptdoctor.gaps import count_text, listed, missing_below
from ckptdoctor.model import (
    Checkpoint,
    DcpMetadataFacts,
    DeepSpeedTag,
    FolderRole,
    Run,
    Stack,
    TextFacts,
    TorchFacts,
    Tree,
)
from ckptdoctor.rules import Hit, rule
from ckptdoctor.stacks import torchtitan as titan


def _checkpoints(tree: Tree) -> Iterator[Checkpoint]:
    for run in tree.runs:
        for ck in run.checkpoints:
            if ck.role in (FolderRole.CHECKPOINT, FolderRole.MODEL):
                yield ck


@rule("CKD501", "fsdp-shard-missing", Severity.ERROR)
def fsdp_shard_missing(tree: Tree) -> Iterator[Hit]:
    """A torch.distributed.checkpoint `.metadata` references a `.distcp` file that is absent or too short.

    ## What it does
    Walks each DCP `.metadata` statically and checks every storage reference (file, offset, length) against the
    files beside it.

    ## Why is this bad?
    Every rank reads its items at resume; a missing rank file or a short one fails the resume on all ranks (FSDP
    `load_fsdp_model` / `load_fsdp_optimizer`), after the job already got its allocation.

    ## Example
    `pytorch_model_fsdp_0/__1_0.distcp` lost when only rank 0's node-local disk was copied.

    ## Fix safety
    No automatic fix: the shard's data is gone.

    ## References
    `torch/distributed/checkpoint/filesystem.py` (`FileSystemReader.read_data`); accelerate `load_fsdp_model`.
    """
    for ck in _checkpoints(tree):
        for f in ck.files:
            if not isinstance(f.content, DcpMetadataFacts):
                continue
            folder = f.path.rsplit("/", 1)[0] if "/" in f.path else ""
            needed: dict[str, int] = {}
            refs: dict[str, int] = {}
            for s in f.content.storage:
                needed[s.relative_path] = max(needed.get(s.relative_path, 0), s.offset + s.length)
                refs[s.relative_path] = refs.get(s.relative_path, 0) + 1
            by_path = {x.path: x for x in ck.files}
            for rel, end in sorted(needed.items()):
                data_path = f"{folder}/{rel}" if folder else rel
                data = by_path.get(data_path)
                if data is None:
                    yield Hit(data_path, f"`{f.path}` references {refs[rel]:,} items in `{rel}`, which does not exist")
                elif data.size < end:
                    yield Hit(
                        data_path, f"`{rel}` has {data.size:,} bytes but `.metadata` references bytes up to {end:,}"
                    )


def _ds_world_size(ck: Checkpoint, tag: DeepSpeedTag) -> int | None:
    """The data-parallel world size a DeepSpeed model-states file records (``dp_world_size``)."""
    for name in tag.model_states:
        f = ck.file(f"{tag.name}/{name}")
        if f is not None and isinstance(f.content, TorchFacts):
            pf = f.content.pickle
            if pf is not None and isinstance(pf.value, dict):
                w = pf.value.get("dp_world_size")
                if isinstance(w, int) and not isinstance(w, bool):
                    return w
    return None


@rule("CKD502", "deepspeed-partition-missing", Severity.ERROR)
def deepspeed_partition_missing(tree: Tree) -> Iterator[Hit]:
    """A DeepSpeed checkpoint holds fewer ZeRO optimizer partitions than the world size that saved it.

    ## What it does
    Counts `*zero_pp_rank_R_mp_rank_*_optim_states.pt` files in each `global_stepN/` and compares them with the
    saved `dp_world_size` (from the model-states file) or with the highest rank present.

    ## Why is this bad?
    `engine.load_checkpoint` needs every partition: a missing one fails the resume on every rank.

    ## Example
    `global_step500/` with partitions 0, 1 and 3 of a 4-GPU run.

    ## Fix safety
    No automatic fix.

    ## References
    `deepspeed/runtime/engine.py` (`_get_all_zero_checkpoints`, `load_checkpoint`).
    """
    for ck in _checkpoints(tree):
        for ds in sorted(ck.deepspeed_tags, key=lambda t: t.name):
            tag, ranks = ds.name, ds.partitions
            world = _ds_world_size(ck, ds) or ((max(ranks) + 1) if ranks else None)
            if world is None:
                continue
            count, missing = missing_below(world, ranks)  # counted: `world` comes from a name or a pickle
            if count:
                yield Hit(
                    f"{ck.path}/{tag}" if ck.path not in ("", ".") else tag,
                    f"{len(ranks)} of {count_text(world, grouped=False)} ZeRO optimizer partitions present; "
                    "missing rank(s) " + listed(count, missing),
                )


@rule("CKD503", "deepspeed-latest-dangling", Severity.ERROR, fix=Applicability.SAFE)
def deepspeed_latest_dangling(tree: Tree) -> Iterator[Hit]:
    """DeepSpeed's `latest` file names a tag folder that does not exist.

    ## What it does
    Reads `latest` and checks that the tag folder it names is present: `global_stepN/` as the Trainer names it, or
    any folder holding DeepSpeed's state files (accelerate's `save_state` uses the tag `pytorch_model`).

    ## Why is this bad?
    DeepSpeed loads the tag `latest` names; when it is missing every rank fails with a bare `AssertionError` that
    names nothing.

    ## Example
    `latest` says `global_step1000` but only `global_step500/` was kept.

    ## Fix safety
    Safe: `latest` is rewritten to the newest complete tag folder present (the original kept in quarantine).

    ## References
    `deepspeed/runtime/engine.py` `load_checkpoint` (`latest` tag lookup), `save_checkpoint` (any tag name);
    `src/accelerate/accelerator.py` `Accelerator.save_state` (tag `pytorch_model`).
    """
    for ck in _checkpoints(tree):
        latest = ck.file("latest")
        if latest is None or not isinstance(latest.content, TextFacts):
            continue
        tag = latest.content.text.strip()
        tags = [t.name for t in ck.deepspeed_tags]
        if tag in tags:
            continue
        complete = [t.name for t in ck.deepspeed_tags if t.model_states]
        newest = max(complete, key=lambda t: int(re.sub(r"\D", "", t) or 0), default=None)
        plan = (
            FixPlan(
                f"Point `{latest.path}` at `{newest}`",
                Applicability.SAFE,
                (FixOp(OpKind.REWRITE_TEXT, latest.path, newest),),
            )
            if newest
            else None
        )
        yield Hit(
            latest.path,
            f"`latest` names `{tag}`, which does not exist"
            + (f" (present: {', '.join(sorted(tags))})" if tags else ""),
            fix=plan,
        )


# ---------------------------------------------------------------------------------------------------------------
# torchtitan's `CheckpointManager` (ckptdoctor.stacks.torchtitan): `checkpoint/step-N/` DCP saves


def _titan_runs(tree: Tree) -> Iterator[tuple[Run, Checkpoint | None]]:
    """Each torchtitan run with the step folder ``load(step=-1)`` loads (None: none, a fresh start)."""
    for run in tree.runs:
        if run.stack is Stack.TORCHTITAN:
            yield run, titan.load_pick(run)


def _name(ck: Checkpoint) -> str:
    return ck.path.rsplit("/", 1)[-1]


@rule(
    "CKD510",
    "dcp-step-without-metadata",
    Severity.WARNING,
    severity_when=((Severity.ERROR, "it is newer than the step `load()` picks: the resume silently falls back"),),
)
def dcp_step_without_metadata(tree: Tree) -> Iterator[Hit]:
    """A torchtitan `step-N` folder holds no `.metadata`: a save cut short, which the resume skips without a word.

    ## What it does
    Looks in every `step-N` folder of a torchtitan checkpoint folder for the `.metadata` file
    torch.distributed.checkpoint writes last (after every rank wrote its `__<rank>_<i>.distcp`). It is an error when
    the folder is newer than the step `CheckpointManager.load()` picks, a warning otherwise.

    ## Why is this bad?
    torchtitan's `_find_load_step` counts only `step-N` folders that hold `.metadata`, so after a save cut short
    (preemption, a full disk, a crash in `dcp.save`) `load()` silently resumes from the save before it: the steps
    between are trained again, and nothing in the log says the newest save was skipped. The folder itself can
    never be loaded: `dcp.load` needs the metadata to find any item.

    ## Example
    `checkpoint/step-1000/` holds `__0_0.distcp` and `__1_0.distcp` but no `.metadata`; the job restarts from
    `step-500`.

    ## Fix safety
    No automatic fix. Remove or move the folder when the older state is what you want to resume; otherwise the
    state of that step is lost.

    ## References
    torchtitan `torchtitan/components/checkpointer/dcp.py` (`CheckpointManager._find_load_step`, `_load`);
    `torch/distributed/checkpoint/state_dict_saver.py` (`save`: `finish_checkpoint` writes the metadata after the
    data), `torch/distributed/checkpoint/filesystem.py` (`FileSystemWriter.finish`).
    """
    for run, pick in _titan_runs(tree):
        for ck in run.checkpoints:
            if ck.step is None or titan.loadable(ck):
                continue
            held = sorted(ck.relname(f) for f in ck.files)
            what = (
                f"holds {', '.join(f'`{h}`' for h in held[:4])}{', ...' if len(held) > 4 else ''}"
                if held
                else ("is empty")
            )
            later = pick is None or (pick.step is not None and ck.step > pick.step)
            if pick is None:
                effect = "finds no other step: a fresh start, training from scratch"
            else:
                effect = f"resumes from `{_name(pick)}`" + (
                    f", {ck.step - (pick.step or 0):,} steps earlier" if later else ""
                )
            yield Hit(
                ck.path,
                f"no `.metadata` (torch.distributed.checkpoint writes it last); the folder {what}: torchtitan's "
                f"`_find_load_step` skips it and `load()` {effect}",
                Severity.ERROR if later else Severity.WARNING,
            )


@rule(
    "CKD511",
    "dcp-model-only-step",
    Severity.INFO,
)
def dcp_model_only_step(tree: Tree) -> Iterator[Hit]:
    """The torchtitan step `load()` picks holds the model alone (`last_save_model_only`): training cannot continue
    from it.

    ## What it does
    Reads the keys of the `.metadata` of the step `CheckpointManager.load()` picks and reports it when none of the
    states torchtitan restores beside the model (`optimizer`, `lr_scheduler`, `dataloader`, `train_state`) is
    there: the final save of a run with the default `checkpoint.last_save_model_only = true`. An info in a scan (a
    finished run is meant to end so); `ckptdoctor gate` fails on it, since continuing is what it checks.

    ## Why is this bad?
    `load()` loads every state but the model alone only for step 0, so continuing such a run (more
    `training.steps`, a new job on the same `checkpoint.folder`) fails in `dcp.load` on every rank:
    `RuntimeError: Missing key in checkpoint state_dict: optimizer...` (or `dataloader.dp_rank_0`,
    `lr_scheduler.last_epoch`, `train_state.step`).

    ## Example
    A 1000-step run with `interval = 500` ends with `step-1000/` holding only the model in float32; a job raised to
    1500 steps on the same folder crashes at start.

    ## Fix safety
    No automatic fix: resume from the previous full save with `--checkpoint.load_step` (the gate predicts it with
    `--load-step`), or save the last step in full with `--checkpoint.last_save_model_only false`.

    ## References
    torchtitan `torchtitan/components/checkpointer/dcp.py` (`CheckpointManager._save_last_step`, `_load`,
    `_states_to_load`), `torchtitan/components/checkpointer/base.py` (`last_save_model_only`);
    `torch/distributed/checkpoint/default_planner.py` (`create_default_local_load_plan`: "Missing key in checkpoint
    state_dict").
    """
    for _, pick in _titan_runs(tree):
        meta = titan.metadata(pick) if pick is not None else None
        if pick is None or meta is None or pick.step == 0:
            continue
        missing = titan.missing_states(meta)
        if len(missing) == len(titan.STATES):
            yield Hit(
                pick.path,
                f"`load()` picks this model-only save (`last_save_model_only`): continuing from it, `dcp.load` "
                f"raises `Missing key in checkpoint state_dict` for {', '.join(f'`{m}`' for m in missing)}",
            )


@rule(
    "CKD512",
    "dcp-train-state-step-mismatch",
    Severity.WARNING,
    severity_when=((Severity.ERROR, "it is the step `load()` picks"),),
)
def dcp_train_state_step_mismatch(tree: Tree) -> Iterator[Hit]:
    """A torchtitan save's `train_state.step` is not the step in its folder's name.

    ## What it does
    Reads the `train_state.step` item of each `step-N` save (a small pickle in a `.distcp` file, located by
    `.metadata`; walked, never loaded) and compares it with N. An error for the step `load()` picks.

    ## Why is this bad?
    `load()` chooses the folder by its name, but the training loop continues from the restored `train_state.step`:
    a folder renamed or copied into place resumes at another step than its name says, retrains or skips steps, and
    its next saves overwrite or interleave the run's other `step-N` folders.

    ## Example
    `step-800/` copied from another run's `step-600/`: the job resumes at step 600 and writes `step-700/`.

    ## Fix safety
    No automatic fix: find the folder the state belongs to.

    ## References
    torchtitan `torchtitan/trainer.py` (`Trainer.state_dict` / `load_state_dict`: `step`, `ntokens_seen`; `train`
    continues from `self.step`), `torchtitan/components/checkpointer/dcp.py` (`_find_load_step`).
    """
    for run, pick in _titan_runs(tree):
        for ck in run.checkpoints:
            meta = titan.metadata(ck)
            if meta is None or ck.step is None:
                continue
            saved = titan.int_value(titan.item_value(ck, meta, "train_state.step"))
            if saved is not None and saved != ck.step:
                picked = pick is not None and pick.path == ck.path
                yield Hit(
                    ck.path,
                    f"`train_state.step` is {saved:,} but the folder is `{_name(ck)}`"
                    + (f": `load()` picks it by its name and training continues from step {saved:,}" if picked else ""),
                    Severity.ERROR if picked else Severity.WARNING,
                )


@rule("CKD513", "dcp-dataloader-ranks-mismatch", Severity.WARNING)
def dcp_dataloader_ranks_mismatch(tree: Tree) -> Iterator[Hit]:
    """A torchtitan save holds dataloader state for other data-parallel ranks than the world size it records.

    ## What it does
    Compares the `dataloader.dp_rank_<r>` keys of each save's `.metadata` with its `dataloader.world_size` item:
    every rank from 0 to the world size less one should be there, and no other. `ckptdoctor gate --world-size`
    also compares them with the planned data-parallel degree.

    ## Why is this bad?
    On `load()`, a rank whose `dp_rank_<r>` state is absent logs "DataLoader state is empty for dp rank" and reads
    its data from the beginning again, so the resumed run sees some samples twice; a save from another data-parallel
    degree fails `ParallelAwareDataloader.load_state_dict`'s assertion ("dp_degree is inconsistent before and after
    checkpoint, dataloader resharding is not supported yet").

    ## Example
    A save whose `dataloader.world_size` is 4 holds `dp_rank_0` and `dp_rank_1` only.

    ## Fix safety
    No automatic fix.

    ## References
    torchtitan `torchtitan/components/dataloader.py` (`ParallelAwareDataloader.state_dict`, `load_state_dict`).
    """
    for run, _ in _titan_runs(tree):
        for ck in run.checkpoints:
            meta = titan.metadata(ck)
            if meta is None or "dataloader.world_size" not in meta.keys:
                continue
            world = titan.int_value(titan.item_value(ck, meta, "dataloader.world_size"))
            ranks = titan.dataloader_ranks(meta)
            if world is None or world < 1 or (len(ranks) == world and ranks == list(range(world))):
                continue
            count, missing = missing_below(world, ranks)  # counted: `world` comes from a pickle
            extra = sorted({r for r in ranks if not 0 <= r < world})
            said = [f"missing dp rank(s) {listed(count, missing)}"] if count else []
            said += [f"dp rank(s) {', '.join(map(str, extra))} beyond it"] if extra else []
            yield Hit(
                ck.path,
                f"`dataloader.world_size` is {count_text(world)} but the save holds {len(ranks):,} "
                f"`dataloader.dp_rank_<r>` states ({'; '.join(said)}): `load()` restarts the "
                "data of each missing rank from the beginning",
            )
