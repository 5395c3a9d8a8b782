"""The ``rules`` and ``explain`` commands: the rule registry as a table, JSON or markdown, and one rule's document."""

from __future__ import annotations

import json
import sys

import click

from ckptdoctor.cli.options import UsageProblem, terminal_width

RULES_SCHEMA = "ckptdoctor.rules/1"

_EPILOG_RULES = """\b
Examples:
  ckptdoctor rules
  ckptdoctor rules --format json | jq -r '.rules[] | select(.fixable) | .code'
  ckptdoctor explain CKD201                    # one rule's full document
"""


@click.command(name="rules", epilog=_EPILOG_RULES, short_help="List every rule: code, name, severity, fix safety.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json", "markdown"]),
    default="text",
    show_default=True,
    help='text: a table; json: {"schema": "ckptdoctor.rules/1", "version", "rules": [{code, name, severity (the '
    "default), severity_when ([{severity, when}]: the other severities a finding can have, and when), fixable, fix "
    "(safe, unsafe or null), deep_only, gate_only, summary}]}; markdown: the table the README embeds (it also marks "
    "the --deep and gate-only rules).",
)
def rules_cmd(fmt: str) -> None:
    """List every rule: code, name, default severity (and when it changes), whether `ckptdoctor fix` can repair
    it, and a summary.

    `ckptdoctor explain CODE` prints a rule's full document.
    """
    from ckptdoctor.rules import all_rules, rules_markdown

    rules = all_rules()
    if fmt == "markdown":
        click.echo(rules_markdown())
        return
    if fmt == "json":
        from ckptdoctor.version import __version__

        data = [
            {
                "code": r.code,
                "name": r.name,
                "severity": r.severity.value,
                "severity_when": [{"severity": sev.value, "when": when} for sev, when in r.severity_when],
                "fixable": r.fixable,
                "fix": r.fix.value if r.fix is not None else None,
                "deep_only": r.deep_only,
                "gate_only": r.gate_only,
                "summary": r.summary,
            }
            for r in rules
        ]
        click.echo(json.dumps({"schema": RULES_SCHEMA, "version": __version__, "rules": data}, indent=2))
        return
    from ckptdoctor.render.rules import render_catalog

    click.echo(render_catalog(rules, terminal_width(sys.stdout)))


_EPILOG_EXPLAIN = """\b
Examples:
  ckptdoctor explain CKD201
  ckptdoctor explain stub-weights-shadow-adapter

\b
Exit codes: 0 printed, 2 no such rule.
"""


@click.command(epilog=_EPILOG_EXPLAIN, short_help="Print one rule's document (by code, e.g. CKD201, or by name).")
@click.argument("rule")
def explain(rule: str) -> None:
    """Print RULE's document (by code, e.g. CKD201, or by name): what it does, why, an example, fix safety.

    Codes and names match in any case; `ckptdoctor rules` lists them all.
    """
    from ckptdoctor.rules import get_rule

    r = get_rule(rule)
    if r is None:
        raise UsageProblem(f"no rule {rule!r} (see `ckptdoctor rules`)")
    from ckptdoctor.render.rules import render_document

    click.echo(render_document(r, terminal_width(sys.stdout)))
