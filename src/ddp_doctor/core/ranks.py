"""Rank lists in words, short at any world size: the one place findings, errors and renderers turn rank numbers
into text.

The exchange names at most a few example ranks and counts the rest (`more`), so every form here takes that count
and ends with it; none drops it. Four forms, for four places:

- `rank_ranges`: the bare list, runs compressed (``0-511, 513-1023 and 41 others``), for after a noun the caller
  writes itself (``seen: ranks ...``).
- `rank_list`: the same with its noun (``rank 3`` / ``ranks 0-7 and 41 others``), for titles and sentences.
- `listed`: the list as Python prints it (``[0, 1] and 41 other ranks``), for finding text that names exact
  ranks (the golden reports and users' greps hold that form).
- `named_ranks`: errors and log lines: ``rank(s) [3, 17]`` when every rank is listed, ``ranks 3, 17 and 41
  others`` when some are counted.

`other_ranks` is the count's tail on its own, for lists of something else per rank (``rank 0: 1024, rank 6: 512
and 3 other ranks``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["listed", "named_ranks", "other_ranks", "rank_list", "rank_ranges", "ranks_label", "ranks_of_label"]

LIMIT = 8
"""How many items (single ranks or runs) a list shows by default: the exchange's number of example ranks."""


def ranks_label(ranks: Iterable[int]) -> str:
    """Ranks as a finding's label (`Finding.labels` holds strings): `"0,3"`, in rank order."""
    return ",".join(map(str, sorted(ranks)))


def ranks_of_label(label: str | None) -> list[int]:
    """The ranks a `ranks_label` holds (none for a missing or empty label)."""
    return [int(r) for r in label.split(",")] if label else []


def other_ranks(more: int, *, noun: bool = True) -> str:
    """`` and 41 other ranks`` / `` and 1 other rank``, or ``""`` when `more` is 0; `noun=False` gives
    `` and 41 others`` (after a list that already says "ranks")."""
    if more <= 0:
        return ""
    plural = "s" if more > 1 else ""
    return f" and {more} other rank{plural}" if noun else f" and {more} other{plural}"


def rank_ranges(ranks: Iterable[int], *, limit: int = LIMIT, more: int = 0) -> str:
    """``0-511, 513-1023``: consecutive ranks compressed into ranges, at most `limit` items shown.

    Args:
        ranks: the ranks named (any order, repeats ignored).
        limit: items shown at most; the rest are said as ``and 17 more ranges``, or, when `more` also counts ranks,
            added to that count so that the phrase keeps one total (``0, 2, 4 and 58 others``).
        more: ranks known to be involved but not in `ranks` (the exchange named only examples).

    Returns:
        ``0, 1, 2 and 41 others``; ``""`` when there is nothing to say.

    Example:
        >>> rank_ranges([3, 17, 250], more=41)
        '3, 17, 250 and 41 others'
    """
    runs: list[tuple[int, int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], r)
        else:
            runs.append((r, r))
    items = [f"{a}" if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}" for a, b in runs]
    text = ", ".join(items[:limit])
    hidden = runs[limit:]
    if hidden and not more:
        return text + f" and {len(hidden)} more range{'s' if len(hidden) > 1 else ''}"
    return text + other_ranks(more + sum(b - a + 1 for a, b in hidden), noun=False)


def rank_list(ranks: Iterable[int], *, limit: int = LIMIT, more: int = 0) -> str:
    """``rank 3`` / ``ranks 0, 2`` / ``ranks 0-511, 513-1023 and 41 others``: `rank_ranges` with its noun."""
    ranks = set(ranks)
    plural = len(ranks) + more > 1
    return f"rank{'s' if plural else ''} {rank_ranges(ranks, limit=limit, more=more)}"


def listed(ranks: Sequence[int], more: int = 0) -> str:
    """``[0, 1]`` as Python prints it, plus ``and 41 other ranks`` when the exchange named only examples."""
    return f"{list(ranks)}{other_ranks(more)}"


def named_ranks(ranks: Sequence[int], more: int = 0, *, prefix: str = "rank(s)") -> str:
    """The ranks of an error or log line: ``rank(s) [3, 17]`` when every rank is listed (`prefix` and the exact
    list), ``ranks 3, 17, 250 and 41 others`` when some are only counted."""
    if not more:
        return f"{prefix} {list(ranks)}"
    return rank_list(ranks, more=more)
