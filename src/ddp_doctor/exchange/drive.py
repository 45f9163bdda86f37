"""Runs an exchange's rounds over a real process group: each collective a generator yields (`packing.Op`) becomes
one all_reduce, and its result goes back to the generator. `simulate.py` runs the same generators in one process
for every rank at once."""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

import torch
import torch.distributed as dist

from ddp_doctor.core.summary import Volume
from ddp_doctor.exchange.packing import Op, Reply

__all__ = ["drive"]

T = TypeVar("T")


def drive(
    steps: Generator[Op, Reply, T],
    *,
    group: dist.ProcessGroup | None,
    device: torch.device,
    volume: Volume | None = None,
) -> T:
    """Run `steps` (one rank's side of some rounds) to its end over `group`, each yielded ``(op, tensor)`` an
    all_reduce of that op on `device`; returns what the generator returns. `volume` counts this rank's bytes."""
    try:
        request = next(steps)
        while True:
            op, local = request
            if volume is not None:
                volume.add(op, local)
            buf = local.to(device, copy=True)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
            request = steps.send(Reply(buf.cpu()))
    except StopIteration as stop:
        return stop.value
