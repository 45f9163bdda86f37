"""What the `check` parent tells each rank, through one environment variable."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["ENV_VAR", "RankConfig"]

ENV_VAR = "DDP_DOCTOR_CHECK"


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
    timed_steps: int = 0
    """After the observed steps and the report, time this many more optimizer steps with every hook removed
    (`ddp-doctor bench`); the step times go to `timing.json`."""
    crash_wait_s: float = 10.0
    """After a crash, how long a rank waits for the others to join the report before it gives up and exits."""

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> RankConfig:
        raw = os.environ.get(ENV_VAR)
        if not raw:
            raise RuntimeError(f"{ENV_VAR} is not set: ddp_doctor.launch.bootstrap is started by `ddp-doctor check`.")
        return cls(**json.loads(raw))
