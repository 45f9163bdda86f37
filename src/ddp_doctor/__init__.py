"""ddp-doctor: find, explain and fix misconfigured PyTorch DistributedDataParallel training.

The flow is one-way: observe (local hooks) -> gather (the only collectives) -> analyze (pure) -> report (renderers).
"""

from __future__ import annotations

__version__ = "0.1.0"

from ddp_doctor.codes import CODES
from ddp_doctor.errors import (
    DDPFailure,
    DoctorError,
    InvalidArgumentError,
    NotDDPModelError,
    NoTrainableParametersError,
    ProcessGroupNotInitializedError,
    RankMismatchError,
    ReductionError,
    ReportTimeoutError,
)
from ddp_doctor.observe import Doctor, observe
from ddp_doctor.report import Finding, ParamRef, Recommendation, Report

__all__ = [
    "CODES",
    "DDPFailure",
    "Doctor",
    "DoctorError",
    "Finding",
    "InvalidArgumentError",
    "NoTrainableParametersError",
    "NotDDPModelError",
    "ParamRef",
    "ProcessGroupNotInitializedError",
    "RankMismatchError",
    "Recommendation",
    "ReductionError",
    "Report",
    "ReportTimeoutError",
    "__version__",
    "observe",
]
