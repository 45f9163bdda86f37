"""Where a rank was when a run that could not exchange records ended, in words: its step, phase and line, the
collective it waited in, the native frame it died in, and the others' positions beside the rank that failed.

Pure: reads the supervisor's `RankState` per rank (the ranks' own files, merged); the failure findings
(`analyze/failures.py`, `analyze/crashed_ranks.py`) quote it.
"""

from __future__ import annotations

from ddp_doctor.core.findings import Measure
from ddp_doctor.core.frames import format_site
from ddp_doctor.core.rankstate import RankState
from ddp_doctor.core.whereabouts import SHOWN, Position, capped, said, short

__all__ = [
    "SHOWN",
    "beside",
    "capped",
    "fault_frame",
    "fault_site",
    "others_ranks",
    "position",
    "positions",
    "short",
    "where",
]

_DDP_INIT = ("torch/nn/parallel/distributed.py", "__init__")


def position(rank: int, s: RankState) -> Position:
    """Where the rank was, from its most exact record (`core.whereabouts.HOW`)."""
    if s.raised is not None:
        # A crashed rank's own record is exact; its last sample may show the doctor's exit path.
        return Position(
            rank=rank,
            step=max(s.raised.step, 0),
            phase=s.raised.phase,
            how="raised",
            site=s.raised.site,
            lost_peer=s.raised.peer_lost,
        )
    step = max(s.step, 0)
    if s.in_collective and s.collective is not None:
        c = s.collective
        return Position(rank=rank, step=step, phase=s.phase, how="in-collective", site=c.site, collective=c.describe())
    died_at = fault_site(s)
    if died_at is not None:
        # Python's fault dump at the fatal signal (an abort, a segfault): exact, where a sample may be stale.
        return Position(rank=rank, step=step, phase=s.phase, how="died", site=died_at)
    waiting = "ddp-backward" if s.phase == "backward" else None
    if not waiting and s.innermost and "/torch/autograd/" in s.innermost:
        waiting = "autograd"
    # The watchdog's sample of the user's line is newer than the last phase change only when the rank sat still
    # (a hang); otherwise the line published at the last phase change is the better one.
    sample_newer = s.user_frame is not None and (
        s.site is None
        or s.position_age_s is None
        or (s.sample_age_s is not None and s.sample_age_s <= s.position_age_s)
    )
    if sample_newer:
        return Position(
            rank=rank, step=step, phase=s.phase, how="sampled", site=s.user_frame, waiting=waiting, age_s=s.sample_age_s
        )
    if s.site:
        return Position(rank=rank, step=step, phase=s.phase, how="after", site=s.site, waiting=waiting)
    return Position(rank=rank, step=step, phase=s.phase, how="innermost", site=s.innermost, waiting=waiting)


def positions(states: dict[int, RankState], ranks: list[int]) -> list[Position]:
    """The positions of the first `SHOWN` of `ranks` that have a state: the ones a finding's words describe."""
    return [position(r, states[r]) for r in ranks if r in states][:SHOWN]


def where(s: RankState) -> str:
    """`step 3, backward, at train.py:41`: where the rank was, from its most exact record, in words."""
    return said(position(s.rank, s))


def fault_frame(s: RankState) -> str:
    """The frame a fatal signal struck, from the fault dump: `DistributedDataParallel.__init__` when DDP's
    constructor is among its innermost three, else `fn (file.py)`; ``""`` without a dump."""
    if s.fault is None or not s.fault.frames:
        return ""
    inner_file, _, inner_fn = s.fault.frames[0]
    if any(inner_file.endswith(_DDP_INIT[0]) and fn == _DDP_INIT[1] for inner_file, _, fn in s.fault.frames[:3]):
        return "DistributedDataParallel.__init__"
    return f"{inner_fn} ({inner_file.rsplit('/', 1)[-1]})"


def fault_site(s: RankState) -> str | None:
    """The user's innermost line in the rank's fault dump (`file:line`, relative to the working folder)."""
    frames = s.fault.frames if s.fault is not None else []
    return next(
        (
            format_site(f, n)
            for f, n, _ in frames
            if "/site-packages/" not in f and "/lib/python" not in f and "ddp_doctor" not in f
        ),
        None,
    )


def others_ranks(states: dict[int, RankState], culprits: list[int]) -> list[int]:
    """The ranks other than `culprits` that `others` describes: the ones that lost their peer, and the ones still
    running."""
    return [
        r for r, s in sorted(states.items()) if r not in culprits and (s.crashed or (s.outcome is None and not s.ended))
    ]


def beside(states: dict[int, RankState], ranks: list[int], culprits: list[int]) -> tuple[list[Position], Measure]:
    """What a failure finding about `ranks` carries of where the ranks were: the positions of the first `SHOWN` of
    `ranks`, then those of the first `SHOWN` others (`others_ranks` of `culprits`), and how many others there are
    (measured `other_ranks`), for the report's words of what the others did."""
    rest = others_ranks(states, culprits)
    return [*positions(states, ranks), *positions(states, rest)], Measure("other_ranks", len(rest), "count")
