"""Rounds T of the exchange: exact medians of the step timings over every rank's common steps, by a radix select
on summed histograms (16 rounds of 4-bit digits: more, but tiny, collectives than 8 rounds of bytes, and 8 times
fewer counts). The volume depends on neither the world size nor the step count."""

from __future__ import annotations

from collections.abc import Generator

import torch

from ddp_doctor.core.records import RankRecord
from ddp_doctor.exchange.packing import Op, Reply, SumRound, order_key, unkey

__all__ = ["medians", "medians_over_ranks"]


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
        for level in range(16):
            shift = 60 - 4 * level
            digit = ((keys >> 60) + 8) if level == 0 else ((keys >> shift) & 0xF)
            hist = torch.zeros(n_sel, 4, 16, dtype=torch.int64)
            for j in range(n_sel):
                for q in range(4):
                    sel = torch.ones(s, dtype=torch.bool) if level == 0 else (keys[:, q] >> (shift + 4)) == prefix[j][q]
                    hist[j, q] = torch.bincount(digit[sel, q], minlength=16)
            t = SumRound(world)
            t.counts("hist", hist, total)
            got = t.read((yield ("sum", t.tensor())))["hist"]
            for j in range(n_sel):
                for q in range(4):
                    cum = got[j, q].cumsum(0)
                    bin_ = int((cum <= remaining[j][q]).sum())
                    remaining[j][q] -= int(cum[bin_ - 1]) if bin_ else 0
                    base = prefix[j][q]
                    prefix[j][q] = bin_ - 8 if level == 0 else base * 16 + bin_
        for q in range(4):
            lo, hi = unkey(prefix[0][q]), unkey(prefix[-1][q])
            timing[q] = lo if total % 2 else (lo + hi) / 2
    return timing


def medians_over_ranks(
    values: list[float | None], counts: list[int], world: int
) -> Generator[Op, Reply, list[float | None]]:
    """For each quantity q, the median of the values the ranks hold (`values[q]`, None where this rank holds none),
    `counts[q]` of them over the group (None: no rank holds one). The same radix select as `medians`, one value per
    rank and quantity: 16 rounds whose size depends on neither the world size nor the values. Collective."""
    n_q = len(values)
    keys = order_key(torch.tensor([v if v is not None else 0.0 for v in values], dtype=torch.float64))
    held = [v is not None for v in values]
    # The middle element (odd count) or the two middle ones (even): selection 0 and 1 (the same when odd).
    remaining = [[(c - 1) // 2 if c else 0 for c in counts], [c // 2 for c in counts]]
    prefix: list[list[int]] = [[0] * n_q, [0] * n_q]
    for level in range(16):
        shift = 60 - 4 * level
        hist = torch.zeros(2, n_q, 16, dtype=torch.int64)
        for j in range(2):
            for q in range(n_q):
                k = int(keys[q])
                if not held[q] or (level and (k >> (shift + 4)) != prefix[j][q]):
                    continue
                digit = ((k >> 60) + 8) if level == 0 else ((k >> shift) & 0xF)
                hist[j, q, digit] = 1
        t = SumRound(world)
        t.counts("hist", hist, world)
        got = t.read((yield ("sum", t.tensor())))["hist"]
        for j in range(2):
            for q in range(n_q):
                cum = got[j, q].cumsum(0)
                bin_ = int((cum <= remaining[j][q]).sum())
                remaining[j][q] -= int(cum[bin_ - 1]) if bin_ else 0
                prefix[j][q] = bin_ - 8 if level == 0 else prefix[j][q] * 16 + bin_
    return [
        None if not c else (unkey(prefix[0][q]) + unkey(prefix[1][q])) / 2 if c % 2 == 0 else unkey(prefix[0][q])
        for q, c in enumerate(counts)
    ]
