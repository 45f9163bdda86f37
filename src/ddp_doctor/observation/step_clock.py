"""The host's clock around the optimizer steps of a model that no DDP hook times (FSDP2's `fully_shard`,
`replicate`): when each step ended, and when the first forward through the model after it began. Between the two
the loop waited for its next batch (and did whatever else it does between steps); from one step's end to the next
is the step. Local, one clock read per step and per first forward; the statistics are computed once, at the report.

Host times measure the step on CPU only: with CUDA the host runs ahead of the device, so its wait for a batch may
be time the GPU was busy. The watch does not time a model on CUDA.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from ddp_doctor.core.steptime import waits_for_data_at
from ddp_doctor.observation import dataloaders

__all__ = ["StepClock", "input_wait"]

MAX_STEPS = 256
"""At most this many steps are timed (the observed steps are far fewer)."""


class StepClock:
    """Per step: the wait from the previous step's end to the first forward, and the whole step."""

    def __init__(self) -> None:
        self._ended: float | None = None
        self._forward: float | None = None
        self.waits: list[float] = []
        self.steps: list[float] = []

    def on_forward(self) -> None:
        """A forward through the model began (its root's forward pre-hook)."""
        if self._ended is not None and self._forward is None:
            self._forward = time.perf_counter()

    def on_step(self) -> None:
        """An optimizer step of the model ended. The first step only starts the clock: no step before it to wait
        from, and FSDP2's lazy initialisation runs in it."""
        now = time.perf_counter()
        if self._ended is not None and self._forward is not None and len(self.steps) < MAX_STEPS:
            self.waits.append(self._forward - self._ended)
            self.steps.append(now - self._ended)
        self._ended, self._forward = now, None

    def stats(self) -> dict[str, Any]:
        """`steps` timed, the medians `wait_s` and `step_s`, `share_q1` (the first quartile of the wait's share of
        its step), `step_iqr_s`, and `waits` (`waits_for_data_at`). Zeros when fewer than two steps were timed."""
        n = len(self.steps)
        if n < 2:
            return {"steps": n, "wait_s": 0.0, "step_s": 0.0, "share_q1": 0.0, "step_iqr_s": 0.0, "waits": False}
        q1, _, q3 = statistics.quantiles(self.steps, n=4)
        shares = [w / s if s > 0 else 0.0 for w, s in zip(self.waits, self.steps)]
        out = {
            "steps": n,
            "wait_s": statistics.median(self.waits),
            "step_s": statistics.median(self.steps),
            "share_q1": statistics.quantiles(shares, n=4)[0],
            "step_iqr_s": q3 - q1,
        }
        return {**out, "waits": waits_for_data_at(**out)}

    @staticmethod
    def slots(clock: StepClock | None) -> dict[str, float]:
        """A rank's figures for the sharded report's reduction: whether it waits for data, over how many steps, its
        medians (zeros where no clock ran)."""
        t = clock.stats() if clock is not None else {"waits": False, "steps": 0, "wait_s": 0.0, "step_s": 0.0}
        return {"waiting": t["waits"], "timed_steps": t["steps"], "wait_s": t["wait_s"], "step_s": t["step_s"]}


def input_wait(top: dict[str, float], low: dict[str, float]) -> dict[str, Any] | None:
    """From the reduced `slots` (MAX in `top`, MIN in `low`): when every rank waits for its data and a DataLoader
    fed the steps, the ranks' median waits and steps as [lowest, highest], the steps timed, and that loader (as this
    rank built it); None otherwise."""
    last = dataloaders.last_pass()
    if low["waiting"] < 1 or last is None or not last.steps:
        return None
    return {
        "wait_s": [low["wait_s"], top["wait_s"]],
        "step_s": [low["step_s"], top["step_s"]],
        "steps": int(low["timed_steps"]),
        "loader": {k: v for k, v in last.info.items() if k != "pass"},
    }
