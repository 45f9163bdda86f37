"""Cross-rank consistency of what each rank did in a step, DDP's own collectives counted by their mechanism (the
ranks' sequences of collectives are `collective_order.py`'s): the same number of synced passes through DDP, no DDP forward in grad mode that only some ranks run without a backward, and no
buffer broadcast of DDP's from a forward without grad that only some ranks run. Pure:
the exchange's per-step maxima and minima show where the ranks differ, its bounded examples name them."""

from __future__ import annotations

from ddp_doctor.analyze.common import all_ranks
from ddp_doctor.analyze.rules import count
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, lines_of
from ddp_doctor.core.ranks import other_ranks, rank_list
from ddp_doctor.core.records import decode_scale

__all__ = [
    "batchnorm_not_synced",
    "eval_broadcast_mismatch",
    "grad_scaler_mismatch",
    "synced_pass_mismatch",
    "unpaired_forward_mismatch",
]


@detects(Code.COLLECTIVE_MISMATCH)
def synced_pass_mismatch(v: View) -> list[Finding]:
    """Ranks that ran different numbers of synced backward passes through DDP in one optimizer step: each extra
    backward issues DDP's gradient all-reduces once more, which the other ranks pair with their next ones."""
    if v.world < 2:
        return []
    (stepped_hi, stepped_lo), (synced_hi, synced_lo) = v.summary.steps_taken, v.summary.synced
    if synced_hi == synced_lo and stepped_hi != stepped_lo:
        # Every rank ran its synced passes in lockstep: counted per rank's own optimizer steps they look uneven
        # only because some rank skipped a step (`optimizer-step-skipped`), not because collectives were extra.
        return []
    most_by, least_by = v.summary.window_passes
    bad = [k for k in range(v.summary.windows) if most_by[k] != least_by[k]]
    if not bad:
        return []
    first = bad[0]
    most, least = most_by[first], least_by[first]
    extra, rest = v.ranks("extra-passes"), v.ranks("fewer-passes")
    sites = sorted({site for r in extra.ranks for site in v.meta(r)["window_sites"]})
    where = f" (the extra pass starts at {', '.join(sites)})" if sites else ""
    return [
        Finding(
            code=Code.COLLECTIVE_MISMATCH,
            sites=lines_of(*sites),
            severity="error",
            title=f"{rank_list(extra.ranks, more=extra.more)} ran {most} synced backward passes in optimizer step {first}, {rank_list(rest.ranks, more=rest.more)} "
            f"{least}",
            detail=f"In optimizer step {first}{where}, the ranks ran different numbers of backward passes through DDP "
            "with gradient sync on. Each synced backward issues DDP's gradient all-reduces, so the extra ones on "
            "one rank are paired with the other ranks' next ones: gradients of different steps get averaged, "
            "and the job hangs or crashes when the counts no longer line up."
            + (f" It happened again in optimizer step(s) {bad[1:]}." if len(bad) > 1 else ""),
            params=[],
            ranks=extra.ranks,
            steps=bad,
            more_ranks=extra.more,
            fix="run the same number of synced forward/backward passes on every rank in each step: decide the retry "
            "from a value all-reduced across ranks, or run the extra pass under ddp.no_sync().",
        )
    ]


@detects(Code.COLLECTIVE_MISMATCH)
def unpaired_forward_mismatch(v: View) -> list[Finding]:
    """Ranks that ran DDP's forward in grad mode (gradient sync on) without a backward where other ranks did not:
    typically a rank-0-only evaluation through the DDP wrapper with autograd on. DDP prepares a reduction in such a
    forward and, when it broadcasts buffers, issues a collective the other ranks never issue."""
    if v.world < 2 or not v.steps:
        return []
    most_by, least_by = v.summary.unpaired
    bad = [s for s in range(v.steps) if most_by[s] != least_by[s]]
    if not bad:
        return []
    first = bad[0]
    extra, rest = v.ranks("unpaired-extra"), v.ranks("unpaired-fewer")
    sites = sorted({site for r in extra.ranks for site in v.meta(r)["unpaired_sites"]})
    where = f" at {', '.join(sites)}" if sites else ""
    broadcasts = bool(v.info.buffer_names) and bool(v.info.ddp_config.get("broadcast_buffers", True))
    consequence = (
        "DDP's forward broadcasts rank 0's buffers (broadcast_buffers=True and the model has buffers), a collective "
        "the other ranks do not issue at that point: their next collectives are paired with it, and the job hangs "
        "or averages the wrong tensors."
        if broadcasts
        else "This run went on because the model has no buffers for DDP to broadcast in that forward, so it issued no "
        "collective there; with buffers (BatchNorm, say) and broadcast_buffers=True the same line broadcasts them on "
        "these ranks alone, a collective the other ranks never join, and the job hangs (measured on torch 2.13)."
    )
    return [
        Finding(
            code=Code.COLLECTIVE_MISMATCH,
            sites=lines_of(*sites),
            severity="error" if broadcasts else "warning",
            title=f"{rank_list(extra.ranks, more=extra.more)} ran DDP's forward with autograd on and no backward{where} in step {first}; "
            f"{rank_list(rest.ranks, more=rest.more)} did not",
            detail=f"In step {first}, {rank_list(extra.ranks, more=extra.more)} called the DDP model in grad mode {most_by[first]} "
            f"more time(s) than {rank_list(rest.ranks, more=rest.more)}, and no backward followed{where} (an evaluation through the DDP "
            "wrapper, say). " + consequence + (f" Also in step(s) {bad[1:]}." if len(bad) > 1 else ""),
            params=[],
            ranks=extra.ranks,
            steps=bad,
            more_ranks=extra.more,
            fix="evaluate on one rank under torch.no_grad() through the inner module (ddp_model.module(x)), or run the "
            "evaluation on every rank.",
        )
    ]


@detects(Code.COLLECTIVE_MISMATCH)
def eval_broadcast_mismatch(v: View) -> list[Finding]:
    """Ranks whose DDP forwards without grad broadcast the buffers where the other ranks' did not: typically a
    rank-0-only evaluation through the DDP wrapper under torch.no_grad() of a model with buffers (BatchNorm).

    DDP broadcasts at every forward that follows a synced forward in grad mode, whatever the grad mode of its own,
    and skips the broadcast at the forward after one without grad: the evaluation takes over rank 0's broadcast
    from its next training forward, and the other ranks pair it with whatever collective they issue next. Steps
    where `unpaired_forward_mismatch` fires are its to explain (the exchange leaves them out).
    """
    if v.world < 2 or not v.steps:
        return []
    (hi, lo), (u_hi, u_lo) = v.summary.broadcasts, v.summary.unpaired
    bad = [s for s in range(v.steps) if int(hi[s, 1]) != int(lo[s, 1]) and u_hi[s] == u_lo[s]]
    if not bad:
        return []
    first = bad[0]
    extra, rest = v.ranks("broadcast-extra"), v.ranks("broadcast-fewer")
    sites = sorted({site for r in extra.ranks for site in v.meta(r)["broadcast_sites"]})
    where = f" at {', '.join(sites)}" if sites else ""
    uneven = [s for s in bad if int(hi[s, 0]) != int(lo[s, 0])]
    counts = (
        f" Counted by optimizer step, the ranks also issued different numbers of buffer broadcasts in step(s) {uneven}."
        if uneven
        else ""
    )
    who, others = rank_list(extra.ranks, more=extra.more), rank_list(rest.ranks, more=rest.more)
    return [
        Finding(
            code=Code.COLLECTIVE_MISMATCH,
            sites=lines_of(*sites),
            severity="error",
            title=f"{who} broadcast DDP's buffers from a forward without grad{where} in step {first}; {others} did not",
            detail=f"In step {first}, {who} called the DDP model without grad{where} (an evaluation through the DDP "
            "wrapper, say), and DDP's forward broadcast rank 0's buffers there: it does at every forward that "
            "follows a synced training forward when broadcast_buffers=True and the model has buffers (BatchNorm), "
            f"in eval mode and under torch.no_grad() too. {others} issued no broadcast at that point. A forward "
            "without grad also makes DDP skip the broadcast of the next forward, so on those ranks the broadcast moved "
            "from their next training forward to the evaluation, and the other ranks pair it with the next "
            "collective they issue. The observed steps got through because that was their next forward's broadcast; when something "
            "else comes first on them (a dist.barrier() or an all_reduce of metrics after the evaluation, DDP's "
            "gradient all-reduce when the evaluation runs between forward and backward, the end of training), the "
            "collectives pair with the wrong ones and the job hangs (measured with gloo on torch 2.13)."
            + counts
            + (f" Also in step(s) {bad[1:]}." if len(bad) > 1 else ""),
            params=[],
            ranks=extra.ranks,
            steps=bad,
            more_ranks=extra.more,
            fix="evaluate through the inner module (ddp_model.module(x)) under torch.no_grad(), or run the evaluation "
            "on every rank.",
        )
    ]


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

    def scale(value: int) -> str:
        return f"{decode_scale(value):g}" if value else "no scaler.step()"

    shown = ", ".join(
        [
            f"rank 0: {scale(v.summary.scales0[first])}",
            *(f"rank {r}: {scale(v.meta(r)['scale'])}" for r in odd.ranks[:7]),
        ]
    )
    more = odd.count - min(len(odd.ranks), 7)
    return [
        Finding(
            code=Code.GRAD_SCALER_MISMATCH,
            severity="warning",
            title=f"GradScaler's scale differs across ranks at step {first} ({shown}" + other_ranks(more) + ")",
            detail="With gradients synchronized by DDP, every rank sees the same infs and NaNs, so every rank's scaler "
            "skips the same steps and keeps the same scale. Here they differ: DDP averages gradients scaled by "
            "different factors and each rank divides the average by its own scale, so the ranks apply different "
            "updates (and skip different steps), and the replicas drift apart. Usual causes: a scaler built with "
            "a rank-dependent "
            "init_scale, scaler.update() or scaler.step() called on some ranks only, or gradients that DDP did "
            "not synchronize (see the other findings)." + (f" Also at step(s) {bad[1:]}." if len(bad) > 1 else ""),
            params=[],
            ranks=sorted({0, *odd.ranks}),
            steps=bad,
            more_ranks=odd.more,
            fix="build the GradScaler with the same arguments on every rank and call scaler.scale(loss).backward(), "
            "scaler.step(optimizer) and scaler.update() on every rank in every step.",
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
            fix="if the per-rank batch is small, convert before wrapping: "
            "model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model); otherwise nothing to do.",
        )
    ]
