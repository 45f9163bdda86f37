"""The exchange's rounds for the report's figures: the distinct usage patterns of the ranks (the usage map) and
each step's largest cross-rank gap of weights and gradients (the divergence curve).

Patterns are found one at a time: group rank 0's first, then the smallest rank whose pattern is not known yet,
each sent once (3 bits a cell) by its owner, at most `MAX_PATTERNS` of them; then one bit per rank says which
known pattern each rank has. When every rank has the same pattern (one MAX pair shows it), nothing else is sent.
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from ddp_doctor.core.figures import MAX_PATTERNS, rank_grid, rows_of
from ddp_doctor.core.records import ModelInfo, RankRecord
from ddp_doctor.exchange.packing import MIN, MaxRound, Op, Reply, int_digest

__all__ = ["local_gaps", "patterns", "usage_grid"]

_PER_WORD = 21  # 3-bit cells (6 states) in a non-negative int64


def _pack(grid: torch.Tensor) -> torch.Tensor:
    flat = grid.reshape(-1).to(torch.int64)
    words = -(-flat.numel() // _PER_WORD)
    x = torch.zeros(words * _PER_WORD, dtype=torch.int64)
    x[: flat.numel()] = flat
    return (x.view(words, _PER_WORD) << (torch.arange(_PER_WORD, dtype=torch.int64) * 3)).sum(1)


def _unpack(words: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    shifts = torch.arange(_PER_WORD, dtype=torch.int64) * 3
    n = 1
    for d in shape:
        n *= d
    return ((words.unsqueeze(1) >> shifts) & 7).reshape(-1)[:n].reshape(shape)


def usage_grid(record: RankRecord, info: ModelInfo, tracked: torch.Tensor, s: int) -> torch.Tensor:
    """This rank's usage map over the `s` common steps (`rank_grid`): what `patterns` compares."""
    row_names, _, row_of, _ = rows_of(info.param_names)
    return rank_grid(
        used=record.used[:s],
        ran=record.ran[:s],
        trainable=record.trainable[:s],
        tracked=tracked,
        ignored=torch.tensor(info.ignored, dtype=torch.bool),
        row_of=row_of,
        rows=len(row_names),
    )


def patterns(
    grid: torch.Tensor, *, rank: int, world: int
) -> Generator[Op, Reply, tuple[list[torch.Tensor], list[list[int]], list[int]]]:
    """The group's distinct usage grids (int64[R, S] each, group rank 0's first), the group ranks that have each,
    and the ranks whose grid was not among the first `MAX_PATTERNS` found. Collective: the rounds and their shapes
    depend only on the grid's shape, the world size and earlier results."""
    mine = int_digest(grid)
    m = MaxRound()
    m.pair("digest", torch.tensor([mine]))
    hi, lo = m.read((yield ("max", m.tensor())))["digest"]
    if int(hi[0]) == int(lo[0]):
        return [grid], [list(range(world))], []
    known: list[int] = []
    grids: list[torch.Tensor] = []
    for k in range(MAX_PATTERNS):
        owner = 0
        if k:
            q = MaxRound()
            q.slot("next", torch.tensor([-rank if mine not in known else MIN]), True)
            found = int(q.read((yield ("max", q.tensor())))["next"][0])
            if found == MIN:
                break
            owner = -found
        words = _pack(grid)
        got = yield ("sum", words if rank == owner else torch.zeros_like(words))
        theirs = _unpack(got.tensor, tuple(grid.shape))
        known.append(int_digest(theirs))
        grids.append(theirs)
    # Which pattern each rank has: one bit per rank in the row of its pattern (the last row: none found).
    per_word = 63
    bits = torch.zeros(len(known) + 1, -(-world // per_word), dtype=torch.int64)
    row = known.index(mine) if mine in known else len(known)
    bits[row, rank // per_word] = 1 << (rank % per_word)
    got = yield ("sum", bits.reshape(-1))
    words = got.tensor.reshape(bits.shape)
    shifts = torch.arange(per_word, dtype=torch.int64)
    flags = ((words.unsqueeze(-1) >> shifts) & 1).reshape(len(known) + 1, -1)[:, :world]
    members = [flags[i].nonzero().flatten().tolist() for i in range(len(known) + 1)]
    return grids, members[:-1], members[-1]


def local_gaps(mine: torch.Tensor, ref: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's side of the divergence curve over some parameters: `mine` and group rank 0's `ref` fingerprints
    float64[T, N, 2], `keep` bool[T, N]. Returns (float64[T]: the largest |mine - ref| over kept parameters and
    both numbers, NaN on both sides counting as equal; bool[T, N]: kept parameters NaN here and not there, or the
    reverse)."""
    both_nan = mine.isnan() & ref.isnan()
    one_nan = mine.isnan() ^ ref.isnan()
    diff = (
        (mine - ref).abs().masked_fill(both_nan | one_nan, 0.0).amax(-1)
        if mine.numel()
        else torch.zeros(keep.shape, dtype=torch.float64)
    )
    gap = diff.masked_fill(~keep, 0.0).amax(-1) if keep.shape[-1] else torch.zeros(keep.shape[0], dtype=torch.float64)
    return gap, one_nan.any(-1) & keep
