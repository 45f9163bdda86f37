"""Cross-rank consistency of the training helpers in a step: AMP GradScaler's scale at each optimizer step
(`grad-scaler-mismatch`) and BatchNorm layers that normalize over each rank's own batch (`batchnorm-not-synced`).
The ranks' collectives, DDP's own counted by their mechanism included, are `collective_order.py`'s. Pure: the
exchange's per-step maxima and minima show where the ranks differ, its bounded examples name them."""

from __future__ import annotations

from ddp_doctor.analyze.common import all_ranks
from ddp_doctor.analyze.rules import count
from ddp_doctor.analyze.snippets import sync_batchnorm
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure
from ddp_doctor.core.records import decode_scale

__all__ = ["batchnorm_not_synced", "grad_scaler_mismatch"]


@detects(Code.GRAD_SCALER_MISMATCH)
def grad_scaler_mismatch(v: View) -> list[Finding]:
    """AMP GradScaler's scale differs across ranks at an optimizer step: the ranks skip different steps (a scaler
    skips the step whose gradients hold an inf or NaN, then lowers its scale), so the replicas drift apart."""
    if v.world < 2 or not v.steps:
        return []
    most_by, least_by = v.summary.scales
    bad = [s for s in range(v.steps) if most_by[s] != least_by[s]]
    if not bad:
        return []
    first = bad[0]
    odd = v.ranks("scale-differs")
    named = [(0, v.summary.scales0[first]), *((r, v.meta(r)["scale"]) for r in odd.ranks[:7])]
    return [
        Finding(
            code=Code.GRAD_SCALER_MISMATCH,
            severity="warning",
            params=[],
            ranks=sorted({0, *odd.ranks}),
            steps=bad,
            more_ranks=odd.more,
            fix="build the GradScaler with the same arguments on every rank and call scaler.scale(loss).backward(), "
            "scaler.step(optimizer) and scaler.update() on every rank in every step.",
            # Each named rank's scale at the first step they differ (none for a rank that called no scaler.step()).
            measured=[Measure(f"scale (rank {r})", decode_scale(value), "ratio") for r, value in named if value],
        )
    ]


@detects(Code.BATCHNORM_NOT_SYNCED)
def batchnorm_not_synced(v: View) -> list[Finding]:
    """BatchNorm layers in training mode under DDP without SyncBatchNorm: each rank normalizes over its own batch.
    Information, not an error: it matters when the per-rank batch is small."""
    if v.world < 2 or not v.steps or not v.info.batchnorm:
        return []
    steps = v.summary.batchnorm_training.nonzero().flatten().tolist()
    if not steps:
        return []
    sizes = sorted(set(v.summary.batch_sizes or ()))
    per_rank = (
        f"{sizes[0]} samples per rank"
        if len(sizes) == 1
        else f"{sizes[0]} to {sizes[-1]} samples per rank"
        if sizes
        else "an unknown number of samples per rank"
    )
    names = v.info.batchnorm
    listed = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return [
        Finding(
            code=Code.BATCHNORM_NOT_SYNCED,
            severity="info",
            title=f"BatchNorm without SyncBatchNorm: {count(len(names), 'layer')} normalizing over each rank's own "
            f"batch ({per_rank})",
            detail=f"{listed} trained in training mode without SyncBatchNorm, so each rank computes the batch mean and "
            f"variance over its own {per_rank} and keeps its own running statistics (DDP then copies rank 0's "
            "running statistics to the others at each forward when broadcast_buffers=True). That is fine when the "
            "per-rank batch is large (tens of samples or more per layer input); with a few samples per rank the "
            "statistics are noisy and training can be worse than on one device with the global batch. "
            "SyncBatchNorm computes them over the global batch at the cost of one all-reduce per layer per forward.",
            params=[],
            ranks=all_ranks(v),
            steps=steps,
            measured=_batchnorm_measured(sizes, len(names), listed=min(len(names), 6)),
            fix="if the per-rank batch is small, convert before wrapping: "
            "model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model); otherwise nothing to do."
            if sync_batchnorm(v.info.device_type, "")
            else "nothing to do when the per-rank batch is large. SyncBatchNorm is not available here: it runs on GPU "
            "modules only (DDP refuses it on CPU: 'SyncBatchNorm layers only work with GPU modules'); with a small "
            "per-rank batch, give each rank more samples, or train on GPUs with SyncBatchNorm.",
        )
    ]


def _batchnorm_measured(sizes: list[int], layers: int, *, listed: int) -> list[Measure]:
    """The evidence of BatchNorm that normalizes per rank: the samples per rank (the fewest and the most when the
    ranks' batches differ; none when not known), the layers, and those beyond the `listed` names."""
    if len(sizes) == 1:
        samples = [Measure("samples_per_rank", sizes[0], "count")]
    elif sizes:
        samples = [Measure("samples_per_rank_fewest", sizes[0], "count")]
        samples.append(Measure("samples_per_rank_most", sizes[-1], "count"))
    else:
        samples = []
    unlisted = [Measure("batchnorm_layers_not_named", layers - listed, "count")] if layers > listed else []
    return [*samples, Measure("batchnorm_layers", layers, "count"), *unlisted]
