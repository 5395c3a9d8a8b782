"""The gate's Python API: ``gate(run_dir, ...)`` scans the run, predicts its resume and judges it: a ``GateResult``."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from ckptdoctor import schedules, trainer_view
from ckptdoctor.facts import holds_checkpoint
from ckptdoctor.findings import Finding, display_path, finding_json, within
from ckptdoctor.gaps import PRINTABLE_BITS
from ckptdoctor.model import FileFacts, PathProblem, ProblemKind, ReadProblem, Tree, frozen
from ckptdoctor.resume_gate import accelerate as accelerate_resume
from ckptdoctor.resume_gate import torchtitan as titan_gate
from ckptdoctor.resume_gate.args_file import read_training_args
from ckptdoctor.resume_gate.plan import (
    DEFAULT_LR_STEPS,
    MAX_LR_STEPS,
    PLAN_FIELDS,
    GateInputError,
    Plan,
    check_plan,
    plan_from_training_args,
)
from ckptdoctor.resume_gate.predict import predict, resume_checkpoint
from ckptdoctor.resume_gate.resolve import ResolvedArgs
from ckptdoctor.resume_gate.rules import ResumeContext, gate_findings
from ckptdoctor.rules import Selection, all_rules, get_rule, run_rules, security_codes
from ckptdoctor.settings.exit import ExitPolicy, Outcome
from ckptdoctor.settings.selection import Options, Scope, warn_kept

SCHEMA = "ckptdoctor.gate/1"
# The stacks `--stack` names (ckptdoctor.stacks): whose resume the gate predicts.
STACKS = ("trainer", "accelerate", "lightning", "torchtitan")


@frozen
class GateResult(Outcome):
    """The predicted resume and the findings about it. ``lr`` holds the LRs of the first optimizer steps."""

    run: str
    checkpoint: str | None
    weights_branch: str
    start_step: int | None  # None: no checkpoint, or its trainer_state.json cannot be read
    max_steps: int | None  # None (as steps_to_train, and the loop fields below): not predicted, train() raises
    steps_to_train: int | None
    lr: tuple[float, ...]
    findings: tuple[Finding, ...]
    settings: ResolvedArgs | None = None
    restores_optimizer: bool = False
    epochs_trained: int | None = None
    num_train_epochs: int | None = None
    warmup_steps: int | None = None
    base_lr: float | None = None
    fail_on: str = "error"
    fail_on_from_settings: bool = False  # fail_on is RUN_DIR's settings file's, not the caller's
    # (restored, total) adapter tensors when the resume loads a full-weights file beside an adapter (CKD201)
    adapter_tensors: tuple[int, int] | None = None
    weights_file: str | None = None  # the file the weights load reads (None: several, or not one file: FSDP...)
    starts_afresh: bool = False  # allow_empty and nothing saved: the launcher starts afresh, so no checkpoint passes
    stack: str = "trainer"  # whose resume was predicted (`--stack`, else the scanned run's: ckptdoctor.stacks)
    restores: tuple[str, ...] = ()  # another stack's resume: the files it loads, in order (the Trainer's: empty)
    ds_scheduler: str | None = None  # DeepSpeed's own scheduler drives the LRs (its config's "scheduler" type)

    def exit_policy(self) -> ExitPolicy:
        """``fail_on``, the caller's, or RUN_DIR's settings file's (``fail_on_from_settings``): as ``ckptdoctor
        scan``, a file that came with the checkpoint cannot wave its own malicious pickle through with "never"."""
        return ExitPolicy(settings_fail_on=self.fail_on) if self.fail_on_from_settings else ExitPolicy(self.fail_on)

    def judged_findings(self) -> Sequence[Finding]:
        return self.findings

    @property
    def failed(self) -> bool:
        """True when a finding reaches ``fail_on``, or, under a settings file's ``fail-on = "never"``, when a
        security rule (CKD6xx) reports an error (``exit_status``)."""
        return self.exit_status() != 0

    @property
    def verdict(self) -> str:
        """``"fail"`` or ``"pass"``."""
        return "fail" if self.failed else "pass"

    @property
    def exit_code(self) -> int:
        """The command line's exit code for this result: 1 when it failed, else 0 (``exit_status``)."""
        return self.exit_status()

    def to_json(self) -> dict[str, Any]:
        """The documented ``ckptdoctor.gate/1`` document (plus ``resolved``: the arguments the prediction used)."""
        s = self.settings
        resolved: dict[str, Any] | None = None
        if s is not None:
            resolved = {
                "num_train_epochs": s.num_train_epochs,
                "max_steps_argument": s.max_steps,
                "learning_rate": s.learning_rate,
                "lr_scheduler_type": s.lr_scheduler_type,
                "warmup_steps_argument": s.warmup_steps,
                "warmup_steps": self.warmup_steps,
                "lr_scheduler_kwargs": dict(s.lr_scheduler_kwargs),
                "steps_per_epoch": s.steps_per_epoch,
                "epochs_trained": self.epochs_trained,
                "loop_epochs": self.num_train_epochs,
                "restores_optimizer_and_scheduler": self.restores_optimizer,
                "adapter_tensors_restored": None if self.adapter_tensors is None else {
                    "restored": self.adapter_tensors[0], "total": self.adapter_tensors[1]},
                "base_lr": self.base_lr,
                "deepspeed_scheduler": self.ds_scheduler,
                "transformers_version": s.transformers_version,
                "save_safetensors": s.save_safetensors,
                "ignored_per_device_train_batch_size": s.ignored_batch_size,
                "sources": dict(s.sources),
            }
        doc: dict[str, Any] = _finite({
            "schema": SCHEMA,
            "run": self.run,
            "stack": self.stack,
            "restores": list(self.restores),
            "checkpoint": self.checkpoint,
            "starts_afresh": self.starts_afresh,
            "weights_branch": self.weights_branch,
            "weights_file": self.weights_file,
            "start_step": self.start_step,
            "max_steps": self.max_steps,
            "steps_to_train": self.steps_to_train,
            "lr": list(self.lr),
            "verdict": self.verdict,
            "findings": [finding_json(f) for f in self.findings],
            "resolved": resolved,
        })
        return doc


def _finite(value: Any, depth: int = 0) -> Any:
    """``value`` as strict JSON can carry it: a NaN or infinite float (read from a checkpoint, say) and an integer
    too long to print become None; anything else a pickle holds, or nesting deeper than ``_JSON_DEPTH``, its
    ``schedules.brief`` text."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, int):
        return value if value.bit_length() <= PRINTABLE_BITS else None
    if depth < _JSON_DEPTH and isinstance(value, dict):
        return {k if isinstance(k, str) else schedules.brief(k): _finite(v, depth + 1) for k, v in value.items()}
    if depth < _JSON_DEPTH and isinstance(value, (list, tuple)):
        return [_finite(v, depth + 1) for v in value]
    return schedules.brief(value)


_JSON_DEPTH = 32  # lr_scheduler_kwargs nest a level or two; json.dumps(indent=2) recurses in Python per level


# ---------------------------------------------------------------------------------------------------------------
# Judging the resume of a scanned tree


def _superseded(code: str) -> bool:
    """A scan rule whose message the gate's exact prediction replaces (``@rule(..., superseded_by_gate=True)``)."""
    r = get_rule(code)
    return r is not None and r.superseded_by_gate


def _sorted(findings: Sequence[Finding]) -> tuple[Finding, ...]:
    return tuple(sorted(findings, key=Finding.sort_key))


def judge(
    tree: Tree,
    plan: Plan,
    *,
    run: str | None = None,
    scanned: Sequence[Finding] = (),
    selection: Selection | None = None,
) -> GateResult:
    """Predict the resume of the run in ``tree`` (or of the checkpoint ``tree`` holds) under ``plan``, and judge it.

    ``scanned`` are the scan's findings for ``tree``; those about the checkpoint the resume loads are kept.
    ``selection`` (``--select``/``--ignore`` and a settings file's) decides which gate rules report, and at what
    severity; the scan findings were made under it already. Raises ``GateInputError`` as ``predict`` does.
    """
    run_label = run if run is not None else tree.root
    selection = selection or Selection()
    ck, pick = resume_checkpoint(tree)
    if ck is None and pick is not None and plan.checkpoint is None:
        # A `checkpoint-N` link out of the root: get_last_checkpoint picks it, the scan never reads it (CKD604,
        # an error there). The resume may well work; nothing here can say what it loads.
        unread = _sorted([f for f in scanned if within(f.path, pick)])
        return GateResult(run_label, display_path(tree.root, pick), "none", None, None, None, (), unread,
                          fail_on=plan.fail_on)  # fmt: skip
    if ck is None:
        found = gate_findings(ResumeContext(tree, plan), selection)
        return GateResult(run_label, None, "none", None, None, None, (), _sorted(found), fail_on=plan.fail_on)
    label = display_path(tree.root, ck.path)
    p = predict(ck, plan, label)
    # CKD201 is judged again for the file this resume reads (resume_gate.rules.adapter_rule)
    kept = [f for f in scanned if within(f.path, ck.path) and not _superseded(f.rule)]
    findings = _sorted(kept + gate_findings(ResumeContext(tree, plan, ck, p), selection))
    steps = p.steps
    adapter = None if p.adapter is None else (p.adapter.restored, p.adapter.total)
    if steps is None:  # train() raises before its first step
        return GateResult(run_label, label, p.branch, p.start, None, None, (), findings, p.settings,
                          fail_on=plan.fail_on, adapter_tensors=adapter, weights_file=p.weights_file)  # fmt: skip
    return GateResult(
        run_label, label, p.branch, p.start, steps.max_steps, steps.steps_to_train, p.lrs, findings, p.settings,
        p.restores, steps.epochs_trained, steps.num_train_epochs, p.warmup, p.base_lr, plan.fail_on,
        adapter_tensors=adapter, weights_file=p.weights_file, ds_scheduler=p.ds_scheduler,
    )


# ---------------------------------------------------------------------------------------------------------------
# Python entry point


def gate(
    run_dir: str | os.PathLike[str],
    *,
    checkpoint: str | os.PathLike[str] | None = None,
    checkpoint_in_run: bool = True,
    training_args: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    lr_steps: int = DEFAULT_LR_STEPS,
    fail_on: str | None = None,
    select: Sequence[str] = (),
    ignore: Sequence[str] = (),
    config: bool = True,
    allow_global: Sequence[str] = (),
    allow_empty: bool = False,
    stack: str | None = None,
    cache: bool | None = None,
    **planned: Any,
) -> GateResult:
    """Predict ``trainer.train(resume_from_checkpoint=checkpoint or True)`` for ``run_dir`` (the output_dir), or
    the resume of the stack that wrote it (``stack``, as ``--stack``: ``"accelerate"`` predicts
    ``Accelerator.load_state()``; None: the stack the scan recognises, see docs/stacks.md).

    ``planned`` takes the ``Plan`` fields (``num_train_epochs``, ``max_steps``, ``learning_rate``,
    ``lr_scheduler_type``, ``warmup_steps`` (below 1 a ratio under 5.x; under 4.x, whose TrainingArguments take
    an integer only, a fraction is CKD413), ``warmup_ratio`` (4.x's), ``lr_scheduler_kwargs``, ``steps_per_epoch``,
    ``world_size``,
    ``per_device_train_batch_size``, ``gradient_accumulation_steps`` (a change of these three derives the steps per
    epoch from the run's, or is CKD414 when it cannot), ``ignore_data_skip``, ``grad_scaler``: whether the resuming
    Trainer has a GradScaler, ``trainer.accelerator.scaler is not None``, None unknown; False with a ``scaler.pt``
    in the checkpoint is CKD413), ``save_safetensors`` (read by transformers 4.x only), ``auto_find_batch_size``
    (5.x then resumes at the checkpoint's ``train_batch_size``, as 4.x always does) and
    ``transformers_version``: the version the resume runs under ("4.57"), whose resume path the gate follows
    (default: the installed transformers, read from its metadata, else the checkpoint's ``transformers_version``,
    else 5.x); ``training_args`` is a ``TrainingArguments``-like mapping, or the path of a file holding one as
    ``--training-args`` reads it (a ``training_args.bin``, read statically and its pickle judged as ``scan`` judges
    it, a security finding such as CKD601 failing the gate; JSON; YAML with PyYAML), read first, which explicit
    keywords override (a value of the wrong type or not finite in either, or a file that cannot be read, raises
    ``GateInputError`` naming it). Anything not planned is the run's own. ``checkpoint`` may be a path, or
    (``checkpoint_in_run``, as ``gate --checkpoint``) a folder name inside ``run_dir``; with
    ``checkpoint_in_run=False`` it is a path only, taken from the working directory exactly as ``train()`` takes it
    (a folder that is not there is CKD413). Reads only; never imports torch.

    ``numpy_version`` is the numpy the resume runs under ("1.26"; default: the installed one), whose weights-only
    RNG load CKD418 judges, and ``save_total_limit`` the resuming one (default: the run's), with which CKD417 plays
    the rotation after the first save.

    Rules are chosen as ``ckptdoctor scan`` chooses them: ``select`` and ``ignore`` are rule codes or prefixes
    (``--select``/``--ignore``), combined with the closest settings file from ``run_dir`` upward
    (``.ckptdoctor.toml`` or ``[tool.ckptdoctor]`` in ``pyproject.toml``, as ``scan`` finds it; else the user
    configuration) unless ``config`` is False. The file's ignore and severity apply to the scan findings and to the
    gate's own rules (CKD407-415, CKD504); its select, like ``select``, narrows the scan findings only (the gate
    rules run unless ignored). It cannot turn off or lower the security rules
    (CKD6xx): when it tries, a ``UserWarning`` says which stay on (``ignore=`` can turn them off). ``fail_on``
    defaults to the file's ``fail-on``, else ``"error"``; a file's ``"never"`` still fails on a security error. An
    unknown code, a deep-only selection or a bad settings file raises ``GateInputError``. ``allow_global`` are
    ``scan``'s user allowances of pickle globals. ``allow_empty`` (``--allow-empty``): a ``run_dir`` that holds no
    checkpoint at all passes (a launcher gating before the first save, which starts afresh: ``starts_afresh`` is then
    True); without it, it fails
    (CKD413: ``train(resume_from_checkpoint=True)`` raises).

    ``stack`` ("trainer", "accelerate", "lightning", "torchtitan"; None: recognised from the run) names the program
    whose resume is predicted. A PyTorch Lightning run is gated as ``Trainer.fit(ckpt_path=...)``
    (``resume_gate.lightning``): ``planned`` then takes ``ckpt_path`` ("last", "best", "none" or a path),
    ``max_epochs``, ``max_steps``, ``logger_version`` and ``steps_per_epoch``. A torchtitan run is judged by
    ``CheckpointManager.load()`` (``ckptdoctor.resume_gate.torchtitan``, CKD514): ``load_step`` is its
    ``checkpoint.load_step`` (-1: the latest), ``max_steps`` its ``training.steps``, ``world_size`` the data-parallel
    degree. ``cache`` is ``scan``'s (None, True for ``--cache``, False for ``--no-cache``).
    """
    args_facts: FileFacts | None = None
    if isinstance(training_args, (str, os.PathLike)):  # a file, read as `--training-args` reads it
        path = os.fspath(training_args)
        if not os.path.isfile(path):
            raise GateInputError(f"training_args {path}: no such file")
        args_file = read_training_args(path)
        training_args, args_facts = args_file.args, args_file.facts
    options = gate_options(
        select=select, ignore=ignore, fail_on=fail_on, no_config=not config, allow_global=allow_global,
        allow_empty=allow_empty, on_kept=warn_kept,
    )
    return run_gate(run_dir, checkpoint, checkpoint_in_run, training_args, lr_steps, options, planned,
                    args_file=args_facts, stack=stack, cache=cache)


def gate_options(**given: Any) -> Options:
    """``Options.build(**given)`` for the gate: a usage error is a ``GateInputError``, and a selection of --deep
    rules only is one too (the gate never reads tensor data)."""
    from ckptdoctor.errors import UsageError

    try:
        options = Options.build(**given)
    except UsageError as exc:
        raise GateInputError(str(exc)) from None
    for code in options.select:
        matched = [r for r in all_rules() if r.code.startswith(code)]
        if matched and all(r.deep_only for r in matched):
            raise GateInputError(f"--select {code}: {code} reads tensor data: `ckptdoctor scan --deep` runs it, the "
                                 "gate never does")
    return options


def run_gate(
    run_dir: str | os.PathLike[str],
    checkpoint: str | os.PathLike[str] | None,
    checkpoint_in_run: bool,
    training_args: Mapping[str, Any] | None,
    lr_steps: int,
    options: Options,
    planned: Mapping[str, Any],
    args_file: FileFacts | None = None,
    stack: str | None = None,
    cache: bool | None = False,
) -> GateResult:
    """``gate`` of a request built at the door (``gate_options``): ``options.on_kept`` hears of security rules a
    settings file may not turn off (the CLI's note on stderr, the API's warning). ``stack`` (``--stack``) names the
    program whose resume is predicted; None: the one that wrote the run. ``cache`` True (``--cache``): the scan
    goes through the user's verdict cache.

    ``args_file`` is the ``--training-args`` file's facts when it holds pickle streams (``ArgsFile.facts``): the
    launcher ``torch.load``s it, so its security findings join the gate's.
    """
    if stack is not None and stack not in STACKS:
        raise GateInputError(f"stack must be one of {', '.join(STACKS)}, not {stack!r}")

    from ckptdoctor.resume_gate import lightning as lightning_gate

    if lightning_gate.handles(run_dir, stack, planned):  # `fit(ckpt_path=...)`, not `train(resume_from_checkpoint=...)`
        scope = _scope(os.fspath(run_dir), options)
        trusted = scope.config.trusted  # the user configuration's fail-on counts as the caller's (as in a scan)
        caller = options.fail_on or (scope.fail_on if trusted else None)
        selected = (scope.selection, None if trusted else scope.fail_on)
        return lightning_gate.run_gate(run_dir, checkpoint, planned, selected, caller, GateResult, cache)
    unknown = sorted(set(planned) - PLAN_FIELDS)
    if unknown:
        raise TypeError(f"gate() got unexpected planned arguments: {', '.join(unknown)}")
    if trainer_view.integer(lr_steps) is None or not 0 <= lr_steps <= MAX_LR_STEPS:
        raise GateInputError(f"lr_steps must be an integer between 0 and {MAX_LR_STEPS:,}, not {lr_steps!r}")
    values = plan_from_training_args(training_args, strict=True) if training_args else {}
    values.update({k: v for k, v in planned.items() if v is not None})
    for given, other in (("warmup_steps", "warmup_ratio"), ("warmup_ratio", "warmup_steps")):
        if planned.get(given) is not None and planned.get(other) is None:
            values.pop(other, None)  # an explicit warm-up replaces the file's, in either form
    check_plan(values)
    if planned.get("num_train_epochs") is not None and planned.get("max_steps") is None:
        values.pop("max_steps", None)  # epochs planned explicitly: an epoch-based run, whatever the file says
    from ckptdoctor.sources import is_remote

    target = os.fspath(run_dir)
    remote = is_remote(target)
    ck_arg: str | None = None
    if checkpoint is not None:
        ck_arg = os.fspath(checkpoint)
        if is_remote(ck_arg):
            target = ck_arg
        elif remote:  # a name inside a URL run (no cheap "is it a folder" there: a missing one scans empty)
            target = ck_arg if not checkpoint_in_run else f"{target.rstrip('/')}/{ck_arg.strip('/')}"
        else:
            inside = os.path.join(target, ck_arg)
            in_run = checkpoint_in_run and not os.path.isdir(ck_arg) and os.path.isdir(inside)
            target = inside if in_run else ck_arg
    scope = _scope(os.fspath(run_dir), options)
    selection, cfg_fail_on = scope.selection, scope.fail_on
    fail_on = options.fail_on
    plan = Plan(checkpoint=ck_arg, lr_steps=lr_steps, fail_on=fail_on or cfg_fail_on or "error", **values)
    scanned: Sequence[Finding] = ()
    if ck_arg is not None and not is_remote(target) and not os.path.isdir(target):
        # No folder there (or a file): train() finds no weights file in it and raises; nothing to scan.
        tree = Tree(target, (), path_problems=(PathProblem(".", ReadProblem(ProblemKind.UNREADABLE, "not a folder")),))
    else:
        from ckptdoctor.scanner import scan

        report = scan(target, selection=selection, cache=cache)
        tree, scanned = report.trees[0], report.findings
    if titan_gate.applies(tree, stack):  # torchtitan's `CheckpointManager.load()`, not the Trainer's resume
        v = titan_gate.judge(tree, plan, scanned, selection, options.allow_empty)
        ck_label = None if v.checkpoint is None else display_path(tree.root, v.checkpoint)
        result = GateResult(os.fspath(run_dir), ck_label, "dcp", v.start_step, v.max_steps, v.steps_to_train, (),
                            v.findings, fail_on=plan.fail_on, weights_file=v.loads, stack="torchtitan")  # fmt: skip
    elif accelerate_resume.chosen(stack, tree):  # accelerate's `load_state()`, not the Trainer's resume
        result = GateResult(**accelerate_resume.judge(tree, plan, run=os.fspath(run_dir), scanned=scanned,
                                                      selection=selection))
    else:
        result = judge(tree, plan, run=os.fspath(run_dir), scanned=scanned, selection=selection)
    if options.allow_empty and ck_arg is None and result.checkpoint is None and not holds_checkpoint(tree):
        # nothing saved yet: the launcher starts afresh, so "train() raises: no checkpoint" (CKD413) is accepted
        result = replace(
            result, findings=tuple(f for f in result.findings if f.rule not in ("CKD413", "CKD432")),
            starts_afresh=True
        )
    if args_file is not None:
        result = replace(result, findings=_sorted([*result.findings, *args_file_findings(args_file, selection)]))
    # The user configuration never travels with a checkpoint: its fail-on is trusted as --fail-on is (as a scan's).
    untrusted = not scope.config.trusted
    return replace(result, fail_on_from_settings=fail_on is None and cfg_fail_on is not None and untrusted)


def args_file_findings(facts: FileFacts, selection: Selection) -> list[Finding]:
    """The security findings (CKD6xx) a scan of the one file ``facts`` makes: its pickles judged under the
    selection's ``--allow-global`` allowances, reported at ``facts.path`` (the file as given)."""
    tree = Tree("", (), loose_files=(facts,))  # run_rules judges its pickles under the selection's allowances
    codes = security_codes()
    return [f for f in run_rules(tree, selection) if f.rule in codes]


def rule_selection(run_dir: str, options: Options) -> tuple[Selection, str | None]:
    """The rule selection of ``options`` plus the settings file at ``run_dir`` (unless ``options.no_config``), and
    that file's fail-on: ``ckptdoctor scan``'s own resolution (``settings.selection.resolve_selection``).

    Raises ``GateInputError`` for a settings file that cannot be used.
    """
    scope = _scope(run_dir, options)
    return scope.selection, scope.fail_on


def _scope(run_dir: str, options: Options) -> Scope:
    from ckptdoctor.errors import UsageError
    from ckptdoctor.settings.selection import resolve_scope

    try:
        return resolve_scope(run_dir, options)
    except UsageError as exc:
        raise GateInputError(str(exc)) from None
