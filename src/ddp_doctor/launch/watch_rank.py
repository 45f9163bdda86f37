"""`ddp-doctor watch` inside each rank: after the observed steps' report the script trains on to its own end.

What stays on is light: the beacon's step after each optimizer step (one small write to shared memory), the
script's own collectives in the beacon (`inflight.py`, as under `check`), and the watchdog's sample of the main
thread's line every half second. The process group's timeout goes into the beacon, so the supervisor can call a
hang before that timeout ends the job. Every thread's Python stack can be asked for at any moment with
`STACKS_SIGNAL` (faulthandler writes them to `rank{R}.stacks` from inside the signal handler: no ptrace, no help from
the stuck thread).
"""

from __future__ import annotations

import faulthandler
from typing import TYPE_CHECKING, Any

from torch.optim.optimizer import Optimizer, register_optimizer_step_post_hook

from ddp_doctor.core.phase import Phase
from ddp_doctor.launch.following_run import group_timeout
from ddp_doctor.launch.watch_run import STACKS_SIGNAL, stacks_path

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

    from ddp_doctor.doctor import Doctor
    from ddp_doctor.launch.session import Session
    from ddp_doctor.report.model import Report

__all__ = ["WatchPolicy"]


class WatchPolicy:
    """The `RunPolicy` of `watch`: after the report, the script goes on; the rank leaves when the script ends."""

    whole_run = True

    def __init__(self, session: Session) -> None:
        self.session = session
        self._steps: dict[int, int] = {}
        self._base = 0
        self._stacks = open(stacks_path(session.outdir, session.rank), "a")  # noqa: SIM115  (kept open for the handler)
        faulthandler.register(STACKS_SIGNAL, file=self._stacks, all_threads=True, chain=False)

    def wrapped(self, ddp: DistributedDataParallel, trainable: list[bool]) -> None:
        self.session.beacon.update(group_timeout=group_timeout())

    def reported(self, doctors: list[Doctor], reports: list[Report]) -> bool:
        """The first steps are reported: count the optimizer steps from here on, and let the script go on."""
        beacon = self.session.beacon
        self._base = max(beacon.state.step, 0)
        self.session.watching = True
        beacon.update(phase=Phase.WATCHED.value, group_timeout=group_timeout())
        register_optimizer_step_post_hook(self._stepped)
        return True

    def script_ended(self) -> bool:
        return False

    def _stepped(self, opt: Optimizer, _args: Any, _kwargs: Any) -> None:
        n = self._steps[id(opt)] = self._steps.get(id(opt), 0) + 1
        step = self._base + n
        if step > self.session.beacon.state.step:
            self.session.beacon.update(step=step)
