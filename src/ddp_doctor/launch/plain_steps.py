"""The rank's callbacks on the path without DDP: every optimizer step of the process (the first optimizer that
trains on several ranks is followed for `model-not-wrapped`, or the FSDP2 model it steps), and, once that model
has stepped, each forward through it and each gather of its sharded tensors in full, counted by the user's line in
the beacon: a collective some ranks enter alone (an evaluation or a `full_state_dict=True` save under
`if rank == 0:`) is named from these counts when the run fails (`analyze/sharded_failures.py`), whether or not
the watchdog's last sample caught the rank inside it."""

from __future__ import annotations

from typing import Any, Protocol

import torch.distributed as dist
from torch.optim.optimizer import Optimizer

from ddp_doctor.core.beacon import Beacon
from ddp_doctor.core.frames import user_site
from ddp_doctor.core.phase import Phase
from ddp_doctor.doctor import Doctor
from ddp_doctor.launch.config import RankConfig
from ddp_doctor.launch.unwrapped import PlainOptimizerWatch

__all__ = ["PlainSteps"]

_LINES = 8
"""Lines counted at most per kind (the beacon stays small; a ninth line is not counted)."""


class PlainRun(Protocol):
    """What the callbacks read and call: the in-rank run (`session.py`'s `Session`)."""

    config: RankConfig
    doctors: list[Doctor]
    plain: PlainOptimizerWatch
    beacon: Beacon

    @property
    def finishing(self) -> bool: ...

    @property
    def steps_reason(self) -> str: ...

    def finish_unwrapped(self, reason: str) -> None: ...


class PlainSteps:
    """See the module docstring. `on_step` is an optimizer step post-hook, `on_gather` is `patch_full_gather`'s
    callback."""

    def __init__(self, run: PlainRun) -> None:
        self._run = run

    def on_step(self, opt: Optimizer, _args: Any, _kwargs: Any) -> None:
        """With no DDP model, follow the first optimizer that trains on several ranks (`model-not-wrapped`)."""
        run = self._run
        if run.doctors or run.finishing or not run.plain.on_step(opt):
            return
        run.beacon.update(step=run.plain.steps, phase=Phase.BETWEEN_STEPS.value)
        if run.plain.sharded is not None and run.beacon.state.sharding is None:
            run.beacon.update(sharding=run.plain.sharded.describe(), backend=str(dist.get_backend()))
            run.plain.sharded.root.register_forward_pre_hook(self._on_forward)
        if run.plain.steps >= run.config.steps:
            run.finish_unwrapped(run.steps_reason)

    def _on_forward(self, _module: Any, _args: Any) -> None:
        """Count a forward through the FSDP2 model by the user's line: a forward some ranks run alone (an evaluation
        on rank 0) pairs its all-gathers with the others' next collectives; and the step clock's first forward after
        a step."""
        self._run.plain.note_forward()
        self._count(self._run.beacon.state.forwards, user_site() or "an unknown place")

    def on_gather(self, call: str, site: str) -> None:
        """Count a gather of sharded tensors in full (`call` at the user's `site`), once the FSDP2 model has stepped
        (before that, no count: the path's other evidence, a traceback or the watchdog's sample, still applies)."""
        if self._run.beacon.state.sharding is not None and not self._run.finishing:
            self._count(self._run.beacon.state.gathers, f"{call} at {site}")

    def _count(self, counts: dict[str, int], key: str) -> None:
        """One more at `key`; the beacon is written when a line is first counted (before its collective starts:
        a rank that dies or hangs in it has said where it was), later counts ride on the next write."""
        if key in counts:
            counts[key] += 1
        elif len(counts) < _LINES:
            counts[key] = 1
            self._run.beacon.update()
