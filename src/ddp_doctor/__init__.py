"""ddp-doctor: find, explain and fix misconfigured PyTorch DistributedDataParallel training.

The flow is one-way: observe (local hooks) -> exchange (the only collectives) -> analyze (pure) -> report (renderers).

The three context managers are implemented under other names (`doctor/`, `fixes/guard/`, `fixes/refreeze/`), as in
rich: `from ddp_doctor import guard` is the function, and no public module of the same name shadows it or is
shadowed by it.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

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

if TYPE_CHECKING:
    from ddp_doctor.core.findings import Finding, ParamRef, Recommendation
    from ddp_doctor.doctor import Doctor, ShardedDoctor, observe
    from ddp_doctor.fixes.guard import Guard, guard
    from ddp_doctor.fixes.refreeze import ProgressiveFreeze, progressive_freeze, refreeze
    from ddp_doctor.fixes.sync import sync_gradients
    from ddp_doctor.report import Report

# The names that need torch load on first use, so that `import ddp_doctor` (and the CLI's help, its argument
# errors, `ddp-doctor codes`) costs no import of torch.
_LAZY = {
    "Finding": "ddp_doctor.core.findings",
    "ParamRef": "ddp_doctor.core.findings",
    "Recommendation": "ddp_doctor.core.findings",
    "Doctor": "ddp_doctor.doctor",
    "ShardedDoctor": "ddp_doctor.doctor",
    "observe": "ddp_doctor.doctor",
    "Guard": "ddp_doctor.fixes.guard",
    "guard": "ddp_doctor.fixes.guard",
    "ProgressiveFreeze": "ddp_doctor.fixes.refreeze",
    "progressive_freeze": "ddp_doctor.fixes.refreeze",
    "refreeze": "ddp_doctor.fixes.refreeze",
    "sync_gradients": "ddp_doctor.fixes.sync",
    "Report": "ddp_doctor.report",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ddp_doctor' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


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
