"""`ddp-doctor watch` inside each rank: after the observed steps' report the script trains on to its own end.

What stays on is light: the beacon's step after each optimizer step (16 bytes written to shared memory), the
script's own collectives in the beacon (`inflight.py`, as under `check`), the watchdog's sample of the main
thread's line every half second, a clock read per step and per first forward after it (`watch_windows.py`, the step
time window by window), and every few steps the DDP models' parameter fingerprints (`watch_replicas.py`, at most
half a percent of the time between steps). The process group's timeout goes into the beacon, so the supervisor can call a
hang before that timeout ends the job. Every thread's Python stack can be asked for at any moment with
`STACKS_SIGNAL` (faulthandler writes them to `rank{R}.stacks` from inside the signal handler: no ptrace, no help from
the stuck thread).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import traceback
from typing import TYPE_CHECKING, Any

from torch.optim.optimizer import Optimizer, register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ddp_doctor.core.beacon import OptimizerSteps
from ddp_doctor.core.frames import user_frame
from ddp_doctor.core.phase import Phase
from ddp_doctor.core.rankfiles import Outcome
from ddp_doctor.launch.config import DESTROYED, SCRIPT_ENDED
from ddp_doctor.launch.following_run import group_timeout
from ddp_doctor.launch.watch_replicas import ReplicaPoints
from ddp_doctor.launch.watch_run import STACKS_SIGNAL, dump_request_path, stacks_path
from ddp_doctor.launch.watch_windows import StepWindows
from ddp_doctor.observation import dataloaders
from ddp_doctor.observation.model_averaging import AveragingsDone

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

    from ddp_doctor.doctor import Doctor
    from ddp_doctor.launch.session import Session
    from ddp_doctor.report.model import Report

__all__ = ["WatchPolicy"]

logger = logging.getLogger("ddp_doctor")


class WatchPolicy:
    """The `RunPolicy` of `watch`: after the report, the script goes on; the rank leaves when the script ends."""

    whole_run = True

    def __init__(self, session: Session) -> None:
        self.session = session
        self._steps: OptimizerSteps | None = None
        """The optimizer steps counted from the report on (`reported`)."""
        self._stacks = open(stacks_path(session.outdir, session.rank), "a")  # noqa: SIM115  (kept open for the handler)
        faulthandler.register(STACKS_SIGNAL, file=self._stacks, all_threads=True, chain=False)
        self._dumped = 0.0
        self._replicas = ReplicaPoints(session.outdir, session.rank)
        self._windows = StepWindows(session.outdir, session.rank)
        dataloaders.listen(self._windows.loader_started)
        self._last_step = 0
        self._averagings = AveragingsDone()
        """Model averagings (post-local SGD): the replicas are compared right after one."""
        session.watchdog.on_tick = self._dump_when_asked

    def wrapped(self, ddp: DistributedDataParallel, trainable: list[bool]) -> None:
        self.session.beacon.update(group_timeout=group_timeout())
        self._replicas.add_model(ddp)
        self._windows.add_model(ddp, lead=True)

    def reported(self, doctors: list[Doctor], reports: list[Report]) -> bool:
        """The first steps are reported: count the optimizer steps from here on, and let the script go on."""
        beacon = self.session.beacon
        self._steps = OptimizerSteps(beacon, max(beacon.state.step, 0))
        sharded = self.session.plain.sharded
        if sharded is not None:
            self._windows.add_model(sharded.root)
        if sharded is not None and (slot := sharded.replica_row()) is not None:
            # `replicate` (a whole copy on every rank) or HSDP (a shard held by every rank along the replicate
            # dimension): compared past the first steps among the ranks that hold the same values (one replica row).
            row, rows = slot
            self._replicas.add_model(sharded.root, "" if rows == 1 else str(row))
        self.session.watching = True
        beacon.update(phase=Phase.WATCHED.value, group_timeout=group_timeout())
        register_optimizer_step_post_hook(self._stepped)
        register_optimizer_step_pre_hook(self._stepping)
        self._averagings.start()  # for the job's life, as the step hooks
        return True

    def script_ended(self) -> bool:
        return False

    def runs_on(self, reason: str, exit_code: int | None, doctors: list[Doctor], reports: list[Report]) -> bool:
        """The script runs on past its observed steps and past a process group it destroyed before them (a short
        job's final save, upload, atexit handlers): the policy takes over. A script that ended before them leaves
        the way it ends (`Session.on_exit`), not from inside the doctor."""
        if reason == SCRIPT_ENDED:
            return True
        runs = reason in (self.session.steps_reason, DESTROYED)
        return not exit_code and runs and self.reported(doctors, reports)

    def torn_down(self, site: str | None) -> None:
        """Past `destroy_process_group()` no collective is left: the beacon says so, and a rank that fails from
        here on (gloo aborting at teardown, a final save) failed after its training, not in it."""
        self.session.teardown = True
        self.session.beacon.update(phase=Phase.TORN_DOWN.value, site=site)

    def script_returned(self, exc: SystemExit | None, code: int) -> None:
        """Past the report, the script returned or called `sys.exit`: record its end (status, line, the watched step),
        then leave the way the script does (its status; the interpreter joins its threads and runs its atexit
        handlers)."""
        session = self.session
        site = "the end of the script" if exc is None else user_frame(traceback.extract_tb(exc.__traceback__))
        session.out.end(
            Outcome.EXITED, overwrite=True, status=code, site=site or "sys.exit", step=session.beacon.state.step
        )
        session.ended.set()
        session.watchdog.write()
        raise exc if exc is not None else SystemExit(code)

    def _stepping(self, opt: Optimizer, _args: Any, _kwargs: Any) -> None:
        """A point after a model averaging, labelled with the step it followed."""
        size = self._averagings.take()
        if size is not None:
            try:
                self._replicas.averaged(self._last_step, size)
            except Exception as exc:  # noqa: BLE001  (watching must never take the rank down)
                logger.debug("ddp-doctor: a point after a model averaging not written: %s", exc)

    def _stepped(self, opt: Optimizer, _args: Any, _kwargs: Any) -> None:
        step = self._steps.stepped(opt) if self._steps is not None else None
        if step is not None:
            self._last_step = step
            try:
                self._windows.stepped(step)
                self._replicas.stepped(step)
            except Exception as exc:  # noqa: BLE001  (watching must never take the rank down)
                logger.debug("ddp-doctor: a watched step's records not written: %s", exc)

    def _dump_when_asked(self) -> None:
        """From the watchdog's thread: when `watch` asked (a hang), write this rank's Flight Recorder ring, the
        collectives it issued with their stacks, DDP's own included (torch records them when TORCH_FR_BUFFER_SIZE
        is set, as `watch` does)."""
        request = dump_request_path(self.session.outdir)
        try:
            asked = request.stat().st_mtime
        except OSError:
            return
        if asked <= self._dumped:
            return
        self._dumped = asked
        try:
            from torch._C._distributed_c10d import _dump_fr_trace
        except ImportError:
            return  # a torch without the Flight Recorder's dump
        data = _dump_fr_trace(True, True, False)
        path = self.session.outdir / f"rank{self.session.rank}.fr"
        tmp = path.with_suffix(".fr.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
