"""What the commands share: root and format options, the rule options, and how the library's errors, notes and
exit policy reach the command line (``UsageError`` is exit 2, notes go to stderr)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from ckptdoctor.settings.selection import Options


class UsageProblem(click.ClickException):
    """A usage error or unusable input: printed without a traceback, exit code 2 (findings use 1)."""

    exit_code = 2


class ScanRoot(click.Path):
    """A local path that must exist, or (``remote=True``) a URL root (``s3://``, ``gs://``, ``hf://``...) passed on
    for fsspec.

    A local path is checked by ``scanner.check_roots``, the library's one check of a root, so every command refuses
    the same roots with the same words (exit 2): missing, a link to nothing, a link loop, a FIFO, socket or device.
    ``file_okay``/``dir_okay`` then narrow it as ``click.Path`` does.
    """

    def __init__(self, *, remote: bool = True, **kwargs: Any) -> None:
        super().__init__(exists=True, **kwargs)
        self.remote = remote

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from ckptdoctor.scanner import check_roots
        from ckptdoctor.sources import is_remote  # only when a command parses its roots: --version stays instant

        if isinstance(value, str) and self.remote and is_remote(value):
            return value
        if isinstance(value, (str, os.PathLike)):
            try:
                check_roots([os.fspath(value)])  # passes a URL by: click's existence check refuses it below
            except OSError as exc:
                self.fail(f"{exc.filename}: {exc.strerror or exc}", param, ctx)
            except ValueError as exc:  # its message names the root
                self.fail(str(exc), param, ctx)
        return super().convert(value, param, ctx)


def note_kept(source: str, codes: Sequence[str]) -> None:
    """The command line's note on stderr for security rules a settings file may not turn off."""
    from ckptdoctor.settings.selection import kept_message

    click.echo(kept_message(source, codes, "use --ignore on the command line"), err=True)


def request_options(
    select: Sequence[str],
    ignore: Sequence[str],
    fail_on: str | None,
    no_config: bool,
    allow_global: Sequence[str],
    allow_empty: bool,
) -> Options:
    """The one ``Options`` of a command's request, from the options ``rule_options`` and ``allow_empty_option``
    declare, built and checked once (``settings.selection.Options.build``); a project file's kept security rules
    are noted on stderr."""
    from ckptdoctor.settings.selection import Options

    return Options.build(
        select=select, ignore=ignore, fail_on=fail_on, no_config=no_config, allow_global=allow_global,
        allow_empty=allow_empty, on_kept=note_kept,
    )


def note_security() -> None:
    """Tell the user on stderr that a security error still fails under ``--fail-on never``."""
    from ckptdoctor.settings.exit import SECURITY_NEVER_NOTE

    click.echo(SECURITY_NEVER_NOTE, err=True)


# Set by a command that wrote nothing, once its output is out: ``cli.run`` may then end the process without
# tearing down the interpreter (see ``cli.run``).
fast_exit = False


def read_only_done() -> None:
    """Mark that this command wrote nothing, so the process may end without tearing down."""
    global fast_exit
    fast_exit = True


def text_or_json(help_text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The ``--format text|json`` option (default text, passed as ``fmt``) with its own help."""
    return click.option(
        "--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True, help=help_text
    )


allow_global_option = click.option(
    "--allow-global",
    "allow_global",
    multiple=True,
    metavar="PATTERN",
    help="Allow this pickle global (pkg.mod.Name, or pkg.mod.* for a module and its submodules): your own classes; "
    "never anything that runs code. Added to `allow-globals` of the user configuration "
    "(~/.config/ckptdoctor/config.toml, or $CKPTDOCTOR_USER_CONFIG); each use is shown in the report.",
)
"""``--allow-global`` (passed as ``allow_global``): the user's pickle-global allowances for this run."""


show_settings_option = click.option(
    "--show-settings",
    is_flag=True,
    help="Print which settings file applies to which folder (the closest .ckptdoctor.toml or [tool.ckptdoctor] "
    "from each folder upward, else the user configuration) and the values they resolve to, then exit 0 without "
    "checking anything; with --format json, one ckptdoctor.settings/1 document.",
)
"""``--show-settings`` (passed as ``show_settings``), as ``ruff check --show-settings``."""


def allow_empty_option(what: str, code: str = "CKD002") -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--allow-empty`` (passed as ``allow_empty``): accept a root that holds no checkpoint at all, which is
    otherwise the error ``code`` (the gate's is CKD413: the resume raises)."""
    return click.option(
        "--allow-empty",
        is_flag=True,
        help=f"Accept a root that holds no checkpoint yet (a launcher gating before the first save): {what}. "
        f"Without it such a root (a mistyped or unmounted path) is {code}, an error.",
    )


CACHE_ENV = "CKPTDOCTOR_CACHE"  # what --cache (1, on, true, yes) or --no-cache (0, off, false, no) says by default


def cache_default() -> bool | None:
    """What a command does with the verdict cache when its command line does not say (``CKPTDOCTOR_CACHE``):
    True, ``--cache``; False, ``--no-cache``; None, the default (``cache.source.FactsCache``: a file's facts are kept
    once a second scan finds it unchanged)."""
    value = os.environ.get(CACHE_ENV, "").strip().lower()
    return True if value in ("1", "on", "true", "yes") else False if value in ("0", "off", "false", "no") else None


def cache_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--cache/--no-cache`` (passed as ``cache``: True, False, or None when neither is given)."""
    return click.option(
        "--cache/--no-cache",
        "cache",
        default=cache_default,
        show_default="the cache keeps a file's facts once a second scan finds it unchanged; CKPTDOCTOR_CACHE=1 "
        "is --cache, CKPTDOCTOR_CACHE=0 --no-cache",
        help="The verdict cache, in the user's cache folder ($XDG_CACHE_HOME/ckptdoctor, else ~/.cache/ckptdoctor; "
        "never in the scanned tree): a file unchanged since its facts were kept (same size, times and inode; same "
        "ETag or version on object storage) is not read again; rules always run. By default a first scan notes "
        "each file and a second one that finds it unchanged keeps its facts, so a one-off scan costs next to "
        "nothing more and a tree scanned again and again (nightly, before each resume) is read from the cache from "
        "the third scan on, at about a quarter of the cost. --cache keeps every file's facts now (a nightly job's "
        "first scan); --no-cache reads every file and leaves the cache alone. `ckptdoctor cache info|prune|clear` "
        "shows, prunes or empties it.",
    )(f)


def rule_options(
    *,
    never_runs: str,
    every_rule: str,
    select_help: str = "Run only these rules: codes, prefixes or names, comma-separated or repeated (CKD2,CKD601).",
    ignore_help: str = "Skip these rules (codes or prefixes), added to the settings file's ignore; unlike a settings "
    "file, this can turn off security rules (CKD6xx).",
    fail_on_help: str = "Exit 1 when a finding has this severity or worse; never: always exit 0 unless the input is "
    "unusable.",
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--fail-on``, ``--select``, ``--ignore``, ``--no-config`` and ``--allow-global`` (passed as ``fail_on``,
    ``select``, ``ignore``, ``no_config``, ``allow_global``, for ``request_options``) of a command that runs rules
    under a root's settings file: each declared here once, for every command.

    ``never_runs`` says which selections are usage errors for the command, ``every_rule`` what runs by default;
    the ``*_help`` texts say what the option does in that command. The settings files are the closest from each
    folder upward (``settings.files.find_config``).
    """
    options = (
        click.option(
            "--fail-on",
            type=click.Choice(["error", "warning", "info", "never"]),
            default=None,
            help=f"{fail_on_help}  [default: the closest settings file's fail-on, else error]",
        ),
        click.option(
            "--select",
            multiple=True,
            metavar="CODES",
            help=f"{select_help} {never_runs}  [default: the settings file's select, else {every_rule}]",
        ),
        click.option(
            "--ignore",
            multiple=True,
            metavar="CODES",
            help=f"{ignore_help}  [default: none]",
        ),
        click.option(
            "--no-config",
            is_flag=True,
            help="Ignore every settings file (.ckptdoctor.toml, or [tool.ckptdoctor] in pyproject.toml) and the "
            "user configuration's rule settings (not its allow-globals).",
        ),
        allow_global_option,
    )

    def apply(func: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):  # decorators apply bottom-up: this keeps the listed order in --help
            func = option(func)
        return func

    return apply

def use_color(stream: Any) -> bool:
    """Colour only on a terminal that can show it: not with NO_COLOR set (no-color.org), nor with TERM=dumb."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def terminal_width(stream: Any) -> int | None:
    """The width to fit text output to: the terminal's (``COLUMNS`` first, as ``shutil.get_terminal_size`` reads
    it; 80 when it cannot tell) when ``stream`` is a terminal, else None: a pipe or a file gets every line whole,
    as ruff writes to a pipe, so scripts and ``grep`` see one line per finding."""
    isatty = getattr(stream, "isatty", None)
    if not (isatty and isatty()):
        return None
    import shutil

    return max(shutil.get_terminal_size((80, 24)).columns, 20)


def output_options(quiet_help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--output-file``, ``-q/--quiet`` and ``-s/--silent`` (passed as ``output_file``, ``quiet``, ``silent``);
    ``quiet_help`` says what ``-q`` keeps of the command's text."""
    options = (
        click.option(
            "--output-file",
            "-o",
            type=click.Path(dir_okay=False, writable=True),
            default=None,
            metavar="PATH",
            help="Write the report (any --format) to PATH instead of stdout; text is then written whole, without "
            "colour or wrapping.",
        ),
        click.option("--quiet", "-q", is_flag=True, help=quiet_help),
        click.option(
            "--silent",
            "-s",
            is_flag=True,
            help="Print no report on stdout (any --format): only the exit code, and errors on stderr, tell the "
            "result. --output-file still gets the report.",
        ),
    )

    def apply(func: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            func = option(func)
        return func

    return apply


def text_width(output_file: str | None, stream: Any) -> int | None:
    """``terminal_width`` of stdout, or None when the report goes to a file."""
    return None if output_file is not None else terminal_width(stream)


class FittingHelpFormatter(click.HelpFormatter):
    """click's help formatter, with the verbatim (``\\b``) lines of an epilog fitted to the width too: an example
    too wide for it shows its ``# comment`` on the line above, and anything still too wide continues on the next
    line, indented."""

    def write_text(self, text: str) -> None:
        from click.formatting import wrap_text

        indent = " " * self.current_indent
        wrapped = wrap_text(text, self.width, initial_indent=indent, subsequent_indent=indent,
                            preserve_paragraphs=True)  # fmt: skip
        self.write("".join(ln + "\n" for line in wrapped.splitlines() for ln in self._fit(line)))

    def _fit(self, line: str) -> list[str]:
        if len(line) <= self.width:
            return [line]
        import re
        import textwrap

        lead = line[: len(line) - len(line.lstrip(" "))]
        example = re.match(r"(\s*)(\S.*?)\s{2,}(# .*)$", line)
        if example:
            return [*self._fit(lead + example[3]), *self._fit(lead + example[2])]
        # a command without quotes continues as a shell reads it, with " \\" (inside quotes it would be literal)
        command = line.lstrip().startswith("ckptdoctor ") and not set("'\"") & set(line)
        lines = textwrap.wrap(line.strip(), self.width - 2 * command, initial_indent=lead,
                              subsequent_indent=lead + "    ", break_on_hyphens=False, break_long_words=False)
        return [ln + " \\" for ln in lines[:-1]] + lines[-1:] if command else lines


class FittingContext(click.Context):
    """The commands' context: help fitted to the terminal by ``FittingHelpFormatter``."""

    formatter_class = FittingHelpFormatter
