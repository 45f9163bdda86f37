"""Rank lists in words, short at any world size: runs compressed into ranges, a bounded number of items shown.

The one place findings and renderers turn rank numbers into text.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["listed", "rank_list", "rank_ranges"]


def rank_ranges(ranks: Iterable[int], *, limit: int = 6, more: int = 0) -> str:
    """``0-511, 513-1023``: consecutive ranks compressed into ranges, at most `limit` items shown; `more` counts
    ranks known to be involved but not listed (``0, 1, 2 and 41 others``)."""
    ranks = sorted(set(ranks))
    runs: list[tuple[int, int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    items = [f"{a}" if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in runs]
    text = ", ".join(items[:limit])
    if len(items) > limit:
        text += f" and {len(items) - limit} more ranges"
    if more:
        text += f" and {more} other{'s' if more > 1 else ''}"
    return text


def rank_list(ranks: list[int], *, limit: int = 6, more: int = 0) -> str:
    """`rank 3` / `ranks 0, 2` / `ranks 0-511, 513-1023`: runs compressed, at most `limit` items shown."""
    plural = len(set(ranks)) + more > 1
    return f"rank{'s' if plural else ''} {rank_ranges(ranks, limit=limit, more=more)}"


def listed(ranks: list[int], more: int = 0) -> str:
    """A rank list inside a finding's text: ``[0, 1]`` as Python prints it, plus ``and 41 other ranks`` when the
    exchange named only examples."""
    return f"{ranks}" + (f" and {more} other rank{'s' if more > 1 else ''}" if more else "")
