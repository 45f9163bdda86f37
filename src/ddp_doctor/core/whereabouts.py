"""Where a rank was when a run that failed ended: the evidence (`Position`, which a failure finding carries in
`positions` and the JSON as ``positions``) and its words (`said`), the one place a rank's position becomes text.
`analyze.positions.position` reads it off the supervisor's `RankState`."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["HOW", "SHOWN", "Position", "capped", "said", "short"]

HOW = ("raised", "in-collective", "died", "sampled", "after", "innermost")
"""How the position was known, most exact first: the rank's own error record (`raised`); its beacon inside a
collective the script or DDP issued (`in-collective`); Python's fault dump at a fatal signal (`died`); the
watchdog's sample of the main thread's user line (`sampled`); the user's line at the last phase change, from the
beacon (`after`); the innermost frame of the last sample, the user's or not (`innermost`)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Position:
    """One rank's position: its step, phase and line (`site`, ``file:line`` or a frame), how it was known (`how`,
    one of `HOW`), the collective it sat in (`collective`, ``all_reduce(float32[4])``) for ``in-collective``,
    `waiting` for where backward waits in DDP's gradient all-reduce (``ddp-backward``: the rank was in its
    backward phase; ``autograd``: its innermost frame was autograd's), `age_s`, for a sampled line, how long
    the rank had been there, and `lost_peer`, for a ``raised`` position, that the error was the rank's lost
    connection to a peer that had failed (not an error of its own)."""

    rank: int
    step: int
    phase: str
    how: str
    site: str | None = None
    collective: str | None = None
    waiting: str | None = None
    age_s: float | None = None
    lost_peer: bool = False

    def __post_init__(self) -> None:
        assert self.how in HOW, f"unknown position kind {self.how!r}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Position:
        return cls(**data)


SHOWN = 8
"""Ranks described one by one in a finding's text and its `positions`; the rest are counted (a 1,024-rank job
stays readable)."""


def capped(parts: list[str], more: int = 0) -> str:
    """``part; part; ...`` for the first `SHOWN` parts, then ``and N other ranks`` for the parts beyond them and
    `more` ranks not among the parts at all."""
    more += max(0, len(parts) - SHOWN)
    return "; ".join(parts[:SHOWN]) + (f"; and {more} other rank{'s' if more > 1 else ''}" if more > 0 else "")


_WAITING = {
    "ddp-backward": ", in DDP's backward (its gradient all-reduce)",
    "autograd": ", inside backward (where DDP's gradient all-reduce runs)",
}


def said(p: Position) -> str:
    """`step 3, backward, at train.py:41`: the position in words."""
    at = p.site or "an unknown place"
    head = f"step {p.step}, {p.phase}"
    if p.how == "raised":
        return f"{head}, at {at}"
    if p.how == "in-collective":
        return f"{head}, inside {p.collective} called at {at}"
    if p.how == "died":
        return f"{head}, at {at} (where it died)"
    waiting = _WAITING.get(p.waiting or "", "")
    if p.how == "sampled":
        age = f" (sampled; there for the last {p.age_s:.1f} s)" if p.age_s and p.age_s > 1 else ""
        return f"{head}{waiting}, at {at}{age}"
    if p.how == "after":
        return f"{head}{waiting}, after {at}"
    return f"{head}{waiting}, at {at}"


def short(site: str | None) -> str:
    """`train.py:12` from a full site (`path/to/train.py:12  code`)."""
    return site.rsplit("/", 1)[-1].split()[0] if site else "an unknown place"
