"""Where a rank is within its training step: the phases the doctor publishes and the launcher reports."""

from __future__ import annotations

from enum import Enum

__all__ = ["Phase"]


class Phase(str, Enum):
    """A rank's position, in the order it happens within a step. The values are what reports print."""

    BEFORE_DDP = "before DDP was built"
    BEFORE_FIRST_STEP = "before the first step"
    BETWEEN_STEPS = "between steps"
    FORWARD = "forward"
    AFTER_FORWARD = "after forward, before backward"
    BACKWARD = "backward"
    AFTER_BACKWARD = "after backward"
    OPTIMIZER = "optimizer step"
    FOLLOWING = "after the observed steps, following the epoch end"
    """`check` follows the script past its observed steps (`--follow-epochs`); not a phase of a step."""
    WATCHED = "after the observed steps, training on under watch"
    """`watch` lets the script run to its end after the observed steps; not a phase of a step."""
    TORN_DOWN = "after the script destroyed its process group"
    """`watch` only: the script called `destroy_process_group()` and runs on without collectives (a final save, an
    upload, the interpreter's exit); a rank that fails here failed in the teardown, not in training."""

    def __str__(self) -> str:
        return self.value


IN_STEP = (Phase.FORWARD, Phase.AFTER_FORWARD, Phase.BACKWARD, Phase.AFTER_BACKWARD, Phase.OPTIMIZER)
"""The phases inside a training step (forward to optimizer step)."""
