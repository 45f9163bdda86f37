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

from ddp_doctor.analyze.positions import position
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, lines_of
from ddp_doctor.core.following import FollowSummary
from ddp_doctor.core.ranks import ranks_label
from ddp_doctor.core.rankstate import RankState

__all__ = ["followed_timeout_risk", "timed_out_waiting", "timeout_fix"]


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
    labels = {"start": alone.start, "end": alone.end}
    if alone.passes:
        labels["passes"] = "; ".join(alone.passes)
    return [
        Finding(
            code=Code.TIMEOUT_RISK,
            severity="error" if value >= timeout else "warning",
            params=[],
            ranks=[alone.rank],
            steps=[],
            fix=timeout_fix(framework),
            sites=lines_of(alone.end, *alone.passes),
            labels=labels,
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
    return Finding(
        code=Code.TIMEOUT_RISK,
        severity="error",
        params=[],
        ranks=away,
        steps=sorted({max(states[r].step, 0) for r in away}),
        sites=lines_of(crash.site or "", *(states[r].user_frame or states[r].site or "" for r in away)),
        measured=[Measure("group_timeout", int(ms) / 1000, "s")] if ms else [],
        labels={"waited": ranks_label(waited), "exception": crash.type, "message": crash.message[:160]},
        positions=[position(r, states[r]) for r in [first, *away[:4]]],
        fix=timeout_fix(next((m.get("framework") for st in states.values() for m in st.models), "torch")),
    )
