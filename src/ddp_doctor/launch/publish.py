"""What the in-rank run (`session.py`) leaves for the supervisor in the node's output folder, the files of
`core/rankfiles.py` and `core/beacon.py`: the rank's live position in its beacon, the watchdog's progress sample,
the rank's end record, and the reports once the ranks exchanged records."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddp_doctor.core.beacon import Beacon, ClosedStep
from ddp_doctor.core.frames import user_site_of
from ddp_doctor.core.phase import Phase
from ddp_doctor.core.rankfiles import EndRecord, Outcome, ProgressSample, write_end, write_json
from ddp_doctor.doctor import Doctor
from ddp_doctor.launch.following_run import is_world
from ddp_doctor.launch.peer_ends import receive, share
from ddp_doctor.launch.watchdog import main_thread_position
from ddp_doctor.report.model import Report

__all__ = ["Publisher"]


class Publisher:
    """Writes one rank's files. `doctors` and `models` are the session's lists (one entry per DDP model, in the
    order the script built them), read when a file is written; `beyond_steps` names the phase when the script runs past
    its observed steps (followed through its epoch ends, or watched to its end), else None."""

    def __init__(
        self,
        outdir: Path,
        *,
        doctors: list[Doctor],
        models: list[dict[str, Any]],
        ended: threading.Event,
        beyond_steps: Callable[[], Phase | None],
    ) -> None:
        self.outdir = outdir
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.doctors, self.models, self.ended, self.beyond_steps = doctors, models, ended, beyond_steps
        self.beacon = Beacon(outdir / f"rank{self.rank}.beacon")

    def position(self, doctor: Doctor) -> None:
        """Publish the rank's position (step, phase, the user's line) in its beacon."""
        model = next((i for i, d in enumerate(self.doctors) if d is doctor), len(self.doctors))
        extra: dict[str, Any] = {}
        if doctor.position.used_set_news:
            # What the step left without a gradient once its backward computed them all: a rank that then waits in
            # DDP's all-reduce (or a later collective) for a peer that never comes still tells which parameters it
            # trained (analyze.failures reads it against a peer's DDP error).
            step, names = doctor.position.missing_grads()
            extra["closed"] = ClosedStep(step=step, missing=list(names))
        self.beacon.update(
            step=doctor.position.step,
            phase=doctor.position.phase,
            model=model,
            site=user_site_of(sys._getframe(2)),
            **extra,
        )

    def progress(self) -> ProgressSample:
        """Where the rank is now (the watchdog's sample; any thread)."""
        active = next((d for d in self.doctors if not d.finished), self.doctors[-1] if self.doctors else None)
        user, innermost = main_thread_position()
        return ProgressSample(
            rank=self.rank,
            local_rank=self.local_rank,
            world_size=self.world_size,
            pid=os.getpid(),
            ddp_models=len(self.doctors),
            models=self.models,
            step=self._step(active),
            phase=self._phase(active),
            user_frame=user,
            innermost=innermost,
            ended=self.ended.is_set(),
            time=time.time(),
        )

    def _step(self, active: Doctor | None) -> int:
        """The active doctor's step; with no DDP model, the FSDP2 model's optimizer step the session published (-1
        before any)."""
        if active is not None:
            return active.position.step
        return self.beacon.state.step if self.beacon.state.sharding is not None else -1

    def _phase(self, active: Doctor | None) -> str:
        beyond = self.beyond_steps()
        if beyond is not None:
            return beyond.value
        if active is not None:
            return active.position.phase
        if self.beacon.state.sharding is not None:
            return self.beacon.state.phase
        return Phase.BEFORE_DDP.value

    def end(self, outcome: Outcome, *, overwrite: bool = False, **fields: Any) -> None:
        """Write the rank's end record (the first ending wins, unless `overwrite`); `fields`: `EndRecord`'s."""
        record = EndRecord(
            rank=self.rank,
            local_rank=self.local_rank,
            world_size=self.world_size,
            pid=os.getpid(),
            outcome=outcome,
            models=self.models,
            ddp_models=len(self.doctors),
            **fields,
        )
        if not write_end(self.outdir, record, overwrite=overwrite):
            return
        if outcome in (Outcome.EXITED, Outcome.CRASHED, Outcome.CRASHED_AFTER_REPORT):
            raised = fields.get("raised")
            if raised is not None and raised.peer_lost:
                receive(self.outdir, self.rank)  # a peer left: which, when another node's (`peer_ends.py`)
            share(self.rank, record.to_dict(), self.beacon.state)

    def reports(self, reports: list[Report], reason: str, name: str) -> None:
        """A model over the whole world is written to `name` by each node's local rank 0; a model over a subgroup
        (a data-parallel group of a hybrid job) by the group's first rank, into its own file."""
        world = [(m, r) for d, m, r in zip(self.doctors, self.models, reports) if is_world(d.ddp.process_group)]
        mine = [
            (m, r)
            for d, m, r in zip(self.doctors, self.models, reports)
            if not is_world(d.ddp.process_group) and dist.get_rank(d.ddp.process_group) == 0
        ]
        if self.local_rank == 0:
            write_json(
                self.outdir / name, {"reason": reason, "models": [{**m, "report": r.to_dict()} for m, r in world]}
            )
        if mine and name == "report.json":
            write_json(
                self.outdir / f"report.rank{self.rank}.json",
                {"reason": reason, "models": [{**m, "report": r.to_dict()} for m, r in mine]},
            )
