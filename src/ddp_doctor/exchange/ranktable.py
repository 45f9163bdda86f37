"""Round P of the exchange: each rank's step split into phases, as robust statistics over its own common steps.

Each rank reduces its own steps locally (medians and quartiles: `RankTiming`) and puts the `ROW_SIZE` floats in its
row of a [W, ROW_SIZE] table that one SUM fills. This is the one round whose volume grows with the world size, by
`ROW_SIZE` float64 per rank (about 130 bytes: 130 KB at a thousand ranks); the steps never add to it.
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from ddp_doctor.core.records import RankRecord
from ddp_doctor.core.steptime import PHASES, ROW_SIZE, RankTiming
from ddp_doctor.exchange.packing import Op, Reply, SumRound

__all__ = ["local_timing", "per_rank"]


def _quartiles(x: torch.Tensor) -> tuple[float, float, float]:
    q = torch.quantile(x, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
    return float(q[0]), float(q[1]), float(q[2])


def local_timing(record: RankRecord, s: int, rank: int) -> RankTiming | None:
    """This rank's phases over its common steps 1..s-1 (the first has no previous step to wait from, and is
    warm-up); None when fewer than two common steps were seen."""
    rows = record.timing[1:s]
    if rows.shape[0] == 0:
        return None
    forward, backward, optimizer, data, comm = rows.unbind(1)
    data = data.nan_to_num(0.0)
    phases = {
        "data_wait_s": data,
        "forward_s": forward,
        "backward_s": (backward - comm).clamp(min=0.0),
        "comm_wait_s": comm,
        "optimizer_s": optimizer,
    }
    assert tuple(phases) == PHASES
    step = torch.stack(list(phases.values())).sum(0)
    median, iqr = {}, {}
    for name, values in (*phases.items(), ("step_s", step)):
        q1, q2, q3 = _quartiles(values)
        median[name], iqr[name] = q2, q3 - q1
    share_q1, _, _ = _quartiles(torch.where(step > 0, data / step, torch.zeros_like(step)))
    own_q1, own, own_q3 = _quartiles(step - comm)
    return RankTiming(
        rank=rank,
        steps=int(rows.shape[0]),
        median=median,
        iqr=iqr,
        data_wait_share_q1=share_q1,
        own_s=own,
        own_q1_s=own_q1,
        own_q3_s=own_q3,
    )


def per_rank(record: RankRecord, s: int, rank: int, world: int) -> Generator[Op, Reply, list[list[float]]]:
    """Every rank's `RankTiming.to_row()` (all NaN for a rank with nothing to measure). Collective: every rank
    yields the same round."""
    mine = local_timing(record, s, rank)
    row = torch.tensor(mine.to_row() if mine else [float("nan")] * ROW_SIZE, dtype=torch.float64)
    table = torch.zeros(world, ROW_SIZE, dtype=torch.int64)
    # Each rank fills its own row with its floats' bits and leaves the others zero: the sum is every row exactly.
    table[rank] = row.view(torch.int64)
    p = SumRound(world)
    p.ints("rows", table)
    got = p.read((yield ("sum", p.tensor())))["rows"]
    return got.contiguous().view(torch.float64).tolist()
