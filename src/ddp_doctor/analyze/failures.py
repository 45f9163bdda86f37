"""Findings for a run whose ranks could not exchange records: who failed first, how, where, and what the others did.

Pure: the input is the supervisor's `RankState` per rank (the ranks' own files, merged); no torch.distributed.
"""

from __future__ import annotations

from ddp_doctor.analyze.collective_order import beacons_apart
from ddp_doctor.analyze.crashed_ranks import crash_findings, died_silently, exited_failing, killed_findings
from ddp_doctor.analyze.epochs import ran_out_alone
from ddp_doctor.analyze.parting import beacons_parting, failed_inside
from ddp_doctor.analyze.positions import beside, positions
from ddp_doctor.analyze.shapes import shape_findings
from ddp_doctor.analyze.sharded_failures import forward_alone, gather_alone, step_skipped_alone
from ddp_doctor.analyze.sharded_saves import state_dict_alone
from ddp_doctor.analyze.timeouts import timed_out_waiting
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, Measure, lines_of
from ddp_doctor.core.phase import Phase
from ddp_doctor.core.rankfiles import PHASES, Outcome
from ddp_doctor.core.ranks import ranks_label
from ddp_doctor.core.rankstate import RankState

__all__ = ["failure_findings"]


def _died_inside(s: RankState) -> bool:
    """The rank ended inside its last collective: its group raised there, or native code aborted it there (gloo
    aborts a rank that received another size than it expected)."""
    return failed_inside(s) or (s.in_collective and s.signal in ("SIGABRT", "SIGSEGV"))


def failure_findings(states: dict[int, RankState], *, timed_out: bool, native: list[str] = ()) -> list[Finding]:
    """The findings for a run whose ranks did not exchange records. `native`: gloo's or NCCL's own error lines
    found in the job's output (C++ aborts print them; no rank file can)."""
    shapes = shape_findings(states)
    if shapes:
        return shapes  # the refusing rank's error and its peers' lost connections are all this one cause
    ranks = sorted(states)
    crashed = {r: s for r, s in states.items() if s.crashed}
    causes = {r: s for r, s in crashed.items() if not s.raised.peer_lost}
    exited = {r: s for r, s in states.items() if s.outcome is Outcome.EXITED}
    killed = {r: s for r, s in states.items() if s.outcome is None and s.signal not in (None, "SIGTERM")}
    findings: list[Finding] = []

    # A rank that ran out of batches first: what it did next alone (an evaluation) is not the cause. The forwards
    # before the state_dict() calls: an evaluation on rank 0 alone also keeps rank 0 from the others' state_dict()
    # (a DCP save on every rank), which then looks taken on some ranks only.
    # For a sharded model the script's collectives come last: a forward, a gather or a state_dict() on some ranks
    # only is the more exact cause (its all-gathers are what the others' collectives met).
    sharded = (
        ran_out_alone(states)
        or gather_alone(states, native)
        or forward_alone(states)
        or state_dict_alone(states, native)
        or step_skipped_alone(states)
    )
    parting = beacons_parting(states)
    script = beacons_apart(states, parting) if parting is not None else None
    if any(s.sharded for s in states.values()):
        # Ranks that each issued their n-th collective, different ones, and one of them died inside it (gloo aborts
        # a rank whose peer sent another size): they parted there, unless a rank had already done something alone
        # in an earlier step; what the other did after it (a forward the aborted rank never reached) is a
        # consequence. A rank still waiting inside it (a hang) waits for what another rank did alone before it:
        # the sharded cause (a state_dict() on rank 0 alone, before Lightning's broadcast in save_checkpoint).
        parted_first = (
            parting is not None
            and parting.different
            and _died_inside(parting.first)
            and (sharded is None or min(script.steps, default=0) <= min(sharded.steps, default=0))
        )
        mismatch = script if parted_first else (sharded or script)
    else:
        mismatch = script or sharded
    if mismatch is not None:
        findings.append(mismatch)
    findings.extend(crash_findings(states, causes))

    findings.extend(killed_findings(states, killed, mismatch, native))

    if exited and not causes:
        steps_by_rank = {r: max(s.step, 0) for r, s in states.items()}
        still = [r for r in ranks if r not in exited and (states[r].outcome is not Outcome.REPORTED)]
        together = not still and len({steps_by_rank[r] for r in exited}) == 1
        if together:
            # Every rank ended at the same step: the script is just short, or it stopped with a failure status.
            findings.extend(exited_failing(states, exited))
        else:
            for rank, s in sorted(exited.items()):
                if s.phase == Phase.TORN_DOWN.value:
                    continue  # it ended after destroying its process group: no collective is left to wait in for it
                carried, others_count = beside(states, [rank], [*exited])
                labels = {"site": s.exit_site or "", "phase": s.phase}
                if still:
                    labels["trained_on"] = ranks_label(still)
                findings.append(
                    Finding(
                        code=Code.RANK_EXITED,
                        severity="error",
                        ranks=[rank],
                        steps=[steps_by_rank[rank]],
                        sites=lines_of(s.exit_site or ""),
                        measured=[Measure("exit_status", s.exit_status or 0, "value"), others_count],
                        labels=labels,
                        positions=carried,
                        fix="make every rank take the same decision to stop: compute the stopping condition from values "
                        "reduced across ranks (all_reduce a flag), and give every rank the same number of batches.",
                    )
                )

    if not findings and (timeout := timed_out_waiting(states)) is not None:
        findings.append(timeout)
    accounted = set(causes) | set(killed) | set(exited) | set(mismatch.ranks if mismatch else [])
    silent = [r for r in ranks if states[r].outcome is None and r not in accounted and not states[r].ended]
    if not findings and silent and not timed_out:
        findings.append(died_silently(states, silent))
    if not findings or (timed_out and mismatch is None and not causes and not killed and not exited):
        findings.extend(_hung(states, timed_out, native[0] if native else None))
    return findings


def _hung(states: dict[int, RankState], timed_out: bool, native: str | None) -> list[Finding]:
    """`rank-hung` for the ranks furthest behind; `native` is what the communication library said, when it did."""
    waiting = {r: s for r, s in states.items() if s.outcome is None and not s.ended}
    if not waiting:
        return []
    order = {r: (s.step, PHASES.index(s.phase) if s.phase in PHASES else 0) for r, s in waiting.items()}
    behind = min(order.values())
    stuck = sorted(r for r, key in order.items() if key == behind)
    if len(stuck) == len(order) > 1:
        # Same step and phase everywhere (past the observed steps, no phase is published): the ranks that are not in
        # a collective (their own code, a sleep, a DataLoader's next()) are the ones the others wait for; a rank
        # whose position was not sampled (another node's record, published before its sample) is neither, and is
        # named when every sampled rank waits.
        sampled = [r for r in stuck if waiting[r].in_collective or waiting[r].innermost]
        away = [r for r in sampled if not _waits_for_peers(waiting[r])]
        unknown = [r for r in stuck if r not in sampled]
        if 0 < len(away) < len(stuck):
            stuck = away
        elif not away and 0 < len(unknown) < len(stuck):  # the sampled ranks all wait: for the others
            stuck = unknown
    world = max(s.world_size for s in states.values())
    missing = [r for r in range(world) if r not in states]
    labels = {"timed_out": str(timed_out)}
    if missing:
        labels["other_node_ranks"] = ranks_label(missing)
    if native:
        labels["native"] = native
    return [
        Finding(
            code=Code.RANK_HUNG,
            severity="error",
            ranks=stuck,
            steps=sorted({max(states[r].step, 0) for r in stuck}),
            sites=lines_of(*(states[r].user_frame or states[r].site or "" for r in stuck)),
            positions=positions(states, sorted(waiting)),
            measured=[Measure("ranks_waiting", len(waiting), "count")],
            labels=labels,
            fix="look at what the stuck rank does at that line: a collective that only some ranks call, a loop with "
            "a different number of iterations per rank, or a data source that blocks.",
        )
    ]


def _waits_for_peers(s: RankState) -> bool:
    """The rank's main thread was inside a collective: one of the script's (its beacon says so), or DDP's gradient
    all-reduce or another torch.distributed call (its innermost frame), as opposed to its own code, a sleep or a
    DataLoader's next()."""
    inner = s.innermost or ""
    return s.in_collective or any(part in inner for part in ("/torch/autograd/", "/torch/distributed/"))
