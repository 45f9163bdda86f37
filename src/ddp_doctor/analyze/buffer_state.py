"""Buffers that differ across ranks (`buffer-divergence`), decided here for every parallelism: those DDP was built
with, at each step; those registered after DDP was built that it does not broadcast; and a sharded model's, which
FSDP2 and `replicate` neither broadcast nor average (`buffers_apart` words them for each). Pure functions of the
`View`, or of the facts a sharded report agreed on."""

from __future__ import annotations

from typing import Any

from ddp_doctor.analyze.common import all_ranks, steps_of, with_flags
from ddp_doctor.analyze.parallelism import every_rank
from ddp_doctor.analyze.rules import count as _count
from ddp_doctor.analyze.snippets import freeze_point, sync_batchnorm
from ddp_doctor.analyze.tree_digest import param_entry, step_apart
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, ParamRef, lines_of
from ddp_doctor.core.sharded_run import ShardedRun, parallelism_of

__all__ = ["buffer_divergence", "buffers_apart", "buffers_apart_sharded", "late_apart"]


@detects(Code.BUFFER_DIVERGENCE)
def buffer_divergence(v: View) -> list[Finding]:
    """Buffers that differ across ranks at a forward: those DDP was built with (`buffer_fp`, each step), and those
    registered after it that DDP does not broadcast (`late_apart`). Ground truth: tests/sync/test_check_rank_buffers.py."""
    if v.world < 2 or not v.steps:
        return []
    broadcast = bool(v.info.ddp_config.get("broadcast_buffers", True))
    found = []
    differ = v.summary.buffer_differs & v.summary.buffer_seen  # [S, B]: every rank recorded it, and they differ
    changing = set(v.meta(0).get("buffers_changing") or [])
    apart = differ.any(0)
    moving = apart & differ.new_tensor([i in changing for i in range(len(apart))], dtype=bool)
    made = apart & ~moving
    fix_made = (
        with_flags(v, broadcast_buffers=True) + " (the default: rank 0's buffers are then broadcast before every "
        "forward), or make the buffers equal on every rank (the same seed or values everywhere) before training."
    )
    for mask, running in ((made, False), (moving, True)):
        if mask.any():
            found.append(
                buffers_apart(
                    buffers=v.buffers(mask),
                    ranks=all_ranks(v),
                    steps=steps_of(differ[:, mask].any(1)),
                    changing=running,
                    parallelism="ddp",
                    fix_ddp=fix_made
                    if not running
                    else with_flags(v, broadcast_buffers=True)
                    + " (the default)"
                    + (
                        f", or {sync} "
                        if (sync := sync_batchnorm(v.info.device_type, freeze_point(v.info.framework)))
                        else ""
                    )
                    + ".",
                    broadcast=broadcast,
                )
            )
    late = late_apart(v)
    if late:
        entries, running = late
        never = broadcast and not v.info.buffers_synced  # the flag is on, yet DDP had no buffers when built
        found.append(
            buffers_apart(
                buffers=[param_entry(e) for e in entries],
                ranks=sorted({0, *v.ranks("state-differs").ranks}),
                steps=[step_apart(v, "late_buffers")[0]],
                changing=running,
                parallelism="ddp",
                fix_ddp="register these buffers before DDP is built (DDP then broadcasts rank 0's before every "
                "forward), or make them equal on every rank (the same seed or values everywhere) before training."
                if never
                else fix_made,
                broadcast=broadcast,
                none_at_wrap=never,
                late=True,
                registered_at=sorted({e["site"] for e in entries if e.get("site")}),
            )
        )
    return found


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


@detects(Code.BUFFER_DIVERGENCE, road="sharded")
def buffers_apart_sharded(run: ShardedRun) -> list[Finding]:
    """Buffers that differ across ranks: FSDP2 shards parameters only, and neither broadcasts nor averages buffers
    (`buffer_state.buffers_apart` words it, for every parallelism).

    Ground truth, plain torchrun, torch 2.13.0, CPU, gloo, 2 ranks, 12 steps (`tests/scripts/fsdp2_train.py
    --mistake buffer-rank`: a constant buffer drawn from each rank's own generator): exit code 0, nothing said, and
    the ranks' outputs on the same input end apart (sums printed by each rank). With the same seed on every rank
    (`buffer-same`) they agree.
    """
    parallelism, ranks = parallelism_of(run.sharding), every_rank(run)
    apart = [(ref, moved) for ref, differ, moved in zip(run.buffers, run.buffers_differ, run.buffers_moved) if differ]
    made = [ref for ref, moved in apart if not moved]  # never changed: they differed from the first step on
    training = [ref for ref, moved in apart if moved]  # running statistics: compared at the last observed step
    found = []
    if made:
        found.append(
            buffers_apart(
                buffers=made, ranks=ranks, steps=list(range(run.steps)), changing=False, parallelism=parallelism
            )
        )
    if training:
        found.append(
            buffers_apart(
                buffers=training,
                ranks=ranks,
                steps=[run.steps - 1],
                changing=True,
                parallelism=parallelism,
                device_type=(run.sharding or {}).get("device_type", ""),
            )
        )
    return found


def buffers_apart(
    *,
    buffers: list[ParamRef],
    ranks: list[int],
    steps: list[int],
    changing: bool,
    parallelism: str,
    fix_ddp: str = "",
    broadcast: bool = True,
    late: bool = False,
    registered_at: list[str] = (),
    none_at_wrap: bool = False,
    device_type: str = "",
) -> Finding:
    """`buffer-divergence`, for every parallelism: `buffers` differ across `ranks` at `steps` (`device_type`: where
    the model runs, for a sharded model's fix: SyncBatchNorm runs on GPU modules only).

    `changing`: they change during the steps (running statistics such as BatchNorm's, each rank from its own
    batches): a ``warning``, training stays correct while evaluation and the saved buffers depend on the rank.
    Otherwise they were made different and never changed (a per-rank seed, memory left uninitialised after
    `to_empty()`): an ``error``, each rank computes a different function of the same weights. DDP broadcasts rank 0's
    buffers at construction and before every forward, or never with broadcast_buffers=False (`fix_ddp` is then the
    fix in the script's framework's words); FSDP2's `fully_shard` and `replicate` take parameters only and never
    touch buffers. `late`: a DDP model's buffers registered after it was built (`registered_at`: their lines);
    `none_at_wrap`: the model had no buffers then, so DDP never syncs any (`will_sync_module_buffers`).
    """
    n = len(buffers)
    after = (
        " They were registered after DDP was built"
        + (f", at {', '.join(registered_at[:3])}." if registered_at else ".")
        if late
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
