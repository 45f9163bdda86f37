"""What a launch does after the check's observed steps: the policy the in-rank run (`session.py`) consults.

The run itself (the wrap of DDP's constructor, the observation, the ending by crash, exit or finish) is the same
for every launch. What differs is what happens after the report: `ddp-doctor check` ends the rank right there
(`CheckPolicy`); `ddp-doctor bench` goes on in the same processes (its policy lives in `bench/inrank.py`, started by
its own entry point, so launch never names bench).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from torch.nn.parallel import DistributedDataParallel

from ddp_doctor.doctor import Doctor

if TYPE_CHECKING:
    from ddp_doctor.report.model import Report

__all__ = ["CheckPolicy", "RunPolicy", "StopsAtReport"]


class RunPolicy(Protocol):
    """The hooks the in-rank run calls. Every method runs on the rank's main thread, inside the script."""

    whole_run: bool
    """The script runs to its own end after the report (`watch`): the rank then leaves as the script does, with
    its status and its atexit handlers, not from inside the doctor."""

    def wrapped(self, ddp: DistributedDataParallel, trainable: list[bool]) -> None:
        """The script built a DDP model (before the report); `trainable` is its own `requires_grad` before any
        freezing the launch applied."""
        ...

    def reported(self, doctors: list[Doctor], reports: list[Report]) -> bool:
        """Every doctor saw its K steps and the report is written (`reports`, one per DDP model, identical on
        every rank; none for a model without DDP, whose report the ranks wrote). True: the policy took over and the
        rank does not leave now (the policy leaves later)."""
        ...

    def script_ended(self) -> bool:
        """The script returned or called `sys.exit`. True: the policy had taken over and has wrapped up; the rank
        leaves with status 0 (the script's end is the policy's end, not a finding)."""
        ...

    def script_returned(self, exc: SystemExit | None, code: int) -> None:
        """`whole_run` only: the script returned (`exc` None) or called `sys.exit` after the report; the policy ends
        the rank the way the script would (it raises `SystemExit`)."""
        ...

    def runs_on(self, reason: str, exit_code: int | None, doctors: list[Doctor], reports: list[Report]) -> bool:
        """`whole_run` only: the report is written at `reason` (`launch/config.py`); True: the rank does not leave
        now (the script runs on, or it ends the way it ends, in `Session.on_exit`)."""
        ...

    def torn_down(self, site: str | None) -> None:
        """The script destroyed its default process group at `site` (under `whole_run` it runs on, without
        collectives; elsewhere the rank has left before)."""
        ...


class StopsAtReport:
    """The hooks of a policy that does not run the whole job (`whole_run` False): never called, or nothing to do."""

    whole_run = False

    def script_returned(self, exc: SystemExit | None, code: int) -> None:
        return None

    def runs_on(self, reason: str, exit_code: int | None, doctors: list[Doctor], reports: list[Report]) -> bool:
        return False

    def torn_down(self, site: str | None) -> None:
        return None


class CheckPolicy(StopsAtReport):
    """`ddp-doctor check`: nothing after the report; the rank leaves."""

    def wrapped(self, ddp: DistributedDataParallel, trainable: list[bool]) -> None:
        return None

    def reported(self, doctors: list[Doctor], reports: list[Report]) -> bool:
        return False

    def script_ended(self) -> bool:
        return False
