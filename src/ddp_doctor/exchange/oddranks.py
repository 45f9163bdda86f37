"""Name the ranks whose copy of something differs, in all_reduces whose size does not grow with the world size.

Part of the communication layer, with `primitives.py`: `replicas.compare_replicas` and `primitives.agree` use it once
a first all_reduce(MAX) has shown that copies differ. Only all_reduce(SUM) and all_reduce(MAX) are issued. Every
shape, and every decision to issue one more, comes from values already reduced, which are identical on every rank,
so every rank issues the same sequence and none can be left waiting. Each carries at most one row (C numbers) per
entry, and an entry takes part in at most ``3 * CANDIDATES + EXAMPLES`` of them, whatever the world size.

1. The reference copy: the most common one, held by the lowest rank on a tie. The candidates are group rank 0's copy,
   then the copy of the lowest rank that holds none of the candidates so far (so each candidate's owner is the lowest
   rank holding it). A candidate's row reaches every rank through a SUM to which only its owner contributes (adding
   zeros is exact), and a SUM counts the ranks holding it. Once the most common candidate is held by at least as
   many ranks as hold no candidate at all, it is provably the reference: any other copy is held by at most that many
   ranks, and its lowest holder is above every candidate's owner, so it loses a tie. After `CANDIDATES` candidates
   without that proof, the most common candidate is taken and marked unproven (`Odd.proven`).
2. The odd ranks, those whose copy differs from the reference: their count is the world size less the reference's
   holders, and each round of MAX over ``-rank`` names the lowest one above those already named, up to `EXAMPLES`.

Each is written once, as rounds (`*_rounds`: a generator that yields its collectives, as the exchange's protocols
do, so the in-process simulation runs it for every rank), and run over a process group by `drive`.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ddp_doctor.exchange.drive import drive
from ddp_doctor.exchange.packing import Op, Reply

__all__ = [
    "CANDIDATES",
    "EXAMPLES",
    "Named",
    "Odd",
    "all_reduced",
    "name_flagged",
    "name_flagged_rounds",
    "odd_ranks",
    "odd_ranks_rounds",
    "pick",
    "pick_rounds",
]

EXAMPLES = 8
"""How many ranks are named; the others are counted."""

CANDIDATES = 4
"""How many copies are compared as the reference before the most common of them is taken unproven."""


@dataclass(frozen=True, slots=True)
class Named:
    """Some ranks of a group: the lowest of them, and how many more there are."""

    examples: list[int]
    """The lowest ones (group ranks, ascending); all of them when `more` is 0."""
    more: int
    """How many further ranks there are."""


@dataclass(frozen=True, slots=True)
class Odd:
    """One entry's reference copy and the ranks whose copy differs from it."""

    reference: int
    """The group rank holding the reference copy (the most common one, lowest rank on a tie, when `proven`)."""
    holders: int
    """How many ranks hold the reference copy."""
    proven: bool
    """False when `CANDIDATES` copies were compared without proving one of them the most common: `reference`
    then holds the most common of those, and some other copy may be more common."""
    odd: Named
    """The ranks whose copy differs from the reference's."""


def all_reduced(
    values: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None, device: torch.device
) -> torch.Tensor:
    """all_reduce of a tensor the caller built for it (it may be reduced in place); the result on CPU."""
    out = values.to(device)
    dist.all_reduce(out, op=op, group=group)
    return out.cpu()


def _lowest(mask: torch.Tensor, *, rank: int, world: int) -> Generator[Op, Reply, torch.Tensor]:
    """int64[N]: per entry, the lowest group rank whose `mask` is set (some rank must set it). One MAX."""
    # The MAX of -rank; -world is below every rank's value, so ranks that do not set the mask never win.
    values = torch.full(mask.shape, -float(world), dtype=torch.float64)
    values[mask] = -float(rank)
    got = yield ("max", values)
    return (-got.tensor).to(torch.int64)


def pick_rounds(rows: torch.Tensor, owners: torch.Tensor, *, rank: int) -> Generator[Op, Reply, torch.Tensor]:
    """Row ``i`` of group rank ``owners[i]``'s `rows`, on every rank. One SUM.

    Args:
        rows: float64[N, C], this rank's rows (finite); `N` and `C` equal on every rank.
        owners: int64[N], the same on every rank.
    """
    mine = (owners == rank).unsqueeze(1)
    got = yield ("sum", torch.where(mine, rows, torch.zeros_like(rows)))
    return got.tensor


def name_flagged_rounds(
    flags: torch.Tensor, *, rank: int, world: int, limit: int = EXAMPLES, counts: torch.Tensor | None = None
) -> Generator[Op, Reply, list[Named]]:
    """For each entry, the lowest `limit` group ranks whose flag is set, and how many more.

    Args:
        flags: bool[N], this rank's flag per entry; `N` equal on every rank.
        limit: how many ranks to name per entry.
        counts: int64[N], how many ranks set each flag, when the caller knows it (identical on every rank);
            otherwise one SUM counts them.

    Returns:
        One `Named` per entry, identical on every rank, after at most `limit` rounds of MAX.
    """
    if counts is None:
        counts = (yield ("sum", flags.to(torch.float64))).tensor
    totals = [int(c) for c in counts.tolist()]
    found: list[list[int]] = [[] for _ in totals]
    while todo := [i for i, c in enumerate(totals) if len(found[i]) < min(c, limit)]:
        above = torch.tensor([found[i][-1] if found[i] else -1 for i in todo])
        # the lowest flagged rank not named yet
        lowest = yield from _lowest(flags[todo] & (above < rank), rank=rank, world=world)
        for i, r in zip(todo, lowest.tolist()):
            found[i].append(r)
    return [Named(examples=f, more=c - len(f)) for f, c in zip(found, totals)]


def odd_ranks_rounds(
    rows: torch.Tensor, *, rank: int, world: int, limit: int = EXAMPLES
) -> Generator[Op, Reply, list[Odd]]:
    """For each entry whose copies differ somewhere, its reference copy and the ranks that differ from it.

    The reference is the most common copy (the lowest rank's on a tie) whenever that can be proven from
    `CANDIDATES` copies; see the module docstring.

    Args:
        rows: float64[N, C], this rank's copy of each entry (finite; compared exactly); `N` and `C` equal on every
            rank, and each entry known to differ on some rank (as a reduced maximum and minimum show).
        limit: how many odd ranks to name per entry.

    Returns:
        One `Odd` per entry (group ranks), identical on every rank.
    """
    n = rows.shape[0]
    copies = torch.zeros(n, CANDIDATES, rows.shape[1], dtype=rows.dtype)
    owners = torch.zeros(n, CANDIDATES, dtype=torch.int64)
    holders = torch.zeros(n, CANDIDATES, dtype=torch.int64)
    unmatched = torch.ones(n, dtype=torch.bool)  # this rank holds none of the candidates so far
    todo = torch.arange(n)  # entries whose reference is not proven yet
    for j in range(CANDIDATES):
        if j:  # the next owner: the lowest rank holding none of the candidates (some rank does, or it is proven)
            owners[todo, j] = yield from _lowest(unmatched[todo], rank=rank, world=world)
        copies[todo, j] = yield from pick_rounds(rows[todo], owners[todo, j], rank=rank)
        same = (rows[todo] == copies[todo, j]).all(1)
        unmatched[todo] = unmatched[todo] & ~same
        holders[todo, j] = (yield ("sum", same.to(torch.float64))).tensor.to(torch.int64)
        rest = world - holders[todo].sum(1)  # ranks holding no candidate
        todo = todo[holders[todo].max(1).values < rest]
        if not len(todo):
            break
    best = holders.argmax(1)  # the first of the most common: the lowest owner
    every = torch.arange(n)
    reference, count = owners[every, best], holders[every, best]
    differs = (rows != copies[every, best]).any(1)
    named = yield from name_flagged_rounds(differs, rank=rank, world=world, limit=limit, counts=world - count)
    unproven = set(todo.tolist())
    return [
        Odd(reference=int(reference[i]), holders=int(count[i]), proven=i not in unproven, odd=named[i])
        for i in range(n)
    ]


def pick(
    rows: torch.Tensor, owners: torch.Tensor, *, group: dist.ProcessGroup | None, device: torch.device
) -> torch.Tensor:
    """`pick_rounds` over `group`. Collective."""
    return drive(pick_rounds(rows, owners, rank=dist.get_rank(group)), group=group, device=device)


def name_flagged(
    flags: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    device: torch.device,
    limit: int = EXAMPLES,
    counts: torch.Tensor | None = None,
) -> list[Named]:
    """`name_flagged_rounds` over `group`. Collective."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    steps = name_flagged_rounds(flags, rank=rank, world=world, limit=limit, counts=counts)
    return drive(steps, group=group, device=device)


def odd_ranks(
    rows: torch.Tensor, *, group: dist.ProcessGroup | None, device: torch.device, limit: int = EXAMPLES
) -> list[Odd]:
    """`odd_ranks_rounds` over `group`. Collective."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return drive(odd_ranks_rounds(rows, rank=rank, world=world, limit=limit), group=group, device=device)
