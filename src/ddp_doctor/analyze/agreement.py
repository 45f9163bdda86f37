"""Detectors of replicas that stop agreeing: a bypassed wrapper, gradients or weights or buffers that differ across
ranks at the optimizer step, and every rank training on the same batch. Pure functions of the aligned `View`."""

from __future__ import annotations

import torch

from ddp_doctor.analyze import rules
from ddp_doctor.analyze.common import steps_of, with_flags
from ddp_doctor.analyze.rules import count as _count
from ddp_doctor.analyze.view import View
from ddp_doctor.report.model import Finding
from ddp_doctor.report.snippets import freeze_point

__all__ = ["buffer_divergence", "grads_not_synced", "identical_inputs", "replica_divergence", "wrapper_bypass"]


def wrapper_bypass(v: View) -> list[Finding]:
    # A step with DDP's forward as well is not a bypass: DDP then reduces every gradient, including those of
    # modules called outside its forward (that case is used-outside-forward).
    hits = [(r.rank, s) for r in v.records
            for s in steps_of((r.counter("bypass_forwards") > 0) & (r.counter("ddp_forwards") == 0))]
    if not hits:
        return []
    sites = sorted({site for r in v.records for site in r.bypass_sites})
    used_on_hits = torch.zeros(len(v.info.param_names), dtype=torch.bool)
    for r in v.records:
        for step in {s for rank, s in hits if rank == r.rank}:
            used_on_hits |= r.used[step]
    where = f" Called from {', '.join(sites)}." if sites else ""
    return [rules.wrapper_bypass(
        title="the wrapped module is called directly, so DDP never synchronizes it",
        detail="The module inside DDP ran forward in grad mode without DDP's forward around it (for example "
               "loss = ddp_model.module(x) or a helper that unwraps the model). DDP's reducer only fires after its "
               "own forward, so each rank trains its own replica." + where,
        params=v.params(used_on_hits),
        ranks=sorted({r for r, _ in hits}), steps=sorted({s for _, s in hits}),
        fix="call the DDP wrapper (ddp_model(x)); if the loss needs other outputs, return them from forward. "
            "ddp_doctor.sync_gradients is the fallback when that is impossible.")]


def grads_not_synced(v: View) -> list[Finding]:
    if v.world < 2 or not v.steps:
        return []
    trainable_all = v.trainable.all(0)                      # [S, P]
    same = v.same_across_ranks(v.grad_fp)                   # [S, P]
    differ = ~same & trainable_all & ~v.ignored
    if not differ.any():
        return []
    params = differ.any(0)
    steps = steps_of(differ.any(1))
    g = v.grad_fp[:, :, params]
    ranks = [r for r in range(1, v.world) if not bool(((g[r] == g[0]) | (g[r].isnan() & g[0].isnan())).all())]
    return [Finding(
        code="grads-not-synced", severity="error",
        title=f"gradients of {_count(int(params.sum()), 'parameter')} differ across ranks at the optimizer step",
        detail="When the optimizer stepped, these gradients were not the same on every rank, so the replicas "
               f"take different updates. Ranks {[0] + ranks} disagree in steps {steps}.",
        params=v.params(params), ranks=[0] + ranks, steps=steps,
        fix="see the findings that explain why (a bypassed wrapper, parameters unused with default flags, "
            "requires_grad changed after wrap); gradients must be reduced by DDP before optimizer.step().")]


def replica_divergence(v: View) -> list[Finding]:
    if v.world < 2:
        return []
    same = v.same_across_ranks(v.weight_fp)                 # [S+1, P]
    differ = ~same & ~v.ignored
    if not differ.any():
        return []
    params = differ.any(0)
    at_entry = bool(differ[0].any())
    after = [s - 1 for s in steps_of(differ.any(1)) if s > 0]
    w = v.weight_fp[:, :, params, 0]
    gap = float((w - w[:1]).abs().nan_to_num(0).max())
    ranks = [r for r in range(1, v.world) if not bool(torch.equal(v.weight_fp[r][:, params], v.weight_fp[0][:, params]))]
    when = "already when observe() started" if at_entry else f"after step {after[0]}"
    return [rules.replica_divergence(
        title=f"weights of {_count(int(params.sum()), 'parameter')} differ across ranks",
        detail=f"The replicas are no longer identical, {when}; the largest difference of a parameter's sum "
               f"between rank 0 and another rank is {gap:.3g}. Whatever rank 0 saves is not what the other ranks "
               "trained.",
        params=v.params(params), ranks=[0] + ranks, steps=after,
        fix="fix the cause (see grads-not-synced and the findings that explain it); restart from a checkpoint "
            "saved before the divergence, or re-broadcast rank 0's weights knowingly.")]


def buffer_divergence(v: View) -> list[Finding]:
    if v.world < 2 or not v.steps or not v.info.buffer_names:
        return []
    fp = v.buffer_fp
    seen = ~fp.isnan().all(-1).any(0)                       # [S, B]: every rank recorded it
    differ = ~v.same_across_ranks(fp) & seen
    if not differ.any():
        return []
    buffers = differ.any(0)
    broadcast = bool(v.info.ddp_config.get("broadcast_buffers", True))
    return [rules.buffer_divergence(
        title=f"{_count(int(buffers.sum()), 'buffer')} differ across ranks during training",
        detail="Buffers such as BatchNorm running statistics differ between ranks when the forward pass runs"
               + (" because DDP was built with broadcast_buffers=False" if not broadcast else "")
               + ". Evaluation then differs by rank, and only rank 0's are saved.",
        params=v.buffers(buffers), ranks=list(range(v.world)), steps=steps_of(differ.any(1)),
        fix=with_flags(v, broadcast_buffers=True) + " (the default), or convert BatchNorm with "
            f"torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) {freeze_point(v.info.framework)}.")]


def identical_inputs(v: View) -> list[Finding]:
    if v.world < 2 or not v.steps:
        return []
    fp = v.input_fp
    has_input = (fp != 0).any(-1).all(0)                    # [S]
    if not has_input.any():
        return []
    same = v.same_across_ranks(fp)[has_input]
    if not bool(same.all()):
        return []
    return [Finding(
        code="identical-inputs-across-ranks", severity="warning",
        title="every rank got the same batch",
        detail=f"In all {int(has_input.sum())} observed steps the inputs were identical on all {v.world} ranks, so "
               "the ranks do the same work and the job trains no faster than one rank.",
        ranks=list(range(v.world)), steps=steps_of(has_input),
        fix="shard the data: DataLoader(dataset, sampler=DistributedSampler(dataset)), and call "
            "sampler.set_epoch(epoch) every epoch.")]
