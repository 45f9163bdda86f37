"""`straggler-rank`: one rank is slower at its own work and the others wait for it in the gradient reduction,
decided for every parallelism (DDP's first steps here and a sharded model's; `watch`'s windows in
`launch/watch_windows.py` through `core/steptime.straggles`). How the steps are measured is
`analyze/throughput.py`'s.

The rank with the longest own time (step less its communication wait, and less the time its
training thread was ready to run but waited for a CPU: Linux's run-queue delay, so a rank starved by other jobs
on a shared machine is not called slow at its own work) is a straggler when
its median own time is at least `STRAGGLER_RATIO` times the other ranks' median and `MIN_WAIT_S` longer, its
first quartile is above every other rank's third quartile (slower in most steps, not in a few), the difference
is larger than the step-to-step spread of its own time (the interquartile range: a rank starved of CPU by
another job on a shared machine is slow by varying amounts), and the other ranks lose at least half of that
difference waiting in DDP's all-reduce, more than the slow rank itself waits there (it reaches the all-reduce
last, so it waits least; a wait every rank shares is not a wait for it).

It needs at least `MIN_STEPS` measured steps on every rank compared. On GPUs it does not run: the waits in NCCL's
collectives, on streams of their own, are not timed.
"""

from __future__ import annotations

from ddp_doctor.analyze.throughput import ms
from ddp_doctor.analyze.view import detects
from ddp_doctor.core.agreed import Agreed
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure
from ddp_doctor.core.steptime import MIN_STEPS, PHASE_LABELS, straggles

__all__ = ["straggler_finding", "straggler_fix", "straggler_rank"]

_MEASURED = "Measured on this machine over {n} steps (the first observed step left out)"


@detects(Code.STRAGGLER_RANK, road="every")
def straggler_rank(a: Agreed) -> list[Finding]:
    """The rule above, on the figures the exchange carries: DDP's the other ranks' medians, a sharded model's their
    bounds (`Slowest.bounds`).

    Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks (`tests/scripts/fsdp2_straggler.py`, rank 1 runs
    60 products of 256x256 matrices on each batch before its forward; three sharded Linear layers): rank 1 spent 74
    ms a step on that and 38 ms in its forward and backward, while rank 0's forward and backward took 113 ms (21 ms
    when no rank does the extra work): rank 0 waits about 90 ms a step in the all-gathers and reduce-scatters. With
    `replicate`, 112 ms of extra work and rank 0's forward and backward at 130 ms (12 ms without). All end with exit
    code 0: nothing says the job runs at the pace of its slowest rank. On a machine whose cores are
    oversubscribed, gloo's collectives take most of a tiny model's step on every rank, and one rank's own work
    reads about 12 ms longer in most steps from noise: the others then spend no longer in the collectives than it
    does (the last bound of `straggles`)."""
    s = a.slowest
    if s is None or s.steps < MIN_STEPS:
        return []
    if not straggles(
        own=s.own_s,
        others_own=s.others_s,
        own_quartiles=s.own_q,
        others_q3=s.others_q3_s,
        others_comm=s.lost_s,
        own_comm=s.own_comm_s,
    ):
        return []
    than = "any other rank" if s.bounds else "the others"
    if s.phase == "data_wait":
        where = (
            "between steps (the wait for the next batch and anything else the loop does before the forward: "
            f"{ms(s.phase_extra_s or 0.0)} more than {than})"
        )
    elif s.phase == "step":
        where = "within the step (its forward, backward or optimizer step)"
    else:
        where = f"in its {PHASE_LABELS[s.phase + '_s']} ({ms(s.phase_extra_s or 0.0)} more than {than})"
    collectives = (
        "DDP's gradient all-reduce"
        if a.parallelism == "ddp"
        else "the sharded model's all-gathers and gradient reductions"
    )
    found = straggler_finding(
        rank=s.rank,
        name=s.name,
        own=s.own_s,
        others=s.others_s,
        lost=s.lost_s,
        where=where,
        phase=s.phase,
        steps=s.steps,
        collectives=collectives,
        bounds=s.bounds,
    )
    return [found]


def straggler_finding(
    *,
    rank: int,
    name: object,
    own: float,
    others: float,
    lost: float,
    where: str,
    phase: str,
    steps: int,
    collectives: str,
    bounds: bool = False,
) -> Finding:
    """`straggler-rank`, for every parallelism: group rank `rank` (`name` as users number it) does `own` seconds of
    its own work per step against `others` on the other ranks (their median; with `bounds`, the longest of them),
    and the others wait `lost` per step in `collectives` (with `bounds`, the shortest of their waits); `where` says
    where its extra time goes, over `steps` timed steps, and `phase` names it (`data_wait`, `forward`, `backward`,
    `optimizer`; `step` where only the step as a whole was timed)."""
    ratio = own / others if others > 0 else float("inf")
    # A tiny model's own work rounds to nothing on the other ranks: no ratio then, the difference.
    tiny = others < 1e-3
    slower = f"does {ms(own - others)} more work per step" if tiny else f"is {ratio:.1f}x slower"
    against = f"at most {ms(others)} on any other rank" if bounds else f"{ms(others)} on the other ranks"
    lose = (
        f"Every other rank spends at least {ms(lost)} per step in {collectives}, waiting for it."
        if bounds
        else f"The other ranks lose {ms(lost)} per step waiting for it in {collectives}."
    )
    return Finding(
        code=Code.STRAGGLER_RANK,
        severity="warning",
        title=f"rank {name} {slower}; the other ranks wait {ms(lost)} per step for it",
        detail=f"{_MEASURED.format(n=steps)}: rank {name} takes {ms(own)} per step of its own work (median, its "
        f"time in {collectives} and its waits for a CPU left out) against {against}"
        + ("" if tiny else f", {ratio:.1f} times as long,")
        + f" in most steps. Its extra time is spent {where}. {lose}",
        ranks=[rank],
        steps=[],
        fix=straggler_fix(name),
        measured=[
            Measure("own_work_slowest", own, "s"),
            Measure("own_work_others", others, "s"),
            Measure("others_wait", lost, "s"),
            Measure("steps_timed", steps, "count"),
        ],
        labels={"clock": "host", "phase": phase},
    )


def straggler_fix(name: object) -> str:
    """The fix of `straggler-rank` for rank `name` (as users number it)."""
    return (
        f"make rank {name} do the same work as the others: look for code that runs on that rank only "
        "(if rank == ..., logging, evaluation or checkpointing inside the step), a data shard with larger "
        "samples, or a slower or busier device on its machine; do rank-0-only work outside the timed loop "
        "or asynchronously."
    )
