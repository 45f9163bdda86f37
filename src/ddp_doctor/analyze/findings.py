"""Detectors: each reads the aligned `View` and returns findings. Pure functions, no communication."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ddp_doctor.analyze import rules
from ddp_doctor.analyze.consistency import (
    batchnorm_not_synced,
    collective_sequence_mismatch,
    grad_scaler_mismatch,
    synced_pass_mismatch,
    unpaired_forward_mismatch,
)
from ddp_doctor.analyze.data import sampler_epoch_not_set, uneven_inputs
from ddp_doctor.analyze.rules import count as _count
from ddp_doctor.analyze.view import View
from ddp_doctor.records import CRASH_KINDS
from ddp_doctor.report.model import Finding
from ddp_doctor.report.snippets import flags_fix, freeze_point

__all__ = ["DETECTORS"]



def _with(v: View, **flags: bool) -> str:
    """'build DDP with ...', in the words of the framework that built the model (TrainingArguments, ...)."""
    return flags_fix(v.info.framework, flags, v.info.flavor)


def _freeze_fix(v: View) -> str:
    return (f"set requires_grad=False on them {freeze_point(v.info.framework)}; if they must train on some steps, "
            f"{_with(v, static_graph=True)} (same params unused every step) or "
            f"{_with(v, find_unused_parameters=True)} (the set changes)")


def _steps(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().flatten().tolist()


def unused_parameters(v: View) -> list[Finding]:
    if not v.steps:
        return []
    never, _ = v.unused_by_cause()      # modules that never ran: the only parameters freezing can be advised for
    if not never.any():
        return []
    n = int(never.sum())
    if v.default_flags:
        severity, effect = "error", ("With find_unused_parameters=False and static_graph=False DDP waits for their "
                                     "gradients: the step's gradients are never all-reduced, then the next step "
                                     "fails with 'Expected to have finished reduction'.")
    else:
        severity, effect = "warning", ("The current flags cope, but DDP still all-reduces zeros for them every step"
                                       + (" and walks the autograd graph to find them." if v.find_unused else "."))
    return [Finding(
        code="unused-parameters", severity=severity,
        title=f"{_count(n, 'trainable parameter')} never reached the loss",
        detail=f"On every rank and every one of the {v.steps} observed steps, these parameters got no gradient and "
               "their modules never ran in a training forward. " + effect,
        params=v.params(never), ranks=list(range(v.world)), steps=list(range(v.steps)),
        fix=_freeze_fix(v) + ".")]


def grad_blocked(v: View) -> list[Finding]:
    if not v.steps:
        return []
    _, blocked = v.unused_by_cause()
    if not blocked.any():
        return []
    sites = v.blocked_checkpoints
    cause = (f"a reentrant checkpoint none of whose inputs requires grad ({', '.join(sites)}): the checkpointed "
             "block runs without building a graph, so no gradient ever reaches it" if sites else
             "their modules ran, but the output was cut from the graph: torch.no_grad(), .detach(), or a reentrant "
             "checkpoint whose inputs do not require grad")
    return [Finding(
        code="grad-blocked", severity="error",
        title=f"{_count(int(blocked.sum()), 'parameter')} ran in forward but never got a gradient",
        detail=f"On every rank and every one of the {v.steps} observed steps these parameters' modules ran, yet "
               f"no gradient reached them: {cause}. The script evidently means to train them, so they silently "
               "stay at their initial values"
               + (" while DDP waits for their gradients" if v.default_flags else "") + ".",
        params=v.params(blocked), ranks=list(range(v.world)), steps=list(range(v.steps)),
        fix=("pass use_reentrant=False to torch.utils.checkpoint.checkpoint (it works whether or not the inputs "
             "require grad)" if sites else
             "remove the torch.no_grad() / .detach() that cuts them off, or use checkpoint(..., use_reentrant=False)")
            + "; if they really are meant to stay fixed, set requires_grad=False on them yourself before wrapping.")]


def dynamic_graph(v: View) -> list[Finding]:
    _, dynamic, _, _ = v.usage()
    if not dynamic.any():
        return []
    steps = _steps((~v.used[:, :, dynamic]).any(0).any(-1))
    if v.static_graph:
        severity = "error"
    elif v.find_unused:
        severity = "info"
    else:
        severity = "error"
    return [Finding(
        code="dynamic-graph", severity=severity,
        title=f"{_count(int(dynamic.sum()), 'parameter')} reach the loss on some steps but not others",
        detail="The set of parameters that get a gradient changes from step to step (for example a branch taken "
               "on some steps). Only find_unused_parameters=True handles a used-set that changes"
               + (", which is what this run uses." if v.find_unused and not v.static_graph else "."),
        params=v.params(dynamic), ranks=list(range(v.world)), steps=steps,
        fix=_with(v, find_unused_parameters=True, static_graph=False) + ".")]


def rank_dependent_graph(v: View) -> list[Finding]:
    if not v.steps or v.world < 2:
        return []
    _, _, rank_dep, _ = v.usage()
    if not rank_dep.any():
        return []
    u = v.used[:, :, rank_dep]
    lacking = _steps((~u).any(1).any(-1))
    return [Finding(
        code="rank-dependent-graph", severity="error" if v.default_flags else "info",
        title=f"{_count(int(rank_dep.sum()), 'parameter')} reach the loss on some ranks but not others",
        detail=f"Ranks {lacking} left these parameters without a gradient while other ranks used them. With "
               "default flags the ranks disagree on which buckets are ready, which hangs or crashes. "
               "static_graph=True handles it when each rank's set is the same every step; "
               "find_unused_parameters=True handles it always.",
        params=v.params(rank_dep), ranks=lacking, steps=_steps((u.any(0) != u.all(0)).any(-1)),
        fix=f"{_with(v, static_graph=True)} if each rank's used set is stable, else "
            f"{_with(v, find_unused_parameters=True)}.")]


def static_graph_unsafe(v: View) -> list[Finding]:
    crashed = v.crashed("static-graph-changed")
    dynamic = v.usage()[1]
    if not v.static_graph or not (crashed or dynamic.any()):
        return []
    return [Finding(
        code="static-graph-unsafe", severity="error",
        title="static_graph=True, but the graph changes between steps",
        detail="static_graph=True records the used parameters on the first steps and assumes they never change. "
               + ("DDP failed on rank(s) " + str([r.rank for r in crashed]) + " with 'Your training graph has "
                  "changed'." if crashed else "Here they changed, so gradients would be reduced wrongly."),
        params=v.params(dynamic), ranks=[r.rank for r in crashed] or list(range(v.world)),
        steps=sorted({r.crash_step for r in crashed}),
        fix=_with(v, static_graph=False, find_unused_parameters=True) + ".")]


@dataclass
class Hidden:
    """Parameters that got a gradient but are not in the graph of DDP's forward outputs."""

    params: set[int] = field(default_factory=set)
    ranks: set[int] = field(default_factory=set)
    steps: set[int] = field(default_factory=set)
    crashed: list[int] = field(default_factory=list)
    """Ranks where DDP failed with 'mark a variable ready only once' because of them."""

    def add(self, rank: int, step: int, params: list[int]) -> None:
        self.params.update(params)
        self.ranks.add(rank)
        self.steps.add(step)


def hidden_params(v: View) -> tuple[Hidden, Hidden]:
    """(used outside forward, used under reentrant checkpoints), from every step including a crashed one."""
    outside, reentrant = Hidden(), Hidden()
    mark_twice = CRASH_KINDS.index("mark-ready-twice")
    for r in v.records:
        forwards = r.counter("ddp_forwards")
        checkpoints = r.counter("reentrant_checkpoints")
        for s in range(r.steps):
            if not forwards[s]:
                continue
            target = reentrant if checkpoints[s] else outside
            hidden = (r.used[s] & ~r.reachable[s] & v.tracked).nonzero().flatten().tolist()
            if r.crash_kind == mark_twice and s == r.crash_step:
                hidden += v.names_in_message(r.crash_message)
                target.crashed.append(r.rank)
            if hidden or checkpoints[s]:
                target.add(r.rank, s, hidden)
    return outside, reentrant


def used_outside_forward(v: View) -> list[Finding]:
    outside, _ = hidden_params(v)
    if not outside.params and not outside.crashed:
        return []
    broken = v.find_unused and not v.static_graph
    detail = ("These parameters got a gradient, but they are not part of the autograd graph of DDP's forward "
              "outputs: the loss uses them after forward (for example ddp.module.head(features)). ")
    detail += ("With find_unused_parameters=True DDP marks them unused after forward and then their gradient "
               "arrives anyway: 'Expected to mark a variable ready only once'." if broken else
               "The current flags cope, but find_unused_parameters=True would crash with 'Expected to mark a "
               "variable ready only once'.")
    return [Finding(
        code="used-outside-forward", severity="error" if broken else "info",
        title=f"{_count(len(outside.params), 'parameter')} used outside DDP's forward",
        detail=detail, params=v.params(sorted(outside.params)), ranks=sorted(outside.ranks),
        steps=sorted(outside.steps),
        fix="compute them inside the wrapped module's forward; or, if the used set is stable, "
            + _with(v, static_graph=True, find_unused_parameters=False) + ".")]


def reentrant_checkpoint(v: View) -> list[Finding]:
    _, reentrant = hidden_params(v)
    sites = v.blocked_checkpoints
    if sites and v.steps:
        _, blocked = v.unused_by_cause()
        return [Finding(
            code="reentrant-checkpoint", severity="error",
            title=f"reentrant checkpoint without grad-requiring inputs at {', '.join(sites)}",
            detail="torch.utils.checkpoint with use_reentrant=True gives the checkpointed block no gradient at all "
                   "when none of the call's tensor inputs requires grad (PyTorch only warns). Its parameters look "
                   "unused, but freezing them would be the wrong fix: the script means to train them.",
            params=v.params(blocked), ranks=list(range(v.world)), steps=list(range(v.steps)),
            fix="pass use_reentrant=False to the checkpoint call at " + ", ".join(sites) + ".")]
    if not reentrant.ranks:
        return []
    broken = v.find_unused and not v.static_graph
    if broken:
        severity, effect = "error", ("With find_unused_parameters=True DDP marks them unused after forward, then "
                                     "the nested backward produces their gradient: 'Expected to mark a variable "
                                     "ready only once'.")
    elif v.static_graph:
        severity, effect = "info", "static_graph=True handles it."
    else:
        severity, effect = "warning", ("Default flags happened to reduce correctly here, but correctness then "
                                       "depends on the order gradients become ready; static_graph=True does not.")
    return [Finding(
        code="reentrant-checkpoint", severity=severity,
        title="reentrant activation checkpointing inside DDP",
        detail="torch.utils.checkpoint with use_reentrant=True runs a nested backward for the checkpointed "
               "segment, so its parameters are invisible in the graph of DDP's forward outputs. " + effect,
        params=v.params(sorted(reentrant.params)), ranks=sorted(reentrant.ranks), steps=sorted(reentrant.steps),
        fix="pass use_reentrant=False to torch.utils.checkpoint.checkpoint (it composes with DDP), or "
            + _with(v, static_graph=True, find_unused_parameters=False) + ".")]


def find_unused_unneeded(v: View) -> list[Finding]:
    if not (v.find_unused and not v.static_graph) or not v.steps:
        return []
    always = v.usage()[3]
    outside, reentrant = hidden_params(v)
    if not bool((always == v.live).all()) or outside.ranks or reentrant.ranks or any(r.crash_kind for r in v.records):
        return []
    if (v.tracked & ~v.live).any():
        return []  # something was frozen after wrap: it would be unused
    return [Finding(
        code="find-unused-unneeded", severity="warning",
        title="find_unused_parameters=True, but every parameter is used",
        detail=f"All {int(v.live.sum())} trainable parameters got a gradient on every one of the {v.world} ranks "
               f"in all {v.steps} observed steps. find_unused_parameters=True makes DDP walk the whole autograd "
               "graph after every forward and delays communication, for nothing.",
        ranks=list(range(v.world)), steps=list(range(v.steps)),
        fix=_with(v, find_unused_parameters=False) + ".")]


def wrapper_bypass(v: View) -> list[Finding]:
    # A step with DDP's forward as well is not a bypass: DDP then reduces every gradient, including those of
    # modules called outside its forward (that case is used-outside-forward).
    hits = [(r.rank, s) for r in v.records
            for s in _steps((r.counter("bypass_forwards") > 0) & (r.counter("ddp_forwards") == 0))]
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
    steps = _steps(differ.any(1))
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
    after = [s - 1 for s in _steps(differ.any(1)) if s > 0]
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
        params=v.buffers(buffers), ranks=list(range(v.world)), steps=_steps(differ.any(1)),
        fix=_with(v, broadcast_buffers=True) + " (the default), or convert BatchNorm with "
            f"torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) {freeze_point(v.info.framework)}.")]


def _midway(v: View, change: str) -> str:
    """How to change the frozen set mid-training, where the framework builds DDP once and keeps it."""
    if v.info.framework in ("transformers", "lightning", "accelerate"):
        # The framework owns the DDP instance, so rebuilding it (refreeze) is not open to the user; a learning
        # rate of 0 keeps the set DDP reduces fixed while the parameters do not move.
        return (f"to {change} mid-training, keep them trainable when DDP is built and hold their learning rate at 0 "
                "while they should not move, so the set DDP reduces never changes"
                + (f"; or {_with(v, find_unused_parameters=True)}, which copes with parameters frozen later "
                   "(DDP still all-reduces them)" if change == "freeze" else "") + ".")
    return (f"to {change} mid-training, rebuild DDP (ddp_doctor.refreeze keeps the optimizer state and checks the "
            "replicas first).")


def frozen_after_wrap(v: View) -> list[Finding]:
    frozen = v.tracked & ~v.live if v.steps else torch.zeros_like(v.tracked)
    inferred = not v.info.wrap_state_exact and (v.info.wrap_trainable_count or 0) > int(v.tracked.sum())
    if not frozen.any() and not inferred:
        return []
    steps = _steps((~v.trainable[:, :, frozen]).any(0).any(-1)) if frozen.any() else []
    note = (f" DDP was built with {v.info.wrap_trainable_count} trainable tensors, but only "
            f"{int(v.tracked.sum())} required grad when observe() started." if inferred else "")
    return [rules.frozen_after_wrap(
        params=v.params(frozen), ranks=list(range(v.world)), steps=steps, find_unused=v.find_unused,
        static_graph=v.static_graph, after_first_step=bool(steps) and steps[0] > 0, note=note,
        fix=f"freeze {freeze_point(v.info.framework)}; " + _midway(v, "freeze"))]


def unfrozen_after_wrap(v: View) -> list[Finding]:
    if not v.steps:
        return []
    unfrozen = ~v.tracked & ~v.ignored & v.trainable.any(0).any(0)
    if not unfrozen.any():
        return []
    return [rules.unfrozen_after_wrap(
        params=v.params(unfrozen), ranks=list(range(v.world)),
        steps=_steps(v.trainable[:, :, unfrozen].any(0).any(-1)),
        fix=f"set requires_grad=True {freeze_point(v.info.framework)}; " + _midway(v, "unfreeze"))]


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
        ranks=list(range(v.world)), steps=_steps(has_input),
        fix="shard the data: DataLoader(dataset, sampler=DistributedSampler(dataset)), and call "
            "sampler.set_epoch(epoch) every epoch.")]


def no_trainable(v: View) -> list[Finding]:
    if not v.steps:
        return []
    empty = ~v.trainable.any(-1)                            # [W, S]
    if not empty.any():
        return []
    return [Finding(
        code="no-trainable-parameters", severity="error",
        title="no parameter requires a gradient",
        detail="At some observed step every parameter had requires_grad=False, so the step trains nothing.",
        ranks=_steps(empty.any(1)), steps=_steps(empty.any(0)),
        fix="set requires_grad=True on the parameters to train, before wrapping the model in DDP.")]


def reduction_error(v: View) -> list[Finding]:
    crashed = v.crashed("reduction-error")
    if not crashed:
        return []
    missing: set[int] = set()
    for r in crashed:
        used = v.last_complete_used(r)
        if used is not None:
            missing.update((v.tracked & ~used).nonzero().flatten().tolist())
    step = min(r.crash_step for r in crashed)
    # Parameters a rank or step used, or whose module ran, are meant to train: never advise freezing them.
    meant = v.ever_used | (v.ran.any(0).any(0) if v.steps else torch.zeros_like(v.ever_used))
    trained = [i for i in sorted(missing) if meant[i]]
    if trained:
        fix = (f"do not freeze them: {', '.join(v.info.param_names[i] for i in trained[:4])}"
               f"{' ...' if len(trained) > 4 else ''} got a gradient on some rank or step, or their module ran. "
               f"{_with(v, static_graph=True)} if each rank's used set is the same every step, else "
               f"{_with(v, find_unused_parameters=True)}; see the recommendation")
    else:
        fix = _freeze_fix(v) + "; see the recommendation for the cheapest flags"
    return [Finding(
        code="reduction-error", severity="error",
        title="DDP failed: 'Expected to have finished reduction in the prior iteration'",
        detail=f"At the start of step {step}, DDP found that the previous step's gradient reduction never "
               "finished, because these trainable parameters got no gradient. Until it failed, the previous "
               "step's gradients were silently not all-reduced.",
        params=v.params(sorted(missing)), ranks=[r.rank for r in crashed], steps=[step],
        fix=fix + ".")]


DETECTORS: tuple[Callable[[View], list[Finding]], ...] = (
    reduction_error, static_graph_unsafe, wrapper_bypass, unfrozen_after_wrap, frozen_after_wrap,
    unused_parameters, grad_blocked, collective_sequence_mismatch, synced_pass_mismatch, unpaired_forward_mismatch,
    dynamic_graph, rank_dependent_graph, used_outside_forward, reentrant_checkpoint,
    grads_not_synced, replica_divergence, buffer_divergence, identical_inputs, no_trainable, find_unused_unneeded,
    uneven_inputs, sampler_epoch_not_set, grad_scaler_mismatch, batchnorm_not_synced,
)
