"""ddp-doctor: find, explain and fix misconfigured PyTorch DistributedDataParallel training.

The flow is one-way: observe (local hooks) -> gather (the only collectives) -> analyze (pure) -> report (renderers).

The implementation modules of the three context managers are private (`_observe`, `_guard`, `_refreeze`), as in
rich: `from ddp_doctor import guard` is the function, and no public module of the same name shadows it or is
shadowed by it.
"""

from __future__ import annotations

__version__ = "0.1.0"

from ddp_doctor._guard import Guard, guard
from ddp_doctor._observe import Doctor, observe
from ddp_doctor._refreeze import ProgressiveFreeze, progressive_freeze, refreeze
from ddp_doctor.codes import CODES
from ddp_doctor.errors import (
    DDPFailure,
    DoctorError,
    GuardError,
    InvalidArgumentError,
    NotDDPModelError,
    NoTrainableParametersError,
    ProcessGroupNotInitializedError,
    RankMismatchError,
    ReductionError,
    ReplicaDivergenceError,
    ReportTimeoutError,
    StaleModelError,
)
from ddp_doctor.report import Finding, ParamRef, Recommendation, Report
from ddp_doctor.sync import sync_gradients

__all__ = [
    "CODES",
    "DDPFailure",
    "Doctor",
    "DoctorError",
    "Finding",
    "Guard",
    "GuardError",
    "InvalidArgumentError",
    "NoTrainableParametersError",
    "NotDDPModelError",
    "ParamRef",
    "ProcessGroupNotInitializedError",
    "ProgressiveFreeze",
    "RankMismatchError",
    "Recommendation",
    "ReductionError",
    "ReplicaDivergenceError",
    "Report",
    "ReportTimeoutError",
    "StaleModelError",
    "__version__",
    "guard",
    "observe",
    "progressive_freeze",
    "refreeze",
    "sync_gradients",
]
