"""The exit policy: 0 when nothing reaches fail-on, 1 when findings do (2, a usage error, is the caller's), and the
one answer every result gives (``Outcome``). A settings file's fail-on came with the checkpoint: its "never" cannot
pass a security error."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from ckptdoctor.errors import UsageError
from ckptdoctor.findings import Finding, Severity
from ckptdoctor.model import frozen

FAIL_ON = ("error", "warning", "info", "never")


def check_fail_on(fail_on: str | None) -> None:
    """A ``UsageError`` for a fail-on that is not one of ``FAIL_ON`` (None: not given)."""
    if fail_on is not None and fail_on not in FAIL_ON:
        raise UsageError(f"fail_on must be one of {', '.join(FAIL_ON)}, not {fail_on!r}")


SECURITY_NEVER_NOTE = (
    'ckptdoctor: security errors fail the scan even with fail-on = "never" in a settings file; pass '
    "--fail-on never on the command line to override."
)
"""What the command line says on stderr when ``exit_code`` fails a scan its settings file's fail-on would pass."""


def fails(findings: Iterable[Finding], fail_on: str = "error") -> bool:
    """True when a finding is at or above ``fail_on`` (``never`` never fails)."""
    if fail_on == "never":
        return False
    threshold = Severity(fail_on).rank
    return any(f.severity.rank >= threshold for f in findings)


def exit_code(
    findings: Sequence[Finding],
    fail_on: str | None,
    settings_fail_on: str | None,
    *,
    on_security_kept: Callable[[], None] | None = None,
) -> int:
    """The exit code of ``findings`` under the caller's ``fail_on`` (``--fail-on``), else the settings file's.

    A settings file's ``fail-on = "never"`` came with the checkpoint and cannot wave a security error through: then
    the code is 1 and ``on_security_kept()`` is called (the command line prints ``SECURITY_NEVER_NOTE``).
    """
    code = 1 if fails(findings, fail_on or settings_fail_on or "error") else 0
    if code == 0 and fail_on is None and settings_fail_on == "never":
        from ckptdoctor.rules import security_codes

        # As with keep_security_rules: a settings file from the scanned folder cannot wave a malicious pickle through.
        security = security_codes()
        if any(f.rule in security and f.severity is Severity.ERROR for f in findings):
            if on_security_kept is not None:
                on_security_kept()
            code = 1
    return code


@frozen
class ExitPolicy:
    """How the exit code of a scan (or of what a fix leaves) is decided, as the command line decides it.

    ``fail_on`` is the caller's (``--fail-on``; None: not given) and ``scopes`` each folder's settings, as
    ``(root, folder, the settings file's fail-on, trusted)`` (``settings.selection.exit_policy`` builds them): a
    finding is judged under the deepest scope holding its path. The default policy fails on errors, as a scan
    without settings does.
    """

    fail_on: str | None = None
    scopes: tuple[tuple[str, str, str | None, bool], ...] = ()
    # The untrusted settings file's fail-on for a finding under no scope: the gate's, from RUN_DIR's closest file.
    settings_fail_on: str | None = None

    def _scope(self, f: Finding) -> tuple[str | None, bool]:
        best: tuple[str, str, str | None, bool] | None = None
        for scope in self.scopes:
            root, folder = scope[0], scope[1]
            if root != f.root or (folder and f.path != folder and not f.path.startswith(folder + "/")):
                continue
            if best is None or len(folder) > len(best[1]):
                best = scope
        return (self.settings_fail_on, False) if best is None else (best[2], best[3])

    def exit_code(self, findings: Sequence[Finding], *, on_security_kept: Callable[[], None] | None = None) -> int:
        """The highest ``exit_code`` of the findings of each settings file's fail-on (a finding's ``root`` and
        ``path`` say its scope; one under no scope is judged without settings). The user configuration's fail-on
        is trusted as ``--fail-on`` is; ``on_security_kept`` is called once per fail-on it concerns."""
        parts: dict[tuple[str | None, bool], list[Finding]] = {(self.settings_fail_on, False): []}
        for f in findings:
            parts.setdefault(self._scope(f), []).append(f)
        codes = [0]
        for (cfg_fail_on, trusted), mine in parts.items():
            if trusted:
                codes.append(exit_code(mine, self.fail_on or cfg_fail_on, None))
            else:
                codes.append(exit_code(mine, self.fail_on, cfg_fail_on, on_security_kept=on_security_kept))
        return max(codes)


class Outcome:
    """The one answer to "did it fail, and with which exit code" that every result shares (``Report``,
    ``GateResult``, ``FixResult``): its ``exit_policy`` judges its ``judged_findings``, as the command line does."""

    __slots__ = ()

    def exit_policy(self) -> ExitPolicy:
        """How this result's findings are judged (the caller's fail-on and each settings file's)."""
        raise NotImplementedError

    def judged_findings(self) -> Sequence[Finding]:
        """The findings the exit code is decided on (for a fix: what remains)."""
        raise NotImplementedError

    def pending_change(self) -> bool:
        """True when the result fails whatever its findings (a dry run that would change something)."""
        return False

    def exit_status(self, *, on_security_kept: Callable[[], None] | None = None) -> int:
        """The command line's exit code for this result: 1 when a judged finding reaches its fail-on (or a
        security error that only a settings file's "never" would pass: ``on_security_kept()`` is then called, the
        command line's note), or when ``pending_change``; else 0."""
        code = self.exit_policy().exit_code(self.judged_findings(), on_security_kept=on_security_kept)
        return max(code, 1 if self.pending_change() else 0)
