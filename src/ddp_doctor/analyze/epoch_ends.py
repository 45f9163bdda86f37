"""What following the script through its epoch ends found: `timeout-risk`, a `collective-mismatch` after the
observed steps, and the report's `following` section (the loaders, the epoch ends reached). Pure: reads the
`FollowSummary` every rank agrees on.

`timeout-risk` rule: at one sync point (a collective every rank must enter), one rank arrived later than every
other by a span of its own work, and that span, with each capped DataLoader pass in it run to its real length,
reaches half of the process group's timeout (a warning) or the timeout itself (an error). Capped passes make the
measured span short; the projection scales each pass's time by its real length over the batches it handed out.
Without a length (an iterable dataset) the projection is unknown and the measured span alone is compared.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from ddp_doctor.core.findings import Finding
from ddp_doctor.core.followed import Following, FollowSummary
from ddp_doctor.core.rankfiles import RankState
from ddp_doctor.core.ranks import rank_list

__all__ = ["following_findings", "following_section", "timed_out_waiting", "timeout_fix"]

NO_LOADER = (
    "No epoch end was reached: the observed steps did not train on a DataLoader pass (a step-based loop, like "
    "nanoGPT's), so the check stopped after them."
)


def _seconds(x: float) -> str:
    if x >= 120:
        return f"{x / 60:.1f} min"
    return f"{x:.2f} s" if x < 10 else f"{x:.0f} s"


def following_section(summary: FollowSummary | None, *, epochs: int, limit: int) -> Following | None:
    """The report's `following` section; None when the run ended before its observed steps did (nothing was
    followed, nothing to say)."""
    if summary is None or not (summary.followed or summary.declined):
        return None
    if not summary.followed:
        return Following(
            epochs=epochs,
            limit_batches=limit,
            epoch_ends=0,
            ended_by="",
            seconds=0.0,
            loaders=summary.loaders,
            note=NO_LOADER,
        )
    note = ""
    if summary.epoch_ends < epochs:
        note = (
            f"The script ended after {summary.epoch_ends} of the {epochs} epoch end(s) asked for."
            if summary.epoch_ends
            else "No epoch end was reached before the script ended."
        )
    return Following(
        epochs=epochs,
        limit_batches=limit,
        epoch_ends=summary.epoch_ends,
        ended_by=summary.ended_by,
        seconds=summary.seconds,
        loaders=summary.loaders,
        note=note,
    )


_RAISE_TIMEOUT = {
    "torch": "dist.init_process_group(..., timeout=datetime.timedelta(minutes=60))",
    "accelerate": "Accelerator(kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=60))])",
    "transformers": "TrainingArguments(..., ddp_timeout=3600)",
    "lightning": "Trainer(strategy=DDPStrategy(timeout=datetime.timedelta(minutes=60)))",
}


def timeout_fix(framework: str | None) -> str:
    """`timeout-risk`'s fix, the timeout raised in the words of the framework that built the DDP model."""
    raise_it = _RAISE_TIMEOUT.get(framework or "torch", _RAISE_TIMEOUT["torch"])
    return (
        "run that work on every rank, each on its shard (a DistributedSampler on the evaluation set, then all_reduce "
        f"the metric), or move it where no rank waits for it, or raise the timeout knowingly: {raise_it}."
    )


def following_findings(summary: FollowSummary | None, *, framework: str = "torch") -> list[Finding]:
    if summary is None or not summary.followed:
        return []
    return [*_mismatch(summary), *_timeout_risk(summary, framework)]


def _mismatch(s: FollowSummary) -> list[Finding]:
    differ = {k: v for k, v in s.counts.items() if v[0] != v[1]}
    if s.lone_broadcasts and s.more_ranks:
        return [_lone_broadcast(s)]
    if not differ:
        return []
    words = {
        "collective": "the script's collectives",
        "ddp-broadcast": "DDP's buffer broadcasts (one per forward through the wrapper that syncs buffers)",
        "ddp-step": "DDP's gradient all-reduces (synced backward passes)",
    }
    counted = "; ".join(f"{words[k]}: {lo} to {hi} per rank" for k, (hi, lo) in differ.items())
    sites = f" The extra forward through the DDP wrapper is at {', '.join(s.extra_sites)}." if s.extra_sites else ""
    ranks = s.more_ranks
    broadcast = "ddp-broadcast" in differ
    return [
        Finding(
            code="collective-mismatch",
            severity="error",
            title=f"after the observed steps, {rank_list(ranks) if ranks else 'some ranks'} issued more collectives "
            "than the others (at the epoch end)",
            detail=f"While following the script through its epoch end, the ranks did not issue the same collectives: "
            f"{counted}.{sites} Collectives pair up by position, so the ranks with more pair theirs with the others' "
            "next ones: tensors of different meaning get combined silently, and the job hangs or crashes when the "
            "counts no longer line up (at the end of training, at the latest)."
            + (
                " A forward through the DDP wrapper broadcasts rank 0's buffers (broadcast_buffers=True and the model "
                "has buffers, BatchNorm say), even under torch.no_grad() in eval mode, right after a training step."
                if broadcast
                else ""
            ),
            params=[],
            ranks=ranks,
            steps=[],
            fix="evaluate through the inner module (ddp_model.module(x)) under torch.no_grad(), or run the evaluation "
            "on every rank (each on its shard)."
            if broadcast
            else "issue the same collectives on every rank: run the code that calls them on every rank.",
        )
    ]


def _lone_broadcast(s: FollowSummary) -> Finding:
    who = rank_list(s.more_ranks)
    where = f" at {', '.join(s.extra_sites)}" if s.extra_sites else ""
    return Finding(
        code="collective-mismatch",
        severity="error",
        title=f"{who} called the DDP model without autograd{where} after the observed steps; the other ranks did not",
        detail=f"At the epoch end the check followed, {who} ran a forward through the DDP wrapper under "
        f"torch.no_grad(){where} (an evaluation, say) that the other ranks did not run. With broadcast_buffers=True "
        "and a model with buffers (BatchNorm), DDP broadcasts rank 0's buffers at the first such forward after a "
        "training step: a collective the other ranks pair with the broadcast of their next training forward (DDP "
        "then skips that rank's next one, so the counts can still agree). The pairing is silently wrong, and when "
        "no training forward follows (an evaluation after the last epoch) the broadcast is never matched and the "
        "job hangs or dies at its end.",
        params=[],
        ranks=s.more_ranks,
        steps=[],
        fix="evaluate through the inner module (ddp_model.module(x)) under torch.no_grad(), or run the evaluation "
        "on every rank (each on its shard).",
    )


def _timeout_risk(s: FollowSummary, framework: str) -> list[Finding]:
    alone, timeout = s.alone, s.timeout_s
    if alone is None or not timeout:
        return []
    value = alone.projected_s if alone.projected_s is not None else alone.measured_s
    if value < timeout / 2:
        return []
    reaches = value >= timeout
    projection = (
        f"about {_seconds(alone.projected_s)} at the loaders' real lengths"
        if alone.projected_s is not None
        else "the projection to the real lengths is unknown (a loader without len())"
    )
    passes = f" Capped DataLoader passes in that span: {'; '.join(alone.passes)}." if alone.passes else ""
    return [
        Finding(
            code="timeout-risk",
            severity="error" if reaches else "warning",
            title=f"rank {alone.rank} works alone for {projection if alone.projected_s is not None else _seconds(value)}"
            f" while the others wait; the process group's timeout is {_seconds(timeout)}",
            detail=f"Between {alone.start} and {alone.end}, rank {alone.rank} worked alone for "
            f"{_seconds(alone.measured_s)} as measured with capped loaders ({projection}) while every other rank "
            f"waited for it in {alone.end}.{passes} "
            + (
                f"That reaches the process group's timeout of {_seconds(timeout)}: in the real run the waiting ranks' "
                "collective times out at this point (gloo raises a timeout error; NCCL's watchdog aborts the job)."
                if reaches
                else f"That is more than half of the process group's timeout of {_seconds(timeout)}: a slower "
                "machine, a bigger evaluation set or a busy file system takes it over the timeout."
            ),
            params=[],
            ranks=[alone.rank],
            steps=[],
            fix=timeout_fix(framework),
        )
    ]


_TIMEOUT_WORDS = ("Timed out waiting", "Watchdog caught collective operation timeout", "timed out")
_TIMEOUT_MS = re.compile(r"(?:Timed out waiting |Timeout\(ms\)=)(\d+)\s*ms|Timeout\(ms\)=(\d+)")


def timed_out_waiting(states: dict[int, RankState], where: Callable[[RankState], str]) -> Finding | None:
    """A run that died of the process group's timeout: some ranks raised a collective timeout while the others,
    not in any collective, were working alone (an evaluation on rank 0, say). `timeout-risk` as it happened: the
    ranks that kept the others waiting, and where they were. `where` words a rank's position."""
    waited = {
        r: s
        for r, s in states.items()
        if s.raised is not None and s.raised.peer_lost and any(w in s.raised.message for w in _TIMEOUT_WORDS)
    }
    away = [r for r, s in sorted(states.items()) if r not in waited and s.raised is None and not s.in_collective]
    if not waited or not away:
        return None
    first = min(waited)
    crash = waited[first].raised
    found = _TIMEOUT_MS.search(crash.message)
    ms = next((g for g in found.groups() if g), None) if found else None
    after = f" after {int(ms) / 1000:g} s" if ms else ""
    return Finding(
        code="timeout-risk",
        severity="error",
        title=f"{rank_list(sorted(waited))} timed out{after} in a collective, waiting for {rank_list(away)}, which "
        "worked alone",
        detail=f"Rank {first} waited in a collective at {crash.site or 'an unknown place'} (step {max(crash.step, 0)}, "
        f"{crash.phase}) until the process group's timeout ran out{after} ({crash.type}: {crash.message[:160]}). "
        + "; ".join(f"Rank {r} was not in any collective: {where(states[r])}" for r in away[:4])
        + ". It worked alone that long while the others waited for it.",
        params=[],
        ranks=away,
        steps=sorted({max(states[r].step, 0) for r in away}),
        fix=timeout_fix(next((m.get("framework") for st in states.values() for m in st.models), "torch")),
    )
