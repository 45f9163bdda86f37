"""The rank's watchdog: a daemon thread that samples where the main thread is (step, phase, the user's line, the
innermost frame) into `rank{R}.progress.json` whenever it changes, so a hung rank's report says where it hangs;
and the look at the other local ranks' beacons that tells an exiting rank whether waiting for them is pointless."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddp_doctor.core.beacon import read_beacon
from ddp_doctor.core.frames import user_frame
from ddp_doctor.core.phase import IN_STEP

if TYPE_CHECKING:
    from ddp_doctor.launch.session import Session

__all__ = ["Watchdog", "peers_train_on"]

logger = logging.getLogger(__name__)

_INTERVAL_S = 0.5
_IN_STEP = tuple(p.value for p in IN_STEP)


class Watchdog:
    """Samples `session`'s main thread every half second (see the module docstring)."""

    def __init__(self, session: Session) -> None:
        self._s = session

    def start(self) -> None:
        """Write a first sample, then sample in a daemon thread until the session ends."""
        self.write()
        threading.Thread(target=self._run, name="ddp-doctor-watchdog", daemon=True).start()

    def progress(self) -> dict[str, Any]:
        """Where the rank is now."""
        s = self._s
        active = next((d for d in s.doctors if not d.finished), s.doctors[-1] if s.doctors else None)
        main = sys._current_frames().get(threading.main_thread().ident or 0)
        frames = traceback.extract_stack(main) if main is not None else []
        inner = frames[-1] if frames else None
        return {
            "rank": s.rank,
            "local_rank": s.local_rank,
            "world_size": s.world_size,
            "pid": os.getpid(),
            "ddp_models": len(s.doctors),
            "models": s.models,
            "step": active.steps_observed if active is not None else -1,
            "phase": active.phase if active is not None else "before DDP was built",
            "user_frame": user_frame(frames),
            "innermost": f"{inner.filename}:{inner.lineno} in {inner.name}" if inner else None,
            "ended": s.ended.is_set(),
            "time": time.time(),
        }

    def write(self) -> None:
        """Write a sample now (never raises: the watchdog must never take the rank down)."""
        from ddp_doctor.launch.session import write_json

        try:
            write_json(self._s.outdir / f"rank{self._s.rank}.progress.json", self.progress())
        except Exception as exc:  # noqa: BLE001
            logger.debug("ddp-doctor: progress not written: %s", exc)

    def _run(self) -> None:
        last: tuple[Any, ...] = ()
        deadline = self._s.config.deadline
        while not self._s.ended.wait(_INTERVAL_S):
            progress = self.progress()
            key = (progress["step"], progress["phase"], progress["user_frame"], progress["innermost"])
            if key != last:
                self.write()
                last = key
            if deadline and time.time() > deadline + 2.0:
                # The parent normally stops us before this; this covers a parent that is gone.
                self.write()
                os._exit(124)


def peers_train_on(outdir: Path, rank: int, step: int, *, watch_s: float = 1.0) -> bool:
    """Whether a rank on this node has started a step `rank` will never take (read from their beacons).

    Then waiting for it to join the exchange is pointless: it waits for `rank` in DDP's all-reduce. Ranks on other
    nodes are not visible here; for them the exchange's own wait applies.
    """
    deadline = time.monotonic() + watch_s
    while True:
        for path in outdir.glob("rank*.beacon"):
            if path.name == f"rank{rank}.beacon":
                continue
            peer = read_beacon(path) or {}
            peer_step = int(peer.get("step", -1))
            if peer_step > step or (peer_step == step and peer.get("phase") in _IN_STEP):
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
