"""The GPU's clock around the optimizer steps: when the device reached each step's end, and the first forward after
it. The host's clock does not tell on CUDA: the host runs ahead of the device, and where the loop waits for the GPU
(a `loss.item()` after the optimizer step) that wait falls between the steps, where the wait for a batch is.

The two marks are CUDA events recorded on the model's device's current stream. The stream reaches a mark when the
device has run everything queued before it: a step's end when the GPU has done the step's work, the forward's start
once the host has handed it the next batch (and queued its copy). So from a step's end to the next forward is the
time the GPU sat idle waiting for its input (nothing, when the host was ahead and had queued the forward already),
and from one step's end to the next is the step on the GPU. Local: two event records per step, read once at the
report.
"""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["DeviceClock"]

MAX_MARKS = 257
"""At most this many step ends are marked (256 steps timed; the observed steps are far fewer)."""
EVENTS_WAIT_S = 2.0
"""How long the report waits for the GPU to reach the last mark (the host may be a few steps ahead); the steps it
has not reached by then are left out, so a device that hangs cannot hang the report."""


class DeviceClock:
    """CUDA events on `device`'s current stream at each optimizer step's end (`on_step`) and at the first forward
    after it (`on_forward`)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._marks: list[list[Any]] = []
        """Per step end: [its event, the first forward's event after it (None until one runs), the caller's tag]."""

    @staticmethod
    def for_devices(devices: set[torch.device]) -> DeviceClock | None:
        """The clock for a model whose parameters are on `devices`: one CUDA device's; None otherwise."""
        if len(devices) == 1 and next(iter(devices)).type == "cuda":
            return DeviceClock(next(iter(devices)))
        return None

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    @staticmethod
    def _recordable() -> bool:
        # Inside a compiled region or a CUDA graph's capture an event is not the host's to record: that step is
        # left untimed.
        return not torch.compiler.is_compiling() and not torch.cuda.is_current_stream_capturing()

    def on_forward(self) -> None:
        """A training forward through the model began."""
        if self._marks and self._marks[-1][1] is None and self._recordable():
            self._marks[-1][1] = self._event()

    def on_step(self, tag: int | None = None) -> None:
        """An optimizer step ended (`tag`: which one, for `measured`)."""
        if len(self._marks) < MAX_MARKS and self._recordable():
            self._marks.append([self._event(), None, tag])

    def measured(self) -> list[tuple[int | None, float, float]]:
        """(the later step end's tag, wait, step) in seconds, for each step after the first whose marks the GPU has
        reached (waiting up to `EVENTS_WAIT_S` for the last ones), in step order."""
        deadline = time.monotonic() + EVENTS_WAIT_S
        while self._marks and not self._marks[-1][0].query() and time.monotonic() < deadline:
            time.sleep(0.005)
        out = []
        for (end, forward, _), (nxt, _, tag) in zip(self._marks, self._marks[1:]):
            if forward is not None and nxt.query() and forward.query():
                out.append((tag, end.elapsed_time(forward) / 1e3, end.elapsed_time(nxt) / 1e3))
        return out

    def times(self) -> tuple[list[float], list[float]]:
        """(waits, steps) in seconds, as `measured`."""
        got = self.measured()
        return [w for _, w, _ in got], [s for _, _, s in got]
