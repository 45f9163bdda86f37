"""What a check learns of a job that trains on several ranks with no DDP model and no sharding: the parameters an
optimizer stepped and whether they differ across ranks, in the one typed record the analysis reads
(`analyze/not_wrapped.py`). `doctor/plain_watch.py` gathers it (one fixed-shape min/max reduction)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ddp_doctor.core.findings import ParamRef

__all__ = ["UnwrappedRun"]


@dataclass(kw_only=True, slots=True)
class UnwrappedRun:
    """An optimizer that stepped parameters on `world` ranks with no DDP around them (cross-rank facts reduced)."""

    world: int
    """Ranks in the process group."""
    steps: int
    """Optimizer steps observed."""
    optimizer: str
    """The optimizer's class name."""
    optimizer_site: str | None
    """Where the script created the optimizer."""
    params: list[ParamRef] = field(default_factory=list)
    """The stepped parameters (names from the module that owns them); DTensors left out."""
    differ: list[bool] = field(default_factory=list)
    """Per parameter: its weights differ across ranks after the observed steps."""
    gap: float = 0.0
    """The largest cross-rank difference of a parameter's weight fingerprint (inf when the ranks step different
    numbers of parameters)."""
    dtensors: int = 0
    """Stepped parameters that are DTensors placed on a device mesh by a parallelism the check has no rules for
    (tensor parallelism, say: FSDP2's and replicate's modules are followed as such): left out of the comparison,
    since their local parts may differ across ranks by design."""
