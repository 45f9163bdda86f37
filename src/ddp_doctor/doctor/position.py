"""Where an observing doctor's rank is, as the launcher publishes it (`launch/publish.py`): the step and its phase,
and, once a step's used set is final, the parameters that got no gradient in it. Local; nothing here
communicates."""

from __future__ import annotations

from ddp_doctor.core.phase import Phase
from ddp_doctor.observation.crash import CrashLog
from ddp_doctor.observation.steplog import StepLog
from ddp_doctor.observation.target import Target
from ddp_doctor.observation.timeline import Timeline

__all__ = ["Position"]


class Position:
    """A read-only view of one `Doctor`'s timeline, log and crash log (`doctor.position`)."""

    def __init__(self, target: Target, timeline: Timeline, log: StepLog, crash: CrashLog) -> None:
        self._target, self._timeline, self._log, self._crash = target, timeline, log, crash

    @property
    def phase(self) -> str:
        """What this rank is doing, for the launcher's hang report (a `Phase` value)."""
        return self._timeline.phase.value

    @property
    def step(self) -> int:
        """The step this rank is in, for its published position: the failed one after a crash (which closes it)."""
        return self._crash.step if self._crash.kind else self._log.steps

    @property
    def used_set_news(self) -> bool:
        """A step's used set just became final (the step closed, or its synced backward computed every gradient
        and DDP's all-reduce is in flight), or the loop crashed after one did: the launcher publishes it."""
        tl = self._timeline
        if tl.state.computed and tl.phase == Phase.BACKWARD:
            return True
        if self._crash.kind:
            return bool(self._log.steps)
        # A step whose synced backward published its used set is not published again when it closes (one pass over
        # the parameters per step, not two).
        return bool(self._log.steps) and tl.phase == Phase.BETWEEN_STEPS and not tl.closed_computed

    def missing_grads(self, limit: int = 16) -> tuple[int, list[str]]:
        """The last step whose synced backward computed every gradient (closed, or waiting in DDP's all-reduce)
        and the trainable parameters that got no gradient in it (at most `limit` names).

        Published by the launcher, so that a rank later stuck in a collective, which can no longer exchange its
        records, still tells which parameters it trained. Local, one pass over the parameters."""
        state = self._timeline.state
        if state.computed:
            params, names = self._target.params, self._target.names
            missing = [n for n, p, u in zip(names, params, state.used) if p.requires_grad and not u]
            return self._log.steps, missing[:limit]
        return self._log.steps - 1, self._log.missing(self._target.names, limit)
