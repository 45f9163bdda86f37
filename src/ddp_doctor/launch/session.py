"""The doctor inside each rank of a script launched by `ddp-doctor check`.

`Session.install()` runs before any user code and patches DDP's constructor (`patches.py`): every DDP model the
script builds, directly or inside HF Trainer, Accelerate or Lightning, gets the `--ddp-kwargs` overrides and a
`Doctor`. When every doctor has seen its K steps (or, inside a `Join`, where it ends: `joined.py`), all ranks
exchange their records and the node's local rank 0 writes the report; then the script is followed through its epoch
ends (`following_run.py`), or every rank exits there. Each rank also leaves files for the supervisor (its position,
the watchdog's samples, the fault dump, how it ended: `core/rankfiles.py`), since a rank that crashed alone cannot
count on a collective. After the report, the run's `RunPolicy` (`policy.py`) decides: `check` exits, `bench` and
`watch` go on in the same processes.
"""

from __future__ import annotations

import faulthandler
import inspect
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import Optimizer, register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ddp_doctor.core.errors import DoctorError
from ddp_doctor.core.frames import FRAMEWORKS, framework_of_stack, user_frame
from ddp_doctor.core.phase import Phase
from ddp_doctor.core.rankfiles import Outcome
from ddp_doctor.doctor import Doctor
from ddp_doctor.doctor.plain_watch import PlainOptimizerWatch
from ddp_doctor.exchange.runner import arrive
from ddp_doctor.launch.config import SCRIPT_ENDED, RankConfig, steps_reason
from ddp_doctor.launch.following_run import CAPPED_NEXT, EpochFollowing, ended_by_our_cap
from ddp_doctor.launch.inflight import CollectiveRecorder
from ddp_doctor.launch.joined import JoinedReport
from ddp_doctor.launch.patches import (
    patch_ddp_init,
    patch_destroy_process_group,
    patch_full_gather,
    patch_fully_shard,
    patch_gradient_sync,
    patch_optimizer_init,
)
from ddp_doctor.launch.plain_steps import PlainSteps
from ddp_doctor.launch.policy import CheckPolicy, RunPolicy
from ddp_doctor.launch.publish import Publisher
from ddp_doctor.launch.raised import raised_error
from ddp_doctor.launch.watchdog import Watchdog, peers_train_on, peers_wait_in_collective
from ddp_doctor.observation import collectives, dataloaders, gradedits, module_calls, saves
from ddp_doctor.observation.wrapstate import WRAP_STATE_ATTR, freeze_named
from ddp_doctor.report.model import Report

__all__ = ["FRAMEWORKS", "PolicyFactory", "Session", "framework_of_stack"]

logger = logging.getLogger(__name__)

PolicyFactory = Callable[["Session"], RunPolicy]
"""Builds the run's policy from the session, in `install()` (before any user code runs)."""


class Session:
    """The per-rank state of one launch. See the module docstring.

    Args:
        config: what the parent told the ranks.
        policy: builds what happens after the report (default: `CheckPolicy`, the rank leaves).
    """

    def __init__(self, config: RankConfig, policy: PolicyFactory | None = None) -> None:
        self.config = config
        self._make_policy = policy
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.outdir = Path(config.outdir)
        self.doctors: list[Doctor] = []
        self.models: list[dict[str, Any]] = []
        self._finishing = False
        self.ended = threading.Event()
        """Set when the rank is done (the watchdog stops)."""
        self.original_init = DistributedDataParallel.__init__
        """DDP's own constructor (a policy may rebuild the script's DDP with it, unobserved: `bench`)."""
        self.signature = inspect.signature(self.original_init)
        """DDP's constructor's signature (the patched constructor binds the script's arguments with it)."""
        self.watching = False
        """The report is written and the script trains on under `watch` (`watch_rank.py`)."""
        self.teardown = False
        """Under `watch`: the script destroyed its process group and runs on to its end (`WatchPolicy.torn_down`)."""
        self.follow = EpochFollowing(config)
        """Follows the script through its epoch ends after the observed steps (`--follow-epochs`)."""
        self.joined = JoinedReport(self)

        def beyond() -> Phase | None:  # the phase past the observed steps, if the script runs on
            if self.teardown:
                return Phase.TORN_DOWN
            return Phase.FOLLOWING if self.follow.active else Phase.WATCHED if self.watching else None

        self.out = Publisher(
            self.outdir, doctors=self.doctors, models=self.models, ended=self.ended, beyond_steps=beyond
        )
        """What the rank leaves for the supervisor (`publish.py`)."""
        self.beacon = self.out.beacon
        self.collectives = CollectiveRecorder(
            self.beacon, lambda: next((d for d in self.doctors if not d.finished), None)
        )
        self.plain = PlainOptimizerWatch()
        self.plain_steps = PlainSteps(self)
        """The callbacks of the path without DDP (`plain_steps.py`)."""
        self.watchdog = Watchdog(self.outdir, self.out.progress, self.ended, config.deadline)
        self.policy: RunPolicy = CheckPolicy()
        """What happens after the report (set in `install`)."""

    # ---------------------------------------------------------------------------------------------- set-up

    def install(self) -> None:
        """Patch DDP's constructor, `destroy_process_group` and `Optimizer.__init__` (`patches.py`), install the
        probes, and start the watchdog. Call before user code."""
        if self._make_policy is not None:
            # Built before any doctor exists: a policy's optimizer hooks run before every doctor's.
            self.policy = self._make_policy(self)
        patch_ddp_init(self)
        patch_destroy_process_group(self)
        patch_optimizer_init()
        patch_gradient_sync()
        patch_fully_shard(self.config.reshard_off, self.plain_steps.on_shard)
        patch_full_gather(self.plain_steps.on_gather)
        saves.listen(self.plain.note_save)
        self._plain_hook = register_optimizer_step_post_hook(self.plain_steps.on_step)
        # The loader probe first: its pre-step hook counts the step on its pass before ours reads it.
        self.follow.install()
        self.joined.install()
        self._step_pre_hook = register_optimizer_step_pre_hook(self._before_any_step)
        self.collectives.install()
        collectives.listen(self.plain.note_collective, fsdp=True)
        dataloaders.install()
        saves.install()
        gradedits.install()
        module_calls.listen_to_empty()
        module_calls.listen_casts()
        # A segfault or abort (gloo's on a mismatched collective) leaves no Python exception: faulthandler writes
        # the signal and the stack to a file the supervisor reads. The file object must stay open.
        self._fault_file = open(self.outdir / f"rank{self.rank}.fault", "w")  # noqa: SIM115
        faulthandler.enable(self._fault_file, all_threads=True)
        self.watchdog.start()

    @property
    def finishing(self) -> bool:
        """The rank is past its observed steps' end (reporting, or the report is written)."""
        return self._finishing

    def before_wrap(self, module: torch.nn.Module, arguments: dict[str, Any]) -> None:
        """Just before DDP's constructor: the `--ddp-kwargs` overrides and the parameters to freeze."""
        if self._finishing:
            return
        for key, value in self.config.ddp_kwargs.items():
            arguments[key] = value
        freeze_named(module, self.config.freeze_before_wrap)

    def after_wrap(self, ddp: DistributedDataParallel, trainable: list[bool], *, init_sync: bool = True) -> None:
        """Just after DDP's constructor: a `Doctor` on the model (once per model), and its entry in the report."""
        if self._finishing or any(d.ddp is ddp for d in self.doctors):
            return
        frames = traceback.extract_stack()[:-2]
        framework = framework_of_stack(frames)
        site = user_frame(frames, code=False)
        setattr(
            ddp, WRAP_STATE_ATTR, {"trainable": trainable, "site": site, "framework": framework, "init_sync": init_sync}
        )
        try:
            doctor = Doctor(ddp, optimizer="auto", steps=self.config.steps)
            doctor.on_steps_done = self._on_doctor_done
            doctor.on_phase = self.on_phase
            doctor.start()
        except Exception as exc:  # noqa: BLE001  (a doctor bug must not take the user's training down)
            logger.warning("ddp-doctor cannot observe the DDP model built at %s: %s", site, exc)
            return
        self.doctors.append(doctor)
        self.on_phase(doctor)
        self.models.append(
            {
                "site": site,
                "framework": framework,
                "module": type(ddp.module).__qualname__,
                "ddp_config": doctor.info.ddp_config,
                "torch_version": torch.__version__,
                "backend": str(dist.get_backend()),
            }
        )
        self.watchdog.write()

    def _before_any_step(self, _opt: Optimizer, _args: Any, _kwargs: Any) -> None:
        """Which loader pass each step trains on; while following, whether the next epoch has begun."""
        if self.follow.before_step() and not self._finishing:
            self._end_following(self.follow.reason)

    def _end_following(self, reason: str) -> None:
        """Following ends (`reason`): through DDP's end, or the path without DDP's (a sharded model followed)."""
        (self.finish if self.doctors else self.finish_unwrapped)(reason)

    # ------------------------------------------------------------------------------------------- no DDP

    def finish_unwrapped(self, reason: str) -> None:
        """The end of the path without DDP (`plain_steps.py`): the report, then exit; or, for a sharded model at
        its observed steps' end, following the script to its epoch end first."""
        if self._finishing:
            return
        try:
            if self.plain_steps.conclude(reason):
                return  # following: the script goes on
        except DoctorError as exc:
            self._finishing = True
            logger.warning("ddp-doctor: rank %d could not compare the unwrapped model: %s", self.rank, exc)
            self.out.end(Outcome.NO_EXCHANGE, error=str(exc))
            self._exit(1)
            return
        except Exception as exc:  # noqa: BLE001  (a bug of ours must never read as the script's crash)
            self._internal_error(exc)
            return
        self._finishing = True
        if self.policy.whole_run and self.policy.runs_on(reason, None, self.doctors, []):
            return  # `watch`: the script runs on, and its end is the rank's (no end record until then)
        self.out.end(Outcome.REPORTED, reason=reason)
        self.leave()

    # ------------------------------------------------------------------------------------------- position

    def on_phase(self, doctor: Doctor) -> None:
        """Publish the rank's position (step, phase, the user's line) in its beacon."""
        self.out.position(doctor)

    # ----------------------------------------------------------------------------------------------- ending

    @property
    def steps_reason(self) -> str:
        return steps_reason(self.config.steps)

    def _on_doctor_done(self, _doctor: Doctor) -> None:
        if all(d.finished for d in self.doctors) and not self.joined.defer():  # inside a Join: at its end
            self.finish(self.steps_reason)

    def on_exit(self, exc: SystemExit | None) -> None:
        """The script returned (`exc` None) or called `sys.exit` on this rank, whatever the status.

        With the observed steps not yet done, the rank records where it left, then waits a short while for the
        others to end too (a short script ends on every rank) and exchanges records with them. If they do not come,
        they are still training: the rank leaves with its own status, and the supervisor reports `rank-exited`.
        """
        code = 0 if exc is None or exc.code is None else exc.code if isinstance(exc.code, int) else 1
        if self._finishing and self.policy.whole_run:
            self.policy.script_returned(exc, code)  # `watch`: the rank leaves as the script does
        if self.policy.script_ended():  # the script's loop ended while the policy ran (bench's blocks)
            self.leave()
        tb = traceback.extract_tb(exc.__traceback__) if exc is not None else None
        site = "the end of the script" if tb is None else user_frame(tb) or "sys.exit"
        for doctor in self.doctors if code and exc is not None and not self._finishing else ():
            doctor.record_crash(exc)  # a failure status: the job fails, as a crash does
        step = max((d.steps_observed for d in self.doctors), default=-1)
        if not self.doctors and self.plain.steps and not self._finishing and code == 0:
            self.finish_unwrapped(SCRIPT_ENDED)
        self.out.end(Outcome.EXITED, status=code, site=site, step=step, phase=str(self.out.progress().phase))
        if (
            self.doctors
            and not self._finishing
            and (self.follow.active or not peers_train_on(self.outdir, self.rank, step))
        ):
            # While following, the others are past the observed steps too: they end at the same epoch end or at
            # the script's end, after whatever they run alone (capped), so they are waited for longer.
            wait = max(0.5, min(self.config.crash_wait_s * (6 if self.follow.active else 1), self.remaining()))
            self.finish(
                SCRIPT_ENDED if code == 0 else f"rank {self.rank} exited with status {code}",
                timeout=wait,
                exit_code=code,
            )
        if self._finishing and self.policy.whole_run:
            self.policy.script_returned(exc, code)  # `watch`: its atexit handlers run, as without the doctor
        self._exit(code)

    def on_crash(self, exc: BaseException) -> None:
        """The script raised on this rank: record it, try to report with the others, and exit."""
        if self.follow.active and not self._finishing and ended_by_our_cap(exc):
            # The loop called next() on its loader's iterator itself and did not expect the pass to end: the cap
            # that ended it is ours, so this is where following stops, not a crash of the script.
            self._end_following(CAPPED_NEXT)
        # First: recording the crash publishes the failed step as closed, and a rank that closed its step in
        # backward looks like one waiting in DDP's all-reduce to a peer that crashed too (peers_wait_in_collective).
        self.beacon.update(crashed=True)
        raised = raised_error(exc, self.doctors, phase=str(self.out.progress().phase))
        if not self.doctors and self.plain.sharded is not None:
            raised.step = self.plain.steps  # the FSDP2 model's optimizer steps (no doctor counts them)
        if self.watching:
            raised.step = max(raised.step, self.beacon.state.step)  # `watch` counts the steps past the report
        # After finish() the report is written: this crash happened in what the policy ran after it (bench).
        outcome = Outcome.CRASHED_AFTER_REPORT if self._finishing else Outcome.CRASHED
        self.out.end(outcome, raised=raised, overwrite=True)
        if raised.explained is None and not raised.peer_lost:
            # Not DDP's error: the user needs the whole traceback, as torchrun would have shown it.
            tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            sys.stderr.write(f"[ddp-doctor] rank {self.rank} crashed:\n{tb}")
            sys.stderr.flush()
        if self.doctors and not raised.peer_lost and not peers_wait_in_collective(self.outdir, self.rank):
            # Ranks that crashed too (the same DDP error at the same step, say) come to the exchange; a rank that
            # waits for this one in a collective never does, so then the rank leaves at once.
            wait = max(0.5, min(self.config.crash_wait_s, self.remaining()))
            self.finish(f"rank {self.rank} crashed", timeout=wait, exit_code=1)
        self._exit(1)

    def finish(self, reason: str, *, timeout: float | None = None, exit_code: int | None = None) -> None:
        """Stop observing, exchange records with every rank, write the report (local rank 0) and exit.

        `exit_code` is the rank's status when the exchange fails (default 1): an exiting rank keeps its own.
        """
        if self._finishing:
            return
        for doctor in self.doctors:
            doctor.stop()
        if exit_code is None and reason == self.steps_reason and self.follow.enabled and not self.follow.active:
            # The observed steps' reports first, kept on disk: a failure at the epoch end (a timeout, say) then
            # still reports what the steps showed, beside the failure.
            reports = self._exchange(reason, timeout, exit_code, follow=False)
            if reports is None:
                return
            self.out.reports(reports, reason, "report.steps.json")
            if self.follow.start(self.doctors):
                self.beacon.update(phase=Phase.FOLLOWING.value)
                return  # the script goes on, lightly watched, to its next epoch end
        self._finishing = True
        reports = self._exchange(reason, timeout, exit_code, follow=True)
        if reports is None:
            return
        self.out.reports(reports, reason, "report.json")
        if self.policy.whole_run and self.policy.runs_on(reason, exit_code, self.doctors, reports):
            return  # `watch`: the script runs on, and its end is the rank's (no end record until then)
        self.out.end(Outcome.REPORTED, reason=reason)
        if not exit_code and reason == self.steps_reason and self.policy.reported(self.doctors, reports):
            return  # the policy goes on in this process, and leaves when it is done
        self.leave()

    def _exchange(
        self, reason: str, timeout: float | None, exit_code: int | None, *, follow: bool
    ) -> list[Report] | None:
        """Every doctor's report (after following's exchange when `follow`); None when the exchange failed, after
        the rank has ended. Collective."""
        timeout = self.remaining() if timeout is None else timeout
        try:
            followed = self.follow.exchange(self.doctors, reason, timeout) if follow else None
            reports = [doctor.report(timeout=timeout) for doctor in self.doctors]
        except DoctorError as exc:
            self._finishing = True
            logger.warning("ddp-doctor: rank %d could not exchange records (%s): %s", self.rank, reason, exc)
            self.out.end(Outcome.NO_EXCHANGE, error=str(exc))
            self._exit(1 if exit_code is None else exit_code)
            return None
        except Exception as exc:  # noqa: BLE001  (a bug of ours must never read as a clean report)
            self._internal_error(exc)
            return None
        if follow:
            self.follow.annotate(self.doctors, reports, followed)
        return reports

    def _internal_error(self, exc: Exception) -> None:
        """A bug of ours while reporting: the rank ends as `internal-error`, with our traceback, and exits 1."""
        self._finishing = True
        self.out.end(
            Outcome.INTERNAL_ERROR, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-20000:]
        )
        self._exit(1)

    def leave(self) -> None:
        """Wait (briefly) for every rank to get here, then exit with status 0."""
        try:
            # Nobody leaves while a peer may still be reading from its sockets.
            arrive("ddp_doctor/exit", timeout=min(10.0, max(0.5, self.remaining())))
        except DoctorError:
            pass
        self._exit(0)

    def _exit(self, code: int) -> None:
        self.ended.set()
        self.watchdog.write()
        sys.stdout.flush()
        sys.stderr.flush()
        # os._exit: the rest of the script, its atexit handlers and its finally blocks (which may save a
        # half-trained checkpoint) must not run in a diagnostic run.
        os._exit(code)

    @property
    def deadline(self) -> float:
        """Wall-clock time by which every rank must have ended (0: none)."""
        return self.config.deadline

    def remaining(self) -> float:
        """Seconds left before the deadline, less a margin to write the results (at least 1)."""
        return max(1.0, self.config.deadline - time.time() - 2.0) if self.config.deadline else 300.0
