"""The host's clock around the optimizer steps of a model that no DDP hook times (FSDP2's `fully_shard`,
`replicate`): when each step ended, and when the first forward through the model after it began. Between the two
the loop waited for its next batch (and did whatever else it does between steps); from one step's end to the next
is the step. Within the step, the time the training thread spent in collectives (`CommClock`: the model's, the
script's, a clip's norm) and waiting for a CPU (Linux's run-queue delay): the rest, its wait between steps
included, is the rank's own work, which `straggler-rank` compares.
Local, a few clock reads per step and per collective; the statistics are computed once, at the report.

On CUDA the host's clock does not tell: the host runs ahead of the device, and where the loop waits for the GPU
(a `loss.item()` after the optimizer step) that wait falls between the steps, where the wait for a batch is. There
the same two marks are CUDA events (`observation/device_clock.py`). The step's time in collectives is not timed on
CUDA (NCCL runs them on streams of its own), so neither is a rank's own work.
"""

from __future__ import annotations

import functools
import statistics
import threading
import time
from typing import Any

import torch

from ddp_doctor.core.steptime import waits_for_data_at
from ddp_doctor.observation import collectives, dataloaders
from ddp_doctor.observation.device_clock import DeviceClock
from ddp_doctor.observation.hooks import ListenerList
from ddp_doctor.observation.steplog import runq_seconds

__all__ = ["CommClock", "StepClock", "input_wait"]

MAX_STEPS = 256
"""At most this many steps are timed (the observed steps are far fewer)."""


class CommClock:
    """The seconds the training thread spends in collectives: each FSDP2 parameter group's `unshard` and
    `wait_for_unshard` (the all-gathers: synchronous with gloo on CPU, or waited for there) and `post_backward` (the
    reduce-scatter, and the all-reduce of `replicate` or HSDP), wrapped on the group; the script's own calls through
    torch.distributed (a logged loss's all_reduce); and every wait for a functional collective (`wait_tensor` of
    `torch.distributed._functional_collectives`: the all-reduce of a DTensor's norm, as in a global gradient clip,
    or a `full_tensor()`). The group methods are private methods of torch's FSDP2 (2.4 to 2.15); where a group lacks
    one, nothing is wrapped and `timed` is False. The time includes the copies into and out of the collectives'
    buffers, small beside a wait for another rank."""

    METHODS = ("unshard", "wait_for_unshard", "post_backward")

    def __init__(self, groups: list[Any]) -> None:
        self.seconds = 0.0
        self._depth = 0
        self._start = 0.0
        self._thread = threading.get_ident()
        self.timed = bool(groups) and all(callable(getattr(g, m, None)) for g in groups for m in self.METHODS)
        self._undo: list[Any] = []
        if self.timed:
            for group in groups:
                for name in self.METHODS:
                    self._undo.append(functools.partial(_restore, group, name, group.__dict__.get(name)))
                    setattr(group, name, self._timed(getattr(group, name)))
            self._undo.append(collectives.listen(lambda _call: self.enter(), self.leave))
            self._undo.append(_functional_waits().add(self))

    def stop(self) -> None:
        """Take this clock off the groups, the collectives and the functional waits (idempotent): a job that trains
        on past the observed steps, or calls `observe()` again, pays nothing more for it."""
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def enter(self) -> bool:
        """The training thread entered a collective (False on another thread: not timed, and no `leave` follows).
        Nested entries (a collective inside a group's method) count once, from the outermost."""
        if threading.get_ident() != self._thread:
            return False
        if not self._depth:
            self._start = time.perf_counter()
        self._depth += 1
        return True

    def leave(self) -> None:
        """The training thread left the collective it entered last (on another thread: nothing)."""
        if self._depth and threading.get_ident() == self._thread:
            self._depth -= 1
            if not self._depth:
                self.seconds += time.perf_counter() - self._start

    def _timed(self, call: Any) -> Any:
        @functools.wraps(call)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.enter():
                return call(*args, **kwargs)
            try:
                return call(*args, **kwargs)
            finally:
                self.leave()

        return timed


def _restore(group: Any, name: str, before: Any) -> None:
    """Put back what the group's instance held under `name` before a clock wrapped it (nothing: its class's method
    is looked up again)."""
    if before is None:
        group.__dict__.pop(name, None)
    else:
        setattr(group, name, before)


_clocks: ListenerList[CommClock] = ListenerList()


def _functional_waits() -> ListenerList[CommClock]:
    """The clocks that time the waits for functional collectives: `wait_tensor` of
    `torch.distributed._functional_collectives` wrapped once per process (a module attribute, which its own
    `AsyncCollectiveTensor` and DTensor's redistribution look up at each call; measured on torch 2.13 and 2.15).
    With no clock, a wrapped wait costs one list check."""
    try:
        import torch.distributed._functional_collectives as funcol
    except ImportError:
        return _clocks
    original = getattr(funcol, "wait_tensor", None)
    if original is None or hasattr(original, "__ddp_doctor_wrapped__"):
        return _clocks

    @functools.wraps(original)
    def wait_tensor(tensor: torch.Tensor) -> torch.Tensor:
        entered = [clock for clock in _clocks if clock.enter()]
        try:
            return original(tensor)
        finally:
            for clock in entered:
                clock.leave()

    wait_tensor.__ddp_doctor_wrapped__ = original  # type: ignore[attr-defined]
    funcol.wait_tensor = wait_tensor
    return _clocks


class StepClock:
    """Per step: the wait from the previous step's end to the first forward, the whole step, and the rank's own
    work in it (the step less the time in the collectives of `comm` and the run-queue delay of the training thread,
    the one that makes this clock; work a rank does between steps is its own too). With `device` (a model on CUDA)
    the wait and the step are the GPU's (`DeviceClock`), and the own work is not timed."""

    def __init__(self, comm: CommClock | None = None, device: DeviceClock | None = None) -> None:
        self._ended: float | None = None
        self._forward: float | None = None
        self._comm = comm
        self.device = device
        self._schedstat = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        self._at_end = (0.0, 0.0)
        """The collectives' seconds and the run-queue delay when the last step ended."""
        self.waits: list[float] = []
        self.steps: list[float] = []
        self.owns: list[float] = []
        self.comms: list[float] = []
        self._stopped = False

    def stop(self) -> None:
        """The observed steps are over: the figures stay, nothing more is timed, and the collectives' clock comes off
        (idempotent)."""
        self._stopped = True
        if self._comm is not None:
            self._comm.stop()

    @staticmethod
    def for_model(devices: set[torch.device], groups: list[Any]) -> StepClock | None:
        """The clock for a sharded model whose parameters are on `devices`, with FSDP2 parameter `groups`: the
        host's on CPU, the GPU's on one CUDA device, none otherwise (parameters on several devices)."""
        if {d.type for d in devices} == {"cpu"}:
            return StepClock(CommClock(groups))
        device = DeviceClock.for_devices(devices)
        return StepClock(device=device) if device is not None else None

    @property
    def comm_timed(self) -> bool:
        """The time in the model's collectives is in the own-work figures (every group's methods were wrapped)."""
        return self._comm is not None and self._comm.timed

    def on_forward(self) -> None:
        """A forward through the model began (its root's forward pre-hook)."""
        if self._stopped:
            return
        if self.device is not None:
            self.device.on_forward()
        elif self._ended is not None and self._forward is None:
            self._forward = time.perf_counter()

    def on_step(self) -> None:
        """An optimizer step of the model ended. The first step only starts the clock: no step before it to wait
        from, and FSDP2's lazy initialisation runs in it."""
        if self._stopped:
            return
        if self.device is not None:
            self.device.on_step()
            return
        now = time.perf_counter()
        at_end = (self._comm.seconds if self._comm is not None else 0.0, runq_seconds(self._schedstat))
        if self._ended is not None and self._forward is not None and len(self.steps) < MAX_STEPS:
            wait, step = self._forward - self._ended, now - self._ended
            comm, runq = (a - b for a, b in zip(at_end, self._at_end))
            self.waits.append(wait)
            self.steps.append(step)
            self.comms.append(comm)
            self.owns.append(max(0.0, step - comm - runq))
        self._ended, self._forward, self._at_end = now, None, at_end

    def stats(self) -> dict[str, Any]:
        """`steps` timed, the medians `wait_s` and `step_s`, `share_q1` (the first quartile of the wait's share of
        its step), `step_iqr_s`, `waits` (`waits_for_data_at`), and the median, first and third quartile of the
        rank's own work (`own_s`, `own_q1_s`, `own_q3_s`) and the median time in collectives (`comm_s`). Zeros when
        fewer than two steps were timed, and for the own work and collectives where they were not (on CUDA)."""
        waits, steps = self.device.times() if self.device is not None else (self.waits, self.steps)
        n = len(steps)
        zeros = dict.fromkeys(("wait_s", "step_s", "share_q1", "step_iqr_s", "own_s", "own_q1_s", "own_q3_s"), 0.0)
        if n < 2:
            return {"steps": n, **zeros, "comm_s": 0.0, "waits": False}
        q1, _, q3 = statistics.quantiles(steps, n=4)
        shares = [w / s if s > 0 else 0.0 for w, s in zip(waits, steps)]
        out = {
            "steps": n,
            "wait_s": statistics.median(waits),
            "step_s": statistics.median(steps),
            "share_q1": statistics.quantiles(shares, n=4)[0],
            "step_iqr_s": q3 - q1,
        }
        if len(self.owns) < 2:
            return {**zeros, **out, "waits": waits_for_data_at(**out), "comm_s": 0.0}
        own_q1, own, own_q3 = statistics.quantiles(self.owns, n=4)
        timing = {"own_s": own, "own_q1_s": own_q1, "own_q3_s": own_q3}
        return {**out, "waits": waits_for_data_at(**out), **timing, "comm_s": statistics.median(self.comms)}

    @staticmethod
    def slots(clock: StepClock | None) -> dict[str, float]:
        """A rank's figures for the sharded report's reduction: whether it waits for data, over how many steps, its
        medians, whether its collectives were timed, whether the GPU's clock timed it (zeros where no clock ran)."""
        t = clock.stats() if clock is not None else {"waits": False, "steps": 0, "wait_s": 0.0, "step_s": 0.0}
        return {
            "waiting": t["waits"],
            "timed_steps": t["steps"],
            "wait_s": t["wait_s"],
            "step_s": t["step_s"],
            "comm_timed": clock is not None and clock.comm_timed,
            "own_s": t.get("own_s", 0.0),
            "gpu_timed": clock is not None and clock.device is not None,
        }


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
        "clock": "gpu" if low["gpu_timed"] >= 1 else "host",
    }
