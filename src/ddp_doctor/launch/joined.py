"""The check's report where the script's `Join` ends, when its observed steps end inside one (`observation/joins.py`).

A rank that ran out of batches inside a Join shadows the others' collectives until every rank has joined; the check's
own exchange, started by the ranks that reached their observed steps, would meet those shadowing all-reduces and
hang. So at the end of the observed steps inside a Join the doctors stop observing and the report waits (the
beacon still counts the optimizer's steps, as watch does after a report); where the Join ends (on every rank
together), one all-reduce tells whether any rank waits to report, and then every rank reports there, the ranks that
ran out with the steps they had.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch.optim.optimizer import register_optimizer_step_post_hook

from ddp_doctor.core.beacon import Beacon, OptimizerSteps
from ddp_doctor.doctor import Doctor
from ddp_doctor.exchange.control import join_waits
from ddp_doctor.exchange.drive import drive
from ddp_doctor.exchange.primitives import comm_device
from ddp_doctor.observation.joins import ACTIVE, listen_joins, over_ddp

__all__ = ["JoinedReport"]


class JoiningRun(Protocol):
    """What the deferred report calls back: the in-rank run (`session.py`'s `Session`)."""

    doctors: list[Doctor]
    beacon: Beacon

    @property
    def finishing(self) -> bool: ...

    @property
    def steps_reason(self) -> str: ...

    def finish(self, reason: str) -> None: ...


class JoinedReport:
    """One rank's report deferred to the end of the script's Join. `install` before the script runs."""

    def __init__(self, session: JoiningRun) -> None:
        self.session = session
        self.waiting = False
        """This rank's observed steps ended inside a Join: it reports where the Join ends."""
        self._counting: Any = None
        """The hook that counts the steps trained while the report waits (removed at the Join's end)."""

    def install(self) -> None:
        listen_joins(self._left)

    def defer(self) -> bool:
        """At the end of the observed steps: True when they end inside a Join over a DDP model (the doctors stop
        observing, and the report waits for the Join's end)."""
        if not ACTIVE:
            return False
        self.waiting = True
        for doctor in self.session.doctors:
            doctor.stop()
        steps = OptimizerSteps(self.session.beacon, max(self.session.beacon.state.step, 0))
        self._counting = register_optimizer_step_post_hook(lambda opt, _args, _kwargs: steps.stepped(opt))
        return True

    def _left(self, join: Any) -> None:
        session = self.session
        if self._counting is not None:
            self._counting.remove()
            self._counting = None
        ddp = over_ddp(join)
        if session.finishing or not any(d.ddp is ddp for d in session.doctors):
            return
        device = comm_device(None, next(ddp.parameters()).device)
        if drive(join_waits(self.waiting), group=ddp.process_group, device=device):
            session.finish(session.steps_reason)
