"""The script's `Join` contexts over its DDP models (`torch.distributed.algorithms.join.Join`, or DDP's join()).

Inside a Join, a rank that runs out of batches does not stop: it shadows the others' collectives (their per-step
"not joined yet" all-reduce, DDP's gradient buckets) until every rank has joined, and the contexts end together. A
collective issued by one rank alone in there (the check's own report) meets a shadowing peer's all-reduce instead
of its own kind. So the check reports where the Join ends, and says that the script's uneven inputs are handled.

With `throw_on_early_termination=True` a rank that runs out does not shadow: every rank raises the Join's own
RuntimeError at that point (the one that ran out in `__exit__`, the others at their next forward's join hook), after
the all-reduce that tells them, and the script catches it. The ranks leave the Join together there too.

`listen_joins` wraps `Join.__enter__` and `Join.__exit__` once per process; `JOIN_SITES` keeps where the script
entered a Join over a DDP model (`JOIN_THROWS`: those that throw), `ACTIVE` the Joins entered and not left.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Any

from torch.distributed.algorithms import join as join_module
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.core.frames import user_site

__all__ = ["ACTIVE", "JOIN_SITES", "JOIN_THROWS", "listen_joins", "over_ddp"]

JOIN_SITES: list[str] = []
"""Where the script entered a Join over a DDP model (each line once, at most 8), once `listen_joins` ran."""
JOIN_THROWS: list[str] = []
"""Those of `JOIN_SITES` whose Join was built with throw_on_early_termination=True."""
ACTIVE: list[Any] = []
"""The Join contexts over a DDP model entered and not yet left, innermost last."""


def over_ddp(join: Any) -> DistributedDataParallel | None:
    """The first DDP model among `join`'s joinables (None: it joins no DDP model)."""
    return next((j for j in getattr(join, "_joinables", []) if isinstance(j, DistributedDataParallel)), None)


def _terminated(join: Any, error: BaseException | None) -> bool:
    """`error` is `join`'s own early-termination error (raised by torch's join module, innermost on its traceback),
    which every rank raises at the same point."""
    if not getattr(join, "_throw_on_early_termination", False) or not isinstance(error, RuntimeError):
        return False
    tb: TracebackType | None = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename == join_module.__file__


def listen_joins(left: Callable[[Any], None]) -> None:
    """Follow the script's Join contexts; `left(join)` runs on every rank as a Join over a DDP model ends (every
    rank has joined and its post-hooks ran, or the Join threw on every rank: a point the ranks reach together). Once
    per process."""
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
                if getattr(self, "_throw_on_early_termination", False):
                    JOIN_THROWS.append(site)
        return enter(self)

    def __exit__(self: Join, *exc: Any) -> Any:
        ended = False
        try:
            out = exit_(self, *exc)
            ended = exc[0] is None or _terminated(self, exc[1])
            return out
        except RuntimeError as error:  # the rank that ran out, under throw_on_early_termination=True
            ended = _terminated(self, error)
            raise
        finally:
            if self in ACTIVE:
                ACTIVE.remove(self)
            if ended and over_ddp(self) is not None:
                left(self)

    __exit__._ddp_doctor = True  # type: ignore[attr-defined]
    Join.__enter__, Join.__exit__ = __enter__, __exit__
