"""progressive_freeze: a schedule of `refreeze` calls (gradual freezing or unfreezing by step or epoch)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.core.errors import InvalidArgumentError, NotDDPModelError
from ddp_doctor.fixes.refreeze.rebuild import refreeze
from ddp_doctor.fixes.refreeze.select import resolve

__all__ = ["ProgressiveFreeze", "Schedule", "progressive_freeze"]


Schedule = Mapping[int, str | Sequence[str]]


def progressive_freeze(
    ddp_model: DistributedDataParallel,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    freeze: Schedule | None = None,
    unfreeze: Schedule | None = None,
) -> ProgressiveFreeze:
    """Freeze (or unfreeze) modules gradually, on a schedule of steps or epochs, rebuilding DDP each time.

    Args:
        ddp_model: the current `DistributedDataParallel`.
        optimizer: passed on to `refreeze`.
        freeze: ``{step: names}``: from `step` on, these modules (or parameters) are frozen.
        unfreeze: ``{step: names}``: from `step` on, these are trainable (gradual unfreezing).

    Returns:
        A `ProgressiveFreeze`. Call ``ddp_model = schedule.update(step)`` at the top of every step (or epoch),
        with the same `step` on every rank; it rebuilds only when an entry is due.

    Raises:
        InvalidArgumentError: a key that is not a non-negative int, an unknown name (checked now, not at the
            step), or a name that is frozen and unfrozen at the same key.

    Example:
        >>> schedule = ddp_doctor.progressive_freeze(ddp_model, opt, freeze={2: ["embed"], 4: ["blocks.0"]})
        >>> for epoch in range(epochs):
        ...     ddp_model = schedule.update(epoch)   # rebuilds at epochs 2 and 4; resuming at 5 applies both
        ...     train_one_epoch(ddp_model)
    """
    return ProgressiveFreeze(ddp_model, optimizer, freeze=freeze, unfreeze=unfreeze)


class ProgressiveFreeze:
    """A freezing schedule on top of `refreeze`. See `progressive_freeze`.

    Attributes:
        model: the DDP to train now (the latest one `update` built).
        applied: the schedule keys applied so far, in order.
    """

    def __init__(
        self,
        ddp_model: DistributedDataParallel,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        freeze: Schedule | None = None,
        unfreeze: Schedule | None = None,
    ) -> None:
        if not isinstance(ddp_model, DistributedDataParallel):
            raise NotDDPModelError(
                f"progressive_freeze() needs a DistributedDataParallel model, got {type(ddp_model).__qualname__}."
            )
        if not freeze and not unfreeze:
            raise InvalidArgumentError(
                "progressive_freeze() needs a schedule: freeze={step: [module names]} and/or unfreeze={...}."
            )
        self.model = ddp_model
        self.applied: list[int] = []
        self._optimizer = optimizer
        self._entries: dict[int, list[tuple[bool, set[str]]]] = {}
        for label, schedule, trainable in (("freeze", freeze, False), ("unfreeze", unfreeze, True)):
            for key, names in (schedule or {}).items():
                if isinstance(key, bool) or not isinstance(key, int) or key < 0:
                    raise InvalidArgumentError(
                        f"{label}= keys must be non-negative ints (a step or an epoch), got {key!r}."
                    )
                spec = [names] if isinstance(names, str) else list(names)
                self._entries.setdefault(key, []).append((trainable, resolve(ddp_model.module, spec, label)))
        for key, changes in self._entries.items():
            if len(changes) == 2 and changes[0][1] & changes[1][1]:
                raise InvalidArgumentError(
                    f"at {key}, {sorted(changes[0][1] & changes[1][1])[:8]} are both frozen and unfrozen."
                )

    @property
    def pending(self) -> list[int]:
        """Schedule keys not applied yet."""
        return sorted(k for k in self._entries if k not in self.applied)

    def update(self, step: int) -> DistributedDataParallel:
        """Apply every schedule entry due at or before `step`; return the DDP to train.

        Collective when an entry is due (it calls `refreeze`): call it on every rank with the same `step`.

        Raises:
            Whatever `refreeze` raises; the schedule is then left as it was.
        """
        due = [k for k in self.pending if k <= step]
        if not due:
            return self.model
        state: dict[str, bool] = {}
        for key in due:
            for trainable, names in self._entries[key]:
                for n in names:
                    state[n] = trainable
        self.model = refreeze(
            self.model,
            self._optimizer,
            freeze=sorted(n for n, t in state.items() if not t) or None,
            unfreeze=sorted(n for n, t in state.items() if t) or None,
        )
        self.applied += due
        return self.model
