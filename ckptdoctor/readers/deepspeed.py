"""DeepSpeed checkpoint pieces: the ``latest`` tag file and the names of the per-rank state files."""

from __future__ import annotations

import re
from typing import BinaryIO

from ckptdoctor.limits import DEFAULT_LIMITS, Limits
from ckptdoctor.model import ProblemKind, ReadOutcome, ReadProblem, TextFacts, frozen
from ckptdoctor.readers.jsonfiles import read_bounded

# deepspeed/runtime/engine.py `_get_ckpt_name` (model states; `zero_pp_rank_{dp}_` under ZeRO-3) and
# `_get_rank_zero_ckpt_name` (optimizer states; `bf16_` prefix when bf16 is enabled). MoE's `expp_rank_*` and
# `layer_*_expert_*` files are not described here.
_NAME = re.compile(
    r"^(?P<bf16>bf16_)?(?:zero_pp_rank_(?P<dp>\d+)_)?mp_rank_(?P<mp>\d+)_(?P<kind>model|optim)_states\.pt$",
    re.ASCII,
)


@frozen
class DeepSpeedName:
    """What a DeepSpeed state file's name says: model or optimizer states, its ranks, and the bf16 prefix."""

    kind: str  # "model" or "optim"
    dp_rank: int | None  # None for `mp_rank_XX_model_states.pt` (written once, by data-parallel rank 0)
    mp_rank: int
    bf16: bool


def parse_deepspeed_name(name: str) -> DeepSpeedName | None:
    """Parse ``mp_rank_00_model_states.pt``, ``bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt`` and kin.

    Returns None for any other name.
    """
    m = _NAME.match(name)
    if m is None:
        return None
    dp = m.group("dp")
    return DeepSpeedName(
        kind=m.group("kind"),
        dp_rank=int(dp) if dp is not None else None,
        mp_rank=int(m.group("mp")),
        bf16=m.group("bf16") is not None,
    )


def read_latest(f: BinaryIO, size: int, limits: Limits = DEFAULT_LIMITS) -> ReadOutcome:
    """Read DeepSpeed's ``latest`` file: the checkpoint tag, stripped as DeepSpeed does (``read().strip()``).

    Problems: ``LIMIT`` when larger than ``limits.text_bytes``, ``MALFORMED`` when not UTF-8 text.
    """
    data = read_bounded(f, size, limits.text_bytes, "text file")
    if isinstance(data, ReadProblem):
        return ReadOutcome(None, (data,))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        msg = f"not UTF-8 text (invalid byte at offset {e.start})"
        return ReadOutcome(None, (ReadProblem(ProblemKind.MALFORMED, msg),))
    if "\x00" in text:
        # A NUL-filled file is what a crash during a write often leaves behind.
        return ReadOutcome(None, (ReadProblem(ProblemKind.MALFORMED, "text file contains NUL bytes"),))
    return ReadOutcome(TextFacts(text.strip()))
