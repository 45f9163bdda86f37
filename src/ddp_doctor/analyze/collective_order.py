"""The ranks issue the same collectives in the same order: every `collective-mismatch` whose evidence is the ranks'
sequences of collectives, whatever the source of the facts. The finding and its words are made here, from what each
source found where its facts are reduced (the exchange's per-step digests, the following's counts, the dumps), and
from a failed run's beacons, whose parting (`Parting`) is found here too:

- a step that completed: each step's count and running digest of the calls through torch.distributed, DDP's and a
  sharded model's alike (`collective_sequence_mismatch`, `sequences_apart`);
- the epoch end the check followed: the ranks' counts of collectives there (`followed_apart`);
- a run that failed or hung: each rank's beacon, its last collective and how many it had issued (`beacons_parting`,
  `beacons_apart`);
- PyTorch's Flight Recorder dumps of a job that never ran under the doctor (`dumps_apart`).

DDP's own collectives counted by their mechanism (extra synced passes, a forward in grad mode without a backward, a
buffer broadcast from a forward without grad) are `consistency.py`'s. Pure: plain data in, `Finding`s out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddp_doctor.analyze.positions import capped, short, where
from ddp_doctor.analyze.view import View, detects
from ddp_doctor.core.codes import Code
from ddp_doctor.core.findings import Finding, lines_of
from ddp_doctor.core.following import FollowSummary
from ddp_doctor.core.fr_dumps import FrDump, FrEntry
from ddp_doctor.core.ranks import rank_list
from ddp_doctor.core.rankstate import RankState

__all__ = [
    "Parting",
    "beacons_apart",
    "beacons_parting",
    "collective_sequence_mismatch",
    "dumps_apart",
    "failed_inside",
    "followed_apart",
    "sequences_apart",
]


@detects(Code.COLLECTIVE_MISMATCH)
def collective_sequence_mismatch(v: View) -> list[Finding]:
    """Ranks whose own collectives (the script's `torch.distributed` calls) differed in a step that still completed:
    a different op, shape or reduction at the same position, or a different count. Compared through each step's
    count and running digest; the logged calls of group rank 0 and of the example ranks that differ from it name
    the first difference. (A mismatch that aborts or hangs the job is named from the ranks' beacons instead:
    `beacons_apart`.)"""
    if v.world < 2 or not v.steps:
        return []
    hi, lo = v.summary.collectives
    bad = [s for s in range(v.steps) if bool((hi[s] != lo[s]).any())]
    if not bad:
        return []
    first = bad[0]
    odd = v.ranks("collective-differs")
    calls = {r: v.meta(r)["collective_log"] for r in [0, *odd.ranks]}  # the exchange kept that step's calls
    counts = sorted({int(lo[first][0]), int(hi[first][0])})
    return [sequences_apart(step=first, calls=calls, odd=odd.ranks, more=odd.more, counts=counts, also=bad[1:])]


def sequences_apart(
    *,
    step: int,
    calls: dict[int, list[str]],
    odd: list[int],
    more: int = 0,
    counts: list[int] = (),
    also: list[int] = (),
) -> Finding:
    """`collective-mismatch` in a step that completed, for every parallelism: the collectives of `step` called through
    torch.distributed (the script's; FSDP2's and `replicate`'s too) were not the same sequence on every rank. `odd` are the ranks whose sequence differs from the reference rank's
    (the lowest few; `more` others); `calls` maps the reference rank (first) and some of `odd` to their calls of the
    step, in order (`all_reduce(float32[1], MAX)/2 at train.py:118`, the first few); `counts` the lowest and highest
    number of calls, `also` later steps that differed too."""
    reference = next(iter(calls))
    signatures = [[c.rsplit(" at ", 1)[0] for c in log] for log in calls.values()]
    position = next(
        (
            i
            for i in range(max((len(s) for s in signatures), default=0))
            if len({s[i] if i < len(s) else None for s in signatures}) > 1
        ),
        None,
    )
    if position is None:
        where = "the calls beyond the logged ones differ"
    else:
        shown = []
        for r, log in list(calls.items())[:4]:
            call = log[position] if position < len(log) else None
            shown.append(
                f"rank {r} called {call.replace('/', ' over a group of ', 1)}"
                if call
                else f"rank {r} called nothing more"
            )
        where = f"at its collective #{position + 1} of the step, " + "; ".join(shown)
    differ = len(odd) + more
    return Finding(
        code=Code.COLLECTIVE_MISMATCH,
        severity="error",
        title=f"the ranks issued different collectives in step {step} ({rank_list(odd, more=more)} "
        f"differ{'s' if differ == 1 else ''} from rank {reference})",
        detail=f"In step {step} the collectives called through torch.distributed (the script's, and FSDP2's for a "
        f"sharded model) were not the same on every rank: {where}. "
        + (f"The ranks issued {' to '.join(map(str, counts))} collectives in that step. " if len(counts) > 1 else "")
        + "Collectives pair up by position, so each rank combined a different tensor or reduction than it "
        "meant to, silently, or waits for a peer that never comes."
        + (f" Also in step(s) {list(also)}." if also else ""),
        params=[],
        sites=lines_of(*(log[position] for log in calls.values() if position is not None and position < len(log))),
        ranks=sorted({reference, *odd}),
        steps=[step, *also],
        more_ranks=more,
        fix="make every rank of the group call the same collectives, in the same order, with the same dtype, shape "
        "and reduction: compute rank-dependent choices (which metric, which op) from values agreed across ranks "
        "first.",
    )


def followed_apart(s: FollowSummary) -> list[Finding]:
    """`collective-mismatch` at the epoch end the check followed: the ranks' counts of the script's collectives,
    DDP's buffer broadcasts or its synced backward passes differed, or some ranks broadcast DDP's buffers from a
    forward without grad that the others did not run."""
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
            code=Code.COLLECTIVE_MISMATCH,
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
        code=Code.COLLECTIVE_MISMATCH,
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


def dumps_apart(
    group: str,
    seq: int,
    kinds: dict[tuple[str, Any], list[int]],
    seqs: dict[int, dict[int, FrEntry]],
    dumps: dict[int, FrDump],
) -> Finding:
    """`collective-mismatch` from Flight Recorder dumps: at sequence number `seq` of `group`, the ranks in each of
    `kinds` issued that op and size (or none)."""
    sides = []
    for (op, _), ranks in sorted(kinds.items(), key=lambda kv: (kv[0][0] == "none", kv[1])):
        if op == "none":
            last = [max(seqs[r]) for r in ranks]
            sides.append(f"{rank_list(ranks)} issued none (its last was #{max(last)})")
        else:
            e = seqs[ranks[0]][seq]
            sides.append(f"{rank_list(ranks)} issued {e.describe()} at {e.line or 'an unknown line'}")
    named = sorted(r for ranks in kinds.values() for r in ranks)
    name = "the default group" if group == "0" else f"process group {group}"
    members = next((d.group_ranks.get(group) for d in dumps.values() if d.group_ranks.get(group)), [])
    missing = [r for r in members if r not in dumps]
    start = max(min(s) for s in seqs.values())
    return Finding(
        code=Code.COLLECTIVE_MISMATCH,
        severity="error",
        title=f"at collective #{seq} of {name}, " + " where ".join(sides),
        detail=(
            f"Flight Recorder dumps of {rank_list(sorted(dumps))}: at collective #{seq} of {name}, "
            + "; ".join(sides)
            + f". Every earlier collective of the group in the dumps (from #{start}) matched on every rank."
            + (f" {rank_list(missing)} left no dump." if missing else "")
        ),
        ranks=named,
        fix="make every rank of the group call the same collectives in the same order: a collective inside a "
        "rank-dependent branch (a save or an evaluation on rank 0) must move out of it, or be called on every rank.",
    )


def failed_inside(s: RankState) -> bool:
    """The rank's wait in its last collective ended in an error of the group (a timeout, a closed connection)
    raised at that collective's line: it waited there as long as the group let it."""
    c, raised = s.collective, s.raised
    return bool(
        raised is not None and raised.peer_lost and c is not None and c.site and (raised.site or "").startswith(c.site)
    )


@dataclass(frozen=True, slots=True)
class Parting:
    """Where the ranks' own collective sequences parted, from their beacons: `first` waited (or failed) in its
    collective `first.collective`; `behind` never called one at that position; `different` called another op or
    shape there."""

    first: RankState
    behind: list[RankState]
    different: list[RankState]


def beacons_parting(states: dict[int, RankState]) -> Parting | None:
    """The ranks whose script collectives disagree: one rank waits in a collective another rank never called (or
    called with another op or shape), so the other rank's next collective (often DDP's gradient all-reduce) is paired
    with it (or, for a sharded model, its next forward's all-gathers). Judged from each rank's last collective and
    its count of the script's collectives."""
    live = [s for s in states.values() if s.trained]
    waiting = [s for s in live if s.collective is not None and (s.in_collective or failed_inside(s))]
    if not waiting or len(live) < 2:
        return None
    first = min(waiting, key=lambda s: (s.collective.n, s.rank))
    c = first.collective
    peers = [s for s in live if s.rank != first.rank]
    behind = [s for s in peers if s.collectives < c.n]
    # A rank still waiting in, or already past, its collective at the same position with another op or shape
    # (the sender of a broadcast returns at once; the receiver of the wrong size aborts).
    different = [
        s
        for s in peers
        if s.collective is not None
        and s.collective.n == c.n
        and (s.collective.op, s.collective.tensor) != (c.op, c.tensor)
    ]
    if not behind and not different:
        return None
    return Parting(first, behind, different)


def beacons_apart(states: dict[int, RankState], parting: Parting) -> Finding:
    """`collective-mismatch` of a failed run, at `parting`."""
    first, behind, different = parting.first, parting.behind, parting.different
    c = first.collective
    parts = [
        (
            f"rank {first.rank} called {c.describe()} at {c.site or 'an unknown place'} in step "
            # (no doctor counts a sharded model's steps when the collective starts: the rank's own count, where it
            # still waits)
            f"{c.step if c.step is not None else max(first.step, 0)} (its collective #{c.n}) and waited there"
        )
    ]
    for s in behind:
        parts.append(
            f"rank {s.rank} never called it: it had issued {s.collectives} of the script's collectives and "
            f"went on to {where(s)}"
            + (
                "; the sharded model's next collectives on that rank (the all-gathers of its forward) wait for it"
                if s.sharded and not s.in_collective
                else "; DDP's next gradient all-reduce on that rank was paired with it"
                if s.phase in ("backward", "after backward") or not s.in_collective
                else ""
            )
        )
    for s in different:
        o = s.collective
        parts.append(f"rank {s.rank} called {o.describe()} at {o.site or 'an unknown place'} at the same position")
    culprits = sorted({s.rank for s in (*behind, *different)})
    signals = [f"rank {s.rank} died of {s.signal}" for s in states.values() if s.signal in ("SIGABRT", "SIGSEGV")]
    return Finding(
        code=Code.COLLECTIVE_MISMATCH,
        severity="error",
        title=(
            f"{rank_list(culprits)} skipped {c.op} ({short(c.site)}) that rank {first.rank} called"
            if behind and not different
            else f"ranks called different collectives at position {c.n}: {c.describe()} on rank {first.rank}"
        ),
        detail=capped(parts)
        + "."
        + (f" {capped(signals)} (gloo aborts a process whose peer issued a different collective)." if signals else ""),
        ranks=sorted({first.rank, *culprits}),
        steps=sorted({max(s.step, 0) for s in (first, *behind, *different)}),
        sites=lines_of(
            c.site or "", *(s.collective.site or "" for s in different), *(s.user_frame or "" for s in behind)
        ),
        fix=(
            f"give {c.op} at {c.site or 'that line'} the same dtype and shape on every rank: agree on the size "
            "first (all_reduce the length, or broadcast_object_list), then pad or slice to it."
            if different and all(s.collective.op == c.op for s in different) and not behind
            else f"make every rank of the group call the same collectives in the same order: move {c.op} at "
            f"{c.site or 'that line'} out of the rank-dependent branch (compute the condition on every rank, "
            f"or all_reduce a flag first), or call it on every rank."
        ),
    )
