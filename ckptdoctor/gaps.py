"""The indices missing from ``0 .. n-1``, counted rather than materialised.

``n`` is a number a checkpoint states: a rank in a file name (``__999999999_0.distcp``, ``zero_pp_rank_R_...``), a
world size in a pickle (``dp_world_size``, torchtitan's ``dataloader.world_size``). A rule that built
``set(range(n))`` would let one hostile name allocate gigabytes; these helpers cost what the files present cost,
whatever ``n`` says, and a message names the first few missing indices and counts the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

# A message lists every missing index up to this many (every honest checkpoint's list), else the first _SHOWN.
_LISTED_WHOLE = 32
_SHOWN = 8
# Bits of a count printed in full: about 1,200 digits, well under Python's 4,300-digit int-to-str limit.
PRINTABLE_BITS = 4000


def missing_below(n: int, present: Iterable[int], first: int = _LISTED_WHOLE) -> tuple[int, list[int]]:
    """``(how many of 0 .. n-1 are not in present, the first `first` of them ascending)``; 0 missing when n < 1.

    Costs ``len(present)``, never ``n``: the gaps are walked between the present indices in order."""
    have = sorted({r for r in present if 0 <= r < n})
    count = max(n, 0) - len(have)
    out: list[int] = []
    nxt = 0
    for r in [*have, max(n, 0)]:
        take = min(r - nxt, first - len(out))
        out.extend(range(nxt, nxt + take))
        if len(out) >= first:
            break
        nxt = r + 1
    return count, out


def count_text(n: int, grouped: bool = True) -> str:
    """``n`` for a message (with thousands separators unless ``grouped`` is False); one too long for Python to
    print (a world size from a pickle) by its size."""
    if n.bit_length() > PRINTABLE_BITS:
        return f"<an integer of {n.bit_length():,} bits>"
    return f"{n:,}" if grouped else str(n)


def listed(count: int, first: list[int], name: Callable[[int], str] = str) -> str:
    """The missing indices for a message: all of them, joined with ``", "``, when they are few (``count`` at most
    32, what the message always said), else the first 8 and how many more."""
    if count <= _LISTED_WHOLE:
        return ", ".join(map(name, first[:count]))
    return ", ".join(map(name, first[:_SHOWN])) + f" ... and {count_text(count - _SHOWN)} more"
