"""Detectors of the used set: which parameters reach the loss, on which ranks and steps, and what the DDP flags make
of it. Each reads the `View` (or the `Agreed` facts every parallelism gives) and returns findings; pure functions, no communication (the frozen set and DDP's own
errors are in `frozen_set.py`, gradients DDP's forward did not see coming in `hidden_use.py`, the agreement of grads, weights, buffers and inputs in `agreement.py`, the
consistency of collectives and passes in `consistency.py`, why replicas diverge in `causes.py`; each detector
registers itself with `@detects`, and `core/codes.py`'s `REPORT_ORDER` places its findings in the report)."""

from __future__ import annotations

from ddp_doctor.analyze.common import all_ranks, freeze_fix_in, steps_of, with_flags
from ddp_doctor.analyze.hidden_use import hidden_params
from ddp_doctor.analyze.parallelism import FULLY_SHARD, api_for
from ddp_doctor.analyze.passes import passes_of
from ddp_doctor.analyze.rules import count as _count
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.agreed import Agreed, NeverReached
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, ParamRef, lines_of
from ddp_doctor.core.ranks import listed

__all__ = [
    "dynamic_graph",
    "find_unused_unneeded",
    "grad_blocked",
    "rank_dependent_graph",
    "static_graph_unsafe",
    "unused_finding",
    "unused_parameters",
]


@detects(Code.UNUSED_PARAMETERS, road="every")
def unused_parameters(a: Agreed) -> list[Finding]:
    """Trainable parameters that nothing in the loss reached on any rank at any observed step, whatever the
    parallelism, which decides the verdict: DDP with default flags waits for their gradients (its reduction
    never finishes, then the next step fails); with its flags set, or under FSDP2 or `replicate`, they cost
    communication or memory and do not train. Freezing is advised for DDP's only where their modules never ran."""
    if (never := a.never_reached) is None or not never.params:
        return []
    if a.parallelism == "ddp":
        return [_unused_ddp(a, never)]
    api = api_for(a.parallelism)
    carried = (
        "the all-gathers of their fully_shard group still carry them in every forward"
        if api is FULLY_SHARD
        else "every rank still holds a whole copy of them"
    )
    effect = (
        f"{api.name} raises no error for them, unlike DDP with default flags; they do not train, and {carried}. If "
        "a later phase of the script uses them (a curriculum, an auxiliary loss switched on later), nothing is wrong."
    )
    fix = (
        f"remove them from the model if nothing uses them, or set requires_grad=False on them before {api.call} "
        "(and build the optimizer from the trainable parameters) while they are not used."
    )
    found = unused_finding(
        never.params,
        steps=f"every one of the {never.steps} observed optimizer steps with gradient sync on",
        seen=_seen(never),
        effect=effect,
        severity="warning",
        ranks=list(range(a.world)),
        step_list=list(range(never.steps)),
        fix=fix,
    )
    return [found]


def _seen(never: NeverReached) -> str:
    """What else shows the parameters never trained: their modules never ran, where that was recorded."""
    if never.modules_ran is False:
        return " and their modules never ran in a training forward"
    return ": nothing in the loss reaches them"


def _unused_ddp(a: Agreed, never: NeverReached) -> Finding:
    find_unused, static = bool(a.ddp_flags.get("find_unused_parameters")), bool(a.ddp_flags.get("static_graph"))
    if not find_unused and not static:
        severity, effect = (
            "error",
            "With find_unused_parameters=False and static_graph=False DDP waits for their gradients: the step's "
            "gradients are never all-reduced, then the next step fails with 'Expected to have finished reduction'.",
        )
    else:
        severity, effect = (
            "warning",
            "The current flags cope, but DDP still all-reduces zeros for them every step"
            + (" and walks the autograd graph to find them." if find_unused else "."),
        )
    return unused_finding(
        never.params,
        steps=f"every one of the {never.steps} observed steps",
        seen=_seen(never),
        effect=effect,
        severity=severity,
        ranks=list(range(a.world)),
        step_list=list(range(never.steps)),
        fix=freeze_fix_in(a.framework, a.flavor) + ".",
    )


def unused_finding(
    params: list[ParamRef],
    *,
    steps: str,
    seen: str,
    effect: str,
    severity: str,
    ranks: list[int],
    step_list: list[int],
    fix: str,
) -> Finding:
    """`unused-parameters`, for every parallelism: `params` got no gradient on any rank in `steps` (what was
    observed, in words), `seen` what else shows they never ran, `effect` what that costs under this parallelism."""
    return Finding(
        code=Code.UNUSED_PARAMETERS,
        severity=severity,
        title=f"{_count(len(params), 'trainable parameter')} never reached the loss",
        detail=f"On every rank and {steps}, these parameters got no gradient{seen}. {effect}",
        params=params,
        ranks=ranks,
        steps=step_list,
        fix=fix,
    )


@detects(Code.GRAD_BLOCKED)
def grad_blocked(v: View) -> list[Finding]:
    if not v.steps or v.crashed_before_first_step:
        return []  # reduction-error names them: the forward that would have trained them may never have run
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
            code=Code.GRAD_BLOCKED,
            sites=lines_of(*sites),
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


@detects(Code.DYNAMIC_GRAPH)
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
            code=Code.DYNAMIC_GRAPH,
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


@detects(Code.RANK_DEPENDENT_GRAPH)
def rank_dependent_graph(v: View) -> list[Finding]:
    if not v.steps or v.world < 2:
        return []
    _, _, rank_dep, _ = v.usage()
    if not rank_dep.any():
        return []
    lacking = v.ranks("lacking")
    return [
        Finding(
            code=Code.RANK_DEPENDENT_GRAPH,
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


@detects(Code.STATIC_GRAPH_UNSAFE)
def static_graph_unsafe(v: View) -> list[Finding]:
    crashed = v.crashed("static-graph-changed")
    dynamic = v.usage()[1]
    if not v.static_graph or not (crashed.count or dynamic.any()):
        return []
    return [
        Finding(
            code=Code.STATIC_GRAPH_UNSAFE,
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


@detects(Code.FIND_UNUSED_UNNEEDED)
def find_unused_unneeded(v: View) -> list[Finding]:
    if not (v.find_unused and not v.static_graph) or not v.steps:
        return []
    always = v.usage()[3]
    outside, reentrant = hidden_params(v)
    if not bool((always == v.live).all()) or outside.ranks or reentrant.ranks or v.ranks("crashed").count:
        return []
    if (v.tracked & ~v.live).any():
        return []  # something was frozen after wrap: it would be unused
    if passes_of(v).steps:
        return []  # each step's passes reach different parameters: each pass has unused ones
    return [
        Finding(
            code=Code.FIND_UNUSED_UNNEEDED,
            severity="warning",
            title="find_unused_parameters=True, but every parameter is used",
            detail=f"All {int(v.live.sum())} trainable parameters got a gradient on every one of the {v.world} ranks "
            f"in all {v.steps} observed steps. find_unused_parameters=True makes DDP walk the whole autograd "
            "graph after every forward and delays communication, for nothing.",
            ranks=all_ranks(v),
            steps=list(range(v.steps)),
            measured=[Measure("parameters_used", int(v.live.sum()), "count")],
            fix=with_flags(v, find_unused_parameters=False) + ".",
        )
    ]
