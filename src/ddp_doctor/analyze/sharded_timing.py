"""The step-time findings for a sharded model (FSDP2's `fully_shard`, `replicate`): `input-bound` (every rank waits
for its next batch for most of each step) and `straggler-rank` (one rank's own work is longer, and the others wait
for it in the model's collectives). Pure: the agreed facts (`ShardedRun.input_wait`, `ShardedRun.slowest`) in.

DDP's rule reads each rank's step phases from DDP's hooks (`analyze/throughput.py`); a sharded model has none, so
the watch times its steps from the host's clock (`observation/step_clock.py`): from one optimizer step's end to the
first forward after it (the wait), and to the next step's end (the step). On CUDA the same marks are events on the
model's stream, so the wait is the GPU's idle time, not the host's (which, after a `loss.item()`, holds the GPU's
work). The same thresholds decide
(`core/steptime.waits_for_data_at`), and on every rank, not on more than half of them: the reduction carries the
lowest and highest of each rank's figures, not their median.

Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks (`tests/scripts/fsdp2_slow_loader.py`, a dataset
that sleeps 5 ms per sample, 8 samples per batch): with no worker the ranks waited 42 ms of a 70 ms step (the
script's own clock); with 4 workers 2 ms of 27 ms. Both end with exit code 0 (tests/timing/test_check_fsdp2_steps.py).

`straggler-rank` is DDP's rule on bounds the reduction can carry: the slowest rank's own work (its step less its
time in the model's collectives, `observation/step_clock.CommClock`, and its run-queue delay) against the longest
of the other ranks' (not their median), its first quartile against the highest of their third quartiles, and the
wait it causes as the shortest of their times in collectives, less the slow rank's own. On CPU only: on CUDA, NCCL's collectives run on
streams of their own, and the time a rank's work waits for them is not timed.

Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks (`tests/scripts/fsdp2_straggler.py`, rank 1 runs
60 products of 256x256 matrices on each batch before its forward; three sharded Linear layers): rank 1 spent 74 ms
a step on that and 38 ms in its forward and backward, while rank 0's forward and backward took 113 ms (21 ms when
no rank does the extra work): rank 0 waits about 90 ms a step in the all-gathers and reduce-scatters. With
`replicate`, 112 ms of extra work and rank 0's forward and backward at 130 ms (12 ms without). All end with exit
code 0: nothing says the job runs at the pace of its slowest rank.
"""

from __future__ import annotations

from ddp_doctor.analyze.throughput import input_bound_finding, straggler_finding
from ddp_doctor.core.findings import Finding
from ddp_doctor.core.sharded_run import ShardedRun
from ddp_doctor.core.steptime import MIN_STEPS, straggles

__all__ = ["sharded_input_bound", "sharded_straggler"]


def sharded_input_bound(run: ShardedRun, ranks: list[int]) -> Finding:
    """The finding for `run.input_wait` (set): all ranks wait, in DDP's words (`throughput.input_bound_finding`)."""
    w = run.input_wait
    assert w is not None
    return input_bound_finding(
        who="all ranks",
        clock=w.get("clock", "host"),
        steps=w["steps"],
        wait=tuple(w["wait_s"]),
        step=tuple(w["step_s"]),
        loader=w["loader"],
        sites=[w["loader"].get("site") or ""],
        ranks=ranks,
        device_type=(run.sharding or {}).get("device_type", ""),
    )


def sharded_straggler(run: ShardedRun) -> Finding | None:
    """`straggler-rank` when `run.slowest` shows one rank's own work longer than every other's, in most steps, by
    more than its own spread, and the others losing at least half of the difference in the collectives: that much
    longer there than the slow rank itself (which reaches each collective last, so waits least). On a machine whose
    cores are oversubscribed, gloo's collectives take most of a tiny model's step on every rank, and one rank's own
    work reads about 12 ms longer in most steps from noise: the others then spend no longer in the collectives
    than it does."""
    s = run.slowest
    if s is None or s["steps"] < MIN_STEPS:
        return None
    own, others = s["own_s"], s["others_own_s"]
    extra = own - others
    if not straggles(
        own=own,
        others_own=others,
        own_quartiles=(s["own_q1_s"], s["own_q3_s"]),
        others_q3=s["others_own_q3_s"],  # the highest of the other ranks' third quartiles
        others_comm=s["others_comm_s"],  # the shortest of the other ranks' times in the collectives
        own_comm=s.get("comm_s", 0.0),
    ):
        return None
    between = s["wait_s"] - s["others_wait_s"]
    where = (
        "between steps (the wait for the next batch and anything else the loop does before the forward: "
        f"{between * 1e3:.1f} ms more than any other rank)"
        if between >= 0.5 * extra
        else "within the step (its forward, backward or optimizer step)"
    )
    return straggler_finding(
        rank=s["rank"],
        name=s["rank"],
        own=own,
        others=others,
        lost=s["others_comm_s"],
        where=where,
        steps=s["steps"],
        collectives="the sharded model's all-gathers and gradient reductions",
        bounds=True,
    )
