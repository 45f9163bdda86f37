"""Typed errors. Every message names the offending value and says how to fix it."""

from __future__ import annotations

__all__ = [
    "DDPFailure",
    "DoctorError",
    "InvalidArgumentError",
    "NoTrainableParametersError",
    "NotDDPModelError",
    "ProcessGroupNotInitializedError",
    "RankMismatchError",
    "ReductionError",
    "ReportTimeoutError",
]


class DoctorError(RuntimeError):
    """Base class of every error ddp-doctor raises on purpose."""


class InvalidArgumentError(DoctorError, ValueError):
    """An argument has a value ddp-doctor cannot use."""


class NotDDPModelError(DoctorError, TypeError):
    """`observe` was given something that is not a `DistributedDataParallel`."""


class ProcessGroupNotInitializedError(DoctorError):
    """`observe` was called before `torch.distributed.init_process_group`."""


class NoTrainableParametersError(DoctorError):
    """The DDP model has no parameter with `requires_grad=True`."""

    code = "no-trainable-parameters"


class RankMismatchError(DoctorError):
    """Ranks disagree about something that must be identical (world size, parameter list)."""


class ReportTimeoutError(DoctorError):
    """`report()` was not called by every rank within the timeout."""


class DDPFailure(DoctorError):
    """DDP itself raised inside `observe`; this error explains it.

    Attributes:
        code: the finding code that explains the failure (e.g. ``"reduction-error"``).
        params: names of the parameters involved, as far as this rank knows.
    """

    def __init__(self, message: str, *, code: str, params: list[str]) -> None:
        super().__init__(message)
        self.code = code
        self.params = params


class ReductionError(DDPFailure):
    """DDP's *Expected to have finished reduction in the prior iteration* error, explained."""
