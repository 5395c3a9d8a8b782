"""``patterns.lazy`` stands for ``re.compile``: the same answers, compiled at the first use only."""

from __future__ import annotations

import re

import pytest

from ckptdoctor import patterns


def test_a_lazy_pattern_answers_as_the_compiled_one() -> None:
    text = r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$"
    lazy, compiled = patterns.lazy(text), re.compile(text)
    name = "bf16_zero_pp_rank_3_mp_rank_01_optim_states.pt"
    assert lazy.match(name) is not None and lazy.match(name).groups() == compiled.match(name).groups()  # type: ignore[union-attr]
    assert lazy.search("x" + name) is None and lazy.pattern == text and lazy.groups == 2
    assert patterns.lazy("[0-9]+").sub("N", "a12b3") == "aNbN"
    assert patterns.lazy("A", re.IGNORECASE).fullmatch("a") is not None


def test_it_compiles_once_at_its_first_use(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[str] = []
    compile_ = re.compile

    def counted(pattern: str, flags: int = 0) -> re.Pattern[str]:
        made.append(pattern)
        return compile_(pattern, flags)

    monkeypatch.setattr(patterns.re, "compile", counted)
    lazy = patterns.lazy(r"step-(\d+)")
    assert made == [] and repr(lazy) == "lazy('step-(\\\\d+)')"
    assert [lazy.search(f"step-{i}") is not None for i in range(3)] == [True] * 3
    assert lazy.match("x") is None and made == [r"step-(\d+)"]
