"""Rule codes, prefixes and names as the command line and settings files give them, checked against the rule
registry: a typo must never select nothing (a clean scan that checked nothing)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ckptdoctor.errors import UsageError
from ckptdoctor.findings import Severity


class UnknownRule(UsageError):
    """A rule code, prefix or name that matches no rule: selecting it would silently check nothing."""

    def __init__(self, pattern: str) -> None:
        super().__init__(f"no rule code starts with {pattern!r} and no rule has that name (see `ckptdoctor rules`)")
        self.pattern = pattern


def rule_codes(patterns: Iterable[str]) -> tuple[str, ...]:
    """``patterns`` (codes, prefixes or rule names, any case) stripped and upper-cased, each rule name replaced by its
    code; anything else is kept as it is, for ``rule_patterns`` to judge."""
    out = tuple(p.strip().upper() for p in patterns)
    if all(p.startswith("CKD") for p in out):
        return out  # codes only: the rule registry (every rule module) is not imported for nothing
    from ckptdoctor.rules import all_rules

    names = {r.name.upper(): r.code for r in all_rules()}
    return tuple(names.get(p, p) for p in out)


def rule_patterns(patterns: Iterable[str]) -> tuple[str, ...]:
    """``patterns`` as ``rule_codes`` gives them, each checked to match a rule.

    Raises ``UnknownRule`` (with the pattern as written) for one that matches no rule, an empty one included:
    ``select = [""]`` or a typo must not select nothing (a clean scan that checked nothing).
    """
    from ckptdoctor.rules import all_rules  # the registry imports every rule module: only when a pattern is read

    raws = tuple(patterns)
    codes = [r.code for r in all_rules()]
    out = rule_codes(raws)
    for raw, p in zip(raws, out, strict=True):
        if not p.startswith("CKD") or not any(code.startswith(p) for code in codes):
            raise UnknownRule(raw)
    return out


def severity_overrides(raw: Mapping[str, Severity]) -> dict[str, Severity]:
    """Severity overrides keyed by rule code, from keys that are codes, rule names or prefixes.

    A prefix stands for every rule it matches (``CKD4 = "error"``); a more specific key wins whatever the order
    (``CKD4`` then ``CKD404``: CKD404 keeps its own). Raises ``UnknownRule`` for a key that matches no rule and
    ``ValueError`` for one rule given twice (``CKD601`` and ``unsafe-pickle-global``).
    """
    from ckptdoctor.rules import all_rules

    codes = [r.code for r in all_rules()]
    keyed: dict[str, tuple[str, Severity]] = {}  # resolved pattern -> (as written, severity)
    for key, level in raw.items():
        (pattern,) = rule_patterns([key])
        if pattern in keyed:
            raise ValueError(f"severity {key}: {keyed[pattern][0]} names the same rules; give one")
        keyed[pattern] = (key, level)
    out: dict[str, Severity] = {}
    for pattern in sorted(keyed, key=len):  # shorter prefixes first, so the more specific key is applied last
        for code in codes:
            if code.startswith(pattern):
                out[code] = keyed[pattern][1]
    return out


def split_codes(values: Sequence[str]) -> tuple[str, ...]:
    """Rule codes from repeated and comma-separated ``--select``/``--ignore`` values, upper-cased; a rule's name
    (``stub-weights-shadow-adapter``, as ``ckptdoctor explain`` takes it) stands for its code."""
    return rule_codes(p for v in values for p in v.split(",") if p.strip())


def check_codes(codes: Sequence[str], option: str) -> None:
    """A ``UsageError`` for a code or prefix that matches no rule (``rule_patterns`` decides)."""
    try:
        rule_patterns(codes)
    except UnknownRule as exc:
        c = exc.pattern
        raise UsageError(f"{option} {c}: no rule code starts with {c!r} (see `ckptdoctor rules`)") from None
