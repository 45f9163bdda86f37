"""The data of the report's figures (usage map, divergence curve), from the exchange's `Summary`. Pure: no
communication.

The exchange already carries what the figures need (`exchange/patterns.py`): the distinct per-rank grids of cell
states, with the ranks that have each, and each step's largest gap of weights and gradients against group rank 0.
The cell states use the same masks as the findings: `used`, `ran`, `trainable`, and `tracked` (trainable at wrap
time, including the inference of parameters unfrozen before `observe()`), so a cell marked "blocked" or "flipped"
means what the `grad-blocked`, `frozen-after-wrap` and `unfrozen-after-wrap` findings mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ddp_doctor.core.figures import MAX_PATTERNS, STATES, Divergence, RankPattern, UsageMap, UsageRow, rows_of
from ddp_doctor.core.findings import Finding
from ddp_doctor.core.summary import Summary

__all__ = ["divergence", "figures", "usage_map"]

_KEYS = list(STATES)


def figures(summary: Summary, findings: Sequence[Finding] = ()) -> tuple[UsageMap | None, Divergence | None]:
    """Both figures' data for one DDP model; None where there is nothing to draw (no complete step).

    Args:
        summary: the group's exchange.
        findings: the diagnosis's findings, whose codes tag the usage map's rows.

    Returns:
        (usage map, divergence curve).
    """
    if not summary.steps or not summary.info.param_names:
        return None, None
    return usage_map(summary, findings), divergence(summary)


def usage_map(summary: Summary, findings: Sequence[Finding] = ()) -> UsageMap:
    """Which parameter (or module) got a gradient on which rank at which step, with ranks deduplicated.

    Args:
        summary: the group's exchange (its distinct per-rank grids).
        findings: their findings; each row lists the codes that name its parameters.

    Returns:
        The map: rows in model order, at most `MAX_ROWS` (modules above that), and at most `MAX_PATTERNS` distinct
        rank patterns, rank 0's first, then the most common, in global ranks.
    """
    info = summary.info
    names = info.param_names
    row_names, modules, rows, aggregated = rows_of(info.param_names)  # as the exchange built each rank's grid
    row_of = rows.tolist()
    to_global = info.group_ranks or list(range(summary.world))

    def global_rank(w: int) -> int:
        return to_global[w] if w < len(to_global) else w

    found = [(grid, members) for grid, members in summary.patterns if members]
    order = sorted(range(len(found)), key=lambda u: (0 not in found[u][1][:1], -len(found[u][1]), found[u][1][0]))
    kept, dropped = order[:MAX_PATTERNS], order[MAX_PATTERNS:]
    patterns = [
        RankPattern(
            ranks=[global_rank(w) for w in found[u][1]],
            cells=["".join(_KEYS[c] for c in row) for row in found[u][0].tolist()],
        )
        for u in kept
    ]
    omitted = [global_rank(w) for u in dropped for w in found[u][1]] + [
        global_rank(w) for w in summary.patterns_omitted
    ]
    codes: list[list[str]] = [[] for _ in row_names]
    index_of = {n: i for i, n in enumerate(names)}
    for f in findings:
        for p in f.params:
            if p.name in index_of:
                row = codes[row_of[index_of[p.name]]]
                if f.code not in row:
                    row.append(f.code)
    numels, counts_per_row = [0] * len(row_names), [0] * len(row_names)
    for i, numel in enumerate(info.numels):
        numels[row_of[i]] += numel
        counts_per_row[row_of[i]] += 1
    rows = [
        UsageRow(name=n, module=m, params=c, numel=e, codes=k)
        for n, m, c, e, k in zip(row_names, modules, counts_per_row, numels, codes)
    ]
    return UsageMap(
        steps=summary.steps, aggregated=aggregated, rows=rows, patterns=patterns, ranks_omitted=sorted(omitted)
    )


def divergence(summary: Summary) -> Divergence:
    """The weights' and gradients' largest cross-rank difference per step, and the step where each started.

    Args:
        summary: the group's exchange (its curve: gaps against group rank 0 over the parameters that differ).

    Returns:
        The curve; zero everywhere and no start step when every rank agreed bit for bit.
    """
    c = summary.curve
    weights = [math.inf if m else w for w, m in zip(c.weights, c.weights_missing)]
    w_start = next((i - 1 for i, w in enumerate(weights) if w > 0), None)
    g_start = next((s for s, (g, m) in enumerate(zip(c.grads, c.grads_missing)) if g > 0 or m), None)
    return Divergence(
        weights=weights,
        grads=list(c.grads),
        grads_missing=list(c.grads_missing),
        weights_start=w_start,
        grads_start=g_start,
    )
