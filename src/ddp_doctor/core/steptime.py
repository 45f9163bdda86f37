"""Where one rank's step time goes: the phases, and the robust statistics of each over the observed steps.

Pure data, shared by the exchange (which computes each rank's row), the analysis (which decides on them) and the
renderers (the JSON's per-rank timing, the text line, the HTML figure).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = [
    "INPUT_SHARE",
    "INPUT_SHARE_Q1",
    "MIN_STEPS",
    "MIN_WAIT_S",
    "OTHERS",
    "PHASES",
    "PHASE_LABELS",
    "ROW_SIZE",
    "SHOWN_LOWEST",
    "STRAGGLER_RATIO",
    "WAITING",
    "EXAMPLE_SLOTS",
    "RankTiming",
    "StepTimes",
    "statistic",
    "step_times",
    "straggles",
    "waits_for_data",
    "waits_for_data_at",
]

PHASES = ("data_wait_s", "forward_s", "backward_s", "comm_wait_s", "optimizer_s")
"""The parts of a step, in the order they happen: waiting for the next batch (from the end of the previous step
to the forward), forward, backward compute, waiting in DDP's gradient communication, optimizer."""
PHASE_LABELS = {
    "data_wait_s": "waiting for data",
    "forward_s": "forward",
    "backward_s": "backward compute",
    "comm_wait_s": "waiting in DDP's all-reduce",
    "optimizer_s": "optimizer",
}
_STATS = (*PHASES, "step_s")
ROW_SIZE = 2 * len(_STATS) + 6
"""Floats per rank in the exchange's per-rank table: the medians and interquartile ranges of the phases and of the
step, the steps counted, the first quartile of the share of the step spent waiting for data, the median, first
and third quartiles of the step less the communication wait and the wait for a CPU (the rank's own time), and 1.0
when the wait for data and the step were timed on the GPU's clock."""


@dataclass(kw_only=True, slots=True)
class RankTiming:
    """One rank's step split into phases: medians and interquartile ranges over its observed steps, in seconds.

    The first common step is left out (no previous step to wait from; warm-up: DDP rebuilds its buckets, loader
    workers start). The step is the sum of the phases.
    """

    rank: int
    steps: int
    """Steps the statistics are taken over."""
    median: dict[str, float]
    """Per phase (`PHASES`) and `step_s`."""
    iqr: dict[str, float]
    """Third minus first quartile, per phase and `step_s`."""
    data_wait_share_q1: float
    """First quartile over the steps of the share of the step spent waiting for data: in three steps out of four
    the rank waited at least this share."""
    own_s: float
    """Median over the steps of the step less the communication wait and the time the loop's thread waited for a
    CPU (run-queue delay, Linux): the rank's own time. A rank slowed by other work on its machine is not slow at its
    own work."""
    own_q1_s: float
    """First quartile of the same."""
    own_q3_s: float
    """Third quartile of the same."""
    gpu_clock: bool = False
    """The wait for data and the step are the GPU's (a model on CUDA: `observation/device_clock.py`): the time the
    GPU sat idle from a step's end to the next forward, and the step on the GPU. The other phases are the host's
    times, and the own time is the whole step (the waits in NCCL's all-reduce are not timed on a GPU)."""

    def to_row(self) -> list[float]:
        return [
            *(self.median[k] for k in _STATS),
            *(self.iqr[k] for k in _STATS),
            float(self.steps),
            self.data_wait_share_q1,
            self.own_s,
            self.own_q1_s,
            self.own_q3_s,
            float(self.gpu_clock),
        ]

    @staticmethod
    def from_row(rank: int, row: list[float]) -> RankTiming | None:
        """None when the rank had no step to take statistics over."""
        n = len(_STATS)
        steps = row[2 * n]
        if not math.isfinite(steps) or steps < 1:
            return None
        return RankTiming(
            rank=rank,
            steps=int(steps),
            median=dict(zip(_STATS, row[:n])),
            iqr=dict(zip(_STATS, row[n : 2 * n])),
            data_wait_share_q1=row[2 * n + 1],
            own_s=row[2 * n + 2],
            own_q1_s=row[2 * n + 3],
            own_q3_s=row[2 * n + 4],
            gpu_clock=row[2 * n + 5] > 0.5,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "steps": self.steps,
            **{k: self.median[k] for k in _STATS},
            "iqr_s": {k: self.iqr[k] for k in _STATS},
            "data_wait_share_q1": self.data_wait_share_q1,
            "own_s": self.own_s,
            "own_q1_s": self.own_q1_s,
            "own_q3_s": self.own_q3_s,
            "clock": "gpu" if self.gpu_clock else "host",
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> RankTiming:
        return RankTiming(
            rank=data["rank"],
            steps=data["steps"],
            median={k: data[k] for k in _STATS},
            iqr=dict(data["iqr_s"]),
            data_wait_share_q1=data["data_wait_share_q1"],
            own_s=data["own_s"],
            own_q1_s=data["own_q1_s"],
            own_q3_s=data["own_q3_s"],
            gpu_clock=data.get("clock") == "gpu",
        )


MIN_WAIT_S = 0.010
"""Seconds per step below which neither step-time finding is reported, whatever the share."""
STRAGGLER_RATIO = 1.5
"""A slow rank's own time over the others', at least (`straggler-rank`, in the first steps and in `watch`'s
windows)."""
MIN_STEPS = 6
"""Measured steps (the first observed step left out) below which neither step-time finding is reported: fewer give
no quartiles to tell a consistent effect from a few slow steps. Three were too few: on a machine shared with other
jobs a rank starved of the CPU for three consecutive steps cleared every other bar (the scenario matrix's 4-step
runs reported straggler-rank on clean scripts while other test runs loaded the 2 cores). The default `--steps 8`
measures 7."""
INPUT_SHARE = 0.5
"""Median wait for data over median step, at least."""
INPUT_SHARE_Q1 = 0.4
"""First quartile over the steps of the wait's share of the step, at least."""
SHOWN_LOWEST = 8
"""The lowest ranks whose phases travel whole (with the slowest and the fastest rank): what the renderers show."""
EXAMPLE_SLOTS = 64
"""The waiting ranks named come from this many slots (rank modulo 64), the lowest rank of each, lowest first."""
WAITING = ("data_wait_s", "step_s", "compute_s")
"""The medians over the ranks that wait for data (`compute_s`: forward plus backward compute)."""
OTHERS = ("own_s", *PHASES)
"""The medians over every measured rank but the slowest."""


def waits_for_data(t: RankTiming) -> bool:
    """The rank waits for its data (`waits_for_data_at` on its timing)."""
    return waits_for_data_at(
        steps=t.steps,
        wait_s=t.median["data_wait_s"],
        step_s=t.median["step_s"],
        share_q1=t.data_wait_share_q1,
        step_iqr_s=t.iqr["step_s"],
    )


def waits_for_data_at(*, steps: int, wait_s: float, step_s: float, share_q1: float, step_iqr_s: float) -> bool:
    """A rank waits for its data: over at least `MIN_STEPS` steps, a median wait of at least `MIN_WAIT_S` and
    `INPUT_SHARE` of its median step, at least `INPUT_SHARE_Q1` of the step in three steps out of four (`share_q1`),
    and longer than the step-to-step spread of its steps (their interquartile range: on a busy machine the steps of
    a rank that does not wait scatter by as much as such a wait)."""
    return (
        steps >= MIN_STEPS
        and wait_s >= MIN_WAIT_S
        and wait_s >= INPUT_SHARE * step_s
        and share_q1 >= INPUT_SHARE_Q1
        and wait_s > step_iqr_s
    )


@dataclass(kw_only=True, slots=True)
class StepTimes:
    """What every rank learns of the ranks' step phases, in a volume that does not grow with the world size: the
    phases of a few ranks whole (`shown`), and over every rank what the two step-time rules need."""

    shown: list[RankTiming]
    """The measured ranks among the lowest `SHOWN_LOWEST`, the slowest and the fastest, by rank."""
    measured: int = 0
    """Ranks that had steps to measure."""
    slowest: int | None = None
    """The rank with the longest own time (the lowest such rank); None when none was measured."""
    fastest: int | None = None
    steps: int = 0
    """The fewest steps a measured rank's statistics are over."""
    waiting: int = 0
    """Ranks that wait for data (`waits_for_data`)."""
    waiting_ranks: list[int] | None = None
    """Some of them, at most `SHOWN_LOWEST`: the lowest waiting rank of each class of rank modulo `EXAMPLE_SLOTS`,
    lowest first (the lowest ones overall up to 64 ranks)."""
    waiting_steps: int = 0
    waiting_median: dict[str, float] | None = None
    """Over the waiting ranks, each of `WAITING`."""
    others_median: dict[str, float] | None = None
    """Over every measured rank but the slowest, each of `OTHERS`."""
    others_q3_max: float | None = None
    """The largest third quartile of own time among every measured rank but the slowest."""


def _median(values: list[float]) -> float | None:
    values = sorted(values)
    n = len(values)
    if not n:
        return None
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2


def statistic(t: RankTiming, name: str) -> float:
    """One of `WAITING` or `OTHERS` for a rank."""
    if name == "compute_s":
        return t.median["forward_s"] + t.median["backward_s"]
    return t.own_s if name == "own_s" else t.median[name]


def step_times(timings: list[RankTiming | None]) -> StepTimes:
    """`StepTimes` from every rank's timing (index = rank; None: not measured): what the exchange computes with
    reductions, computed directly (the in-process reference, and the tests' expectation)."""
    measured = [t for t in timings if t is not None]
    if not measured:
        return StepTimes(shown=[])
    slow = max(measured, key=lambda t: (t.own_s, -t.rank))
    fast = min(measured, key=lambda t: (t.own_s, t.rank))
    chosen = {t.rank for t in measured if t.rank < SHOWN_LOWEST} | {slow.rank, fast.rank}
    waiting = [t for t in measured if waits_for_data(t)]
    others = [t for t in measured if t.rank != slow.rank]
    return StepTimes(
        shown=[t for t in measured if t.rank in chosen],
        measured=len(measured),
        slowest=slow.rank,
        fastest=fast.rank,
        steps=min(t.steps for t in measured),
        waiting=len(waiting),
        waiting_ranks=sorted({t.rank % EXAMPLE_SLOTS: t.rank for t in reversed(waiting)}.values())[:SHOWN_LOWEST],
        waiting_steps=min((t.steps for t in waiting), default=0),
        waiting_median={k: _median([statistic(t, k) for t in waiting]) for k in WAITING} if waiting else None,
        others_median={k: _median([statistic(t, k) for t in others]) for k in OTHERS} if others else None,
        others_q3_max=max((t.own_q3_s for t in others), default=None),
    )


def straggles(
    *,
    own: float,
    others_own: float,
    own_quartiles: tuple[float, float],
    others_q3: float,
    others_comm: float,
    own_comm: float,
) -> bool:
    """The straggler rule, for every parallelism (DDP's first steps and a sharded model's in `analyze/stragglers.py`, `watch`'s windows in `launch/watch_windows.py`): one
    rank's own work per step (its time in the collectives and its waits for a CPU left out) is `STRAGGLER_RATIO`
    times the others' and `MIN_WAIT_S` longer, in most steps (its first quartile above the others' third) and by
    more than its own spread, and the others lose at least half of the difference in the collectives: that much
    longer there than the slow rank itself, which reaches each collective last and so waits least."""
    extra = own - others_own
    q1, q3 = own_quartiles
    return (
        own >= STRAGGLER_RATIO * others_own
        and extra >= MIN_WAIT_S
        and q1 > others_q3
        and extra > q3 - q1
        and others_comm - own_comm >= 0.5 * extra
    )
