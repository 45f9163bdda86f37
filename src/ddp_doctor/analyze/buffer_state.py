"""Buffers that differ across ranks (`buffer-divergence`), decided here for every parallelism: those DDP was built
with, at each step; those registered after DDP was built that it does not broadcast; and a sharded model's, which
FSDP2 and `replicate` neither broadcast nor average (`buffers_apart` words them for each). Pure functions of the
`View`, or of the facts a sharded report agreed on."""

from __future__ import annotations

from typing import Any

from ddp_doctor.analyze.rules import count as _count
from ddp_doctor.analyze.snippets import flags_fix, freeze_point, sync_batchnorm
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.agreed import Agreed, BuffersApart
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, lines_of

__all__ = ["buffer_divergence", "buffers_apart", "late_apart"]


@detects(Code.BUFFER_DIVERGENCE, road="every")
def buffer_divergence(a: Agreed) -> list[Finding]:
    """Buffers that differ across ranks at a forward: a DDP model's that it was built with (each step), those
    registered after it that DDP does not broadcast, and a sharded model's, which FSDP2 and `replicate` never
    touch. Ground truth: tests/sync/test_check_rank_buffers.py, and `tests/scripts/fsdp2_train.py --mistake
    buffer-rank` (a constant buffer drawn from each rank's own generator): exit code 0, nothing said, and the
    ranks' outputs on the same input end apart (sums printed by each rank); with the same seed on every rank
    (`buffer-same`) they agree."""
    return [buffers_apart(b, a) for b in a.buffers_apart]


def late_apart(v: View) -> tuple[list[dict[str, Any]], bool] | None:
    """The buffers registered after DDP was built, when it does not broadcast them (broadcast_buffers=False, or no
    buffers when it was built), whose values differ between rank 0 and the example ranks whose module tree differs
    from its, and whether any of them changed between two steps. Buffers the check cannot read are left out
    (`unreadable`)."""
    mine = {e["name"]: e for e in v.meta(0).get("late_buffers") or [] if e.get("readable", True)}
    odd = v.ranks("state-differs").ranks
    if not mine or not odd or v.summary.state_step is None:
        return None
    theirs = [{e["name"]: e for e in v.meta(r).get("late_buffers") or []} for r in odd]
    apart = [e for n, e in mine.items() if any(n not in t or t[n]["fp"] != e["fp"] for t in theirs)]
    if not apart:
        return None
    return apart, any(e["changing"] or any(t.get(e["name"], {}).get("changing") for t in theirs) for e in apart)


def buffers_apart(b: BuffersApart, a: Agreed) -> Finding:
    """`buffer-divergence` of the buffers `b` of the model `a` describes (its parallelism, DDP's flags, the framework
    and device a fix is worded for).

    Buffers that change during the steps (running statistics such as BatchNorm's, each rank from its own batches)
    are a ``warning``: training stays correct while evaluation and the saved buffers depend on the rank. Buffers
    made different that never changed (a per-rank seed, memory left uninitialised after `to_empty()`) are an
    ``error``: each rank computes a different function of the same weights. DDP broadcasts rank 0's buffers at
    construction and before every forward, or never with broadcast_buffers=False; FSDP2's `fully_shard` and
    `replicate` take parameters only and never touch buffers (SyncBatchNorm, the fix for running statistics, runs
    on GPU modules only).
    """
    buffers, ranks, steps, changing, parallelism = b.buffers, b.ranks, b.steps, b.changing, a.parallelism
    broadcast, none_at_wrap, registered_at = (
        bool(a.ddp_flags.get("broadcast_buffers", True)),
        b.none_at_wrap,
        b.registered_at,
    )
    fix_ddp = _ddp_fix(b, a) if parallelism == "ddp" else ""
    device_type = a.device_type
    n = len(buffers)
    after = (
        " They were registered after DDP was built"
        + (f", at {', '.join(registered_at[:3])}." if registered_at else ".")
        if b.late
        else ""
    )
    if parallelism == "ddp" and not changing:
        return Finding(
            code=Code.BUFFER_DIVERGENCE,
            severity="error",
            title=f"{_count(n, 'buffer')} {'differs' if n == 1 else 'differ'} across ranks and never changed in training",
            detail=(
                "DDP was built with broadcast_buffers=False, so it never broadcasts rank 0's buffers, not even at "
                "construction. "
                if not broadcast
                else "DDP was built from a model without buffers, and DDP syncs buffers only when the model had some "
                "at construction: it never broadcasts these. "
                if none_at_wrap
                else "DDP broadcasts rank 0's buffers before each forward, yet these differed at the forward. "
            )
            + f"These were made different (a per-rank seed when they were drawn, or a value assigned on each rank) "
            f"and rank 0's copy did not change through the {len(steps)} observed step(s) where they differ: each rank "
            "computes a different function of the same synced weights, and the gradients averaged across ranks "
            "come from different models. DDP raises nothing." + after,
            sites=lines_of(*registered_at),
            params=buffers,
            ranks=ranks,
            steps=steps,
            fix=fix_ddp,
        )
    if parallelism == "ddp":
        return Finding(
            code=Code.BUFFER_DIVERGENCE,
            severity="warning",
            title=f"{_count(n, 'buffer')} {'differs' if n == 1 else 'differ'} across ranks during training",
            detail="Buffers such as BatchNorm running statistics differ between ranks when the forward pass runs"
            + (
                " because DDP was built with broadcast_buffers=False"
                if not broadcast
                else " because DDP was built from a model without buffers (it then never syncs any)"
                if none_at_wrap
                else ""
            )
            + ". Evaluation then differs by rank, and only rank 0's are saved."
            + after,
            sites=lines_of(*registered_at),
            params=buffers,
            ranks=ranks,
            steps=steps,
            fix=fix_ddp,
        )
    call = "replicate" if parallelism == "replicate" else "fully_shard"
    if changing:
        return Finding(
            code=Code.BUFFER_DIVERGENCE,
            severity="warning",
            title=f"{n} buffer(s) of the {_MODEL[parallelism]} change in training and differ across ranks",
            detail="These buffers change during the steps (running statistics such as BatchNorm's), each rank "
            f"from its own batches; {call} neither broadcasts nor averages buffers, so evaluation differs by rank "
            "and a checkpoint holds the saving rank's.",
            params=buffers,
            ranks=ranks,
            steps=steps,
            fix=f"{sync}, or average the buffers across ranks before evaluating and saving."
            if (sync := sync_batchnorm(device_type, f"before {call}"))
            else "average the buffers across ranks before evaluating and saving (SyncBatchNorm runs on GPU modules "
            "only).",
        )
    return Finding(
        code=Code.BUFFER_DIVERGENCE,
        severity="error",
        title=f"{n} buffer(s) of the {_MODEL[parallelism]} differ across ranks and never changed",
        detail=f"{call} takes parameters only: a buffer stays a plain tensor on each rank, and nothing "
        "broadcasts it, as DDP does at construction. These were made different and stayed so through the "
        f"{len(steps)} observed steps (a per-rank seed when they were drawn, or memory left uninitialised "
        "after to_empty()): each rank computes a different function of the same shared weights, and the "
        "gradients averaged across ranks come from different models.",
        params=buffers,
        ranks=ranks,
        steps=steps,
        fix="make them equal on every rank before training: compute them from the same seed or values "
        "everywhere (after model.to_empty(...), initialise the buffers too, not only the parameters), or "
        "copy rank 0's once: `for b in model.buffers(): dist.broadcast(b, src=0)`.",
    )


_MODEL = {"fsdp2": "sharded model", "replicate": "replicated model"}


def _ddp_fix(b: BuffersApart, a: Agreed) -> str:
    """DDP's fix, in the script's framework's words: its broadcast on (the default), or the buffers made equal;
    SyncBatchNorm for running statistics where the model runs on a GPU; the buffers registered before DDP is
    built, where DDP had none when it was built."""
    on = flags_fix(a.framework, {"broadcast_buffers": True}, a.flavor)
    if b.late and b.none_at_wrap:
        return (
            "register these buffers before DDP is built (DDP then broadcasts rank 0's before every forward), or "
            "make them equal on every rank (the same seed or values everywhere) before training."
        )
    if b.changing and not b.late:
        sync = sync_batchnorm(a.device_type, freeze_point(a.framework))
        return on + " (the default)" + (f", or {sync} " if sync else "") + "."
    return (
        on + " (the default: rank 0's buffers are then broadcast before every forward), or make the buffers equal "
        "on every rank (the same seed or values everywhere) before training."
    )
