"""The rank's watchdog: a daemon thread that samples where the main thread is (step, phase, the user's line, the
innermost frame) into `rank{R}.progress.json` whenever it changes, so a hung rank's report says where it hangs;
and the look at the other local ranks' beacons that tells an exiting or crashed rank whether waiting for them is
pointless.

The watchdog knows nothing of the run: it is given the function that takes a sample, the event that ends it and
the deadline (see `session.py`)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from ddp_doctor.core.beacon import BeaconState, read_beacon
from ddp_doctor.core.frames import user_frame
from ddp_doctor.core.phase import IN_STEP, Phase
from ddp_doctor.core.rankfiles import ProgressSample, write_progress

__all__ = ["Watchdog", "main_thread_position", "peers_train_on", "peers_wait_in_collective"]

logger = logging.getLogger(__name__)

_INTERVAL_S = 0.5
_IN_STEP = tuple(p.value for p in IN_STEP)


def main_thread_position() -> tuple[str | None, str | None]:
    """(the user's innermost line, the innermost frame) on the main thread, from any thread."""
    main = sys._current_frames().get(threading.main_thread().ident or 0)
    frames = traceback.extract_stack(main) if main is not None else []
    inner = frames[-1] if frames else None
    return user_frame(frames), f"{inner.filename}:{inner.lineno} in {inner.name}" if inner else None


class Watchdog:
    """Writes `sample()` to `folder` every half second when it changed, until `ended` is set.

    Args:
        folder: the node's output folder.
        sample: where the rank is now.
        ended: set when the rank is done (the thread stops).
        deadline: wall-clock time by which the rank must have ended (0: none); past it (plus a margin), the
            watchdog ends the rank with status 124, in case the parent is gone.
    """

    def __init__(
        self, folder: Path, sample: Callable[[], ProgressSample], ended: threading.Event, deadline: float
    ) -> None:
        self._folder, self._sample, self._ended, self._deadline = folder, sample, ended, deadline
        self.on_tick: Callable[[], None] | None = None
        """Called from the watchdog's thread every half second (`watch`: a Flight Recorder dump when asked)."""

    def start(self) -> None:
        """Write a first sample, then sample in a daemon thread until `ended` is set."""
        self.write()
        threading.Thread(target=self._run, name="ddp-doctor-watchdog", daemon=True).start()

    def write(self) -> None:
        """Write a sample now (never raises: the watchdog must never take the rank down)."""
        try:
            write_progress(self._folder, self._sample())
        except Exception as exc:  # noqa: BLE001
            logger.debug("ddp-doctor: progress not written: %s", exc)

    def _run(self) -> None:
        last: tuple[object, ...] = ()
        while not self._ended.wait(_INTERVAL_S):
            if self.on_tick is not None:
                try:
                    self.on_tick()
                except Exception as exc:  # noqa: BLE001  (the watchdog must never take the rank down)
                    logger.debug("ddp-doctor: watchdog tick failed: %s", exc)
            s = self._sample()
            key = (s.step, s.phase, s.user_frame, s.innermost)
            if key != last:
                self.write()
                last = key
            if self._deadline and time.time() > self._deadline + 2.0:
                # The parent normally stops us before this; this covers a parent that is gone.
                self.write()
                os._exit(124)


_SETTLED_S = 1.0
"""How long a peer's beacon must have shown it waiting in DDP's all-reduce before a crashed rank stops waiting for it.
0.3 s was too short on a loaded 2-core machine: a peer on its way to the same error (Lightning's reworded reduction
error at a second manual_backward) still showed the closed step after 0.3 s, both ranks left, and the report had
one rank's box instead of the joint finding."""


_BLOCKED_S = 0.5
"""How long a peer's main thread must have slept in the kernel, every time it was looked at, to be taken for one
that waits in a collective. Its beacon alone was not enough: on a 2-core machine beside 4 to 6 busy processes, the
Lightning GAN's report lost its joint finding in 3 of 15 runs (none of 10 with this): the peer, on its way to the
same error or just out of a collective both ranks entered, still showed a closed step in backward or a collective,
and both ranks left without the exchange."""


def _blocked(pid: int) -> bool:
    """Whether the process's main thread sleeps in the kernel (state S or D in /proc/PID/stat): a rank that waits in
    DDP's all-reduce does (measured on gloo: S throughout); one that runs Python on its way to its next pass does
    not, even a starved one on a busy machine (R). True where it cannot be read (no /proc, a pid not known): then the
    beacon alone decides. Not run on CUDA: a host thread that waits for the GPU may spin (R) rather than sleep, and
    then a crashed rank waits for it at the exchange (`RankConfig.crash_wait_s`) before it leaves."""
    if pid <= 0:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("S", "D")
    except (OSError, IndexError):
        return True


def _any_peer(outdir: Path, rank: int, test: Callable[[BeaconState], bool], watch_s: float) -> bool:
    """Whether the beacon of some other rank on this node passes `test`, watched for up to `watch_s` seconds."""
    deadline = time.monotonic() + watch_s
    while True:
        for path in outdir.glob("rank*.beacon"):
            if path.name == f"rank{rank}.beacon":
                continue
            peer = read_beacon(path)
            if peer is not None and test(peer):
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def peers_train_on(outdir: Path, rank: int, step: int, *, watch_s: float = 1.0) -> bool:
    """Whether a rank on this node has started a step `rank` will never take (read from their beacons).

    Then waiting for it to join the exchange is pointless: it waits for `rank` in DDP's all-reduce. Ranks on other
    nodes are not visible here; for them the exchange's own wait applies.
    """
    return _any_peer(outdir, rank, lambda p: p.step > step or (p.step == step and p.phase in _IN_STEP), watch_s)


def peers_wait_in_collective(outdir: Path, rank: int, *, watch_s: float = 2.0) -> bool:
    """Whether a rank on this node sits in a collective: one of the script's, or DDP's gradient all-reduce (its
    backward computed every gradient and it waits for the others). For a rank that crashed, such a peer can only
    come to the exchange when that collective fails, which NCCL's never does (gloo's fails when this process
    ends), so waiting for it is pointless. Ranks that crashed too (their beacon says so) are in no collective: they
    come to the exchange, and ranks that failed the same way get one joint report.
    """

    asleep: dict[int, float] = {}
    """pid -> when its main thread was first seen blocked in this watch, while its beacon showed it waiting."""

    def waits(p: BeaconState) -> bool:
        if p.crashed:
            return False  # it raised too (its failed step reads as closed in backward): it comes to the exchange
        # A rank whose backward computed its gradients and that waits in DDP's all-reduce stays there, blocked; one
        # that only passes through (no bucket to wait for: static_graph=True on a graph that changed, or the first
        # of Lightning's two manual_backward passes) moves on, running, to the same error as this rank's, and comes
        # to the exchange. So does one just out of a collective of the script's (Lightning's clean-up after the
        # error, which both ranks entered) whose beacon still says it is in it.
        reducing = (
            p.phase == Phase.BACKWARD.value
            and p.closed is not None
            and p.closed.step == p.step
            and time.time() - p.time >= _SETTLED_S
        )
        if not ((p.in_collective or reducing) and _blocked(p.pid)):
            asleep.pop(p.pid, None)
            return False
        return time.monotonic() - asleep.setdefault(p.pid, time.monotonic()) >= _BLOCKED_S

    return _any_peer(outdir, rank, waits, watch_s)
