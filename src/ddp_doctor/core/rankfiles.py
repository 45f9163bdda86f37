"""What a rank leaves in the node's output folder, typed once for both sides.

The rank side (`session.py`) writes these files; the supervisor (`outcome.py`) reads them into `RankState`, the
input of `analyze.failures`. Files, not a collective, because a rank that failed alone cannot count on the others.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar

from ddp_doctor.core.beacon import read_beacon
from ddp_doctor.core.phase import Phase

__all__ = ["PHASES", "Collective", "Crash", "Fault", "Outcome", "RankState", "read_rank_states"]

PHASES = tuple(p.value for p in Phase)
"""The phases a rank reports, in the order they happen within a step (`ddp_doctor.doctor.Phase`)."""


class Outcome(str, Enum):
    """How a rank ended, as written in `rank{R}.json`."""

    REPORTED = "reported"
    """The ranks exchanged records and the report was written."""
    CRASHED = "crashed"
    """The script raised."""
    CRASHED_AFTER_REPORT = "crashed-after-report"
    """The script raised after the report (in `bench`'s timed steps)."""
    EXITED = "exited"
    """The script returned or called `sys.exit` (any status) before the exchange."""
    NO_EXCHANGE = "no-exchange"
    """The rank tried to exchange records and the others did not come."""
    INTERNAL_ERROR = "internal-error"
    """ddp-doctor itself failed on the rank (a bug in the tool, not in the script)."""


@dataclass(kw_only=True)
class Crash:
    type: str
    message: str
    traceback: str = ""
    site: str | None = None
    step: int = -1
    explained: dict[str, Any] | None = None
    peer_lost: bool = False
    phase: str = "?"


@dataclass(kw_only=True)
class Collective:
    """The last collective the script entered on a rank (DDP's own gradient all-reduces are not among them)."""

    op: str
    n: int
    """Its position in the rank's sequence of the script's collectives (1-based)."""
    site: str | None = None
    tensor: str | None = None
    step: int | None = None
    phase: str | None = None
    group_size: int | None = None

    def describe(self) -> str:
        return f"{self.op}({self.tensor})" if self.tensor else self.op


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
        # The thread that hit the signal is listed first ("Current thread ..."), innermost call first.
        block = re.split(r"\n\s*\n", text[match.end() :].strip() + "\n\n", maxsplit=2)
        current = next(
            (b for b in block if "Current thread" in b or "Stack (most recent call first)" in b),
            block[0] if block else "",
        )
        frames = [(f, int(n), fn) for f, n, fn in re.findall(r'File "([^"]+)", line (\d+) in (\S+)', current)]
        return cls(signal=name, frames=frames)


@dataclass(kw_only=True)
class RankState:
    """Everything the supervisor knows about one rank after the run."""

    rank: int
    world_size: int = 1
    outcome: Outcome | None = None
    """None: the rank left no end record (killed by a signal, or stopped by the launcher or the timeout)."""
    crash: Crash | None = None
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
    signal: str | None = None
    """The signal that ended it, from torchrun's view of the worker (SIGKILL included), when known."""
    fault: Fault | None = None
    models: list[dict[str, Any]] = field(default_factory=list)
    ddp_models: int = 0
    ended: bool = False
    closed: dict[str, Any] | None = None
    """From the beacon: `{"step": S, "missing": [...]}`, the last step the rank closed and the trainable parameters
    that got no gradient in it (at most 16 names)."""

    @property
    def built_ddp(self) -> bool:
        return self.ddp_models > 0


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_rank_states(folder: Path, *, end_time: float) -> dict[int, RankState]:
    """Merge each rank's files (end record, beacon, sampled progress, fault dump, torchrun's exit statuses)."""
    ends = {
        d["rank"]: d
        for p in folder.glob("rank*.json")
        if not p.name.endswith(".progress.json")
        if (d := _read(p)) is not None
    }
    progress = {d["rank"]: d for p in folder.glob("rank*.progress.json") if (d := _read(p)) is not None}
    beacons = {
        int(p.name[4 : -len(".beacon")]): b for p in folder.glob("rank*.beacon") if (b := read_beacon(p)) is not None
    }
    failures = (_read(folder / "torchrun.json") or {}).get("failures", {})
    states: dict[int, RankState] = {}
    for rank in sorted(set(ends) | set(progress) | set(beacons)):
        end, prog, beacon = ends.get(rank, {}), progress.get(rank, {}), beacons.get(rank)
        state = RankState(rank=rank, world_size=int(end.get("world_size") or prog.get("world_size") or 1))
        if end.get("outcome"):
            state.outcome = Outcome(end["outcome"])
        if end.get("crash"):
            crash = end["crash"]
            state.crash = Crash(**{k: crash[k] for k in Crash.__dataclass_fields__ if k in crash})
        if state.outcome is Outcome.EXITED:
            state.exit_status, state.exit_site = end.get("status"), end.get("site")
        state.models = end.get("models") or prog.get("models") or []
        state.ddp_models = max(end.get("ddp_models", 0) or 0, prog.get("ddp_models", 0) or 0)
        state.ended = bool(prog.get("ended"))
        state.step = prog.get("step", -1)
        state.phase = prog.get("phase", state.phase)
        state.user_frame, state.innermost = prog.get("user_frame"), prog.get("innermost")
        if prog.get("time"):
            state.sample_age_s = max(0.0, end_time - prog["time"])
        if beacon is not None:
            state.step, state.phase = beacon.get("step", state.step), beacon.get("phase", state.phase)
            state.site = beacon.get("site")
            state.closed = beacon.get("closed")
            state.position_age_s = max(0.0, end_time - beacon.get("time", end_time))
            state.in_collective = bool(beacon.get("in_collective"))
            state.collectives = int(beacon.get("collectives", 0))
            if beacon.get("collective"):
                c = beacon["collective"]
                state.collective = Collective(**{k: c[k] for k in Collective.__dataclass_fields__ if k in c})
        failure = failures.get(str(rank))
        if failure is not None:
            state.signal = failure.get("signal")
        fault_path = folder / f"rank{rank}.fault"
        if fault_path.exists():
            state.fault = Fault.parse(fault_path.read_text(errors="replace"))
            if state.fault is not None and state.signal is None:
                state.signal = state.fault.signal
        states[rank] = state
    return states
