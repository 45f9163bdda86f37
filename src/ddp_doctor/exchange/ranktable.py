"""Rounds P of the exchange: the ranks' steps split into phases, in a volume that does not grow with the world size.

Each rank reduces its own steps locally (medians and quartiles: `RankTiming`). Then: one MAX finds the slowest and
the fastest rank's own time and the fewest steps, one more names them; one SUM counts the measured and the waiting
ranks and carries the whole rows of the lowest `SHOWN_LOWEST` ranks, the slowest and the fastest; one MAX gives the
largest third quartile among the others; and a radix select finds the medians over ranks the two step-time rules
need. The result equals `core.steptime.step_times` on every rank's timing (the tests check it).
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from ddp_doctor.core.records import RankRecord
from ddp_doctor.core.steptime import (
    EXAMPLE_SLOTS,
    OTHERS,
    PHASES,
    ROW_SIZE,
    SHOWN_LOWEST,
    WAITING,
    RankTiming,
    StepTimes,
    statistic,
    waits_for_data,
)
from ddp_doctor.exchange.packing import MIN, MaxRound, Op, Reply, SumRound, order_key, unkey
from ddp_doctor.exchange.timing import medians_over_ranks

__all__ = ["local_timing", "per_rank"]


def _quartiles(x: torch.Tensor) -> tuple[float, float, float]:
    q = torch.quantile(x, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64))
    return float(q[0]), float(q[1]), float(q[2])


def local_timing(record: RankRecord, s: int, rank: int) -> RankTiming | None:
    """This rank's phases over its common steps 1..s-1 (the first has no previous step to wait from, and is
    warm-up); None when fewer than two common steps were seen. On a GPU (the record's last two columns timed: see
    `TIMING_COLUMNS`) the wait for data and the step are the GPU's, over the steps it timed."""
    rows = record.timing[1:s]
    gpu = rows.shape[1] > 7 and bool(rows[:, 6:8].isfinite().all(1).any())
    if gpu:
        rows = rows[rows[:, 6:8].isfinite().all(1)]
    if rows.shape[0] == 0:
        return None
    forward, backward, optimizer, data, comm = rows[:, :5].unbind(1)
    # The time the loop's thread waited for a CPU (a machine busy with other work) is not the rank's own work.
    cpu_wait = rows[:, 5] if rows.shape[1] > 5 else torch.zeros_like(comm)
    data = rows[:, 6] if gpu else data.nan_to_num(0.0)
    phases = {
        "data_wait_s": data,
        "forward_s": forward,
        "backward_s": (backward - comm).clamp(min=0.0),
        "comm_wait_s": comm,
        "optimizer_s": optimizer,
    }
    assert tuple(phases) == PHASES
    step = rows[:, 7] if gpu else torch.stack(list(phases.values())).sum(0)
    median, iqr = {}, {}
    for name, values in (*phases.items(), ("step_s", step)):
        q1, q2, q3 = _quartiles(values)
        median[name], iqr[name] = q2, q3 - q1
    share_q1, _, _ = _quartiles(torch.where(step > 0, data / step, torch.zeros_like(step)))
    own_q1, own, own_q3 = _quartiles(step if gpu else (step - comm - cpu_wait).clamp(min=0.0))
    return RankTiming(
        rank=rank,
        steps=int(rows.shape[0]),
        median=median,
        iqr=iqr,
        data_wait_share_q1=share_q1,
        own_s=own,
        own_q1_s=own_q1,
        own_q3_s=own_q3,
        gpu_clock=gpu,
    )


def per_rank(record: RankRecord, s: int, rank: int, world: int) -> Generator[Op, Reply, StepTimes]:
    """The group's `StepTimes`. Collective: every rank yields the same rounds (their shapes depend on the world
    size and on earlier results only)."""
    mine = local_timing(record, s, rank)
    waits = mine is not None and waits_for_data(mine)
    lowest = list(range(min(world, SHOWN_LOWEST)))

    p1 = MaxRound()
    p1.pair("own", order_key(torch.tensor([mine.own_s if mine else 0.0])), mine is not None)
    p1.pair("steps", torch.tensor([mine.steps if mine else 0]), mine is not None)
    p1.pair("wsteps", torch.tensor([mine.steps if mine else 0]), waits)
    slots = torch.full((EXAMPLE_SLOTS,), MIN, dtype=torch.int64)
    if waits:
        slots[rank % EXAMPLE_SLOTS] = -rank
    p1.slot("waiting", slots, True)
    r1 = p1.read((yield ("max", p1.tensor())))
    own_hi, own_lo = int(r1["own"][0][0]), int(r1["own"][1][0])
    if own_hi == MIN:  # no rank measured anything
        return StepTimes(shown=[])
    mine_key = int(order_key(torch.tensor([mine.own_s]))[0]) if mine else None

    p2 = MaxRound()
    p2.slot("who", torch.tensor([-rank if mine_key == own_hi else MIN, -rank if mine_key == own_lo else MIN]), True)
    who = p2.read((yield ("max", p2.tensor())))["who"]
    slowest, fastest = -int(who[0]), -int(who[1])

    chosen = sorted({*lowest, slowest, fastest})
    table = torch.zeros(len(chosen), ROW_SIZE, dtype=torch.int64)
    if rank in chosen:
        row = mine.to_row() if mine else [float("nan")] * ROW_SIZE
        table[chosen.index(rank)] = torch.tensor(row, dtype=torch.float64).view(torch.int64)
    p3 = SumRound(world)
    p3.ints("counts", torch.tensor([int(mine is not None), int(waits)]))
    p3.ints("rows", table)
    r3 = p3.read((yield ("sum", p3.tensor())))
    measured, waiting = (int(v) for v in r3["counts"])
    rows = r3["rows"].contiguous().view(torch.float64).tolist()
    shown = [t for r, row in zip(chosen, rows) if (t := RankTiming.from_row(r, row)) is not None]

    other = mine is not None and rank != slowest
    p4 = MaxRound()
    p4.pair("q3", order_key(torch.tensor([mine.own_q3_s if mine else 0.0])), other)
    q3 = int(p4.read((yield ("max", p4.tensor())))["q3"][0][0])

    values = [statistic(mine, k) if waits else None for k in WAITING]
    values += [statistic(mine, k) if other else None for k in OTHERS]
    counts = [waiting] * len(WAITING) + [measured - 1] * len(OTHERS)
    medians = yield from medians_over_ranks(values, counts, world)
    found = sorted(-int(v) for v in r1["waiting"] if int(v) != MIN)
    return StepTimes(
        shown=shown,
        measured=measured,
        slowest=slowest,
        fastest=fastest,
        steps=int(r1["steps"][1][0]),
        waiting=waiting,
        waiting_ranks=found[:SHOWN_LOWEST],
        waiting_steps=int(r1["wsteps"][1][0]) if waiting else 0,
        waiting_median=dict(zip(WAITING, medians[: len(WAITING)])) if waiting else None,
        others_median=dict(zip(OTHERS, medians[len(WAITING) :])) if measured > 1 else None,
        others_q3_max=unkey(q3) if measured > 1 else None,
    )
