"""Record each collective the script enters in the rank's beacon: op, tensor, group size, the user's line, and the
step and phase of the doctor then observing. A hung or crashed rank's report names the collective it was in.

The calls come from the process-wide probe `ddp_doctor.observation.collectives` (which also feeds the observed steps' per-step
digests); this module only publishes them."""

from __future__ import annotations

from collections.abc import Callable

from ddp_doctor.core.beacon import Beacon, Collective
from ddp_doctor.core.frames import user_site_of
from ddp_doctor.doctor import Doctor
from ddp_doctor.observation import collectives
from ddp_doctor.observation.collectives import Call

__all__ = ["CollectiveRecorder"]


class CollectiveRecorder:
    """Publishes each collective the script enters (`install`) in `beacon`."""

    def __init__(self, beacon: Beacon, active: Callable[[], Doctor | None]) -> None:
        self.beacon = beacon
        self.active = active
        """The doctor observing now (None when none is), for the step and phase."""
        self.count = 0

    def install(self) -> None:
        collectives.listen(self._enter, self._leave)

    def _enter(self, call: Call) -> None:
        self.count += 1
        active = self.active()
        self.beacon.update(
            in_collective=True,
            collectives=self.count,
            collective=Collective(
                op=call.op,
                n=self.count,
                site=user_site_of(call.caller),
                tensor=call.tensor,
                group_size=call.group_size,
                step=active.steps_observed if active is not None else None,
                phase=active.position.phase if active is not None else None,
            ),
        )

    def _leave(self) -> None:
        self.beacon.update(in_collective=False)
