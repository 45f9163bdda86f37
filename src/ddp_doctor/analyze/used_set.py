"""Detectors of the used set: which parameters reach the loss, on which ranks and steps, and what the DDP flags make
of it. Each reads the `View` (or the `Agreed` facts every parallelism gives) and returns findings; pure functions, no communication (the frozen set and DDP's own
errors are in `frozen_set.py`, gradients DDP's forward did not see coming in `hidden_use.py`, the agreement of grads, weights, buffers and inputs in `agreement.py`, the
consistency of collectives and passes in `consistency.py`, why replicas diverge in `causes.py`; each detector
registers itself with `@detects`, and `core/codes.py`'s `REPORT_ORDER` places its findings in the report)."""

from __future__ import annotations

from ddp_doctor.analyze.common import all_ranks, flag_labels, freeze_fix_in, steps_of, with_flags
from ddp_doctor.analyze.hidden_use import hidden_params
from ddp_doctor.analyze.parallelism import api_for
from ddp_doctor.analyze.passes import passes_of
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.agreed import Agreed
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, lines_of

__all__ = [
    "dynamic_graph",
    "find_unused_unneeded",
    "grad_blocked",
    "rank_dependent_graph",
    "static_graph_unsafe",
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
    labels = {"parallelism": a.parallelism}
    if never.modules_ran is not None:
        labels["modules_ran"] = str(never.modules_ran)
    if a.parallelism == "ddp":
        find_unused, static = bool(a.ddp_flags.get("find_unused_parameters")), bool(a.ddp_flags.get("static_graph"))
        labels |= flag_labels(find_unused, static)
        severity = "warning" if find_unused or static else "error"
        fix = freeze_fix_in(a.framework, a.flavor) + "."
    else:
        api = api_for(a.parallelism)
        severity = "warning"
        fix = (
            f"remove them from the model if nothing uses them, or set requires_grad=False on them before {api.call} "
            "(and build the optimizer from the trainable parameters) while they are not used."
        )
    return [
        Finding(
            code=Code.UNUSED_PARAMETERS,
            severity=severity,
            params=never.params,
            ranks=list(range(a.world)),
            steps=list(range(never.steps)),
            fix=fix,
            labels=labels,
        )
    ]


@detects(Code.GRAD_BLOCKED)
def grad_blocked(v: View) -> list[Finding]:
    if not v.steps or v.crashed_before_first_step:
        return []  # reduction-error names them: the forward that would have trained them may never have run
    _, blocked = v.unused_by_cause()
    if not blocked.any():
        return []
    sites = v.blocked_checkpoints
    return [
        Finding(
            code=Code.GRAD_BLOCKED,
            sites=lines_of(*sites),
            severity="error",
            params=v.params(blocked),
            ranks=all_ranks(v),
            steps=list(range(v.steps)),
            labels={"kind": "checkpoint" if sites else "cut", **flag_labels(v.find_unused, v.static_graph)},
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
    severity = "info" if v.find_unused and not v.static_graph else "error"
    return [
        Finding(
            code=Code.DYNAMIC_GRAPH,
            severity=severity,
            params=v.params(dynamic),
            ranks=all_ranks(v),
            steps=steps,
            labels=flag_labels(v.find_unused, v.static_graph),
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
            params=v.params(rank_dep),
            ranks=lacking.ranks,
            more_ranks=lacking.more,
            steps=steps_of((v.used_any[:, rank_dep] != v.used_all[:, rank_dep]).any(-1)),
            labels=flag_labels(v.find_unused, v.static_graph),
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
            params=v.params(dynamic),
            ranks=crashed.ranks or all_ranks(v),
            more_ranks=crashed.more,
            steps=v.crash_steps("static-graph-changed"),
            labels={"kind": "crashed" if crashed.count else "changed"},
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
            ranks=all_ranks(v),
            steps=list(range(v.steps)),
            measured=[Measure("parameters_used", int(v.live.sum()), "count")],
            fix=with_flags(v, find_unused_parameters=False) + ".",
        )
    ]
