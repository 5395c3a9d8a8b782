"""Adapter rules: an adapter's weights against its `adapter_config.json`, and (``--deep``) whether it trained."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from ckptdoctor import trainer_view
from ckptdoctor.facts import is_lora_b
from ckptdoctor.findings import Severity
from ckptdoctor.model import Checkpoint, FolderRole, JsonFacts, TensorInfo, Tree
from ckptdoctor.patterns import lazy
from ckptdoctor.rules import Hit, rule

_LORA_RE = lazy(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


def _adapter_dirs(ck: Checkpoint) -> list[str]:
    """Relative folders (``""`` for the checkpoint itself) that hold adapter weights."""
    out = [""] if (ck.file(trainer_view.ADAPTER_SAFE) or ck.file(trainer_view.ADAPTER_BIN)) else []
    return out + list(trainer_view.adapter_subdirs(ck))


def _join(d: str, name: str) -> str:
    return f"{d}/{name}" if d else name


def _adapter_config(ck: Checkpoint, d: str) -> tuple[str, Any, str | None]:
    rel = _join(d, trainer_view.ADAPTER_CONFIG)
    f = ck.file(rel)
    if f is None:
        weights = ck.file(_join(d, trainer_view.ADAPTER_SAFE)) or ck.file(_join(d, trainer_view.ADAPTER_BIN))
        what = f"`{weights.path}`" if weights is not None else "adapter weights"
        return rel, None, f"{what} has no `{trainer_view.ADAPTER_CONFIG}` beside it"
    if not isinstance(f.content, JsonFacts):
        reason = f.problems[0].message if f.problems else "unreadable"
        return rel, None, f"`{rel}` cannot be read: {reason}"
    return rel, f.content.value, None


def validate_adapter_config(cfg: Any) -> list[str]:
    """What PEFT would reject in an adapter config (PEFT only requires `peft_type`; LoRA needs a valid r)."""
    if not isinstance(cfg, dict):
        return ["is not a JSON object"]
    problems = []
    if not isinstance(cfg.get("peft_type"), str):
        problems.append("has no `peft_type`")
    if cfg.get("peft_type") == "LORA":
        r = cfg.get("r")
        if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
            problems.append(f"`r` must be a positive integer, not {r!r}")
        tm = cfg.get("target_modules")
        if tm is not None and not isinstance(tm, (str, list)):
            problems.append("`target_modules` must be a list or a regex string")
    return problems


@rule("CKD301", "adapter-config-invalid", Severity.ERROR)
def adapter_config_invalid(tree: Tree) -> Iterator[Hit]:
    """Adapter weights without a readable, valid `adapter_config.json`.

    ## What it does
    Checks each folder holding `adapter_model.*` for an `adapter_config.json` that parses and that PEFT accepts
    (`peft_type`; for LoRA a positive `r`).

    ## Why is this bad?
    A resume into an existing PeftModel does not read the config and goes on, but `PeftModel.from_pretrained` of
    the checkpoint fails: the adapter cannot be deployed, evaluated or merged.

    ## Example
    A copy script that transferred `*.safetensors` only.

    ## Fix safety
    No automatic fix: copy the config from the run that trained the adapter.

    ## References
    `src/peft/config.py` (`PeftConfig.from_pretrained`, `MIN_EXPECTED_CONFIG_KEYS`).
    """
    for run in tree.runs:
        for ck in run.checkpoints:
            for d in _adapter_dirs(ck):
                rel, cfg, problem = _adapter_config(ck, d)
                path = f"{ck.path}/{rel}" if ck.path not in ("", ".") else rel
                if problem is not None:
                    # A missing config is reported at the folder that lacks it, an unreadable one at the file.
                    missing = ck.file(rel) is None
                    folder = (_join(ck.path, d) if d else ck.path) if ck.path not in ("", ".") else (d or ".")
                    yield Hit(folder if missing else path, problem)
                    continue
                bad = validate_adapter_config(cfg)
                if bad:
                    yield Hit(path, f"`{rel}` " + "; ".join(bad))


def _targets_match(target_modules: Any, module: str) -> bool:
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, module) is not None
    if isinstance(target_modules, list):
        last = module.rsplit(".", 1)[-1]
        return any(module == t or module.endswith("." + t) or last == t for t in target_modules if isinstance(t, str))
    return True


def adapter_mismatches(cfg: dict[str, Any], tensors: tuple[TensorInfo, ...]) -> list[str]:
    """Disagreements between a LoRA config and the tensors: rank, and modules outside `target_modules`."""
    out: list[str] = []
    r = cfg.get("r")
    rank_pattern = cfg.get("rank_pattern") or {}
    tm = cfg.get("target_modules")
    bad_modules: list[str] = []
    bad_ranks: list[tuple[str, int]] = []
    lora = 0
    for t in tensors:
        m = _LORA_RE.match(t.name)
        if m is None or len(t.shape) != 2:
            continue
        lora += 1
        module, ab = m.group("module"), m.group("ab")
        rank = t.shape[0] if ab == "A" else t.shape[1]
        if isinstance(r, int) and not rank_pattern and rank != r:
            bad_ranks.append((t.name, rank))
        if tm is not None and not _targets_match(tm, module) and module not in bad_modules:
            bad_modules.append(module)
    if bad_ranks:
        ranks = sorted({rank for _, rank in bad_ranks})
        out.append(
            f"r is {r} but {len(bad_ranks)} of {lora} LoRA matrices have rank {'/'.join(map(str, ranks))} "
            f"(e.g. `{bad_ranks[0][0]}`)"
        )
    if bad_modules:
        out.append(f"{len(bad_modules)} adapted module(s) are not in target_modules {tm!r} (e.g. `{bad_modules[0]}`)")
    return out


@rule("CKD302", "adapter-config-mismatch", Severity.ERROR)
def adapter_config_mismatch(tree: Tree) -> Iterator[Hit]:
    """The adapter config's `r` or `target_modules` disagree with the adapter tensors.

    ## What it does
    Compares LoRA `r` with the rank of every `lora_A`/`lora_B` matrix, and the adapted module names with
    `target_modules`.

    ## Why is this bad?
    `PeftModel.from_pretrained` builds the adapter from the config and then loads the tensors: a rank mismatch
    fails with a size error; modules outside `target_modules` are silently dropped.

    ## Example
    `adapter_config.json` from a run with `r=8` copied next to weights trained with `r=16`.

    ## Fix safety
    No automatic fix: restore the config that belongs to these weights.

    ## References
    `src/peft/tuners/lora/model.py`; `src/peft/utils/save_and_load.py` `set_peft_model_state_dict`.
    """
    for run in tree.runs:
        for ck in run.checkpoints:
            if ck.role not in (FolderRole.CHECKPOINT, FolderRole.MODEL):
                continue
            for d in _adapter_dirs(ck):
                _, cfg, problem = _adapter_config(ck, d)
                if problem is not None or not isinstance(cfg, dict) or validate_adapter_config(cfg):
                    continue
                f = ck.file(_join(d, trainer_view.ADAPTER_SAFE)) or ck.file(_join(d, trainer_view.ADAPTER_BIN))
                tensors = trainer_view.tensors_of(f)
                if f is None or not tensors or cfg.get("peft_type") != "LORA":
                    continue
                problems = adapter_mismatches(cfg, tensors)
                if problems:
                    yield Hit(f.path, "; ".join(problems[:3]))


# --deep: what ``ckptdoctor.deep`` measured in the adapter weights.
@rule("CKD303", "untrained-adapter", Severity.WARNING, deep_only=True)
def untrained_adapter(tree: Tree) -> Iterator[Hit]:
    """Every LoRA B matrix of an adapter is still zero although training ran.

    ## What it does
    With `--deep`, looks at the adapter weights (`adapter_model.safetensors` / `adapter_model.bin`, and those of
    extra adapters in subfolders) of each checkpoint whose `global_step` is above 0, and reports the adapter when
    every `lora_B` matrix is all zeros.

    ## Why is this bad?
    PEFT initializes `lora_B` to zeros so that a fresh adapter changes nothing; the first optimizer step moves
    it. After training steps, all-zero B matrices mean the adapter never learned: its parameters were frozen or
    not handed to the optimizer, the learning rate was 0, or the adapter saved is not the one that trained. The
    checkpoint loads and evaluates exactly like the base model, and resuming from it trains from scratch.

    ## Example
    A script that called `get_peft_model` after building the optimizer: 500 steps later,
    `checkpoint-500/adapter_model.safetensors` holds the initial adapter.

    ## Fix safety
    No automatic fix: check that the adapter's parameters are trainable and in the optimizer, then retrain.

    ## References
    peft `src/peft/tuners/lora/layer.py` (`reset_lora_parameters`: `nn.init.zeros_(self.lora_B[...])`).
    """
    data = {d.path: d for d in tree.data}
    for run in tree.runs:
        for ck in run.checkpoints:
            step = _global_step(ck)
            if not step:
                continue
            for d in _adapter_dirs(ck):
                for fname in (trainer_view.ADAPTER_SAFE, trainer_view.ADAPTER_BIN):
                    f = ck.file(_join(d, fname))
                    measured = data.get(f.path) if f is not None else None
                    if measured is None:
                        continue
                    b = [t for t in measured.tensors if is_lora_b(t.name)]
                    if b and all(t.all_zero for t in b):
                        yield Hit(
                            measured.path,
                            f"all {len(b)} LoRA B matrices are zero after {step:,} training steps: "
                            "the adapter is still at its initialization",
                        )


def _global_step(ck: Checkpoint) -> int | None:
    state = trainer_view.trainer_state(ck)
    if state is not None and state.global_step is not None:
        return state.global_step
    return ck.step
