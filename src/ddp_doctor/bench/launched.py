"""One launch of the script under `ddp-doctor bench`, and what it left: the check's result plus the bench's own.

The parent starts the bench's entry point (`start.py`) in every rank through the check's supervisor, with the
launch's `BenchPlan` in the bench's own environment variable, then reads back what only the bench asks about: the
timed steps after the report (`timing.json`), an error raised after the report (a rank's end record with
`Outcome.CRASHED_AFTER_REPORT`), and the launch's `BenchLog`.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ddp_doctor.bench.plan import ENV_VAR, TIMING_FILE, BenchLog, BenchPlan
from ddp_doctor.core.rankfiles import Outcome, read_ends
from ddp_doctor.launch.config import RankConfig
from ddp_doctor.launch.outcome import CheckResult
from ddp_doctor.launch.supervise import run_check

__all__ = ["BOOTSTRAP", "LaunchResult", "read_launch", "run_launch", "time_steps"]

BOOTSTRAP = "ddp_doctor.bench.start"
"""The module torchrun starts in every rank of a bench launch. Named, not imported: `python -m` warns about a
module already imported by its package."""


@dataclass(kw_only=True)
class LaunchResult:
    """What one bench launch produced on this node."""

    check: CheckResult
    """The check's result: the report of the observed steps (or why there is none)."""
    step_times: list[float] | None = None
    """The first timed block's optimizer-step times after the report (no hook left), from local rank 0."""
    late_crash: str | None = None
    """An error raised after the report was written (during the blocks that follow it), per rank."""
    log: BenchLog | None = None
    """What the launch's blocks did (None when the ranks wrote no log)."""


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_launch(check: CheckResult, folder: Path) -> LaunchResult:
    """The bench's part of what a launch left in `folder`, next to the check's `check`."""
    out = LaunchResult(check=check, log=BenchLog.read(folder))
    # Only a launch that reported has steps after the report (timed, or crashed in).
    if check.error is None and _read(folder / "report.json") is not None:
        timing = _read(folder / TIMING_FILE)
        out.step_times = timing["step_s"] if timing else None
        late = [
            f"rank {end.rank}: {end.raised.type}: {end.raised.message[:300]}"
            for end in read_ends(folder).values()
            if end.outcome is Outcome.CRASHED_AFTER_REPORT and end.raised is not None
        ]
        out.late_crash = "; ".join(late) or None
    return out


def run_launch(
    namespace: dict[str, Any],
    config: RankConfig,
    plan: BenchPlan,
    *,
    timeout: float,
    output: IO[str] | None,
    outdir: Path,
) -> LaunchResult:
    """Run the script under torchrun with the check's doctor and the bench's policy in every rank.

    Args:
        namespace: torchrun's parsed namespace for the script (as a dict).
        config: the check's settings for the ranks (the first block's DDP arguments among them).
        plan: the blocks this launch runs.
        timeout: seconds after which every rank is stopped.
        output: where the script's output goes (None: this process's own).
        outdir: the ranks' files go here (read back after the launch).
    """
    check = run_check(
        namespace,
        config,
        timeout=timeout,
        output=output,
        outdir=outdir,
        bootstrap=BOOTSTRAP,
        env={ENV_VAR: plan.to_env()},
    )
    return read_launch(check, outdir)


def time_steps(
    namespace: dict[str, Any], *, steps: int, timed_steps: int, timeout: float, output: IO[str] | None = None
) -> LaunchResult:
    """Check the script (`steps` observed), then time `timed_steps` more optimizer steps with every hook removed.

    Example:
        >>> from torch.distributed.run import get_args_parser
        >>> ns = vars(get_args_parser().parse_args(["--nproc-per-node", "2", "train.py"]))
        >>> time_steps(ns, steps=4, timed_steps=4, timeout=120).step_times  # doctest: +SKIP
    """
    config = RankConfig(target=namespace["training_script"], module=bool(namespace["module"]), steps=steps)
    plan = BenchPlan(steps=timed_steps, rounds=1, share=False)
    with tempfile.TemporaryDirectory(prefix="ddp-doctor-bench-") as tmp:
        return run_launch(namespace, config, plan, timeout=timeout, output=output, outdir=Path(tmp))
