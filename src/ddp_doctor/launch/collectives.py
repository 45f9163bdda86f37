"""Record each collective the script enters in the rank's beacon: op, tensor, group size, the user's line, and the
step and phase of the doctor then observing. A hung or crashed rank's report names the collective it was in."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ddp_doctor.launch.beacon import Beacon
from ddp_doctor.launch.frames import user_site_of
from ddp_doctor.observe import Doctor

__all__ = ["COLLECTIVES", "CollectiveRecorder"]

_OWN_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep
# The script's collectives that the beacon records (DDP's own gradient all-reduces run in C++ and are not among
# them: the beacon's phase says when a rank is in DDP's backward).
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce",
               "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single")


class CollectiveRecorder:
    """Wraps `torch.distributed`'s collectives (`install`) so each one the script enters updates `beacon`."""

    def __init__(self, beacon: Beacon, active: Callable[[], Doctor | None]) -> None:
        self.beacon = beacon
        self.active = active
        """The doctor observing now (None when none is), for the step and phase."""
        self.count = 0
        self._in_collective = False

    def install(self) -> None:
        c10d = dist.distributed_c10d
        for name in COLLECTIVES:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapped = self._recording(name, original)
            if getattr(dist, name, None) is original:
                setattr(dist, name, wrapped)
            setattr(c10d, name, wrapped)

    def _recording(self, name: str, original: Any) -> Any:
        recorder = self

        @functools.wraps(original)
        def collective(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            # Nested calls (all_gather_object -> all_gather) and the doctor's own exchange are not the script's.
            if recorder._in_collective or caller.f_code.co_filename.startswith(_OWN_DIR):
                return original(*args, **kwargs)
            recorder._in_collective = True
            try:
                recorder._enter(name, args, kwargs, caller)
                return original(*args, **kwargs)
            finally:
                recorder._in_collective = False
                recorder.beacon.update(in_collective=False)

        return collective

    def _enter(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], caller: Any) -> None:
        self.count += 1
        tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if tensor is None:
            lists = [a for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple)) and a]
            tensor = next((x for lst in lists for x in lst if isinstance(x, torch.Tensor)), None)
        group = next((a for a in (*args, *kwargs.values()) if isinstance(a, dist.ProcessGroup)), None)
        site = user_site_of(caller)
        active = self.active()
        self.beacon.update(in_collective=True, collectives=self.count, collective={
            "op": name, "n": self.count, "site": site,
            "tensor": f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}" if tensor is not None else None,
            "group_size": dist.get_world_size(group) if dist.is_initialized() else None,
            "step": active.steps_observed if active is not None else None,
            "phase": active.phase if active is not None else None})
