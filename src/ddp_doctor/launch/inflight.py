"""Record each collective the script enters in the rank's beacon: op, tensor, group size, the user's line, and the
step and phase of the doctor then observing; and each DDP model's broadcast of its buffers at a forward, which pairs
with the other ranks' collectives like any other. A hung or crashed rank's report names the collective it was in,
and where the ranks' last collectives part.

The script's calls come from the process-wide probe `ddp_doctor.observation.collectives` (which also feeds the
observed steps' per-step digests); this module only publishes them. DDP's broadcasts are seen by wrapping
`DistributedDataParallel._sync_buffers` (a private method, called by DDP's forward only when it broadcasts). A copy
of a DDP model (`copy.deepcopy`, `AveragedModel(ddp_model)` for an EMA) is a DDP model of its own, which the
constructor never saw: DDP's `__setstate__` is wrapped to name it with the line that copied it, so its broadcasts are
not taken for the original's."""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.core.beacon import RECENT, Beacon, Collective
from ddp_doctor.core.frames import user_site, user_site_of
from ddp_doctor.doctor import Doctor
from ddp_doctor.observation import collectives
from ddp_doctor.observation.collectives import Call

__all__ = ["BUILT_AT", "COPIED_AT", "CollectiveRecorder"]

BUILT_AT = "_ddp_doctor_built_at"
"""The attribute of a DDP model that holds the user's line that built it (set by the patched constructor)."""
COPIED_AT = "_ddp_doctor_copied_at"
"""The attribute of a copy of a DDP model that holds the user's line that copied it."""


class CollectiveRecorder:
    """Publishes each collective the script enters, and each DDP buffer broadcast (`install`), in `beacon`."""

    def __init__(self, beacon: Beacon, active: Callable[[], Doctor | None]) -> None:
        self.beacon = beacon
        self.active = active
        """The doctor observing now (None when none is), for the step and phase."""
        self.count = 0
        self.recent: deque[Collective] = deque(maxlen=RECENT)

    def install(self) -> None:
        collectives.listen(self._enter, self._leave)
        self._watch_buffer_broadcasts()

    def _enter(self, call: Call) -> None:
        self._publish(op=call.op, site=user_site_of(call.caller), tensor=call.tensor, group_size=call.group_size)

    def _publish(
        self,
        *,
        op: str,
        site: str | None,
        tensor: str | None,
        group_size: int | None,
        ddp_buffers: bool = False,
        copied_at: str | None = None,
    ) -> None:
        self.count += 1
        active = self.active()
        entered = Collective(
            op=op,
            n=self.count,
            site=site,
            tensor=tensor,
            group_size=group_size,
            ddp_buffers=ddp_buffers,
            copied_at=copied_at,
            step=active.steps_observed if active is not None else None,
            phase=active.position.phase if active is not None else None,
        )
        self.recent.append(entered)
        self.beacon.update(in_collective=True, collectives=self.count, collective=entered, recent=list(self.recent))

    def _leave(self) -> None:
        self.beacon.update(in_collective=False)

    def _watch_buffer_broadcasts(self) -> None:
        """Publish each DDP model's broadcast of its buffers (rank 0's, at a forward with `broadcast_buffers=True`),
        named by the line that built the model: a forward through one DDP model on some ranks only pairs its
        broadcast with the others' next collective."""
        original = DistributedDataParallel._sync_buffers
        if getattr(original, "_ddp_doctor", False):
            return
        recorder = self

        @functools.wraps(original)
        def _sync_buffers(ddp: DistributedDataParallel, *args: Any, **kwargs: Any) -> Any:
            built = f"the DDP model built at {getattr(ddp, BUILT_AT, None) or 'an unknown line'}"
            copied = getattr(ddp, COPIED_AT, None)
            recorder._publish(
                op="broadcast",
                site=user_site({id(ddp)}),
                tensor=f"{len(ddp.modules_buffers)} buffers of "
                + (f"a copy (made at {copied}) of {built}" if copied else built),
                group_size=ddp.process_group.size() if ddp.process_group is not None else None,
                ddp_buffers=True,
                copied_at=copied,
            )
            try:
                return original(ddp, *args, **kwargs)
            finally:
                recorder._leave()

        _sync_buffers._ddp_doctor = True  # type: ignore[attr-defined]
        DistributedDataParallel._sync_buffers = _sync_buffers  # type: ignore[method-assign]
        restore = DistributedDataParallel.__setstate__

        @functools.wraps(restore)
        def __setstate__(ddp: DistributedDataParallel, state: dict[str, Any]) -> None:
            restore(ddp, state)
            setattr(ddp, COPIED_AT, user_site() or "an unknown line")

        DistributedDataParallel.__setstate__ = __setstate__  # type: ignore[method-assign]
