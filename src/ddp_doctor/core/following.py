"""What following a script through its epoch ends saw (`check --follow-epochs`): each rank's local record, and the
part of the report every rank agrees on. Plain data; `observation/following_watch.py` fills the record,
`exchange/following_rounds.py` reduces it, `analyze/following_ends.py` reads the result."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["AloneSpan", "FollowRecord", "FollowSummary", "Following", "JoinedLoop", "LoaderSeen", "SyncPoint"]

MAX_SYNC_POINTS = 1024
"""Sync points a rank keeps while following; later ones are counted, not timed."""
COUNTED_PASSES = 4
"""Passes of each loader whose batches are counted per rank and compared across ranks."""


@dataclass(frozen=True, slots=True)
class JoinedLoop:
    """The script's training loop runs inside a `Join` over its DDP model: its uneven inputs are handled."""

    site: str
    """Where the script entered the Join."""
    throws: bool = False
    """throw_on_early_termination=True: once a rank runs out, every rank ends the loop there (no shadowing)."""


@dataclass(kw_only=True, slots=True)
class SyncPoint:
    """A point where every rank of the world must meet: one of the script's collectives, a buffer broadcast in
    DDP's forward, DDP's gradient all-reduce (a synced backward before an optimizer step), or the end of
    following. Times are this rank's `time.perf_counter()`."""

    kind: str
    """"collective", "ddp-broadcast", "ddp-step" or "end"."""
    what: str
    site: str | None
    enter: float
    exit: float


@dataclass(kw_only=True, slots=True)
class LoaderSeen:
    """A DataLoader the script iterated, by its creation line: its real length on this rank and its passes."""

    key: str
    site: str | None
    batches: int | None
    """`len(loader)` on this rank (None: an iterable dataset without a length)."""
    passes: int = 0
    most: int = 0
    """The most batches one pass handed out."""
    capped: int = 0
    """Passes ended at the cap (or at the end of the observed steps)."""
    training: bool = False
    """An optimizer step was taken on one of its batches."""
    sampler: str | None = None
    ordinal: int = 1
    """Its order among the loaders built together at its line (#2: the second built there)."""
    counted: list[int] = field(default_factory=list)
    """Its first `COUNTED_PASSES` passes: the batches each handed out when it ran to its real end, -1 for a pass
    the check capped (or the loop left early)."""
    floors: list[int] = field(default_factory=list)
    """The batches each of those passes handed out, run to its end or not (a lower bound of its real count)."""


@dataclass(kw_only=True)
class FollowRecord:
    """One rank's record of the epoch following (local)."""

    requested: int
    limit: int
    followed: bool
    """Following started."""
    declined: bool = False
    """The observed steps ended but trained on no DataLoader pass (a step-based loop): nothing was followed."""
    epoch_ends: int = 0
    ended_by: str = ""
    seconds: float = 0.0
    syncs: list[SyncPoint] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    """Sync points by kind, including those beyond `MAX_SYNC_POINTS`."""
    passes: list[dict[str, Any]] = field(default_factory=list)
    """The passes started while following: site, started, ended, yielded, capped, batches (real length)."""
    loaders: list[LoaderSeen] = field(default_factory=list)
    extra_broadcast_sites: list[str] = field(default_factory=list)
    """Lines of DDP forwards without autograd that broadcast buffers while following (an evaluation through the
    wrapper): the ranks that run them alone issue a collective the others do not."""
    timeout_s: float | None = None
    """The default process group's timeout (None: unknown)."""
    started_at: float = 0.0
    files: list[dict[str, Any]] = field(default_factory=list)
    """The files the script wrote under the check, from launch on: `path` (absolute), `shown`, `site`, `how`
    (`torch.save` or `open()`), `existed` (it was there before: overwritten or appended to)."""


@dataclass(kw_only=True, slots=True)
class AloneSpan:
    """The longest time one rank worked alone while the others waited for it at a sync point."""

    rank: int
    measured_s: float
    """How much longer than the slowest other rank it took to reach the sync point, as measured (capped loaders)."""
    projected_s: float | None
    """The same with each capped pass in the span run to its real length (None: a loader has no length)."""
    start: str
    """Where the span starts: the sync point before it."""
    end: str
    """Where it ends: the sync point the others waited in."""
    passes: list[str] = field(default_factory=list)
    """The capped passes inside the span: `file:line: 2 of 400 batches, 0.31 s`."""


@dataclass(kw_only=True)
class FollowSummary:
    """What every rank agrees on after following (the exchange's result)."""

    followed: bool
    declined: bool
    """Some rank ended its observed steps outside a DataLoader pass (`FollowRecord.declined`)."""
    epoch_ends: int
    """The fewest epoch ends any rank reached."""
    ended_by: str
    seconds: float
    loaders: list[dict[str, Any]]
    counts: dict[str, tuple[int, int]]
    """Sync points by kind: (most, fewest) over the ranks."""
    more_ranks: list[int] = field(default_factory=list)
    """Ranks with more sync points than the fewest (up to 8), when the counts differ."""
    extra_sites: list[str] = field(default_factory=list)
    """The lines of the extra broadcasting forwards on the first of `more_ranks`."""
    lone_broadcasts: bool = False
    """The counts agree, but `more_ranks` broadcast buffers in a forward without autograd that the others did not
    run (`FollowRecord.extra_broadcast_sites`)."""
    alone: AloneSpan | None = None
    timeout_s: float | None = None
    files: list[dict[str, Any]] = field(default_factory=list)
    """The files any rank wrote (`FollowRecord.files`), each with `ranks` (the lowest 8 that wrote it) and
    `more_ranks`."""
    files_unlisted: int = 0
    """Ranks whose files are not listed (beyond the 9 listings exchanged)."""
    repeated_epoch: dict[str, Any] | None = None
    """A shuffling DistributedSampler of a training loader that started a pass with the epoch of its last one on
    some rank (`epoch`, the loader's `site`, the epochs `seen`). Filled on the path without DDP after the exchange
    (`launch/plain_steps.py`); DDP's observed steps record it themselves (`analyze/epochs.py`)."""


@dataclass(kw_only=True)
class Following:
    """The report's `following` section: what `check` followed after the observed steps."""

    epochs: int
    """Epoch ends asked for (`--follow-epochs`)."""
    limit_batches: int
    epoch_ends: int
    """Epoch ends reached."""
    ended_by: str
    seconds: float
    loaders: list[dict[str, Any]]
    """Each loader: `site`, `batches` (real length: `min`, `max`, and `by_rank` for the first ranks), `passes`,
    `most` (batches of its longest pass), `capped`, `training`."""
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Following:
        return cls(**data)
