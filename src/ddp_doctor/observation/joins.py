"""The script's `Join` contexts over its DDP models (`torch.distributed.algorithms.join.Join`, or DDP's join()).

Inside a Join, a rank that runs out of batches does not stop: it shadows the others' collectives (their per-step
"not joined yet" all-reduce, DDP's gradient buckets) until every rank has joined, and the contexts end together. A
collective issued by one rank alone in there (the check's own report) meets a shadowing peer's all-reduce instead
of its own kind. So the check reports where the Join ends, and says that the script's uneven inputs are handled.

`listen_joins` wraps `Join.__enter__` and `Join.__exit__` once per process; `JOIN_SITES` keeps where the script
entered a Join over a DDP model, `ACTIVE` the Joins entered and not left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.core.frames import user_site

__all__ = ["ACTIVE", "JOIN_SITES", "listen_joins", "over_ddp"]

JOIN_SITES: list[str] = []
"""Where the script entered a Join over a DDP model (each line once, at most 8), once `listen_joins` ran."""
ACTIVE: list[Any] = []
"""The Join contexts over a DDP model entered and not yet left, innermost last."""


def over_ddp(join: Any) -> DistributedDataParallel | None:
    """The first DDP model among `join`'s joinables (None: it joins no DDP model)."""
    return next((j for j in getattr(join, "_joinables", []) if isinstance(j, DistributedDataParallel)), None)


def listen_joins(left: Callable[[Any], None]) -> None:
    """Follow the script's Join contexts; `left(join)` runs on every rank as a Join over a DDP model ends normally
    (every rank has joined, its post-hooks ran: a point the ranks reach together). Once per process."""
    from torch.distributed.algorithms.join import Join

    if getattr(Join.__exit__, "_ddp_doctor", False):
        return
    enter, exit_ = Join.__enter__, Join.__exit__

    def __enter__(self: Join) -> Any:
        if over_ddp(self) is not None:
            ACTIVE.append(self)
            site = user_site() or "an unknown place"
            if site not in JOIN_SITES and len(JOIN_SITES) < 8:
                JOIN_SITES.append(site)
        return enter(self)

    def __exit__(self: Join, *exc: Any) -> Any:
        try:
            out = exit_(self, *exc)
        finally:
            if self in ACTIVE:
                ACTIVE.remove(self)
        if exc[0] is None and over_ddp(self) is not None:
            left(self)
        return out

    __exit__._ddp_doctor = True  # type: ignore[attr-defined]
    Join.__enter__, Join.__exit__ = __enter__, __exit__
