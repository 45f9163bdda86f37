"""Replicas whose weights were written other than by the optimizer: they differed when DDP was built (or when
observing started), or something wrote them between an optimizer step (or DDP's wrap) and the next forward, on some
ranks only or on every rank with different values. Pure functions of the `View`; the codes explain a
`replica-divergence` (`causes.CAUSES`)."""

from __future__ import annotations

import torch

from ddp_doctor.analyze.common import all_ranks, first_differing, meta_sites, steps_of, with_more
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, calls_of, lines_of
from ddp_doctor.core.ranks import rank_list

__all__ = ["replicas_differ_at_wrap", "weights_changed_outside_optimizer"]

_FIX = (
    "make the change on every rank: load a checkpoint on every rank before wrapping the model in DDP (its "
    "constructor then broadcasts rank 0's copy), copy an EMA back on every rank, or broadcast rank 0's weights after "
    "the change on purpose."
)


def _when(step: int) -> str:
    return (
        "between DDP's wrap and the first forward"
        if step == 0
        else f"between optimizer step {step - 1} and the next forward"
    )


def _mask(v: View, ranks: list[int]) -> torch.Tensor:
    """The parameters the given ranks recorded as written outside the optimizer."""
    changed = sorted({i for r in ranks for i in v.meta(r).get("changed_params", [])})
    mask = torch.zeros(len(v.info.param_names), dtype=torch.bool)
    mask[[i for i in changed if i < len(mask)]] = True
    return mask


def _call(sites: list[str]) -> dict[str, str]:
    """The call that wrote the weights (`load_state_dict`), where the ranks recorded one: a finding's `labels`."""
    calls = calls_of(*sites)
    return {"call": calls[0]} if calls else {}


@detects(Code.REPLICAS_DIFFER_AT_WRAP)
def replicas_differ_at_wrap(v: View) -> list[Finding]:
    """The replicas differed before any optimizer step: right after DDP was built (or when observing started)."""
    s = v.summary
    if v.world < 2 or not bool(s.weight_steps[0]) or not s.weight_params.any():
        return []
    others = v.ranks("weight-differs")
    init_sync = v.info.ddp_config.get("init_sync")
    exact = v.info.wrap_state_exact
    if init_sync is False:
        why = (
            "DDP was built with init_sync=False, so its constructor did not broadcast rank 0's weights and each "
            "rank kept the weights it built"
        )
    elif exact:
        why = (
            "they differed right after DDP's constructor returned, which broadcasts rank 0's weights unless "
            "init_sync=False: each rank kept the weights it built"
        )
    else:
        why = "they differed when observing started, before any step"
    return [
        with_more(
            Finding(
                code=Code.REPLICAS_DIFFER_AT_WRAP,
                severity="error",
                title=f"the replicas already differ before the first step ({v.params(s.weight_params)[0].name}"
                + (" and others)" if int(s.weight_params.sum()) > 1 else ")"),
                detail=f"Before any optimizer step the weights of {int(s.weight_params.sum())} parameter tensor(s) "
                f"were not the same on every rank: {why}. What makes them differ is rank-dependent construction: a "
                "per-rank seed (torch.manual_seed(rank)) before the model is built, or a model built from "
                "rank-local data.",
                params=v.params(s.weight_params),
                ranks=[0, *others.ranks],
                steps=[0],
                labels={"init_sync": "False"} if init_sync is False else {},
                fix="build DDP with the default init_sync=True (its constructor broadcasts rank 0's weights), or "
                "seed every rank alike before building the model (a per-rank seed belongs after DDP is built, for "
                "data order and dropout).",
            ),
            others.more,
        )
    ]


@detects(Code.WEIGHTS_CHANGED_OUTSIDE_OPTIMIZER)
def weights_changed_outside_optimizer(v: View) -> list[Finding]:
    """Some ranks' parameters were written between DDP's wrap (or an optimizer step) and the next forward, where
    only the optimizer should write them, and the other ranks' were not; or every rank wrote them and they differ
    from that step on (`_written_apart`)."""
    if v.world < 2 or not v.steps:
        return []
    bad = first_differing(v.summary.changed)
    if not bad:
        return _written_apart(v)
    first = bad[0]
    who = v.ranks("changed-outside")
    sites = meta_sites(v, who.ranks, "changed_sites")
    when = _when(first)
    how = f" ({'; '.join(sites)})" if sites else ""
    return [
        with_more(
            Finding(
                code=Code.WEIGHTS_CHANGED_OUTSIDE_OPTIMIZER,
                sites=lines_of(*sites),
                severity="error",
                title=f"{rank_list(who.ranks, more=who.more)} changed the weights {when}; the other ranks did not",
                detail=f"On {rank_list(who.ranks, more=who.more)}, parameters were written {when}{how}, where only "
                "the optimizer should write them, and the other ranks' were not. DDP synchronizes the weights only "
                "in its constructor, so from here the replicas differ."
                + (f" Again in step(s) {bad[1:]}." if len(bad) > 1 else ""),
                params=v.params(_mask(v, who.ranks)),
                ranks=who.ranks,
                steps=[first],
                fix=_FIX,
                labels=_call(sites),
            ),
            who.more,
        )
    ]


def _written_apart(v: View) -> list[Finding]:
    """Every rank wrote parameters before step k's forward, the weights agreed until then and differ right after
    step k, in parameters that were written: the ranks wrote different values (a re-initialisation after DDP was
    built, drawn from each rank's own random state).

    Ground truth (tests/causes/test_weight_writes.py): `model.module.head.reset_parameters()` after DDP's
    constructor, under `torch.manual_seed(100 + rank)`, 2 ranks: the head's weights differ from the first step on
    and stay apart; DDP's gradients agree at every step, so nothing else explains it.
    """
    s = v.summary
    _, fewest = s.changed
    differ = steps_of(s.weight_steps)
    if not differ or differ[0] == 0:
        return []  # equal at entry is required: replicas-differ-at-wrap explains the other case
    step = differ[0] - 1
    if step >= len(fewest) or not fewest[step]:
        return []
    written = _mask(v, [0]) & s.weight_params
    if not written.any():
        return []  # what differs is not what was written
    sites = meta_sites(v, [0], "changed_sites")
    when = _when(step)
    how = f" ({'; '.join(sites)} on rank 0)" if sites else ""
    n = int(written.sum())
    return [
        Finding(
            code=Code.WEIGHTS_CHANGED_OUTSIDE_OPTIMIZER,
            sites=lines_of(*sites),
            severity="error",
            title=f"every rank wrote the weights {when}, each its own values",
            detail=f"Every rank wrote parameters {when}{how}, where only the optimizer should write them. The "
            f"replicas agreed before, and right after step {step} the weights of {n} of the written tensor(s) "
            "differed: the ranks wrote different values. A re-initialisation after DDP was built "
            "(`reset_parameters()`, a `torch.nn.init` call) draws from each rank's own random state, which a "
            "per-rank seed makes differ; DDP synchronizes the weights only in its constructor.",
            params=v.params(written),
            ranks=all_ranks(v),
            steps=[step],
            labels=_call(sites),
            fix="initialise (or load) the weights before wrapping the model in DDP, whose constructor broadcasts "
            "rank 0's copy; or seed every rank alike before the re-initialisation; or broadcast rank 0's weights "
            "after it on purpose (for p in model.module.parameters(): dist.broadcast(p.data, src=0)).",
        )
    ]
