"""Where one rank's step time goes: the phases, and the robust statistics of each over the observed steps.

Pure data, shared by the exchange (which computes each rank's row), the analysis (which decides on them) and the
renderers (the JSON's `timing.per_rank`, the text line, the HTML figure).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["PHASES", "PHASE_LABELS", "ROW_SIZE", "RankTiming"]

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
ROW_SIZE = 2 * len(_STATS) + 5
"""Floats per rank in the exchange's per-rank table: the medians and interquartile ranges of the phases and of the
step, the steps counted, the first quartile of the share of the step spent waiting for data, and the median, first
and third quartiles of the step less the communication wait (the rank's own time)."""


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
    """Median over the steps of the step less the communication wait: the rank's own time."""
    own_q1_s: float
    """First quartile of the same."""
    own_q3_s: float
    """Third quartile of the same."""

    def to_row(self) -> list[float]:
        return [
            *(self.median[k] for k in _STATS),
            *(self.iqr[k] for k in _STATS),
            float(self.steps),
            self.data_wait_share_q1,
            self.own_s,
            self.own_q1_s,
            self.own_q3_s,
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
        )
