"""Distributed-checkpoint rules: FSDP (torch.distributed.checkpoint) shards and DeepSpeed partitions."""

from __future__ import annotations

import re
from collections.abc import Iterator

from ckptdoctor.findings import Applicability, FixOp, FixPlan, OpKind, Severity
from ckptdoctor.model import Checkpoint, DcpMetadataFacts, DeepSpeedTag, FolderRole, TextFacts, TorchFacts, Tree
from ckptdoctor.rules import Hit, rule


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
            missing = sorted(set(range(world)) - set(ranks))
            if missing:
                yield Hit(
                    f"{ck.path}/{tag}" if ck.path not in ("", ".") else tag,
                    f"{len(ranks)} of {world} ZeRO optimizer partitions present; missing rank(s) "
                    + ", ".join(map(str, missing)),
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
