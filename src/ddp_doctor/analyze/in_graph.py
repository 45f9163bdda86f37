"""`collective-in-graph`: the script reduced a tensor autograd tracks in place (`dist.all_reduce(loss)` before
`loss.backward()`), and a backward went through it. Decided here for every parallelism, from the factor a hook
measured on the reduced tensor (`observation/graph_collectives.py`).

Ground truth (tests/scripts/loss_all_reduce.py, plain torchrun, torch 2.13.0, gloo, 2 ranks): `dist.all_reduce(loss)`
then `loss /= world_size` before backward runs to the end with exit code 0 and a UserWarning ("an autograd kernel was
not registered ... silently incorrect behavior"): rank 0's gradient of the first step is half of the one the same
script computes when it reduces a detached copy for logging (-0.0798 against -0.1597 for the first weight). A SUM
left undivided (the gradient unchanged: only the logged value is the sum) or a reduction after the backward changes
no gradient and is not reported.
"""

from __future__ import annotations

from typing import Any

from ddp_doctor.analyze.parallelism import api_for
from ddp_doctor.analyze.view import detects
from ddp_doctor.core.agreed import Agreed
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, lines_of

__all__ = ["collectives_in_graph", "in_graph_findings"]

_TOLERANCE = 1e-3
"""How far a measured factor may be from 1 or 1/world_size and still count as it (float32 rounding)."""


@detects(Code.COLLECTIVE_IN_GRAPH, road="every")
def collectives_in_graph(a: Agreed) -> list[Finding]:
    """From rank 0's record (every rank runs the script's line; the factor is rank 0's), whatever the
    parallelism."""
    wrapper = "DDP" if a.parallelism == "ddp" else api_for(a.parallelism).name
    return in_graph_findings(a.graph_collectives, ranks=[0], wrapper=wrapper)


def in_graph_findings(entries: list[dict[str, Any]], *, ranks: list[int], wrapper: str = "DDP") -> list[Finding]:
    """One finding per line whose reduction the backward went through with a factor other than 1, under a SUM:
    the gradient is the rank's own loss's times that factor, where the gradient of the reduced value would have
    summed the ranks' (an AVG gives the same gradient either way). `wrapper`: what averages the gradients (DDP,
    FSDP2, replicate)."""
    found = []
    for e in entries:
        scale, world = e.get("scale"), e.get("group_size") or 1
        if scale is None or e.get("reduce_op") not in ("SUM", None) or abs(scale - 1.0) <= _TOLERANCE:
            continue
        averaged = world > 1 and abs(scale * world - 1.0) <= _TOLERANCE
        found.append(_finding(e, scale, world, averaged, ranks, wrapper))
    return found


def _finding(e: dict[str, Any], scale: float, world: int, averaged: bool, ranks: list[int], wrapper: str) -> Finding:
    site = e["site"]
    passes = (
        f"dist.{e['call']} at {site} reduces a tensor the backward goes through (the loss, reduced before "
        "backward). The c10d collectives have no autograd formula, so backward passes through the all_reduce as "
        f"if it were not there: each rank's gradient is its own loss's times {scale:.4g}, the factor applied to the "
        "reduced value before the backward"
    )
    if averaged:
        title = (
            f"the loss is summed across ranks by an in-place dist.all_reduce before backward and divided by {world}: "
            f"every gradient is {world} times smaller"
        )
        detail = (
            f"{passes} (the division by the world size). {wrapper} then averages those, so every step uses a gradient "
            f"{world} times smaller than that of the averaged loss: under SGD the steps are {world} times smaller "
            "(optimizers such as Adam normalise most of a constant factor away). Nothing fails; torch warns once "
            "that an autograd kernel was not registered."
        )
    else:
        title = (
            f"backward goes through an in-place dist.all_reduce as if it were not there (gradients times {scale:.4g})"
        )
        detail = (
            f"{passes} (the script's weight or division, or a GradScaler's scale). The gradient of the reduced value "
            "would sum the ranks' gradients; this one is the rank's own, scaled."
        )
    return Finding(
        code=Code.COLLECTIVE_IN_GRAPH,
        severity="warning" if averaged else "info",
        title=title,
        detail=detail,
        sites=lines_of(site),
        ranks=ranks,
        steps=[e["step"]] if e.get("step") is not None else [],
        fix=f"reduce a detached copy for logging and call backward on this rank's own loss ({wrapper} averages the "
        "gradients): `logged = loss.detach().clone(); dist.all_reduce(logged); logged /= world_size`.",
        measured=[
            Measure("gradient_factor", scale, "ratio"),
            Measure("group_size", world, "count"),
            *([Measure("loss_scale", e["loss_scale"], "ratio")] if e.get("loss_scale", 1.0) != 1.0 else []),
        ],
    )
