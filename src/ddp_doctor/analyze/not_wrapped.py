"""`model-not-wrapped`: an optimizer trained parameters on several ranks and no DDP was built. Pure."""

from __future__ import annotations

from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Recommendation, Unchecked
from ddp_doctor.core.unwrapped_run import UnwrappedRun

__all__ = ["unwrapped_compared", "unwrapped_findings", "unwrapped_recommendation", "unwrapped_unchecked"]


def unwrapped_recommendation(run: UnwrappedRun) -> Recommendation:
    """No DDP model: no flags to recommend; and no advice to wrap a model whose parameters are DTensors."""
    if run.dtensors:
        return Recommendation.unknown(
            "No DDP model was built, so there are no DDP flags to recommend. The parameters are DTensors of a "
            "parallelism the check has no rules for (tensor parallelism, say): wrapping this model in DDP is not "
            "the advice."
        )
    return Recommendation.unknown(
        "No DDP model was built, so there are no DDP flags to recommend: wrap the model first, then run the check "
        "again."
    )


def unwrapped_compared(run: UnwrappedRun) -> dict[str, int | str]:
    """What the check compared across the ranks of a run without a wrapper: the weights of the plain parameters
    the optimizer stepped (`parameters`: 0 when it stepped only DTensors of a parallelism without rules here)."""
    return {
        "parallelism": "none",
        "ranks": run.world,
        "steps": run.steps,
        "parameters": len(run.params),
        "dtensors": run.dtensors,
    }


def unwrapped_unchecked(run: UnwrappedRun) -> list[Unchecked]:
    """What the check could not compare: the DTensor parameters of a parallelism it has no rules for."""
    if not run.dtensors:
        return []
    compared = f"the other {len(run.params)} were compared across ranks" if run.params else "it steps no other"
    text = (
        f"{run.dtensors} of the parameters the optimizer{_where(run)} steps are DTensors placed on a device mesh "
        "by a parallelism other than FSDP2 or replicate (tensor parallelism, say). Their local parts may differ "
        f"across ranks by design and the check has no rules for them, so none of them was compared; {compared}."
    )
    return [Unchecked("dtensors", text, {"dtensors": run.dtensors, "compared": len(run.params)})]


def _where(run: UnwrappedRun) -> str:
    return f" ({run.optimizer} created at {run.optimizer_site})" if run.optimizer_site else f" ({run.optimizer})"


def unwrapped_findings(run: UnwrappedRun) -> list[Finding]:
    """Findings for parameters an optimizer stepped with no DDP around them (none when it stepped none)."""
    if not run.params:
        return []
    params, world, steps = run.params, run.world, run.steps
    where = _where(run)
    if any(run.differ):
        bad = [p for p, d in zip(params, run.differ) if d]
        return [
            Finding(
                code=Code.MODEL_NOT_WRAPPED,
                severity="error",
                title=f"no DDP: {len(bad)} of {len(params)} trained parameters differ across ranks",
                detail=f"The process group has {world} ranks and an optimizer{where} stepped these parameters "
                f"{steps} time(s), but no DistributedDataParallel was built, so nothing averages the gradients: "
                f"each rank trains its own copy on its own data (the largest weight difference is "
                f"{run.gap:.3g}). Whatever rank 0 saves is one rank's model, not the job's.",
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
