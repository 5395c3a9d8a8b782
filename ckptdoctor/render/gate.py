"""The gate's text output: the prediction as a short block for people, one finding a line, and a line for CI logs."""

from __future__ import annotations

from typing import Any

from ckptdoctor.findings import Finding, Severity
from ckptdoctor.resume_gate.api import GateResult
from ckptdoctor.resume_gate.rules import CRASH_RULES, format_lrs


def render_text(result: GateResult, *, width: int | None = None, quiet: bool = False) -> str:
    """The prediction as a short block for people, then the findings as `scan` prints them, then the verdict.

    ``width`` None (a pipe, a file) keeps each line whole; a terminal's width wraps every line to it, findings as
    `scan` shows them there. ``quiet`` prints the findings only (``-q``).
    """
    from ckptdoctor.facts import plural
    from ckptdoctor.render.report import finding_entries, fit, printable

    if quiet:
        return "\n".join(finding_entries(result.findings, width=width, fix_line=False))
    lines: list[str] = [f"ckptdoctor gate {printable(result.run)}"]
    if result.checkpoint is None and any(f.rule == "CKD449" for f in result.findings):
        lines.append('  checkpoint       undetermined: "last" may load one of several files (CKD449)')
    elif result.checkpoint is None:
        afresh = " (allowed: the run starts afresh)" if result.starts_afresh else ""
        lines.append(f"  checkpoint       none found{afresh}")
    else:
        loads = f", {result.weights_file}" if result.weights_file else ""
        if result.adapter_tensors is not None:  # a full-weights file loaded in place of the adapter (CKD201)
            restored, of = result.adapter_tensors
            loads += f": restores {restored:,} of {plural(of, 'adapter tensor')}"
        lines.append(f"  checkpoint       {printable(result.checkpoint)}  (weights: {result.weights_branch}{loads})")
        s = result.settings
        if s is not None:
            source = s.sources.get("transformers_version", "default")
            lines.append(f"  transformers     {printable(s.transformers_version)} ({source})")
        start, total, todo = result.start_step, result.max_steps, result.steps_to_train
        if result.weights_branch == "lightning":  # `fit(ckpt_path=...)`: the loops' step, no schedule to predict
            at = "unknown" if start is None else f"global_step {start}"
            lines.append(f"  steps            {at} -> {total}: trains {todo}" if todo is not None and total is not None
                         else f"  steps            {at}: how many it trains is not predicted")
        elif result.weights_branch == "dcp":  # torchtitan: `load()` restores train_state.step, trains to training.steps
            at = "unknown" if start is None else f"train_state.step {start}"
            plan = "" if total is None else f" -> training.steps {total}: trains {todo if todo is not None else '?'}"
            lines.append(f"  steps            {at}{plan}")
        elif s is None and result.stack != "trainer":  # another stack's resume: its steps as far as they are known
            at = "unknown" if start is None else f"step {start} (the loaded scheduler's)"
            plan = "" if total is None or todo is None else f" -> {start + todo if start else todo} of max_steps " \
                f"{total}: trains {todo}"
            lines.append(f"  steps            {at}{plan}")
            if result.restores:
                lines.append(f"  restores         {', '.join(result.restores)}")
        elif total is None or todo is None:
            at = "unknown" if start is None else f"global_step {start}"
            rules = {f.rule for f in result.findings}
            why = ("the resume raises before its first step" if rules & CRASH_RULES
                   else "the planned batch size changes the steps per epoch by an unknown amount (CKD414)"
                   if "CKD414" in rules else "`trainer_state.json` was not read (CKD412)" if "CKD412" in rules
                   else "the checkpoint was not read (CKD604)")
            lines.append(f"  steps            {at}: not predicted, {why}")
        elif s is not None and start is not None and total:
            end = start + todo
            lines.append(
                f"  steps            global_step {start} -> {end} of max_steps {total}: "
                f"trains {todo} ({s.steps_per_epoch} steps per epoch, {result.epochs_trained} of "
                f"{result.num_train_epochs} epochs done)"
            )
            state = "restored from the checkpoint" if result.restores_optimizer else "NOT restored (fresh)"
            base = "?" if result.base_lr is None else f"{result.base_lr:.4g}"
            lines.append(f"  optimizer        {state}")
            sched = printable(s.lr_scheduler_type)
            if result.ds_scheduler is not None:
                lines.append(f"  schedule         DeepSpeed's {printable(result.ds_scheduler)} (its config's "
                             "\"scheduler\"): LRs after the first not predicted")
            else:
                lines.append(f"  schedule         {sched}, {result.warmup_steps} warm-up steps, base LR {base}")
        if result.lr:
            lines.append(f"  first {len(result.lr)} LRs      " + format_lrs(result.lr))
    if result.findings:
        lines.append("")
        lines.extend(finding_entries(result.findings, width=width, fix_line=False))
    counts = {sev: sum(1 for f in result.findings if f.severity == sev) for sev in Severity}
    tally = ", ".join(plural(counts[s], s.value) for s in (Severity.ERROR, Severity.WARNING, Severity.INFO))
    lines.append("")
    threshold = f"fail-on {result.fail_on} from the settings file" if result.fail_on_from_settings else (
        f"--fail-on {result.fail_on}")
    lines.append(f"Verdict: {result.verdict} ({tally}; {threshold})")
    if width is None:
        return "\n".join(lines)
    # the prediction's values line up after their 19-column labels: continuation lines start there too
    return "\n".join(w for ln in lines for w in fit(ln, width, " " * 17 if ln.startswith("  ") else "  "))


def finding_line(f: Finding) -> str:
    """One finding as ``scan``'s text output prints it: ``path: CODE [severity] message`` (without its fix line)."""
    from ckptdoctor.render.report import finding_text

    return finding_text(f)[0]


def gate_json(result: GateResult) -> dict[str, Any]:
    """The ``ckptdoctor.gate/1`` document the command prints: ``GateResult.to_json`` with ckptdoctor's
    ``version`` after the schema and ``summary`` counts of the findings by severity, as in scan's report."""
    from ckptdoctor.version import __version__

    doc = result.to_json()
    counts = {sev.value: sum(1 for f in result.findings if f.severity == sev) for sev in Severity}
    return {
        "schema": doc.pop("schema"),
        "version": __version__,
        **doc,
        "summary": {k: counts[k] for k in ("error", "warning", "info")},
    }


def summary(result: GateResult) -> str:
    """One line for CI logs: what the resume will do."""
    if result.checkpoint is None:
        return "resume finds no checkpoint"
    lrs = f"; first LRs {format_lrs(result.lr)}" if result.lr else ""
    if result.max_steps is None or result.steps_to_train is None:
        what = "and raises before its first step" if any(f.rule in CRASH_RULES for f in result.findings) else (
            "; its steps are not predicted")
        return f"resume loads {result.checkpoint} ({result.weights_branch}) {what}; verdict {result.verdict}"
    return (
        f"resume loads {result.checkpoint} ({result.weights_branch}) at step {result.start_step} and trains "
        f"{result.steps_to_train} of max_steps {result.max_steps}{lrs}; verdict {result.verdict}"
    )
