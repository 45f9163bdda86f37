"""A rank's state after the run, as the supervisor reads it back from the rank's files (`rankfiles.py` lists them):
`RankState`, the input of the analysis of a run whose ranks could not exchange records (`analyze/failures.py`),
merged by `read_rank_states` from the end record, the beacon, the watchdog's last sample, the fault dump and
torchrun's exit statuses."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ddp_doctor.core.beacon import Beacon, BeaconState, ClosedStep, Collective, read_beacon
from ddp_doctor.core.rankfiles import (
    Outcome,
    RaisedError,
    WrapShapes,
    read_ends,
    read_json,
    read_progress,
    read_wrap,
    wrap_path,
    write_json,
)

__all__ = ["Fault", "RankState", "read_rank_states", "write_other_nodes"]


def _frames(block: str) -> tuple[str, list[tuple[str, int, str]]]:
    return block, [(f, int(n), fn) for f, n, fn in re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)]


@dataclass(kw_only=True)
class Fault:
    """Python's faulthandler dump: the fatal signal and the stack it hit."""

    signal: str
    """SIGSEGV, SIGABRT, SIGBUS, SIGFPE or SIGILL."""
    frames: list[tuple[str, int, str]] = field(default_factory=list)
    """(file, line, function), innermost first."""

    _TITLES: ClassVar[dict[str, str]] = {
        "Segmentation fault": "SIGSEGV",
        "Aborted": "SIGABRT",
        "Bus error": "SIGBUS",
        "Floating-point exception": "SIGFPE",
        "Floating point exception": "SIGFPE",
        "Illegal instruction": "SIGILL",
    }

    @classmethod
    def parse(cls, text: str) -> Fault | None:
        match = re.search(r"Fatal Python error: (.+)", text)
        if match is None:
            return None
        title = match.group(1).strip()
        name = next((v for k, v in cls._TITLES.items() if title.startswith(k)), title)
        # Every thread is dumped, innermost call first. The one that hit the signal ("Current thread") when it ran
        # Python code; else the main thread, the one not started by `threading` (gloo and NCCL abort from threads
        # of their own, with no Python frame, while the main thread waits in the collective).
        blocks = [_frames(b) for b in re.split(r"\n\s*\n", text[match.end() :].strip())]
        current = [f for b, f in blocks if ("Current thread" in b or "Stack (most recent call first)" in b) and f]
        # (A rank born warm runs its main thread inside multiprocessing's `_bootstrap`: only threading's counts.)
        main = [
            f
            for _, f in blocks
            if f and not any(fn == "_bootstrap" and path.endswith("threading.py") for path, _, fn in f)
        ]
        return cls(signal=name, frames=(current or main or [[]])[0])


@dataclass(kw_only=True)
class RankState:
    """Everything the supervisor knows about one rank after the run."""

    rank: int
    world_size: int = 1
    outcome: Outcome | None = None
    """None: the rank left no end record (killed by a signal, or stopped by the launcher or the timeout)."""
    raised: RaisedError | None = None
    exit_status: int | None = None
    exit_site: str | None = None
    step: int = -1
    """The step it was in, exact (the beacon), else the last sample."""
    phase: str = "before DDP was built"
    position_age_s: float | None = None
    """Seconds between the rank's last published position and the end of the run."""
    site: str | None = None
    """The user's line at the last phase change (exact, from the beacon)."""
    user_frame: str | None = None
    """The user's line on the main thread, from the last sample (see `sample_age_s`)."""
    sample_age_s: float | None = None
    innermost: str | None = None
    collective: Collective | None = None
    in_collective: bool = False
    collectives: int = 0
    recent: list[Collective] = field(default_factory=list)
    """Its last collectives, oldest first (`BeaconState.recent`)."""
    signal: str | None = None
    """The signal that ended it, from torchrun's view of the worker (SIGKILL included), when known."""
    fault: Fault | None = None
    models: list[dict[str, Any]] = field(default_factory=list)
    ddp_models: int = 0
    ended: bool = False
    closed: ClosedStep | None = None
    """From the beacon: the last step the rank closed and the trainable parameters that got no gradient in it."""
    wrap: WrapShapes | None = None
    """The parameters of the last DDP model the rank started to build (`rank{R}.wrap.json`)."""
    sharding: dict[str, Any] | None = None
    """The sharding of the FSDP2 model the rank trained (no DDP), from the beacon."""
    forwards: dict[str, int] = field(default_factory=dict)
    """Forwards through that model since its first optimizer step, by the user's line, from the beacon."""
    forward_first: dict[str, list[Any]] = field(default_factory=dict)
    """Each such line's first step and grad mode (`BeaconState.forward_first`), from the beacon."""
    fully_shard: dict[str, Any] | None = None
    """The script's `fully_shard` calls (`calls`, `site`, the first mixed-precision `policy`), from the beacon."""
    train_loader: dict[str, Any] | None = None
    """The loader that model's last step trained on (`site`, `batches`), from the beacon."""
    state_dicts: dict[str, int] = field(default_factory=dict)
    """`state_dict()` calls on that model since then, by the user's line, from the beacon."""
    gathers: dict[str, int] = field(default_factory=dict)
    """Gathers of sharded tensors in full since then, by `call at file:line`, from the beacon."""
    backend: str | None = None
    """That model's process group backend, from the beacon."""
    framework: str | None = None
    """The training framework that steps that model's optimizer, from the beacon."""

    @property
    def sharded(self) -> bool:
        return self.sharding is not None

    @property
    def crashed(self) -> bool:
        """The script raised on this rank (before the observed steps' report, or after it, as under `watch`)."""
        return self.outcome in (Outcome.CRASHED, Outcome.CRASHED_AFTER_REPORT) and self.raised is not None

    @property
    def built_ddp(self) -> bool:
        return self.ddp_models > 0

    @property
    def trained(self) -> bool:
        """The rank built a DDP model or trains a sharded one: a run whose failure gets a report."""
        return self.built_ddp or self.sharded


def write_other_nodes(folder: Path, records: dict[str, Any]) -> None:
    """Write other nodes' ranks' records, by file name, in `folder`'s "nodes" (read by `read_rank_states`): a
    beacon's state (`rank{R}.beacon`), or an end record or sample as a dict or as the JSON text it was written as."""
    out = folder / "nodes"
    out.mkdir(exist_ok=True)
    for name, record in records.items():
        if name.endswith(".beacon"):
            Beacon(out / name, BeaconState.from_dict(record))
        elif isinstance(record, str):
            (out / name).write_text(record)
        else:
            write_json(out / name, record)


def read_rank_states(folder: Path, *, end_time: float) -> dict[int, RankState]:
    """Merge each rank's files (end record, beacon, sampled progress, fault dump, torchrun's exit statuses), with
    the other nodes' ranks' records in the folder's "nodes" (`launch/peer_ends.py`, `launch/watch_nodes.py`) for
    the ranks the folder has no files of."""
    own = _read_states(folder, end_time=end_time)
    others = folder / "nodes"
    if not others.is_dir():
        return own
    return dict(sorted({**_read_states(others, end_time=end_time), **own}.items()))


def _read_states(folder: Path, *, end_time: float) -> dict[int, RankState]:
    ends = read_ends(folder)
    progress = {s.rank: s for p in folder.glob("rank*.progress.json") if (s := read_progress(p)) is not None}
    beacons: dict[int, BeaconState] = {
        int(p.name[4 : -len(".beacon")]): b for p in folder.glob("rank*.beacon") if (b := read_beacon(p)) is not None
    }
    failures = (read_json(folder / "torchrun.json") or {}).get("failures", {})
    states: dict[int, RankState] = {}
    for rank in sorted(set(ends) | set(progress) | set(beacons)):
        end, prog, beacon = ends.get(rank), progress.get(rank), beacons.get(rank)
        world = (end.world_size if end else 0) or (prog.world_size if prog else 0) or 1
        state = RankState(rank=rank, world_size=world)
        if end is not None:
            state.outcome, state.raised = end.outcome, end.raised
            if end.outcome is Outcome.EXITED:
                state.exit_status, state.exit_site = end.status, end.site
        state.models = (end.models if end else []) or (prog.models if prog else [])
        state.ddp_models = max(end.ddp_models if end else 0, prog.ddp_models if prog else 0)
        if prog is not None:
            state.ended, state.step, state.phase = prog.ended, prog.step, prog.phase
            state.user_frame, state.innermost = prog.user_frame, prog.innermost
            if prog.time:
                state.sample_age_s = max(0.0, end_time - prog.time)
        if beacon is not None:
            state.step, state.phase, state.site, state.closed = beacon.step, beacon.phase, beacon.site, beacon.closed
            state.position_age_s = max(0.0, end_time - (beacon.time or end_time))
            state.in_collective, state.collectives = beacon.in_collective, beacon.collectives
            state.collective = beacon.collective
            state.recent = list(beacon.recent)
            state.sharding, state.forwards, state.backend = beacon.sharding, beacon.forwards, beacon.backend
            state.forward_first = beacon.forward_first
            state.framework = beacon.framework
            state.gathers, state.state_dicts = beacon.gathers, beacon.state_dicts
            state.train_loader, state.fully_shard = beacon.train_loader, beacon.fully_shard
        failure = failures.get(str(rank))
        if failure is not None:
            state.signal = failure.get("signal")
        state.wrap = read_wrap(wrap_path(folder, rank))
        fault_path = folder / f"rank{rank}.fault"
        if fault_path.exists():
            state.fault = Fault.parse(fault_path.read_text(errors="replace"))
            if state.fault is not None and state.signal is None:
                state.signal = state.fault.signal
        states[rank] = state
    return states
