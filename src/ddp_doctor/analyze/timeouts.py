"""`timeout-risk`, decided here from what following measured and from a run that died of the timeout.

`timeout-risk` rule: at one sync point (a collective every rank must enter), one rank arrived later than every
other by a span of its own work, and that span, with each capped DataLoader pass in it run to its real length,
reaches half of the process group's timeout (a warning) or the timeout itself (an error). Capped passes make the
measured span short; the projection scales each pass's time by its real length over the batches it handed out.
Without a length (an iterable dataset) the projection is unknown and the measured span alone is compared.

A run that died of it: some ranks raised a collective timeout while the others, in no collective, worked alone.
"""

from __future__ import annotations

import re

from ddp_doctor.analyze.positions import position, where
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, lines_of
from ddp_doctor.core.following import FollowSummary
from ddp_doctor.core.ranks import rank_list, ranks_label
from ddp_doctor.core.rankstate import RankState

__all__ = ["followed_timeout_risk", "timed_out_waiting", "timeout_fix"]


def _seconds(x: float) -> str:
    if x >= 120:
        return f"{x / 60:.1f} min"
    return f"{x:.2f} s" if x < 10 else f"{x:.0f} s"


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


def followed_timeout_risk(s: FollowSummary, framework: str) -> list[Finding]:
    """`timeout-risk` from following: the span one rank worked alone at a sync point (`FollowSummary.alone`)."""
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
            code=Code.TIMEOUT_RISK,
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
            sites=lines_of(alone.end, *alone.passes),
            measured=[
                Measure("alone", alone.measured_s, "s"),
                *([Measure("alone_projected", alone.projected_s, "s")] if alone.projected_s is not None else []),
                Measure("group_timeout", timeout, "s"),
            ],
        )
    ]


_TIMEOUT_WORDS = ("Timed out waiting", "Watchdog caught collective operation timeout", "timed out")
_TIMEOUT_MS = re.compile(r"(?:Timed out waiting |Timeout\(ms\)=)(\d+)\s*ms|Timeout\(ms\)=(\d+)")


def timed_out_waiting(states: dict[int, RankState]) -> Finding | None:
    """A run that died of the process group's timeout: some ranks raised a collective timeout while the others,
    not in any collective, were working alone (an evaluation on rank 0, say). `timeout-risk` as it happened: the
    ranks that kept the others waiting, and where they were."""
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
        code=Code.TIMEOUT_RISK,
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
        sites=lines_of(crash.site or "", *(states[r].user_frame or states[r].site or "" for r in away)),
        measured=[Measure("group_timeout", int(ms) / 1000, "s")] if ms else [],
        labels={"waited": ranks_label(waited)},
        positions=[position(r, states[r]) for r in [first, *away[:4]]],
        fix=timeout_fix(next((m.get("framework") for st in states.values() for m in st.models), "torch")),
    )
