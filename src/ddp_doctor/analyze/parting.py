"""Where a failed or hung run's ranks parted in their own collective sequences, from each rank's beacon (its last
collectives, and how many the script had issued): one rank waits in a collective another never called, or called
with another op or shape. `collective_order.beacons_apart` words it as `collective-mismatch`; `failures.py` asks
whether a rank's wait ended in its group's error. Pure: the supervisor's `RankState` per rank in."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ddp_doctor.core.rankstate import RankState

__all__ = ["Parting", "beacons_parting", "failed_inside"]


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
    earlier: bool = False
    """Found in the ranks' last collectives before the ones they were in (`RankState.recent`): the ranks went on
    past it, paired with each other's next collectives."""
    sent: bool = False
    """`first` sent a DDP buffer broadcast as its root and went on (`_sent_unmatched`): it did not wait there."""


def beacons_parting(states: dict[int, RankState]) -> Parting | None:
    """The ranks whose script collectives disagree: one rank waits in a collective another rank never called (or
    called with another op or shape), so the other rank's next collective (often DDP's gradient all-reduce) is paired
    with it (or, for a sharded model, its next forward's all-gathers). Judged from each rank's last collective and
    its count of the script's collectives."""
    live = [s for s in states.values() if s.trained]
    aborted = any(s.signal == "SIGABRT" for s in states.values())
    waiting = [
        s
        for s in live
        if s.collective is not None and (s.in_collective or failed_inside(s) or (aborted and _sent_unmatched(s)))
    ]
    if not waiting or len(live) < 2:
        return None
    parted = _recent_parting(live)
    if parted is not None:
        return parted
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
    sent = not first.in_collective and not failed_inside(first)
    return Parting(first, behind, different, sent=sent)


def _sent_unmatched(s: RankState) -> bool:
    """The rank's last collective is a DDP buffer broadcast it sent (rank 0, the root, returns as soon as the data
    is out): when a peer then aborts on a collective of the wrong size, the broadcast it went on from is the one
    that was never matched, whichever unrecorded collective (a gradient bucket's all-reduce, the buckets' rebuild)
    it was in when the group fell apart."""
    return bool(s.collective.ddp_buffers and s.rank == 0 and not s.in_collective)


def _recent_parting(live: list[RankState]) -> Parting | None:
    """The first position at which two ranks' last collectives (`RankState.recent`) hold different ones, before
    the last of either, or at it when every rank whose last it is has left it (an EMA copy's broadcast that a peer's
    training forward took): the ranks paired them and went on. Each rank's state there is its entry there."""
    held = {s.rank: {c.n: c for c in s.recent} for s in live}
    last = min((max(h) for h in held.values() if h), default=0)
    left = all(not s.in_collective for s in live if held[s.rank] and max(held[s.rank]) == last)
    for n in sorted({n for h in held.values() for n in h if n < last or (n == last and left)}):
        at = {s.rank: held[s.rank][n] for s in live if n in held[s.rank]}
        first = min(at)
        odd = [r for r, c in at.items() if (c.op, c.tensor) != (at[first].op, at[first].tensor)]
        if odd and len(at) == len(live):
            by_rank = {s.rank: s for s in live}
            return Parting(
                first=replace(by_rank[first], collective=at[first]),
                behind=[],
                different=[replace(by_rank[r], collective=at[r]) for r in odd],
                earlier=True,
            )
    return None
