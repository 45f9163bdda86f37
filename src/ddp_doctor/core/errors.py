"""Typed errors. Every message names the offending value and says how to fix it."""

from __future__ import annotations

from ddp_doctor.core.codes import Code

__all__ = [
    "DDPFailure",
    "DoctorError",
    "GuardError",
    "InvalidArgumentError",
    "MixedParallelismError",
    "NoTrainableParametersError",
    "NotDDPModelError",
    "ProcessGroupNotInitializedError",
    "RankMismatchError",
    "ReductionError",
    "ReplicaDivergenceError",
    "ReportTimeoutError",
    "StaleModelError",
]


class DoctorError(RuntimeError):
    """Base class of every error ddp-doctor raises on purpose."""


class InvalidArgumentError(DoctorError, ValueError):
    """An argument has a value ddp-doctor cannot use."""


class NotDDPModelError(DoctorError, TypeError):
    """`observe` was given something that is not a `DistributedDataParallel`."""


class MixedParallelismError(DoctorError, TypeError):
    """DistributedDataParallel was given a model that `fully_shard` (FSDP2) already sharded."""


class ProcessGroupNotInitializedError(DoctorError):
    """`observe` was called before `torch.distributed.init_process_group`."""


class NoTrainableParametersError(DoctorError):
    """The DDP model has no parameter with `requires_grad=True`."""

    code = Code.NO_TRAINABLE_PARAMETERS


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


class ReplicaDivergenceError(DoctorError):
    """The replicas already differ across ranks, so ddp-doctor refuses to go on (for example, to rebuild DDP).

    Attributes:
        params: names of the parameters (or optimizer-state entries) that differ.
        ranks: the ranks whose copy differs from the most common one (rank 0's on a tie).
        max_difference: the largest difference of a fingerprint (a float64 sum) between two ranks.
    """

    code = Code.REPLICA_DIVERGENCE

    def __init__(self, message: str, *, params: list[str], ranks: list[int], max_difference: float) -> None:
        super().__init__(message)
        self.params = params
        self.ranks = ranks
        self.max_difference = max_difference


class GuardError(DoctorError):
    """`guard(..., on_problem="raise")` found a problem.

    Attributes:
        findings: the problems, as `ddp_doctor.Finding` objects (code, params, ranks, steps, fix).
        code: the code of the first finding (for example ``"wrapper-bypass"``).
    """

    def __init__(self, message: str, *, findings: list) -> None:
        super().__init__(message)
        self.findings = findings
        self.code = findings[0].code if findings else ""


class StaleModelError(DoctorError):
    """A `DistributedDataParallel` that `refreeze` replaced was called; the model it returned must be used."""
