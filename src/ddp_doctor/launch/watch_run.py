"""`ddp-doctor watch` in the parent: run the whole job, print the first steps' report as soon as it is written,
and call a hang while it happens.

The ranks run under `check`'s launch with `RankConfig.whole_run` (`watch_rank.py`): no step cap, no deadline. This
side polls the ranks' beacons (`core/beacon.py`, shared memory: no system call in the rank). When no rank's beacon
has changed for `hang_after` seconds (by default half the process group's timeout, which the ranks publish), it asks
every rank for its stacks (`STACKS_SIGNAL`), reads where each rank is, and decides what the ranks' files say with
the failure analysis `check` uses (`analyze/failures.py`): which ranks wait in which collective at which line, and
which rank is elsewhere. The verdict is printed and written to `hang.json` in the run folder, which survives the
job; `ddp-doctor explain` reads that folder again later.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_doctor.core.beacon import BeaconState, read_beacon
from ddp_doctor.core.rankfiles import end_path, progress_path, write_json
from ddp_doctor.launch.watch_nodes import NodeShare
from ddp_doctor.launch.watch_replicas import ReplicaWatch
from ddp_doctor.launch.watch_windows import WindowEvent, WindowWatch

__all__ = [
    "DEFAULT_HANG_AFTER_S",
    "STACKS_SIGNAL",
    "HangVerdict",
    "WatchLoop",
    "beacons",
    "dump_request_path",
    "hang_verdict",
    "last_progress",
    "parted",
    "read_rings",
    "stacks_path",
]

STACKS_SIGNAL = signal.SIGRTMIN + 6
"""The signal that makes a watched rank write every thread's Python stack (a real-time signal: the script's own
SIGUSR1 / SIGUSR2 handlers, a scheduler's requeue signal, stay its own)."""

DEFAULT_HANG_AFTER_S = 300.0
"""`--hang-after` before any rank has published its process group's timeout."""
_POLL_S = 0.5
"""How often the parent reads the beacons: it shares the machine with the ranks."""
_STACKS_WAIT_S = 1.0
_RINGS_WAIT_S = 5.0


def beacons(folder: Path) -> dict[int, BeaconState]:
    """Each rank's last published state on this node."""
    out = {}
    for path in folder.glob("rank*.beacon"):
        state = read_beacon(path)
        if state is not None:
            out[int(path.name[4 : -len(".beacon")])] = state
    return out


def stacks_path(folder: Path, rank: int) -> Path:
    """Where a watched rank writes its threads' stacks when asked (`STACKS_SIGNAL`)."""
    return folder / f"rank{rank}.stacks"


def dump_request_path(folder: Path) -> Path:
    """Touched by `watch` at a hang: each rank's watchdog thread then writes its Flight Recorder ring to
    `rank{R}.fr` (the main thread may be stuck in a collective; the watchdog's is not)."""
    return folder / "flight-recorder.request"


def last_progress(folder: Path, states: dict[int, BeaconState]) -> float | None:
    """When a live rank (one without an end record) last moved: its beacon changed (a step, a phase, a collective
    entered or left) or its watchdog's sample of the main thread's line changed. None when no rank is live.

    A rank that runs code (an evaluation alone, a long save) moves its sampled line; one that waits in a
    collective, or loops on one line, does not."""
    moved = []
    for rank, state in states.items():
        if end_path(folder, rank).exists():
            continue
        try:
            sampled = progress_path(folder, rank).stat().st_mtime
        except OSError:
            sampled = 0.0
        moved.append(max(state.time, sampled))
    return max(moved) if moved else None


@dataclass(kw_only=True)
class HangVerdict:
    """What the ranks were doing when none had made progress for `stalled_s` seconds."""

    stalled_s: float
    hang_after_s: float
    group_timeout_s: float | None
    at: float
    """`time.time()` when the verdict was made."""
    findings: list[Any] = field(default_factory=list)
    """The failure analysis's findings (`core/findings.Finding`), the first one the cause."""
    sequences: list[Any] = field(default_factory=list)
    """From the ranks' Flight Recorder rings (every collective, DDP's own included): the first collective where the
    ranks' sequences part (`analyze/flight_recorder.py`), per process group."""
    sequences_compared: int = 0
    """How many ranks' rings were read (0: the Flight Recorder was off, or no rank wrote its ring)."""
    positions: list[dict[str, Any]] = field(default_factory=list)
    """Per rank: `rank`, `step`, `phase`, `line` (the user's line on its main thread), `collective` (the last
    collective the script entered: op, line, whether the rank is inside it), `stacks` (the file)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "ddp-doctor/hang@1",
            "stalled_s": round(self.stalled_s, 1),
            "hang_after_s": self.hang_after_s,
            "group_timeout_s": self.group_timeout_s,
            "at": self.at,
            "positions": self.positions,
            "findings": [f.to_dict() for f in self.findings],
            "sequences": [f.to_dict() for f in self.sequences],
            "sequences_compared": self.sequences_compared,
        }


def hang_verdict(folder: Path, *, stalled_s: float, hang_after_s: float, group_timeout_s: float | None) -> HangVerdict:
    """Where every rank is now, and the failure analysis's reading of it. The ranks' files are read first, then the
    analysis is imported (torch, seconds on a loaded machine: not before a hang, so that the parent takes no CPU
    from the ranks while they train). The other nodes' ranks' records are the folder's "nodes"
    (`NodeShare.materialize`)."""
    from ddp_doctor.core.rankstate import read_rank_states

    now = time.time()
    states = read_rank_states(folder, end_time=now)
    dumps = read_rings(folder)
    positions = []
    for rank, s in sorted(states.items()):
        c = s.collective
        stacks = stacks_path(folder, rank)
        positions.append(
            {
                "rank": rank,
                "step": s.step,
                "phase": s.phase,
                "line": s.user_frame,
                "innermost": s.innermost,
                "collective": {"op": c.op, "line": c.site, "n": c.n, "inside": s.in_collective} if c else None,
                "ended": s.outcome.value if s.outcome is not None else None,
                "stacks": str(stacks) if stacks.exists() and stacks.stat().st_size else None,
            }
        )
    from ddp_doctor.analyze import failure_findings
    from ddp_doctor.report.words import worded

    return HangVerdict(
        stalled_s=stalled_s,
        hang_after_s=hang_after_s,
        group_timeout_s=group_timeout_s,
        at=now,
        findings=[worded(f) for f in failure_findings(states, timed_out=True, native=[])],
        sequences=parted(dumps),
        sequences_compared=len(dumps),
        positions=positions,
    )


def read_rings(folder: Path, pattern: str = "rank*.fr") -> list[Any]:
    """The Flight Recorder rings in `folder` (no torch)."""
    from ddp_doctor.core.fr_dumps import read_dumps

    return read_dumps(folder, pattern)[0]


def parted(dumps: list[Any]) -> list[Any]:
    """The first collective where the ranks' Flight Recorder rings part, per process group (imports torch)."""
    from ddp_doctor.analyze import first_divergence

    return first_divergence(dumps)


class WatchLoop:
    """`run_check`'s `wait` under `watch`: returns when torchrun ends (False), or True after a hang when `on_hang`
    is `stop`.

    Args:
        hang_after: seconds without progress on any rank that make a hang (None: half the process group's timeout,
            once a rank published it; `DEFAULT_HANG_AFTER_S` before).
        on_hang: `wait` (print the verdict, keep waiting) or `stop` (print it, stop the run).
        reported: called once with the run folder when the first steps' report is written.
        hung: called with each verdict.
        resumed: called when the ranks make progress again after a verdict.
        diverged: called once, when the ranks' parameters first differ (`watch_replicas.py`).
        window: called with each change in a window of steps (`watch_windows.WindowEvent`: input-bound, no longer,
            a slower step).
        warn: called once with a sentence when `hang_after` is not shorter than the process group's timeout (the
            timeout would end the job before a hang is called).
        nodes: the other nodes' records through the rendezvous store (`watch_nodes.py`), on a multi-node job.
    """

    def __init__(
        self,
        *,
        hang_after: float | None,
        on_hang: str,
        reported: Callable[[Path], None],
        hung: Callable[[HangVerdict], None],
        resumed: Callable[[float], None],
        diverged: Callable[[Any], None] = lambda _: None,
        window: Callable[[WindowEvent], None] = lambda _: None,
        warn: Callable[[str], None] = lambda _: None,
        nodes: NodeShare | None = None,
    ) -> None:
        self.hang_after, self.on_hang = hang_after, on_hang
        self._reported, self._hung, self._resumed, self._warn = reported, hung, resumed, warn
        self._diverged, self._window = diverged, window
        self.replicas: ReplicaWatch | None = None
        self.windows: WindowWatch | None = None
        self.nodes = nodes if nodes is not None and nodes.enabled else None
        self._warned = False
        self.verdicts: list[HangVerdict] = []
        self._announced = False
        self._printing = threading.Lock()
        """Held while one of the callbacks prints: the first steps' report (a thread of its own, so that reading
        and drawing it, with the analysis imported, never delays a hang's verdict) and a verdict never interleave."""
        self._reporter: threading.Thread | None = None

    def threshold(self, states: dict[int, BeaconState]) -> tuple[float, float | None]:
        """(seconds without progress that make a hang, the process group's timeout when a rank published it)."""
        timeouts = [s.group_timeout for s in states.values() if s.group_timeout]
        group = min(timeouts) if timeouts else None
        if self.hang_after is not None:
            return self.hang_after, group
        return (group / 2 if group else DEFAULT_HANG_AFTER_S), group

    def __call__(self, proc: subprocess.Popen[Any], folder: Path) -> bool:
        hung_at: float | None = None
        self.replicas = ReplicaWatch(folder=folder)
        self.windows = WindowWatch(folder=folder)
        polls = 0
        while proc.poll() is None:
            time.sleep(_POLL_S)
            polls += 1
            if not self._announced and (folder / "report.json").exists():
                self._announced = True
                self._reporter = threading.Thread(
                    target=self._report, args=(folder,), name="ddp-doctor-report", daemon=True
                )
                self._reporter.start()
            states = beacons(folder)
            if not states:
                continue
            if self._announced and polls % 4 == 0:
                live = {r for r in states if not end_path(folder, r).exists()}
                if (divergence := self.replicas.poll(live)) is not None:
                    self._say(self._diverged, divergence)
                remote = self.nodes.windows(folder) if self.nodes is not None else None
                for event in self.windows.poll(live, remote):
                    self._say(self._window, event)
            if hung_at is not None:
                if self.nodes is not None:
                    self.nodes.publish(folder, last_progress(folder, states))
                hung_at = self._moved_since(hung_at, states)
                continue
            hang_after, group = self.threshold(states)
            last = self._progress(folder, states, hang_after)
            if last is None:
                continue
            if group is not None and hang_after >= group and not self._warned:
                self._warned = True
                self._say(
                    self._warn,
                    f"--hang-after {hang_after:g} s is not shorter than the process group's timeout ({group:g} s): "
                    "the timeout ends the job before a hang can be called. Pass a --hang-after below it.",
                )
            stalled = time.time() - last
            if stalled < hang_after:
                continue
            _ask_for_stacks(folder, states)
            now = beacons(folder)
            again = self._progress(folder, now, hang_after)
            if again is None or again > last + 1.0 or any(end_path(folder, r).exists() for r in states):
                continue  # a rank moved or ended while its stacks were taken: not a hang
            called = time.time()  # the ranks may move again while the verdict is made (seconds, on a busy machine)
            if self.nodes is not None:
                self.nodes.materialize(folder)
            verdict = hang_verdict(folder, stalled_s=stalled, hang_after_s=hang_after, group_timeout_s=group)
            self.verdicts.append(verdict)
            write_json(folder / "hang.json", verdict.to_dict())
            self._say(self._hung, verdict)
            if self.on_hang == "stop":
                self.join_report()
                return True
            hung_at = called
        if hung_at is not None:
            self._moved_since(hung_at, beacons(folder))  # the ranks moved again and ended between two looks
        if not self._announced and (folder / "report.json").exists():
            self._announced = True  # written just before the job ended, between two looks
            self._report(folder)
        self.join_report()
        return False

    def join_report(self) -> None:
        """Wait for the first steps' report to be printed (the job's end is read against it)."""
        if self._reporter is not None:
            self._reporter.join()

    def _report(self, folder: Path) -> None:
        try:
            self._say(self._reported, folder)
        except Exception as exc:  # a thread's traceback would reach the user raw: one line instead
            self._say(self._warn, f"the first steps' report could not be read: {type(exc).__name__}: {exc}")

    def _say(self, callback: Callable[[Any], None], arg: Any) -> None:
        with self._printing:
            callback(arg)

    def _progress(self, folder: Path, states: dict[int, BeaconState], hang_after: float | None = None) -> float | None:
        """When a live rank last moved: this node's (`last_progress`); on several nodes (published through the
        rendezvous store, to which this node publishes its own), another node's when later, looked up only once this
        node's ranks have stood still for `hang_after` seconds."""
        last = last_progress(folder, states)
        if self.nodes is None:
            return last
        self.nodes.publish(folder, last)
        if last is not None and hang_after is not None and time.time() - last < hang_after:
            return last
        return max((t for t in (last, self.nodes.others_moved()) if t is not None), default=None)

    def _moved_since(self, hung_at: float, states: dict[int, BeaconState]) -> float | None:
        """After a verdict: None (and `resumed` called) once any rank's beacon changed since, else `hung_at`."""
        moved = max((s.time for s in states.values()), default=0.0)
        if moved > hung_at:
            self._say(self._resumed, moved - hung_at)
            return None
        return hung_at


def _ask_for_stacks(folder: Path, states: dict[int, BeaconState]) -> None:
    """Every local rank writes all its threads' stacks (`STACKS_SIGNAL`) and its Flight Recorder ring (from its
    watchdog's thread, within half a second); wait a moment for them."""
    asked = False
    requested = time.time()
    try:
        dump_request_path(folder).write_text(str(requested))
        requested = dump_request_path(folder).stat().st_mtime
    except OSError:
        pass
    for s in states.values():
        try:
            os.kill(s.pid, STACKS_SIGNAL)
            asked = True
        except (ProcessLookupError, PermissionError):
            continue
    if not asked:
        return
    # The stacks come from a signal handler at once; the rings from each watchdog's next tick (half a second, more
    # on a loaded machine, or when the main thread holds the interpreter in a Python loop).
    time.sleep(_STACKS_WAIT_S)
    deadline = time.monotonic() + _RINGS_WAIT_S
    while time.monotonic() < deadline:
        rings = [folder / f"rank{r}.fr" for r, s in states.items() if not end_path(folder, r).exists()]
        if all(p.exists() and p.stat().st_mtime >= requested for p in rings):
            return
        time.sleep(_POLL_S)
