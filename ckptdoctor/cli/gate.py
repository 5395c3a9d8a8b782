"""The ``ckptdoctor gate`` command: parse the options, run the gate, print the result, exit 0, 1 or 2."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from ckptdoctor import schedules
from ckptdoctor.cli.options import (
    ScanRoot,
    UsageProblem,
    allow_empty_option,
    cache_option,
    note_kept,
    note_security,
    output_options,
    read_only_done,
    rule_options,
    show_settings_option,
    text_width,
)
from ckptdoctor.cli.output import emit, print_settings
from ckptdoctor.model import FileFacts
from ckptdoctor.render.gate import gate_json, render_text, summary
from ckptdoctor.resume_gate.api import gate_options, run_gate
from ckptdoctor.resume_gate.args_file import read_training_args
from ckptdoctor.resume_gate.plan import (
    DEFAULT_LR_STEPS,
    MAX_LR_STEPS,
    GateInputError,
    parse_kwargs,
    plan_from_training_args,
)
from ckptdoctor.sources import is_remote

_EPILOG = """\b
Examples:
  ckptdoctor gate runs/my-run                          # resume with the run's own arguments
  ckptdoctor gate runs/my-run --num-train-epochs 5     # what will 2 more epochs do?
  ckptdoctor gate fixtures/lr-finished --max-steps 16  # resume a finished run: LR 0, then a new schedule
  ckptdoctor gate runs/my-run --checkpoint checkpoint-800 --learning-rate 1e-4 --format json
  ckptdoctor gate runs/my-run --training-args job/training_args.bin --world-size 8 --format github  # in CI
  ckptdoctor gate runs/my-run --per-device-train-batch-size 16    # a new batch size: new steps per epoch
  ckptdoctor gate s3://bucket/runs/my-run                         # a run in object storage, as `scan` reads it
  ckptdoctor gate runs/my-run --transformers-version 4.57         # the job resumes with transformers 4.57
  ckptdoctor gate runs/my-run --ignore CKD411 --fail-on warning   # rules chosen as for `ckptdoctor scan`
  ckptdoctor gate runs/my-run --format json -o gate.json -s       # the document to a file, only the exit code

Options left out are the run's own: read from the checkpoint's training_args.bin and trainer_state.json (or
--training-args), else transformers' defaults; --format json lists each value used and where it came from.

Settings: RUN_DIR's .ckptdoctor.toml or [tool.ckptdoctor] in its pyproject.toml applies as it does for
`ckptdoctor scan RUN_DIR`: its ignore and severity to the scan findings and to the gate rules, its select to the
scan findings only (the gate rules CKD407-415 and CKD504 run unless ignored), its fail-on when --fail-on is not
given. It cannot turn off or lower the security rules (CKD6xx), nor let their errors pass
with fail-on = "never"; --ignore and --fail-on here can. --no-config ignores it.

Exit codes: 0 pass, 1 a finding at or above --fail-on (a RUN_DIR with no checkpoint is CKD413, unless
--allow-empty), 2 usage error (a RUN_DIR that is missing, unreadable or not a folder, conflicting options, a number
that is not finite, an unreadable --training-args, no such --checkpoint, an unknown rule code, a bad settings file)
or a checkpoint whose global_step is beyond any float (nothing can be predicted from it).
"""


@click.command("gate", epilog=_EPILOG, short_help="Predict what a resume will load, train and at which LRs.")
@click.argument("run_dir", type=ScanRoot(file_okay=False))
@click.option("--checkpoint", metavar="PATH", help="Resume from this checkpoint (a path, or a folder in RUN_DIR), as "
              "resume_from_checkpoint=PATH does.  [default: the highest-numbered checkpoint-N in RUN_DIR, as "
              "resume_from_checkpoint=True picks]")
@click.option("--num-train-epochs", type=float, help="Planned num_train_epochs: an epoch-based run (not with "
              "--max-steps).  [default: the run's own]")
@click.option("--max-steps", type=click.IntRange(min=1), help="Planned max_steps: a step-based run, which ignores "
              "epochs (not with --num-train-epochs).  [default: the run's own]")
@click.option("--learning-rate", type=float, help="Planned learning_rate. A restored scheduler keeps the "
              "checkpoint's base LR, so a different value is ignored (CKD409).  [default: the run's own]")
@click.option("--lr-scheduler-type", type=click.Choice([*schedules.SUPPORTED, *schedules.METRIC_DRIVEN]),
              metavar="NAME", help="Planned lr_scheduler_type: "
              f"{', '.join(schedules.SUPPORTED)}, or the metric-driven {' or '.join(schedules.METRIC_DRIVEN)} "
              "(reported as unpredictable).  [default: the run's own]")
@click.option("--lr-scheduler-kwargs", metavar="JSON", help='Planned lr_scheduler_kwargs, a JSON object, e.g. '
              '\'{"num_cycles": 2}\'.  [default: the run\'s own]')
@click.option("--warmup-steps", type=click.FloatRange(min=0), help="Planned warmup_steps; below 1 it is a ratio of "
              "max_steps, as in transformers 5.x (4.x takes an integer only: a fraction is CKD413 there; not with "
              "--warmup-ratio).  [default: the run's own]")
@click.option("--warmup-ratio", type=click.FloatRange(min=0, max=1, max_open=True), help="Planned warm-up as a "
              "ratio of max_steps (4.x's warmup_ratio; not with --warmup-steps).  [default: the run's own]")
@click.option("--steps-per-epoch", type=click.IntRange(min=1),
              help="Optimizer steps per epoch of the resumed run; give it when the dataset changes, or when a new "
              "batch size cannot be sized (CKD414).  [default: the checkpoint's, from trainer_state.json, or "
              "derived from it for a planned batch size, gradient accumulation or world size]")
@click.option("--per-device-train-batch-size", type=click.IntRange(min=1), help="Planned "
              "per_device_train_batch_size. A new batch size changes the steps per epoch: they are derived from "
              "the run's recorded train_batch_size, or reported unknown (CKD414).  [default: the run's own]")
@click.option("--gradient-accumulation-steps", type=click.IntRange(min=1), help="Planned "
              "gradient_accumulation_steps; changes the steps per epoch as a new batch size does.  "
              "[default: the run's own]")
@click.option("--world-size", type=click.IntRange(min=1), help="Processes the resume will run on: compared with "
              "the ranks that saved the checkpoint (CKD504), and a change of it changes the steps per epoch.  "
              "[default: the run's own, not checked]")
@click.option("--load-step", type=click.IntRange(min=-1), help="torchtitan: the planned --checkpoint.load_step "
              "(-1: the latest step-N holding .metadata, as CheckpointManager.load() takes it); with --max-steps as "
              "training.steps and --world-size as the data-parallel degree.  [default: -1]")
@click.option("--transformers-version", metavar="X.Y", help="The transformers version the resume will run "
              "under: the gate follows its resume path (4.x differs from 5.x in the weights file it loads, the batch "
              "size it resumes at, and some schedules).  [default: the installed transformers, else the "
              "checkpoint's transformers_version, else 5.x]")
@click.option("--numpy-version", metavar="X.Y", help="The numpy version the resume will run under: numpy 1 and 2 "
              "name their array rebuild differently, and the RNG state's weights-only load admits only the resuming "
              "one's (CKD418).  [default: the installed numpy, else 2]")
@click.option("--save-total-limit", type=click.IntRange(min=0), help="The resuming save_total_limit: the rotation "
              "after the resume's first save is played with it (CKD417; 0 keeps every checkpoint).  [default: the "
              "run's own]")
@click.option("--save-safetensors/--no-save-safetensors", default=None, help="The resuming save_safetensors "
              "(transformers 4.x only: with --no-save-safetensors it loads pytorch_model.bin, never "
              "model.safetensors).  [default: the run's own, else True]")
@click.option("--auto-find-batch-size/--no-auto-find-batch-size", default=None, help="The resuming "
              "auto_find_batch_size (with it transformers 5.x, like 4.x always, resumes at the checkpoint's "
              "train_batch_size, not a planned --per-device-train-batch-size).  [default: the run's own, else False]")
@click.option("--training-args", "training_args_file", type=click.Path(exists=True, dir_okay=False),
              metavar="FILE", help="The planned TrainingArguments: a training_args.bin (read statically, never "
              "loaded; its pickle is judged as `scan` judges it: a security finding fails the gate), a JSON file "
              "(args.to_json_string()), or YAML when PyYAML is installed; the options above "
              "override it.  [default: none: the run's own arguments]")
@click.option("--stack", type=click.Choice(["trainer", "accelerate", "lightning", "torchtitan"]), default=None,
              help="Whose resume to predict: trainer (Trainer.train(resume_from_checkpoint)), accelerate "
              "(Accelerator.load_state(): the save it picks, what it restores, where it raises; --max-steps is the "
              "planned end), lightning (Trainer.fit(ckpt_path=...)), torchtitan (CheckpointManager.load(): the "
              "step-N it loads, --max-steps as training.steps).  [default: the stack that wrote RUN_DIR, "
              "recognised from its files]")
@click.option("--ckpt-path", metavar="last|best|none|PATH", help="Lightning: the planned Trainer.fit(ckpt_path=...).  "
              "[default: last]")
@click.option("--max-epochs", type=click.IntRange(min=-1), help="Lightning: the planned Trainer(max_epochs=...).  "
              "[default: Lightning's: 1000, or unlimited with --max-steps]")
@click.option("--logger-version", type=click.IntRange(min=0), help="Lightning: the version_N the resuming Trainer's "
              "logger takes (or its ModelCheckpoint's dirpath names), for a run in lightning_logs/version_N/.  "
              "[default: the default logger's, the next version]")
@click.option("--lr-steps", type=click.IntRange(min=0, max=MAX_LR_STEPS), default=DEFAULT_LR_STEPS, show_default=True,
              help="How many resumed optimizer steps' LRs to predict (fewer when the resume trains fewer steps).")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "sarif", "github"]), default="text",
              show_default=True, help="text: the prediction, findings and verdict for people; json: one "
              "ckptdoctor.gate/1 document for scripts; sarif: SARIF 2.1.0 for code scanning; github: workflow "
              "annotation lines.")
@output_options("Print the findings only: no prediction, no verdict line (text; other formats are unchanged).")
@rule_options(never_runs="Narrows the scan findings the gate keeps; the gate rules (CKD407-415, CKD504) run "
              "unless ignored. Selecting only --deep rules is a usage error (the gate never reads tensor data).",
              every_rule="every rule the gate runs")
@cache_option
@show_settings_option
@allow_empty_option("with no checkpoint in RUN_DIR the gate passes (the run starts afresh)",
                    "CKD413 (train() raises: no valid checkpoint)")
def gate_command(
    run_dir: str,
    checkpoint: str | None,
    num_train_epochs: float | None,
    max_steps: int | None,
    learning_rate: float | None,
    lr_scheduler_type: str | None,
    lr_scheduler_kwargs: str | None,
    warmup_steps: float | None,
    warmup_ratio: float | None,
    steps_per_epoch: int | None,
    per_device_train_batch_size: int | None,
    gradient_accumulation_steps: int | None,
    world_size: int | None,
    load_step: int | None,
    transformers_version: str | None,
    numpy_version: str | None,
    save_total_limit: int | None,
    save_safetensors: bool | None,
    auto_find_batch_size: bool | None,
    training_args_file: str | None,
    stack: str | None,
    lr_steps: int,
    fmt: str,
    output_file: str | None,
    quiet: bool,
    silent: bool,
    fail_on: str | None,
    select: tuple[str, ...],
    ignore: tuple[str, ...],
    no_config: bool,
    allow_global: tuple[str, ...],
    cache: bool | None,
    show_settings: bool,
    allow_empty: bool,
    ckpt_path: str | None = None,
    max_epochs: int | None = None,
    logger_version: int | None = None,
) -> None:
    """Predict what trainer.train(resume_from_checkpoint=...) will do for RUN_DIR, and fail when it is wrong.

    It names the checkpoint the resume loads and through which loader, how many steps it trains and at which
    learning rates, following the resume path of the transformers version it will run under (5.x or 4.x), then
    judges the plan: the gate rules (CKD407-421, CKD423, CKD504) plus every scan finding about that checkpoint,
    under the closest settings file from RUN_DIR upward, as `ckptdoctor scan` reads it. RUN_DIR is the output_dir, or
    a checkpoint folder. Arguments you do not plan are the run's own (read from the checkpoint's training_args.bin
    and trainer_state.json). Nothing is loaded or executed.

    A PyTorch Lightning run (recognised from its .ckpt files, or --stack lightning) is gated as
    Trainer.fit(ckpt_path=...) instead: --ckpt-path, --max-epochs, --max-steps and --logger-version plan it, and
    CKD440-446 judge it (docs/stacks.md).
    """
    try:
        options = gate_options(
            select=select, ignore=ignore, fail_on=fail_on, no_config=no_config, allow_global=allow_global,
            allow_empty=allow_empty, on_kept=note_kept,
        )
    except GateInputError as exc:
        raise UsageProblem(str(exc)) from None
    if show_settings:  # the gate judges the run under RUN_DIR's closest settings file
        print_settings([run_dir], fmt, options, nested=False, output_file=output_file, silent=silent)
    if num_train_epochs is not None and max_steps is not None:
        raise UsageProblem("give --num-train-epochs or --max-steps, not both")
    if warmup_steps is not None and warmup_ratio is not None:
        raise UsageProblem("give --warmup-steps or --warmup-ratio, not both")
    kwargs = None
    if lr_scheduler_kwargs is not None:
        kwargs = parse_kwargs(lr_scheduler_kwargs)
        if kwargs is None and lr_scheduler_kwargs.strip():
            raise UsageProblem("--lr-scheduler-kwargs must be a JSON object")
    file_args: dict[str, Any] | None = None
    args_facts: FileFacts | None = None  # a training_args.bin the launcher will torch.load: judged as scan does
    if training_args_file is not None:
        try:
            args_file = read_training_args(training_args_file)
            file_args, args_facts = args_file.args, args_file.facts
            plan_from_training_args(file_args, strict=True)
        except GateInputError as exc:
            message = str(exc).removeprefix(f"{training_args_file}: ")
            raise UsageProblem(f"--training-args {training_args_file}: {message}") from None
    remote = is_remote(run_dir)
    if remote:  # click checked a local RUN_DIR; a URL's prefix is listed once, as `scan` lists its roots
        from ckptdoctor.cli.scan import check_remote_roots
        from ckptdoctor.roots import Roots

        check_remote_roots(Roots.of(run_dir), deep=False)
    if checkpoint is not None and not remote and not is_remote(checkpoint) and not (
        os.path.isdir(checkpoint) or os.path.isdir(os.path.join(run_dir, checkpoint))
    ):
        raise UsageProblem(f"--checkpoint {checkpoint}: no such folder (nor in {run_dir})")
    try:
        planned = {
            "num_train_epochs": num_train_epochs, "max_steps": max_steps, "learning_rate": learning_rate,
            "lr_scheduler_type": lr_scheduler_type, "lr_scheduler_kwargs": kwargs,
            "warmup_steps": warmup_steps, "warmup_ratio": warmup_ratio,
            "auto_find_batch_size": auto_find_batch_size,
            "steps_per_epoch": steps_per_epoch, "world_size": world_size,
            "per_device_train_batch_size": per_device_train_batch_size,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "transformers_version": transformers_version, "save_safetensors": save_safetensors,
            "load_step": load_step,
            "numpy_version": numpy_version, "save_total_limit": save_total_limit,
        }
        lightning = {"ckpt_path": ckpt_path, "max_epochs": max_epochs, "logger_version": logger_version}
        if stack not in (None, "lightning") and any(v is not None for v in lightning.values()):
            raise UsageProblem("--ckpt-path, --max-epochs and --logger-version plan a Lightning resume, not "
                               f"--stack {stack}'s")
        planned.update({k: v for k, v in lightning.items() if v is not None})  # only a Lightning gate reads them
        # run_gate, not gate: a settings file's note on security rules is the CLI's stderr line, not a Python warning
        result = run_gate(run_dir, checkpoint, True, file_args, lr_steps, options, planned, args_file=args_facts,
                          stack=stack, cache=cache)
    except GateInputError as exc:
        raise UsageProblem(str(exc)) from None
    if fmt == "json":
        text = json.dumps(gate_json(result), indent=2, allow_nan=False)
    elif fmt in ("sarif", "github"):
        from ckptdoctor.render import sarif

        if fmt == "sarif":
            text = sarif.render_sarif(result.findings)
        else:
            text = sarif.render_github(result.findings, notice=summary(result))
    else:
        text = render_text(result, width=text_width(output_file, sys.stdout), quiet=quiet)
    emit(text, output_file, silent)
    # scan's exit code and its note on stderr when a settings file's fail-on = "never" meets a security error
    code = result.exit_status(on_security_kept=note_security)
    read_only_done()  # the gate wrote nothing: the process may end without tearing the scan down
    sys.exit(code)
