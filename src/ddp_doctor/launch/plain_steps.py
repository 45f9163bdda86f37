"""The rank's path without DDP: every optimizer step of the process (the first optimizer that trains on several
ranks is followed for `model-not-wrapped`, or the FSDP2 model it steps); once that model has stepped, each forward
through it, each `state_dict()` of it and each gather of its sharded tensors in full, counted by the user's line in
the beacon; and the report
at the end of the observed steps, after following the script through its epoch ends for a sharded model (as DDP's
path does: `following_run.py`).

A collective some ranks enter alone (an evaluation or a `full_state_dict=True` save under `if rank == 0:`, in the
observed steps or at an epoch end), or a `state_dict()` that changed FSDP2's state on some ranks only, is named
from those counts when the run fails (`analyze/sharded_failures.py`),
whether or not the watchdog's last sample caught the rank inside it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.optim.optimizer import Optimizer

from ddp_doctor.core.beacon import Beacon
from ddp_doctor.core.frames import user_call, user_site
from ddp_doctor.core.phase import Phase
from ddp_doctor.core.rankfiles import write_json
from ddp_doctor.doctor import Doctor
from ddp_doctor.doctor.plain_watch import PlainOptimizerWatch
from ddp_doctor.exchange.control import epoch_repeated
from ddp_doctor.exchange.drive import drive
from ddp_doctor.exchange.primitives import comm_device
from ddp_doctor.exchange.runner import arrive
from ddp_doctor.launch.config import RankConfig
from ddp_doctor.launch.following_run import EpochFollowing
from ddp_doctor.observation import dataloaders
from ddp_doctor.report.model import Report

__all__ = ["PlainSteps"]

_LINES = 8
"""Lines counted at most per kind (the beacon stays small; a ninth line is not counted)."""


class PlainRun(Protocol):
    """What the callbacks read and call: the in-rank run (`session.py`'s `Session`)."""

    config: RankConfig
    doctors: list[Doctor]
    plain: PlainOptimizerWatch
    beacon: Beacon
    follow: EpochFollowing
    local_rank: int
    outdir: Path

    @property
    def finishing(self) -> bool: ...

    @property
    def steps_reason(self) -> str: ...

    def finish_unwrapped(self, reason: str) -> None: ...

    def remaining(self) -> float: ...


class PlainSteps:
    """See the module docstring. `on_step` is an optimizer step post-hook, `on_gather` is `patch_full_gather`'s
    callback."""

    def __init__(self, run: PlainRun) -> None:
        self._run = run
        self._report: Report | None = None
        """The observed steps' report, kept while the script is followed."""

    def on_step(self, opt: Optimizer, _args: Any, _kwargs: Any) -> None:
        """With no DDP model, follow the first optimizer that trains on several ranks (`model-not-wrapped`)."""
        run = self._run
        if run.doctors or run.finishing or not run.plain.on_step(opt):
            return
        if run.follow.active:  # past the observed steps: the phase stays "following"
            run.beacon.update(step=run.plain.steps)
            return
        one = dataloaders.last_pass()  # the loader this step trained on: ranks of different lengths run out apart
        loader = None if one is None else {"site": one.info.get("site"), "batches": one.info.get("batches")}
        run.beacon.update(step=run.plain.steps, phase=Phase.BETWEEN_STEPS.value, train_loader=loader)
        if run.plain.sharded is not None and run.beacon.state.sharding is None:
            run.beacon.update(
                sharding=run.plain.sharded.describe(), backend=str(dist.get_backend()), framework=run.plain.framework
            )
            # First, before FSDP2's own pre-hook all-gathers (and waits for the other ranks): the clock's wait for
            # data ends where the forward is entered, and a forward that hangs in its all-gather is counted.
            run.plain.sharded.root.register_forward_pre_hook(self._on_forward, prepend=True)
            run.plain.sharded.root.register_state_dict_pre_hook(self._on_state_dict)
        if run.plain.steps >= run.config.steps:
            run.finish_unwrapped(run.steps_reason)

    def _on_forward(self, _module: Any, args: Any) -> None:
        """Count a forward through the FSDP2 model by the user's line: a forward some ranks run alone (an evaluation
        on rank 0) pairs its all-gathers with the others' next collectives; and the step clock's first forward after
        a step."""
        self._run.plain.note_forward(args)
        site, first = user_site() or "an unknown place", self._run.beacon.state.forward_first
        if site not in first and len(first) < _LINES:  # (published with the line's first count, just below)
            first[site] = [self._run.plain.steps, torch.is_grad_enabled()]
        self._count(self._run.beacon.state.forwards, site)

    def _on_state_dict(self, _module: Any, _prefix: str, _keep_vars: bool) -> None:
        """Count a `state_dict()` of the FSDP2 model by the user's line: on some ranks only (a save under
        `if rank == 0:`), it reshards there what a forward left unsharded, and the ranks' next all-gathers differ.
        The script's own line, past a framework's (`trainer.save_checkpoint(...)` under `if trainer.is_global_zero:`
        takes it inside Lightning)."""
        if not self._run.finishing:
            self._count(self._run.beacon.state.state_dicts, user_site(frameworks=True) or "an unknown place")

    def on_shard(self, site: str | None, policy: Any) -> None:
        """A `fully_shard` call of the script (at `site`, with its `mp_policy`): counted in the beacon, with the
        first policy that runs a module in another dtype, so a failure before the first step is read as FSDP2's."""
        shard = dict(self._run.beacon.state.fully_shard or {"calls": 0, "site": site})
        shard["calls"] += 1
        dtype = getattr(policy, "param_dtype", None)
        if dtype is not None and "policy" not in shard:
            shard["policy"] = {
                "site": site,
                "param_dtype": str(dtype).removeprefix("torch."),
                "cast_forward_inputs": bool(getattr(policy, "cast_forward_inputs", True)),
            }
        self._run.beacon.update(fully_shard=shard)

    def on_gather(self, frame: FrameType) -> None:
        """Count a gather of sharded tensors in full (called from `frame`) by the function the user's line called
        and that line, once the FSDP2 model has stepped (before that, no count: the path's other evidence, a
        traceback or the watchdog's sample, still applies)."""
        if self._run.beacon.state.sharding is not None and not self._run.finishing:
            site, call = user_call(frame)
            self._count(self._run.beacon.state.gathers, f"{call} at {site or 'an unknown place'}")

    def _count(self, counts: dict[str, int], key: str) -> None:
        """One more at `key`; the beacon is written when a line is first counted (before its collective starts:
        a rank that dies or hangs in it has said where it was), later counts ride on the next write."""
        if key in counts:
            counts[key] += 1
        elif len(counts) < _LINES:
            counts[key] = 1
            self._run.beacon.update()

    def conclude(self, reason: str) -> bool:
        """The path's end: compare the followed optimizer's parameters across ranks and write the report (local
        rank 0). For a sharded model at the end of its observed steps with `--follow-epochs`, write that report to
        `report.steps.json` and start following instead (True: the script goes on); at following's end, the report
        gains what following saw. Collective; raises `DoctorError` when the ranks cannot exchange."""
        run = self._run
        sharded = run.plain.sharded
        if self._report is None:
            arrive("ddp_doctor/unwrapped", timeout=min(run.config.crash_wait_s, run.remaining()))
            self._report = run.plain.report()
            if sharded is not None and reason == run.steps_reason and run.follow.enabled:
                self._write("report.steps.json", reason)
                if run.follow.start([], hint=sharded.device):
                    run.plain.freeze()
                    run.beacon.update(phase=Phase.FOLLOWING.value)
                    return True
        if sharded is not None:
            # Also without following: each loader's counted passes and len() per rank (`uneven-inputs`), whether a
            # sampler's epoch repeated, and the files written.
            summary = run.follow.exchange([], reason, run.remaining(), hint=sharded.device)
            if summary is not None:
                summary = replace(summary, repeated_epoch=self._repeated_epoch(sharded.device))
            if run.plain.frozen:  # followed: the steps' report again, with the saves of the epoch end
                self._report = run.plain.report()
            self._report = run.follow.annotated(self._report, summary)
        self._write("report.json", reason)
        return False

    def _repeated_epoch(self, hint: torch.device | None) -> dict[str, Any] | None:
        """The training sampler's repeated epoch (`FollowWatch.repeated_epoch`) when any rank saw one (every rank
        runs the same loop: this rank's loader is named, or none when this rank saw no repeat). Collective: the
        control round `epoch_repeated`."""
        mine = self._run.follow.watch.repeated_epoch()
        if not drive(epoch_repeated(mine is not None), group=None, device=comm_device(None, hint)):
            return None
        return {**(mine or {"site": None, "epoch": None, "seen": []}), "ranks": list(range(dist.get_world_size()))}

    def _write(self, name: str, reason: str) -> None:
        run, report = self._run, self._report
        assert report is not None
        opt = run.plain.optimizer
        model = {
            "site": getattr(opt, "_ddp_doctor_site", None),
            "framework": run.plain.framework,
            "module": run.plain.module or type(opt).__qualname__,
            "report": report.to_dict(),
        }
        if run.local_rank == 0:
            write_json(run.outdir / name, {"reason": reason, "models": [model]})
