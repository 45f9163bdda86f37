"""What the `check` parent tells each rank, through one environment variable (`ddp-doctor bench` adds its own
plan in another: `bench/plan.py`)."""

from __future__ import annotations

import ctypes
import json
import os
import signal
from dataclasses import asdict, dataclass, field
from typing import Any

from ddp_doctor.core import CHECK_ENV_VAR

__all__ = [
    "CLI_PID_VAR",
    "DESTROYED",
    "ENV_VAR",
    "LAUNCHER_PID_VAR",
    "RUN_MARKER_VAR",
    "SCRIPT_ENDED",
    "RankConfig",
    "die_with_parent",
    "steps_reason",
]

ENV_VAR = CHECK_ENV_VAR
RUN_MARKER_VAR = "DDP_DOCTOR_RUN"
"""Set to a fresh id in the environment of every process a run starts (torchrun, ranks, their children): the
supervisor finds them by scanning /proc for it, from the first millisecond, without any file the ranks write."""
CLI_PID_VAR = "DDP_DOCTOR_CLI_PID"
LAUNCHER_PID_VAR = "DDP_DOCTOR_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1

# Why the ranks wrote their report (`reason` in report.json): `watch` reads what the script does next from it.
DESTROYED = "the script destroyed its process group"
"""Before its observed steps were done: the report is made while the group exists (under `watch` the script goes
on past it, without collectives)."""
SCRIPT_ENDED = "the script ended"
"""Before its observed steps were done, on every rank (it returned, or called `sys.exit(0)`)."""


def steps_reason(steps: int) -> str:
    """The observed steps were all seen (under `check` the script is stopped there; under `watch` it trains on)."""
    return f"{steps} steps observed"


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux `PR_SET_PDEATHSIG`).

    torchrun's workers and torchrun itself call this first thing, so a `ddp-doctor` that is killed outright
    (SIGKILL, an OOM kill) still takes its whole run with it. The parent's pid, passed in the environment, closes the
    race where the parent died before the call. A no-op where prctl is missing (not Linux).
    """
    expected = os.environ.get(LAUNCHER_PID_VAR if os.environ.get(LAUNCHER_PID_VAR) else CLI_PID_VAR)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if expected and os.getppid() != int(expected):
        os._exit(1)


@dataclass(kw_only=True, slots=True)
class RankConfig:
    """The check's settings, as every rank of the launched script sees them."""

    target: str
    """The user's script path, or module name when `module` is true."""
    module: bool = False
    """Run `target` like `python -m target`."""
    steps: int = 8
    """Observe this many optimizer steps of every DDP model, then stop the script on all ranks."""
    ddp_kwargs: dict[str, Any] = field(default_factory=dict)
    """DDP constructor arguments that override the script's own."""
    freeze_before_wrap: list[str] = field(default_factory=list)
    """Parameter names to set `requires_grad=False` on right before DDP is built."""
    outdir: str = "."
    """This node's folder for the ranks' progress, crash records and the report."""
    deadline: float = 0.0
    """Wall-clock time (`time.time()`) by which every rank must have ended."""
    follow_epochs: int = 0
    """After the observed steps, follow the script through this many epoch ends (0: stop right after them)."""
    limit_batches: int = 2
    """While following, every DataLoader pass hands out at most this many batches."""
    crash_wait_s: float = 10.0
    """After a crash, how long a rank waits for the others to join the report before it gives up and exits."""
    reshard_off: list[int] = field(default_factory=list)
    """`fully_shard` calls (0 the first the script makes) to run with `reshard_after_forward=False`: the advice a
    verification run applies to a sharded model (`verify.py`)."""
    whole_run: bool = False
    """After the report, let the script train on to its own end, lightly watched (`ddp-doctor watch`)."""

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> RankConfig:
        raw = os.environ.get(ENV_VAR)
        if not raw:
            raise RuntimeError(
                f"{ENV_VAR} is not set: ddp_doctor.launch.bootstrap is started by `ddp-doctor check` (or `bench`)."
            )
        return cls(**json.loads(raw))
