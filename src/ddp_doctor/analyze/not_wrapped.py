"""`model-not-wrapped`: an optimizer trained parameters on several ranks and no DDP was built. Pure."""

from __future__ import annotations

import torch

from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, ParamRef

__all__ = ["unwrapped_findings"]


def unwrapped_findings(
    params: list[ParamRef],
    differ: torch.Tensor,
    gap: torch.Tensor,
    *,
    world: int,
    steps: int,
    optimizer_site: str | None,
    optimizer: str,
) -> list[Finding]:
    """Findings for parameters an optimizer stepped with no DDP around them.

    Args:
        params: the stepped parameters (names from the module that owns them).
        differ: bool[P], the parameter's weights differ across ranks after the observed steps.
        gap: float64[P], the largest cross-rank difference of the parameter's weight fingerprint.
        world: ranks in the process group.
        steps: optimizer steps observed.
        optimizer_site: where the optimizer was created.
        optimizer: its class name.
    """
    where = f" ({optimizer} created at {optimizer_site})" if optimizer_site else f" ({optimizer})"
    if bool(differ.any()):
        bad = [p for p, d in zip(params, differ.tolist()) if d]
        return [
            Finding(
                code=Code.MODEL_NOT_WRAPPED,
                severity="error",
                title=f"no DDP: {len(bad)} of {len(params)} trained parameters differ across ranks",
                detail=f"The process group has {world} ranks and an optimizer{where} stepped these parameters "
                f"{steps} time(s), but no DistributedDataParallel was built, so nothing averages the gradients: "
                f"each rank trains its own copy on its own data (the largest weight difference is "
                f"{float(gap.max()):.3g}). Whatever rank 0 saves is one rank's model, not the job's.",
                params=bad,
                ranks=list(range(world)),
                steps=list(range(steps)),
                fix="wrap the model before creating the optimizer: model = DistributedDataParallel(model, "
                "device_ids=[local_rank]) on GPU, DistributedDataParallel(model) on CPU (a script that only wraps "
                "on its GPU branch trains unsynchronized copies on CPU).",
            )
        ]
    return [
        Finding(
            code=Code.MODEL_NOT_WRAPPED,
            severity="info",
            title=f"no DDP, but {len(params)} trained parameters stayed identical across ranks",
            detail=f"An optimizer{where} stepped them {steps} time(s) on {world} ranks with no DistributedDataParallel, "
            "and their weights are the same on every rank: the script keeps them in sync itself (a manual "
            "all-reduce, or identical data and seeds).",
            params=params,
            ranks=list(range(world)),
            steps=list(range(steps)),
            fix="if the script all-reduces gradients by hand, ddp_doctor.sync_gradients does it bucketed and treats a "
            "missing gradient as zeros (a per-parameter loop hangs when one rank has None); DDP overlaps it with "
            "backward.",
        )
    ]
