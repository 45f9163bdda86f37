"""Where a rank was when a run that could not exchange records ended, in words: its step, phase and line, the
collective it waited in, the native frame it died in, and the others' positions beside the rank that failed.

Pure: reads the supervisor's `RankState` per rank (the ranks' own files, merged); the failure findings
(`analyze/failures.py`, `analyze/crashed_ranks.py`) quote it.
"""

from __future__ import annotations

from ddp_doctor.core.frames import format_site
from ddp_doctor.core.rankstate import RankState
from ddp_doctor.core.whereabouts import SHOWN, Position, capped, said

__all__ = ["SHOWN", "capped", "fault_place", "others", "others_ranks", "position", "positions", "short", "where"]

_DDP_INIT = ("torch/nn/parallel/distributed.py", "__init__")


def position(rank: int, s: RankState) -> Position:
    """Where the rank was, from its most exact record (`core.whereabouts.HOW`)."""
    if s.raised is not None:
        # A crashed rank's own record is exact; its last sample may show the doctor's exit path.
        return Position(rank=rank, step=max(s.raised.step, 0), phase=s.raised.phase, how="raised", site=s.raised.site)
    step = max(s.step, 0)
    if s.in_collective and s.collective is not None:
        c = s.collective
        return Position(rank=rank, step=step, phase=s.phase, how="in-collective", site=c.site, collective=c.describe())
    died_at = _fault_user_site(s)
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


def short(site: str | None) -> str:
    """`train.py:12` from a full site."""
    return site.rsplit("/", 1)[-1].split()[0] if site else "an unknown place"


def fault_place(s: RankState) -> str:
    """`in DistributedDataParallel.__init__ at train.py:12` from the fault dump."""
    if s.fault is None or not s.fault.frames:
        return ""
    inner_file, _, inner_fn = s.fault.frames[0]
    if any(inner_file.endswith(_DDP_INIT[0]) and fn == _DDP_INIT[1] for inner_file, _, fn in s.fault.frames[:3]):
        place = "in DistributedDataParallel.__init__"
    else:
        place = f"in {inner_fn} ({inner_file.rsplit('/', 1)[-1]})"
    user = _fault_user_site(s)
    return place + (f" at {user}" if user else "")


def _fault_user_site(s: RankState) -> str | None:
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


def others(states: dict[int, RankState], culprits: list[int]) -> str:
    """Where the ranks other than `culprits` were: the ones that lost their peer, and the ones still running."""
    parts = []
    for r in others_ranks(states, culprits):
        s = states[r]
        if s.crashed:
            c = s.raised
            parts.append(
                f"rank {r} lost its peer at step {max(c.step, 0)}, {c.phase}, at {c.site or 'an unknown place'}"
            )
        else:
            parts.append(f"rank {r} was at {where(s)}")
    return capped(parts)
