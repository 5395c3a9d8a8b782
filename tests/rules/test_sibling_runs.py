"""CKD422 (a run started from a sibling run's checkpoint) looks each run up in an index of the runs judged before
it (``facts.SiblingRuns``) instead of comparing every pair: the findings are the ones comparing every pair gives,
in the same order, on random fleets built to collide (few layouts, few first steps, tied folder times and losses),
and a fleet of thousands of runs is judged in about linear work.

The real-checkpoint proofs of the rule itself (a run started from another's checkpoint by the real Trainer, and
runs that stay silent) are tests/gate/test_resume_hazards.py and tests/rules/test_rules.py; here the inputs are the
``RunHistory`` values those runs reduce to.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from ckptdoctor.facts import SiblingRuns, started_from
from ckptdoctor.model import RunHistory
from ckptdoctor.rules import Hit
from ckptdoctor.rules.training import started_hits

LAYOUTS = [frozenset({("w", (2, 2))}), frozenset({("w", (2, 2)), ("b", (2,))}), None]


def every_pair(current: list[RunHistory], siblings: Sequence[RunHistory]) -> list[tuple[str, str]]:
    """The rule as it was before the index (each history against every other), as (where, sibling named)."""
    here = {h.path for h in current}
    histories = [*current, *(h for h in siblings if h.path not in here)]
    out: list[tuple[str, str]] = []
    for mine in histories:
        if mine.named is not None:
            if mine.path in here:
                out.append((mine.where, f"named {mine.named}"))
            continue
        if not mine.losses or not mine.has_config or mine.layout is None:
            continue
        if mine.path not in here and any(fits(mine, o) for o in siblings if o.path not in here and o is not mine):
            continue  # a run judged before fits it: said when the later of the two was judged, once a run
        for other in histories:
            if other is mine or (mine.path not in here and other.path not in here):
                continue
            if fits(mine, other):
                out.append((mine.where, other.path))
                break
    return out


def fits(mine: RunHistory, other: RunHistory) -> bool:
    """Whether ``mine`` looks started from ``other`` (the rule's test, written out)."""
    first_step, first = mine.losses[0]
    if other.newest_mtime > mine.oldest_mtime or other.layout != mine.layout:
        return False
    theirs = other.losses
    if len(theirs) < 2 or theirs[0][0] != first_step:
        return False
    start, late = theirs[0][1], theirs[-1][1]
    return not (start - late < 0.02 * abs(start) or not first < start - (start - late) / 2)


def shown(hits: list[Hit]) -> list[tuple[str, str]]:
    out = []
    for h in hits:
        if "`_name_or_path` names `" in h.message:
            out.append((h.path, "named " + h.message.split("`")[3]))
        else:
            out.append((h.path, h.message.split("sibling run `")[1].split("`")[0]))
    return out


def history(rng: random.Random, i: int) -> RunHistory:
    steps = [1, 1, 1, 5]
    losses: tuple[tuple[int, float], ...] = ()
    n = rng.choice([0, 1, 2, 2, 2])
    if n:
        start = rng.choice([2.0, 3.0, 3.0, 1.0, 0.0, -1.0])
        late = rng.choice([start, start * 0.99, start * 0.5, start - 1.0, 0.0])
        losses = ((rng.choice(steps), start),) if n == 1 else ((rng.choice(steps), start), (8, late))
    oldest = float(rng.randint(0, 6))
    return RunHistory(
        path=f"run-{i:04d}",
        where=f"run-{i:04d}/checkpoint-8/config.json",
        newest_mtime=oldest + rng.choice([0.0, 0.0, 1.0, 3.0]),
        oldest_mtime=oldest,
        layout=rng.choice(LAYOUTS),
        has_config=rng.random() < 0.9,
        named="elsewhere/checkpoint-8" if rng.random() < 0.05 else None,
        losses=losses,
    )


@pytest.mark.parametrize("seed", range(40))
def test_the_index_finds_what_comparing_every_pair_finds_in_the_same_order(seed: int) -> None:
    rng = random.Random(seed)
    runs = [history(rng, i) for i in range(rng.randint(2, 40))]
    # judged run by run (a part per run, or a few runs per part), as a scan of a root hands them, and whole
    for per_part in (1, 3, len(runs)):
        judged = SiblingRuns()
        for at in range(0, len(runs), per_part):
            part = runs[at : at + per_part]
            expected = every_pair(part, list(judged))
            assert shown(list(started_hits(part, judged))) == expected
            assert shown(list(started_hits(part, list(judged)))) == expected  # a plain sequence is indexed here
            judged = judged.extended(part)
    # the last part again with every run as a sibling (a tree merged from its parts keeps the last one's siblings)
    assert shown(list(started_hits(runs, judged))) == every_pair(runs, list(judged))


@pytest.mark.parametrize("seed", range(40))
def test_judged_run_by_run_each_run_gets_the_finding_it_gets_judged_whole(seed: int) -> None:
    """A scan hands a root's runs on one by one (a part each): over all the parts, each run is told once, of the
    same sibling, as when the root is judged whole (where a run fits several siblings, the first in order)."""
    rng = random.Random(seed)
    runs = [history(rng, i) for i in range(rng.randint(2, 40))]
    whole = sorted(shown(list(started_hits(runs, SiblingRuns()))))
    judged = SiblingRuns()
    by_part: list[tuple[str, str]] = []
    for run in runs:
        by_part += shown(list(started_hits([run], judged)))
        judged = judged.extended([run])
    assert sorted(by_part) == whole


def test_a_view_keeps_its_runs_when_the_index_grows_and_an_older_one_extended_is_indexed_again() -> None:
    rng = random.Random(7)
    runs = [history(rng, i) for i in range(30)]
    first = SiblingRuns(runs[:10])
    newer = first.extended(runs[10:20])
    assert list(first) == runs[:10] and len(first) == 10 and first[-1] == runs[9]
    assert list(newer) == runs[:20]
    branch = first.extended(runs[20:])  # not the newest value: it must not see runs 10-19
    assert list(branch) == [*runs[:10], *runs[20:]]
    for mine in runs:
        for view, held in ((first, runs[:10]), (newer, runs[:20]), (branch, [*runs[:10], *runs[20:]])):
            assert view.source_of(mine) == next((o for o in held if started_from(mine, o)), None)


def test_a_fleet_of_thousands_of_runs_is_judged_in_about_linear_work() -> None:
    """5,000 runs of one model, logged from the same step, judged one at a time: every pair would be 12.5 million
    comparisons; the index makes a few per run (counted, not timed)."""
    calls = 0
    import ckptdoctor.facts as facts

    real = facts.started_from

    def counted(mine: RunHistory, other: RunHistory) -> bool:
        nonlocal calls
        calls += 1
        return real(mine, other)

    layout = LAYOUTS[0]
    judged = SiblingRuns()
    found = 0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(facts, "started_from", counted)
        for i in range(5000):
            start = 3.0 - (i % 7) * 0.01  # none started where another ended
            h = RunHistory(f"r{i}", f"r{i}/config.json", float(i) + 0.5, float(i), layout, True, None,
                           ((1, start), (9, start / 2)))  # fmt: skip
            found += len(list(started_hits([h], judged)))
            judged = judged.extended([h])
        restarted = RunHistory("late", "late/config.json", 1e9, 1e9, layout, True, None, ((1, 1.0), (9, 0.9)))
        hits = list(started_hits([restarted], judged))
    assert found == 0 and calls < 5 * 5000
    assert shown(hits) == [("late/config.json", "r0")]  # the first run it fits, in the order judged
