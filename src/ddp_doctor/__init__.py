"""ddp-doctor: find, explain and fix misconfigured PyTorch DistributedDataParallel training.

The flow is one-way: observe (local hooks) -> exchange (the only collectives) -> analyze (pure) -> report (renderers).

The three context managers are implemented under other names (`doctor/`, `fixes/guard/`, `fixes/refreeze/`), as in
rich: `from ddp_doctor import guard` is the function, and no public module of the same name shadows it or is
shadowed by it.
"""

from __future__ import annotations

from ddp_doctor.core import VERSION as __version__
from ddp_doctor.core.codes import CODES, Code
from ddp_doctor.core.errors import (
    DDPFailure,
    DoctorError,
    GuardError,
    InvalidArgumentError,
    MixedParallelismError,
    NotDDPModelError,
    NoTrainableParametersError,
    ProcessGroupNotInitializedError,
    RankMismatchError,
    ReductionError,
    ReplicaDivergenceError,
    ReportTimeoutError,
    StaleModelError,
)
from ddp_doctor.core.findings import Finding, ParamRef, Recommendation
from ddp_doctor.doctor import Doctor, ShardedDoctor, observe
from ddp_doctor.fixes.guard import Guard, guard
from ddp_doctor.fixes.refreeze import ProgressiveFreeze, progressive_freeze, refreeze
from ddp_doctor.fixes.sync import sync_gradients
from ddp_doctor.report import Report

__all__ = [
    "CODES",
    "Code",
    "DDPFailure",
    "Doctor",
    "DoctorError",
    "Finding",
    "Guard",
    "GuardError",
    "InvalidArgumentError",
    "MixedParallelismError",
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
    "ShardedDoctor",
    "StaleModelError",
    "__version__",
    "guard",
    "observe",
    "progressive_freeze",
    "refreeze",
    "sync_gradients",
]
