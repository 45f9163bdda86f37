"""Detectors of the used set, the frozen set and DDP's own errors: each reads the `View` and returns findings.
Pure functions, no communication (the agreement of grads, weights, buffers and inputs is in `agreement.py`, the
consistency of collectives and passes in `consistency.py`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ddp_doctor.analyze import rules
from ddp_doctor.analyze.agreement import (
    buffer_divergence,
    grads_not_synced,
    identical_inputs,
    replica_divergence,
    wrapper_bypass,
)
from ddp_doctor.analyze.causes import (
    grads_reduced_twice,
    optimizer_differs,
    optimizer_step_skipped,
    replicas_differ_at_wrap,
    weights_changed_outside_optimizer,
)
from ddp_doctor.analyze.common import all_ranks, freeze_fix, has_flags, steps_of, with_flags
from ddp_doctor.analyze.consistency import (
    batchnorm_not_synced,
    collective_sequence_mismatch,
    grad_scaler_mismatch,
    synced_pass_mismatch,
    unpaired_forward_mismatch,
)
from ddp_doctor.analyze.epochs import sampler_epoch_not_set, uneven_inputs
from ddp_doctor.analyze.rules import count as _count
from ddp_doctor.analyze.snippets import freeze_point
from ddp_doctor.analyze.throughput import input_bound, straggler_rank
from ddp_doctor.analyze.view import View
from ddp_doctor.core.findings import Finding
from ddp_doctor.core.ranks import listed

__all__ = ["DETECTORS"]


def unused_parameters(v: View) -> list[Finding]:
    if not v.steps:
        return []
    never, _ = v.unused_by_cause()  # modules that never ran: the only parameters freezing can be advised for
    if not never.any():
        return []
    n = int(never.sum())
    if v.default_flags:
        severity, effect = (
            "error",
            (
                "With find_unused_parameters=False and static_graph=False DDP waits for their "
                "gradients: the step's gradients are never all-reduced, then the next step "
                "fails with 'Expected to have finished reduction'."
            ),
        )
    else:
        severity, effect = (
            "warning",
            (
                "The current flags cope, but DDP still all-reduces zeros for them every step"
                + (" and walks the autograd graph to find them." if v.find_unused else ".")
            ),
        )
    return [
        Finding(
            code="unused-parameters",
            severity=severity,
            title=f"{_count(n, 'trainable parameter')} never reached the loss",
            detail=f"On every rank and every one of the {v.steps} observed steps, these parameters got no gradient and "
            "their modules never ran in a training forward. " + effect,
            params=v.params(never),
            ranks=all_ranks(v),
            steps=list(range(v.steps)),
            fix=freeze_fix(v) + ".",
        )
    ]


def grad_blocked(v: View) -> list[Finding]:
    if not v.steps:
        return []
    _, blocked = v.unused_by_cause()
    if not blocked.any():
        return []
    sites = v.blocked_checkpoints
    cause = (
        f"a reentrant checkpoint none of whose inputs requires grad ({', '.join(sites)}): the checkpointed "
        "block runs without building a graph, so no gradient ever reaches it"
        if sites
        else "their modules ran, but the output was cut from the graph: torch.no_grad(), .detach(), or a reentrant "
        "checkpoint whose inputs do not require grad"
    )
    return [
        Finding(
            code="grad-blocked",
            severity="error",
            title=f"{_count(int(blocked.sum()), 'parameter')} ran in forward but never got a gradient",
            detail=f"On every rank and every one of the {v.steps} observed steps these parameters' modules ran, yet "
            f"no gradient reached them: {cause}. The script evidently means to train them, so they silently "
            "stay at their initial values" + (" while DDP waits for their gradients" if v.default_flags else "") + ".",
            params=v.params(blocked),
            ranks=all_ranks(v),
            steps=list(range(v.steps)),
            fix=(
                "pass use_reentrant=False to torch.utils.checkpoint.checkpoint (it works whether or not the inputs "
                "require grad)"
                if sites
                else "remove the torch.no_grad() / .detach() that cuts them off, or use checkpoint(..., use_reentrant=False)"
            )
            + "; if they really are meant to stay fixed, set requires_grad=False on them yourself before wrapping.",
        )
    ]


def dynamic_graph(v: View) -> list[Finding]:
    _, dynamic, _, _ = v.usage()
    if not dynamic.any():
        return []
    steps = steps_of((~v.used_all[:, dynamic]).any(-1))
    if v.static_graph:
        severity = "error"
    elif v.find_unused:
        severity = "info"
    else:
        severity = "error"
    return [
        Finding(
            code="dynamic-graph",
            severity=severity,
            title=f"{_count(int(dynamic.sum()), 'parameter')} reach the loss on some steps but not others",
            detail="The set of parameters that get a gradient changes from step to step (for example a branch taken "
            "on some steps). Only find_unused_parameters=True handles a used-set that changes"
            + (", which is what this run uses." if v.find_unused and not v.static_graph else "."),
            params=v.params(dynamic),
            ranks=all_ranks(v),
            steps=steps,
            # info means the script already has exactly these flags: no fix to print.
            fix="" if severity == "info" else with_flags(v, find_unused_parameters=True, static_graph=False) + ".",
        )
    ]


def rank_dependent_graph(v: View) -> list[Finding]:
    if not v.steps or v.world < 2:
        return []
    _, _, rank_dep, _ = v.usage()
    if not rank_dep.any():
        return []
    lacking = v.ranks("lacking")
    return [
        Finding(
            code="rank-dependent-graph",
            severity="error" if v.default_flags else "info",
            title=f"{_count(int(rank_dep.sum()), 'parameter')} reach the loss on some ranks but not others",
            detail=f"Ranks {listed(lacking.ranks, lacking.more)} left these parameters without a gradient while other ranks used them. With "
            "default flags the ranks disagree on which buckets are ready, which hangs or crashes. "
            "static_graph=True handles it when each rank's set is the same every step; "
            "find_unused_parameters=True handles it always.",
            params=v.params(rank_dep),
            ranks=lacking.ranks,
            more_ranks=lacking.more,
            steps=steps_of((v.used_any[:, rank_dep] != v.used_all[:, rank_dep]).any(-1)),
            # Either flag copes, and a script that is not on default flags has one of them: no fix to print then.
            fix=f"{with_flags(v, static_graph=True)} if each rank's used set is stable, else "
            f"{with_flags(v, find_unused_parameters=True)}."
            if v.default_flags
            else "",
        )
    ]


def static_graph_unsafe(v: View) -> list[Finding]:
    crashed = v.crashed("static-graph-changed")
    dynamic = v.usage()[1]
    if not v.static_graph or not (crashed.count or dynamic.any()):
        return []
    return [
        Finding(
            code="static-graph-unsafe",
            severity="error",
            title="static_graph=True, but the graph changes between steps",
            detail="static_graph=True records the used parameters on the first steps and assumes they never change. "
            + (
                "DDP failed on rank(s) " + listed(crashed.ranks, crashed.more) + " with 'Your training graph "
                "has changed'."
                if crashed.count
                else "Here they changed, so gradients would be reduced wrongly."
            ),
            params=v.params(dynamic),
            ranks=crashed.ranks or all_ranks(v),
            more_ranks=crashed.more,
            steps=v.crash_steps("static-graph-changed"),
            fix=with_flags(v, static_graph=False, find_unused_parameters=True) + ".",
        )
    ]


@dataclass
class Hidden:
    """Parameters that got a gradient but are not in the graph of DDP's forward outputs."""

    params: set[int] = field(default_factory=set)
    ranks: list[int] = field(default_factory=list)
    more_ranks: int = 0
    steps: set[int] = field(default_factory=set)
    crashed: int = 0
    """Ranks where DDP failed with 'mark a variable ready only once' because of them."""


def hidden_params(v: View) -> tuple[Hidden, Hidden]:
    """(used outside forward, used under reentrant checkpoints), from every step including a crashed one."""
    out = []
    for k, predicate in enumerate(("hidden-outside", "hidden-reentrant")):
        ex = v.ranks(predicate)
        out.append(
            Hidden(
                params=set(steps_of(v.summary.hidden[k])),
                ranks=ex.ranks,
                more_ranks=ex.more,
                steps=set(steps_of(v.summary.hidden_steps[k])),
                crashed=v.summary.hidden_crashed[k],
            )
        )
    return out[0], out[1]


def used_outside_forward(v: View) -> list[Finding]:
    outside, _ = hidden_params(v)
    if not outside.params and not outside.crashed:
        return []
    broken = v.find_unused and not v.static_graph
    detail = (
        "These parameters got a gradient, but they are not part of the autograd graph of DDP's forward "
        "outputs: the loss uses them after forward (for example ddp.module.head(features)). "
    )
    detail += (
        "With find_unused_parameters=True DDP marks them unused after forward and then their gradient "
        "arrives anyway: 'Expected to mark a variable ready only once'."
        if broken
        else "The current flags cope, but find_unused_parameters=True would crash with 'Expected to mark a "
        "variable ready only once'."
    )
    return [
        Finding(
            code="used-outside-forward",
            severity="error" if broken else "info",
            title=f"{_count(len(outside.params), 'parameter')} used outside DDP's forward",
            detail=detail,
            params=v.params(sorted(outside.params)),
            ranks=outside.ranks,
            more_ranks=outside.more_ranks,
            steps=sorted(outside.steps),
            fix="compute them inside the wrapped module's forward"
            + (
                "."
                if has_flags(v, static_graph=True, find_unused_parameters=False)
                else "; or, if the used set is stable, "
                + with_flags(v, static_graph=True, find_unused_parameters=False)
                + "."
            ),
        )
    ]


def reentrant_checkpoint(v: View) -> list[Finding]:
    _, reentrant = hidden_params(v)
    sites = v.blocked_checkpoints
    if sites and v.steps:
        _, blocked = v.unused_by_cause()
        return [
            Finding(
                code="reentrant-checkpoint",
                severity="error",
                title=f"reentrant checkpoint without grad-requiring inputs at {', '.join(sites)}",
                detail="torch.utils.checkpoint with use_reentrant=True gives the checkpointed block no gradient at all "
                "when none of the call's tensor inputs requires grad (PyTorch only warns). Its parameters look "
                "unused, but freezing them would be the wrong fix: the script means to train them.",
                params=v.params(blocked),
                ranks=all_ranks(v),
                steps=list(range(v.steps)),
                fix="pass use_reentrant=False to the checkpoint call at " + ", ".join(sites) + ".",
            )
        ]
    if not reentrant.ranks:
        return []
    broken = v.find_unused and not v.static_graph
    if broken:
        severity, effect = (
            "error",
            (
                "With find_unused_parameters=True DDP marks them unused after forward, then "
                "the nested backward produces their gradient: 'Expected to mark a variable "
                "ready only once'."
            ),
        )
    elif v.static_graph:
        severity, effect = "info", "static_graph=True handles it."
    else:
        severity, effect = (
            "warning",
            (
                "Default flags happened to reduce correctly here, but correctness then "
                "depends on the order gradients become ready; static_graph=True does not."
            ),
        )
    return [
        Finding(
            code="reentrant-checkpoint",
            severity=severity,
            title="reentrant activation checkpointing inside DDP",
            detail="torch.utils.checkpoint with use_reentrant=True runs a nested backward for the checkpointed "
            "segment, so its parameters are invisible in the graph of DDP's forward outputs. " + effect,
            params=v.params(sorted(reentrant.params)),
            ranks=reentrant.ranks,
            more_ranks=reentrant.more_ranks,
            steps=sorted(reentrant.steps),
            fix="pass use_reentrant=False to torch.utils.checkpoint.checkpoint (it composes with DDP)"
            + (
                "."
                if has_flags(v, static_graph=True, find_unused_parameters=False)
                else ", or " + with_flags(v, static_graph=True, find_unused_parameters=False) + "."
            ),
        )
    ]


def find_unused_unneeded(v: View) -> list[Finding]:
    if not (v.find_unused and not v.static_graph) or not v.steps:
        return []
    always = v.usage()[3]
    outside, reentrant = hidden_params(v)
    if not bool((always == v.live).all()) or outside.ranks or reentrant.ranks or v.ranks("crashed").count:
        return []
    if (v.tracked & ~v.live).any():
        return []  # something was frozen after wrap: it would be unused
    return [
        Finding(
            code="find-unused-unneeded",
            severity="warning",
            title="find_unused_parameters=True, but every parameter is used",
            detail=f"All {int(v.live.sum())} trainable parameters got a gradient on every one of the {v.world} ranks "
            f"in all {v.steps} observed steps. find_unused_parameters=True makes DDP walk the whole autograd "
            "graph after every forward and delays communication, for nothing.",
            ranks=all_ranks(v),
            steps=list(range(v.steps)),
            fix=with_flags(v, find_unused_parameters=False) + ".",
        )
    ]


def _midway(v: View, change: str) -> str:
    """How to change the frozen set mid-training, where the framework builds DDP once and keeps it."""
    if v.info.framework in ("transformers", "lightning", "accelerate"):
        # The framework owns the DDP instance, so rebuilding it (refreeze) is not open to the user; a learning
        # rate of 0 keeps the set DDP reduces fixed while the parameters do not move.
        return (
            f"to {change} mid-training, keep them trainable when DDP is built and hold their learning rate at 0 "
            "while they should not move, so the set DDP reduces never changes"
            + (
                f"; or {with_flags(v, find_unused_parameters=True)}, which copes with parameters frozen later "
                "(DDP still all-reduces them)"
                if change == "freeze"
                else ""
            )
            + "."
        )
    return (
        f"to {change} mid-training, rebuild DDP (ddp_doctor.refreeze keeps the optimizer state and checks the "
        "replicas first)."
    )


def frozen_after_wrap(v: View) -> list[Finding]:
    frozen = v.tracked & ~v.live if v.steps else torch.zeros_like(v.tracked)
    inferred = not v.info.wrap_state_exact and (v.info.wrap_trainable_count or 0) > int(v.tracked.sum())
    if not frozen.any() and not inferred:
        return []
    steps = steps_of((~v.train_all[:, frozen]).any(-1)) if frozen.any() else []
    note = (
        f" DDP was built with {v.info.wrap_trainable_count} trainable tensors, but only "
        f"{int(v.tracked.sum())} required grad when observe() started."
        if inferred
        else ""
    )
    return [
        rules.frozen_after_wrap(
            params=v.params(frozen),
            ranks=all_ranks(v),
            steps=steps,
            find_unused=v.find_unused,
            static_graph=v.static_graph,
            after_first_step=bool(steps) and steps[0] > 0,
            note=note,
            fix=f"freeze {freeze_point(v.info.framework)}; " + _midway(v, "freeze"),
        )
    ]


def unfrozen_after_wrap(v: View) -> list[Finding]:
    if not v.steps:
        return []
    unfrozen = ~v.tracked & ~v.ignored & v.train_any.any(0)
    if not unfrozen.any():
        return []
    return [
        rules.unfrozen_after_wrap(
            params=v.params(unfrozen),
            ranks=all_ranks(v),
            steps=steps_of(v.train_any[:, unfrozen].any(-1)),
            fix=f"set requires_grad=True {freeze_point(v.info.framework)}; " + _midway(v, "unfreeze"),
        )
    ]


def no_trainable(v: View) -> list[Finding]:
    if not v.steps:
        return []
    empty = v.ranks("no-trainable")  # ranks with a step that trained nothing
    if not empty.count:
        return []
    return [
        Finding(
            code="no-trainable-parameters",
            severity="error",
            title="no parameter requires a gradient",
            detail="At some observed step every parameter had requires_grad=False, so the step trains nothing.",
            ranks=empty.ranks,
            more_ranks=empty.more,
            steps=steps_of(v.summary.no_trainable_steps),
            fix="set requires_grad=True on the parameters to train, before wrapping the model in DDP.",
        )
    ]


def reduction_error(v: View) -> list[Finding]:
    crashed = v.crashed("reduction-error")
    if not crashed.count:
        return []
    missing = set(steps_of(v.summary.reduction_missing))
    step = min(v.crash_steps("reduction-error"))
    # Parameters a rank or step used, or whose module ran, are meant to train: never advise freezing them.
    meant = v.ever_used | v.summary.ran
    trained = [i for i in sorted(missing) if meant[i]]
    if trained:
        fix = (
            f"do not freeze them: {', '.join(v.info.param_names[i] for i in trained[:4])}"
            f"{' ...' if len(trained) > 4 else ''} got a gradient on some rank or step, or their module ran. "
            f"{with_flags(v, static_graph=True)} if each rank's used set is the same every step, else "
            f"{with_flags(v, find_unused_parameters=True)}; see the recommendation"
        )
    else:
        fix = freeze_fix(v) + "; see the recommendation for the cheapest flags"
    return [
        Finding(
            code="reduction-error",
            severity="error",
            title="DDP failed: 'Expected to have finished reduction in the prior iteration'",
            detail=f"At the start of step {step}, DDP found that the previous step's gradient reduction never "
            "finished, because these trainable parameters got no gradient. Until it failed, the previous "
            "step's gradients were silently not all-reduced.",
            params=v.params(sorted(missing)),
            ranks=crashed.ranks,
            more_ranks=crashed.more,
            steps=[step],
            fix=fix + ".",
        )
    ]


DETECTORS: tuple[Callable[[View], list[Finding]], ...] = (
    reduction_error,
    replicas_differ_at_wrap,
    weights_changed_outside_optimizer,
    optimizer_step_skipped,
    optimizer_differs,
    grads_reduced_twice,
    static_graph_unsafe,
    wrapper_bypass,
    unfrozen_after_wrap,
    frozen_after_wrap,
    unused_parameters,
    grad_blocked,
    collective_sequence_mismatch,
    synced_pass_mismatch,
    unpaired_forward_mismatch,
    dynamic_graph,
    rank_dependent_graph,
    used_outside_forward,
    reentrant_checkpoint,
    grads_not_synced,
    replica_divergence,
    buffer_divergence,
    identical_inputs,
    no_trainable,
    find_unused_unneeded,
    uneven_inputs,
    sampler_epoch_not_set,
    grad_scaler_mismatch,
    batchnorm_not_synced,
    input_bound,
    straggler_rank,
)
