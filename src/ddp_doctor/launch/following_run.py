"""The launch's side of following a script through its epoch ends (`check --follow-epochs N`): when it starts,
when it ends, the exchange at its end, and what it adds to the reports. The watch itself (the capped loaders, the
sync points) is `observation/following_watch.py`; the exchange `exchange/following_rounds.py`; the findings `analyze/following_ends.py`.

Every rank follows or none does: whether the observed steps trained on an open DataLoader pass is agreed in one
all_reduce(MIN) when they end. Following ends at the first optimizer step of a training pass started after the Nth
epoch end, at the script's end, when it destroys its process group, or where a loop that calls `next()` itself lets
the StopIteration of a capped pass escape (`CAPPED_NEXT`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ddp_doctor.analyze import diagnose_following
from ddp_doctor.core.following import FollowSummary, JoinedLoop
from ddp_doctor.doctor import Doctor
from ddp_doctor.exchange.control import following_agreed
from ddp_doctor.exchange.drive import drive
from ddp_doctor.exchange.following_rounds import exchange_follow
from ddp_doctor.exchange.primitives import comm_device
from ddp_doctor.launch.config import RankConfig, steps_reason
from ddp_doctor.observation import dataloaders
from ddp_doctor.observation.following_watch import FollowWatch
from ddp_doctor.observation.joins import JOIN_SITES, JOIN_THROWS
from ddp_doctor.report.model import Report

__all__ = ["CAPPED_NEXT", "EpochFollowing", "ended_by_our_cap", "group_timeout", "is_world"]

CAPPED_NEXT = (
    "the script called next() on a DataLoader iterator that following had ended (it does not expect the pass to end)"
)


def is_world(group: dist.ProcessGroup | None) -> bool:
    return group is None or group is dist.group.WORLD or dist.get_world_size(group) == dist.get_world_size()


def group_timeout() -> float | None:
    """The default process group's timeout in seconds (what `init_process_group(timeout=...)` set), or None."""
    backend = str(dist.get_backend()).lower()
    device = torch.device("cuda" if "nccl" in backend and "gloo" not in backend else "cpu")
    try:
        timeout = dist.group.WORLD._get_backend(device).options._timeout
        return float(timeout.total_seconds())
    except Exception:  # noqa: BLE001  (a private API: unknown on a torch that lacks it)
        return None


def ended_by_our_cap(exc: BaseException) -> bool:
    """A StopIteration from a capped DataLoader pass that the script's own next() call let escape (bare, or turned
    into RuntimeError by a generator)."""
    stop = exc if isinstance(exc, StopIteration) else exc.__cause__ if isinstance(exc, RuntimeError) else None
    if not isinstance(stop, StopIteration):
        return False
    last = dataloaders.last_pass()
    return last is not None and last.capped


def _device(doctors: Sequence[Doctor], hint: torch.device | None) -> torch.device:
    params = [p for d in doctors for p in d.ddp.parameters()][:1]
    return comm_device(None, params[0].device if params else hint)


class EpochFollowing:
    """One rank's following. `install` before the script runs; `before_step` before every optimizer step."""

    def __init__(self, config: RankConfig) -> None:
        self.config = config
        self.watch = FollowWatch()
        self.active = False
        self.stopped_by = ""
        """Why the rank's records were last exchanged (`launch/config.py`'s reasons, or following's own)."""

    @property
    def enabled(self) -> bool:
        return bool(self.config.follow_epochs)

    def install(self) -> None:
        self.watch.install()

    def before_step(self) -> bool:
        """True: following is done (the next epoch's first step)."""
        return self.watch.on_step() and self.active

    @property
    def reason(self) -> str:
        return f"the next epoch's first step, after {self.watch.epoch_ends} epoch end(s)"

    def start(self, doctors: Sequence[Doctor], hint: torch.device | None = None) -> bool:
        """At the end of the observed steps: end the training pass and cap every later one. Collective (the
        control round `following_agreed`); False when following is off or some rank's steps did not train on an
        open DataLoader pass. `hint`: the model's device where no DDP model gives it (an FSDP2 model's, for NCCL)."""
        every = drive(following_agreed(self.watch.can_start()), group=None, device=_device(doctors, hint))
        models = [d.ddp for d in doctors]
        if not self.watch.start(self.config.follow_epochs, self.config.limit_batches, models, agreed=every):
            return False
        self.active = True
        for doctor in doctors:
            doctor.listen_after_steps()
        return True

    def exchange(
        self, doctors: Sequence[Doctor], reason: str, timeout: float, hint: torch.device | None = None
    ) -> FollowSummary | None:
        """Stop following and reduce what it saw over every rank. Collective. Also with following off: the loaders'
        counted passes and the files written are reported all the same."""
        self.stopped_by = reason
        record = self.watch.stop(reason, timeout_s=group_timeout())
        for doctor in doctors:
            doctor.stop_listening()
        return exchange_follow(record, timeout=timeout, device=_device(doctors, hint))

    def annotate(self, doctors: Sequence[Doctor], reports: list[Report], summary: FollowSummary | None) -> None:
        """Put in `reports`, for each model over the whole world, the report of its diagnosis with what following
        found (`annotated`)."""
        for i, (doctor, report) in enumerate(zip(doctors, reports)):
            if is_world(doctor.ddp.process_group):
                reports[i] = self.annotated(report, summary)

    def annotated(self, report: Report, summary: FollowSummary | None) -> Report:
        """A new report of `report`'s diagnosis with what following found (`analyze.diagnose_following`: the
        section, its findings, what went unchecked, the files written). The report itself is never edited."""
        diagnosis = diagnose_following(
            report.diagnosis,
            summary,
            framework=report.framework,
            epochs=self.config.follow_epochs,
            limit=self.config.limit_batches,
            followed=self.enabled,
            parallelism=report.facts.parallelism,
            world=report.facts.world_size,
            stopped=self.stopped_by == steps_reason(self.config.steps),
            watched=self.config.whole_run,
            joined=JoinedLoop(JOIN_SITES[0], throws=JOIN_SITES[0] in JOIN_THROWS) if JOIN_SITES else None,
        )
        return Report.build(report.facts, diagnosis)
