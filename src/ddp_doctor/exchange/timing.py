"""Rounds T of the exchange: exact medians of the step timings over every rank's common steps, by a radix select
on summed histograms (16 rounds of 4-bit digits: more, but tiny, collectives than 8 rounds of bytes, and 8 times
fewer counts). The volume depends on neither the world size nor the step count. And for a sharded model, whose
steps the exchange does not see, the one round that finds its slowest rank (`slowest_rank`)."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch

from ddp_doctor.core.records import RankRecord
from ddp_doctor.exchange.packing import Op, Reply, SumRound, order_key, unkey
from ddp_doctor.exchange.primitives import minmax_rounds

__all__ = ["medians", "medians_over_ranks", "slowest_rank"]


def medians(record: RankRecord, s: int, world: int) -> Generator[Op, Reply, list[float | None]]:
    """Forward, backward, optimizer and step medians over the `s` common steps of all `world` ranks (None: no
    step). Collective: every rank yields the same rounds."""
    timing: list[float | None] = [None] * 4
    if s:
        rows = record.timing[:s, :3]  # forward, backward, optimizer
        values = torch.cat([rows, rows.sum(1, keepdim=True)], 1)  # [s, 4]
        keys = order_key(values)
        total = world * s
        # The middle element (odd count), or the two middle ones, of each quantity's world * s values.
        targets = [(total - 1) // 2, total // 2] if total % 2 == 0 else [total // 2]
        n_sel = len(targets)
        remaining = [[t] * 4 for t in targets]  # [selection][quantity]
        prefix: list[list[int | None]] = [[None] * 4 for _ in targets]
        # 16 rounds of 4-bit digits: more (tiny) collectives than 8 rounds of bytes, 8 times fewer counts.
        offsets = torch.arange(4, dtype=torch.int64) * 16  # one bincount for the 4 quantities' 16 bins each
        for level in range(16):
            shift = 60 - 4 * level
            digit = ((keys >> 60) + 8) if level == 0 else ((keys >> shift) & 0xF)
            hist = torch.zeros(n_sel, 4, 16, dtype=torch.int64)
            for j in range(n_sel):
                picked = digit + offsets
                if level:
                    picked = picked[(keys >> (shift + 4)) == torch.tensor(prefix[j], dtype=torch.int64)]
                hist[j] = torch.bincount(picked.reshape(-1), minlength=64).view(4, 16)
            t = SumRound(world)
            t.counts("hist", hist, total)
            _descend((yield ("sum", t.tensor())), t, remaining, prefix, level)
        for q in range(4):
            lo, hi = unkey(prefix[0][q]), unkey(prefix[-1][q])
            timing[q] = lo if total % 2 else (lo + hi) / 2
    return timing


def _descend(reply: Reply, t: SumRound, remaining: list[list[int]], prefix: list[list[Any]], level: int) -> None:
    """One digit of the radix select, from the summed histograms `[selection][quantity][16]` in `reply`: each
    selection's target falls in the bin where the cumulative count passes what remains of it; that bin extends the
    selection's prefix (the top digit is signed) and the counts below it leave the target (in place)."""
    got = t.read(reply)["hist"].cumsum(-1).tolist()
    for j, rows in enumerate(got):
        for q, cum in enumerate(rows):
            bin_ = sum(c <= remaining[j][q] for c in cum)
            remaining[j][q] -= cum[bin_ - 1] if bin_ else 0
            prefix[j][q] = bin_ - 8 if level == 0 else prefix[j][q] * 16 + bin_


def medians_over_ranks(
    values: list[float | None], counts: list[int], world: int
) -> Generator[Op, Reply, list[float | None]]:
    """For each quantity q, the median of the values the ranks hold (`values[q]`, None where this rank holds none),
    `counts[q]` of them over the group (None: no rank holds one). The same radix select as `medians`, one value per
    rank and quantity: 16 rounds whose size depends on neither the world size nor the values. Collective."""
    n_q = len(values)
    keys = order_key(torch.tensor([v if v is not None else 0.0 for v in values], dtype=torch.float64)).tolist()
    held = [v is not None for v in values]
    # The middle element (odd count) or the two middle ones (even): selection 0 and 1 (the same when odd).
    remaining = [[(c - 1) // 2 if c else 0 for c in counts], [c // 2 for c in counts]]
    prefix: list[list[int]] = [[0] * n_q, [0] * n_q]
    for level in range(16):
        shift = 60 - 4 * level
        hist = [[[0] * 16 for _ in range(n_q)] for _ in range(2)]
        for j in range(2):
            for q, k in enumerate(keys):
                if not held[q] or (level and (k >> (shift + 4)) != prefix[j][q]):
                    continue
                hist[j][q][((k >> 60) + 8) if level == 0 else ((k >> shift) & 0xF)] = 1
        t = SumRound(world)
        t.counts("hist", torch.tensor(hist, dtype=torch.int64).view(2, n_q, 16), world)
        _descend((yield ("sum", t.tensor())), t, remaining, prefix, level)
    return [
        None if not c else (unkey(prefix[0][q]) + unkey(prefix[1][q])) / 2 if c % 2 == 0 else unkey(prefix[0][q])
        for q, c in enumerate(counts)
    ]


def slowest_rank(
    mine: dict[str, Any] | None, top: dict[str, float], low: dict[str, float], *, rank: int
) -> Generator[Op, Reply, dict[str, Any] | None]:
    """For a sharded model's steps timed on CPU (`observation/step_clock.py`; `mine`: this rank's `StepClock.stats`,
    None where no clock ran): when every rank timed its steps and its collectives, and some rank's own work is the
    longest (from the reduced `StepClock.slots`: MAX in `top`, MIN in `low`), one more fixed-shape min/max that names that rank and gives its
    own time's median and quartiles, its median wait between steps and time in collectives, and, over the other
    ranks, the longest
    median and third quartile of own work and wait between steps, and the shortest median time in collectives (the
    bounds `straggler-rank` needs, whatever the world size).
    Yields one collective whenever it does not return None; every rank decides alike from the reduced figures. None
    also when two ranks tie as the slowest."""
    if mine is None or low["comm_timed"] < 1 or low["timed_steps"] < 2 or top["own_s"] <= low["own_s"]:
        return None
    slow = torch.tensor(mine["own_s"], dtype=torch.float32).item() == top["own_s"]  # as the reduction held it
    far = float(2**24)  # above any rank and any time in seconds, exact in float32
    values = [
        rank if slow else far,
        rank if slow else -1.0,
        *((mine["own_q1_s"], mine["own_q3_s"], mine["wait_s"], mine["comm_s"]) if slow else (0.0, 0.0, 0.0, 0.0)),
        *((0.0, 0.0, 0.0, far) if slow else (mine["own_s"], mine["own_q3_s"], mine["wait_s"], mine["comm_s"])),
    ]
    high, least = yield from minmax_rounds(torch.tensor(values, dtype=torch.float64))
    if least[0] != high[1]:
        return None  # two ranks tie as the slowest
    return {
        "rank": int(least[0]),
        "steps": int(low["timed_steps"]),
        "own_s": top["own_s"],
        "own_q1_s": float(high[2]),
        "own_q3_s": float(high[3]),
        "wait_s": float(high[4]),
        "comm_s": float(high[5]),
        "others_own_s": float(high[6]),
        "others_own_q3_s": float(high[7]),
        "others_wait_s": float(high[8]),
        "others_comm_s": float(least[9]),
    }
