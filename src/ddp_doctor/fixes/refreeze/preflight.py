"""What `refreeze` proves across ranks before it changes anything: every rank called it, resolved the same valid
plan for the same model, and holds the same weights (and optimizer state). A rebuild would otherwise adopt rank 0's
weights (DDP's constructor broadcasts them) and hide a divergence.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn

from ddp_doctor.core.errors import DoctorError, RankMismatchError, ReplicaDivergenceError
from ddp_doctor.core.ranks import named_ranks
from ddp_doctor.exchange.primitives import agree, arrive, layout_hash
from ddp_doctor.exchange.replicas import Entry, compare_replicas, describe

__all__ = ["agree_on_plan", "require_identical_replicas"]

_calls = itertools.count()


def agree_on_plan(
    named: list[tuple[str, nn.Parameter]],
    target: list[bool],
    problem: DoctorError | None,
    *,
    group: dist.ProcessGroup | None,
    device: torch.device,
    timeout: float,
) -> None:
    """Check that every rank called `refreeze`, with valid arguments, for the same model and trainable set.

    Collective. `problem` is this rank's own argument error, if any: every rank learns that some rank failed; the
    failing rank raises its own error and the others a `RankMismatchError` naming it, so no rank goes on alone.

    Raises:
        ReportTimeoutError: a rank did not call `refreeze` within `timeout` seconds.
        DoctorError: this rank's `problem`.
        RankMismatchError: another rank's arguments were invalid, or the ranks resolved different plans.
    """
    arrive(
        f"refreeze/{next(_calls)}",
        group=group,
        timeout=timeout,
        call="refreeze()",
        fix="call it on every rank of the DDP's process group, at the same step, with the same arguments.",
    )
    layout = layout_hash([f"{n}:{tuple(p.shape)}:{p.dtype}" for n, p in named])
    plan = layout_hash([n for (n, _), t in zip(named, target) if t])
    headers = agree(
        [len(named), layout, plan],
        failed=int(problem is not None),
        group=group,
        device=device,
        what="refreeze() resolved a different model or a different trainable set on the ranks",
        cause="names, shapes or the selected parameters",
        describe=lambda h: f"{int(h[0])} params",
        fix="A predicate or name list must select the same parameters on every rank; nothing was changed.",
    )
    if headers is not None:  # some rank's arguments were invalid: every rank raises
        if problem is not None:
            raise problem
        raise RankMismatchError(
            f"refreeze() was rejected on {named_ranks(headers.failed, headers.more_failed)} (their error names the "
            "argument); nothing was changed on any rank. Pass the same valid freeze=/unfreeze= on every rank."
        )


def require_identical_replicas(
    named: list[tuple[str, nn.Parameter]],
    ignore: frozenset[str] | set[str],
    optimizer: torch.optim.Optimizer | None,
    *,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    """Compare every parameter (and its optimizer state, with `optimizer`) across ranks. Collective.

    Raises:
        ReplicaDivergenceError: some tensors differ (raised on every rank, naming them).
    """
    entries = [Entry(n, "param", p.numel(), p) for n, p in named if n not in ignore]
    if optimizer is not None:
        entries += [
            Entry(f"{n} (optimizer state)", "optimizer-state", p.numel(), _state_tensors(optimizer, p))
            for n, p in named
            if n not in ignore
        ]
    comparison = compare_replicas(entries, group=group, device=device)
    if comparison.differences:
        diffs = comparison.differences
        ranks = sorted({r for d in diffs for r in d.ranks})
        raise ReplicaDivergenceError(
            f"refreeze() refuses to rebuild DDP: {len(diffs)} tensor(s) already differ across ranks:\n"
            f"{describe(diffs)}\nA rebuild would make every rank adopt rank {diffs[0].reference_rank}'s copy and "
            "hide this. Nothing was changed. Find the cause first (ddp_doctor.guard or observe name it: a "
            "bypassed DDP wrapper, a requires_grad change after wrapping); then restart from a checkpoint saved "
            "before the divergence, or broadcast rank 0's weights knowingly and call refreeze again.",
            params=[d.name for d in diffs],
            ranks=ranks,
            max_difference=max(d.gap for d in diffs),
        )


def _state_tensors(optimizer: torch.optim.Optimizer, p: nn.Parameter) -> list[torch.Tensor] | None:
    state = optimizer.state.get(p)
    if not state:
        return None
    out = []
    for key in sorted(state, key=str):
        v = state[key]
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append(torch.tensor(float(v), dtype=torch.float64))
    return out or None
