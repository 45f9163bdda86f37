"""Rounds T of the exchange: exact medians of the step timings over every rank's common steps, by a radix select
on summed histograms (16 rounds of 4-bit digits: more, but tiny, collectives than 8 rounds of bytes, and 8 times
fewer counts). The volume depends on neither the world size nor the step count."""

from __future__ import annotations

from collections.abc import Generator

import torch

from ddp_doctor.core.records import RankRecord
from ddp_doctor.exchange.packing import Op, Reply, SumRound, order_key, unkey

__all__ = ["medians"]


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
