"""The data of the report's figures (usage map, divergence curve), from the aligned `View`. Pure: no communication.

Everything here is read from what the report builder already holds (the ranks' records), so it adds nothing to
the cross-rank exchange. The cell states use the `View`'s own masks: `used`, `ran`, `trainable`, and `tracked`
(trainable at wrap time, including its inference of parameters unfrozen before `observe()`), so a cell marked
"blocked" or "flipped" means what the `grad-blocked`, `frozen-after-wrap` and `unfrozen-after-wrap` findings mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ddp_doctor.analyze.view import View
from ddp_doctor.records import ModelInfo, RankRecord
from ddp_doctor.report.figures import (
    MAX_PATTERNS,
    MAX_ROWS,
    NOTABLE,
    STATES,
    Divergence,
    RankPattern,
    UsageMap,
    UsageRow,
)
from ddp_doctor.report.model import Finding

__all__ = ["cell_states", "divergence", "figures", "usage_map"]

_KEYS = list(STATES)


def figures(info: ModelInfo, records: list[RankRecord],
            findings: Sequence[Finding] = ()) -> tuple[UsageMap | None, Divergence | None]:
    """Both figures' data for one DDP model; None where there is nothing to draw (no complete step).

    Args:
        info: the model as DDP wrapped it.
        records: one `RankRecord` per rank of the model's process group, in group order.
        findings: the diagnosis's findings, whose codes tag the usage map's rows.

    Returns:
        (usage map, divergence curve).
    """
    view = View(info, records)
    if not view.steps or not info.param_names:
        return None, None
    return usage_map(view, findings), divergence(view)


def cell_states(v: View) -> torch.Tensor:
    """int64[W, S, P] indices into `STATES`' keys. Later rules win: a flipped or ignored parameter is shown as
    such whatever else happened to it."""
    state = torch.full(v.used.shape, _KEYS.index("N"), dtype=torch.int64)
    state[v.ran & ~v.used] = _KEYS.index("B")
    state[v.used] = _KEYS.index("U")
    state[~v.trainable] = _KEYS.index("F")
    state[v.trainable != v.tracked] = _KEYS.index("X")
    state[:, :, v.ignored] = _KEYS.index("I")
    return state


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else "(top level)"


def _group_rows(names: list[str]) -> tuple[list[str], list[str], list[int], bool]:
    """(row names, row modules, row index of each parameter, aggregated)."""
    if len(names) <= MAX_ROWS:
        return names, [_module(n) for n in names], list(range(len(names))), False
    parts = [_module(n).split(".") for n in names]
    for depth in range(max(len(p) for p in parts), 0, -1):
        keys = [".".join(p[:depth]) for p in parts]
        distinct = list(dict.fromkeys(keys))
        if len(distinct) <= MAX_ROWS:
            index = {k: i for i, k in enumerate(distinct)}
            return distinct, [k.split(".")[0] for k in distinct], [index[k] for k in keys], True
    # Hundreds of top-level modules: consecutive runs of parameters, in model order.
    size = math.ceil(len(names) / MAX_ROWS)
    rows = [f"{names[i]} ... {names[min(i + size, len(names)) - 1]}" for i in range(0, len(names), size)]
    return rows, ["(parameters in model order)"] * len(rows), [i // size for i in range(len(names))], True


def usage_map(v: View, findings: Sequence[Finding] = ()) -> UsageMap:
    """Which parameter (or module) got a gradient on which rank at which step, with ranks deduplicated.

    Args:
        v: the aligned records.
        findings: their findings; each row lists the codes that name its parameters.

    Returns:
        The map: rows in model order, at most `MAX_ROWS` (modules above that), and at most `MAX_PATTERNS` distinct
        rank patterns, rank 0's first, in global ranks.
    """
    names = v.info.param_names
    row_names, modules, row_of, aggregated = _group_rows(names)
    state = cell_states(v)                                              # [W, S, P]
    if aggregated:
        # Each module row shows its most notable parameter's state: rank states by NOTABLE, take the min per row.
        rank_of = torch.tensor([NOTABLE.index(k) for k in _KEYS])
        prio = rank_of[state]
        index = torch.tensor(row_of).expand_as(prio)
        init = torch.full((*prio.shape[:2], len(row_names)), len(NOTABLE), dtype=torch.int64)
        best = init.scatter_reduce(-1, index, prio, reduce="amin", include_self=True)
        back = torch.tensor([_KEYS.index(k) for k in NOTABLE])
        state = back[best]
    grid = state.transpose(1, 2).reshape(v.world, -1)                   # [W, R * S]
    unique, inverse, counts = torch.unique(grid, dim=0, return_inverse=True, return_counts=True)
    to_global = v.info.group_ranks or list(range(v.world))
    members: dict[int, list[int]] = {}
    for w, u in enumerate(inverse.tolist()):
        members.setdefault(u, []).append(to_global[w] if w < len(to_global) else w)
    order = sorted(members, key=lambda u: (0 not in members[u][:1], -int(counts[u]), members[u][0]))
    kept, dropped = order[:MAX_PATTERNS], order[MAX_PATTERNS:]
    patterns = []
    for u in kept:
        cells = unique[u].reshape(len(row_names), v.steps).tolist()
        patterns.append(RankPattern(ranks=members[u], cells=["".join(_KEYS[c] for c in row) for row in cells]))
    codes: list[list[str]] = [[] for _ in row_names]
    index_of = {n: i for i, n in enumerate(names)}
    for f in findings:
        for p in f.params:
            if p.name in index_of:
                row = codes[row_of[index_of[p.name]]]
                if f.code not in row:
                    row.append(f.code)
    numels, counts_per_row = [0] * len(row_names), [0] * len(row_names)
    for i, numel in enumerate(v.info.numels):
        numels[row_of[i]] += numel
        counts_per_row[row_of[i]] += 1
    rows = [UsageRow(name=n, module=m, params=c, numel=e, codes=k)
            for n, m, c, e, k in zip(row_names, modules, counts_per_row, numels, codes)]
    return UsageMap(steps=v.steps, aggregated=aggregated, rows=rows, patterns=patterns,
                    ranks_omitted=sorted(r for u in dropped for r in members[u]))


def _gap(fp: torch.Tensor, keep: torch.Tensor) -> tuple[list[float], list[int]]:
    """fp: [W, T, P, 2], keep: bool[T, P]. Per T: (max |fp(rank r) - fp(rank 0)| over kept params, ranks and both
    numbers, the number of kept params that are NaN on some ranks only)."""
    ref = fp[:1]
    both_nan = fp.isnan() & ref.isnan()
    one_nan = fp.isnan() ^ ref.isnan()
    diff = (fp - ref).abs().masked_fill(both_nan | one_nan, 0.0).amax(-1).amax(0)      # [T, P]
    missing = one_nan.any(-1).any(0) & keep                                             # [T, P]
    if not keep.shape[-1]:
        return [0.0] * keep.shape[0], [0] * keep.shape[0]
    return diff.masked_fill(~keep, 0.0).amax(-1).tolist(), missing.sum(-1).tolist()


def divergence(v: View) -> Divergence:
    """The weights' and gradients' largest cross-rank difference per step, and the step where each started.

    Args:
        v: the aligned records (their weight and gradient fingerprints).

    Returns:
        The curve; zero everywhere and no start step when every rank agreed bit for bit.
    """
    kept = ~v.ignored
    weights, w_missing = _gap(v.weight_fp, kept.expand(v.steps + 1, -1))
    # Only parameters trainable on every rank at the step, as the grads-not-synced finding compares them.
    grads, g_missing = _gap(v.grad_fp, v.trainable.all(0) & kept)
    weights = [math.inf if m else w for w, m in zip(weights, w_missing)]
    w_start = next((i - 1 for i, w in enumerate(weights) if w > 0), None)
    g_start = next((s for s, (g, m) in enumerate(zip(grads, g_missing)) if g > 0 or m), None)
    return Divergence(weights=weights, grads=grads, grads_missing=g_missing, weights_start=w_start,
                      grads_start=g_start)
