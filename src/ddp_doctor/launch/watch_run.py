"""`ddp-doctor watch` in the parent: run the whole job, print the first steps' report as soon as it is written,
and call a hang while it happens.

The ranks run under `check`'s launch with `RankConfig.whole_run` (`watch_rank.py`): no step cap, no deadline. This
side polls the ranks' beacons (`core/beacon.py`, shared memory: no system call in the rank). When no rank's beacon
has changed for `hang_after` seconds (by default half the process group's timeout, which the ranks publish), it asks
every rank for its stacks (`STACKS_SIGNAL`), reads where each rank is, and decides what the ranks' files say with
the failure analysis `check` uses (`analyze/failures.py`): which ranks wait in which collective at which line, and
which rank is elsewhere. The verdict is printed and written to `hang.json` in the run folder, which survives the
job; `ddp-doctor explain` reads that folder again later.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_doctor.core.beacon import BeaconState, read_beacon
from ddp_doctor.core.rankfiles import end_path, progress_path

__all__ = [
    "DEFAULT_HANG_AFTER_S",
    "STACKS_SIGNAL",
    "HangVerdict",
    "WatchLoop",
    "beacons",
    "hang_verdict",
    "last_progress",
    "stacks_path",
    "write_json",
]

STACKS_SIGNAL = signal.SIGRTMIN + 6
"""The signal that makes a watched rank write every thread's Python stack (a real-time signal: the script's own
SIGUSR1 / SIGUSR2 handlers, a scheduler's requeue signal, stay its own)."""

DEFAULT_HANG_AFTER_S = 300.0
"""`--hang-after` before any rank has published its process group's timeout."""
_POLL_S = 0.2
_STACKS_WAIT_S = 1.0


def beacons(folder: Path) -> dict[int, BeaconState]:
    """Each rank's last published state on this node."""
    out = {}
    for path in folder.glob("rank*.beacon"):
        state = read_beacon(path)
        if state is not None:
            out[int(path.name[4 : -len(".beacon")])] = state
    return out


def stacks_path(folder: Path, rank: int) -> Path:
    """Where a watched rank writes its threads' stacks when asked (`STACKS_SIGNAL`)."""
    return folder / f"rank{rank}.stacks"


def last_progress(folder: Path, states: dict[int, BeaconState]) -> float | None:
    """When a live rank (one without an end record) last moved: its beacon changed (a step, a phase, a collective
    entered or left) or its watchdog's sample of the main thread's line changed. None when no rank is live.

    A rank that runs code (an evaluation alone, a long save) moves its sampled line; one that waits in a
    collective, or loops on one line, does not."""
    moved = []
    for rank, state in states.items():
        if end_path(folder, rank).exists():
            continue
        try:
            sampled = progress_path(folder, rank).stat().st_mtime
        except OSError:
            sampled = 0.0
        moved.append(max(state.time, sampled))
    return max(moved) if moved else None


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


@dataclass(kw_only=True)
class HangVerdict:
    """What the ranks were doing when none had made progress for `stalled_s` seconds."""

    stalled_s: float
    hang_after_s: float
    group_timeout_s: float | None
    at: float
    """`time.time()` when the verdict was made."""
    findings: list[Any] = field(default_factory=list)
    """The failure analysis's findings (`core/findings.Finding`), the first one the cause."""
    positions: list[dict[str, Any]] = field(default_factory=list)
    """Per rank: `rank`, `step`, `phase`, `line` (the user's line on its main thread), `collective` (the last
    collective the script entered: op, line, whether the rank is inside it), `stacks` (the file)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "ddp-doctor/hang@1",
            "stalled_s": round(self.stalled_s, 1),
            "hang_after_s": self.hang_after_s,
            "group_timeout_s": self.group_timeout_s,
            "at": self.at,
            "positions": self.positions,
            "findings": [f.to_dict() for f in self.findings],
        }


def hang_verdict(folder: Path, *, stalled_s: float, hang_after_s: float, group_timeout_s: float | None) -> HangVerdict:
    """Where every rank is now, and the failure analysis's reading of it (imports torch: the analysis needs it)."""
    from ddp_doctor.analyze.failures import failure_findings
    from ddp_doctor.core.rankstate import read_rank_states

    now = time.time()
    states = read_rank_states(folder, end_time=now)
    positions = []
    for rank, s in sorted(states.items()):
        c = s.collective
        stacks = stacks_path(folder, rank)
        positions.append(
            {
                "rank": rank,
                "step": s.step,
                "phase": s.phase,
                "line": s.user_frame,
                "innermost": s.innermost,
                "collective": {"op": c.op, "line": c.site, "n": c.n, "inside": s.in_collective} if c else None,
                "ended": s.outcome.value if s.outcome is not None else None,
                "stacks": str(stacks) if stacks.exists() and stacks.stat().st_size else None,
            }
        )
    findings = failure_findings(states, timed_out=True, native=[])
    return HangVerdict(
        stalled_s=stalled_s,
        hang_after_s=hang_after_s,
        group_timeout_s=group_timeout_s,
        at=now,
        findings=findings,
        positions=positions,
    )


class WatchLoop:
    """`run_check`'s `wait` under `watch`: returns when torchrun ends (False), or True after a hang when `on_hang`
    is `stop`.

    Args:
        hang_after: seconds without progress on any rank that make a hang (None: half the process group's timeout,
            once a rank published it; `DEFAULT_HANG_AFTER_S` before).
        on_hang: `wait` (print the verdict, keep waiting) or `stop` (print it, stop the run).
        reported: called once with the run folder when the first steps' report is written.
        hung: called with each verdict.
        resumed: called when the ranks make progress again after a verdict.
        warn: called once with a sentence when `hang_after` is not shorter than the process group's timeout (the
            timeout would end the job before a hang is called).
    """

    def __init__(
        self,
        *,
        hang_after: float | None,
        on_hang: str,
        reported: Callable[[Path], None],
        hung: Callable[[HangVerdict], None],
        resumed: Callable[[float], None],
        warn: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.hang_after, self.on_hang = hang_after, on_hang
        self._reported, self._hung, self._resumed, self._warn = reported, hung, resumed, warn
        self._warned = False
        self.verdicts: list[HangVerdict] = []
        self._announced = False

    def threshold(self, states: dict[int, BeaconState]) -> tuple[float, float | None]:
        """(seconds without progress that make a hang, the process group's timeout when a rank published it)."""
        timeouts = [s.group_timeout for s in states.values() if s.group_timeout]
        group = min(timeouts) if timeouts else None
        if self.hang_after is not None:
            return self.hang_after, group
        return (group / 2 if group else DEFAULT_HANG_AFTER_S), group

    def __call__(self, proc: subprocess.Popen[Any], folder: Path) -> bool:
        hung_at: float | None = None
        while proc.poll() is None:
            time.sleep(_POLL_S)
            if not self._announced and (folder / "report.json").exists():
                self._announced = True
                self._reported(folder)
            states = beacons(folder)
            if not states:
                continue
            last = last_progress(folder, states)
            if last is None:
                continue
            if hung_at is not None:
                if last > hung_at:
                    self._resumed(last - hung_at)
                    hung_at = None
                continue
            hang_after, group = self.threshold(states)
            if group is not None and hang_after >= group and not self._warned:
                self._warned = True
                self._warn(
                    f"--hang-after {hang_after:g} s is not shorter than the process group's timeout ({group:g} s): "
                    "the timeout ends the job before a hang can be called. Pass a --hang-after below it."
                )
            stalled = time.time() - last
            if stalled < hang_after:
                continue
            _ask_for_stacks(states)
            verdict = hang_verdict(folder, stalled_s=stalled, hang_after_s=hang_after, group_timeout_s=group)
            self.verdicts.append(verdict)
            write_json(folder / "hang.json", verdict.to_dict())
            self._hung(verdict)
            if self.on_hang == "stop":
                return True
            hung_at = time.time()
        return False


def _ask_for_stacks(states: dict[int, BeaconState]) -> None:
    """Every local rank writes all its threads' stacks (`watch_rank.STACKS_SIGNAL`); wait a moment for them."""
    asked = False
    for s in states.values():
        try:
            os.kill(s.pid, STACKS_SIGNAL)
            asked = True
        except (ProcessLookupError, PermissionError):
            continue
    if asked:
        time.sleep(_STACKS_WAIT_S)


@dataclass(kw_only=True)
class WatchResult:
    """What `watch` ends with: the result to report, whether the job failed, one sentence on how it ended."""

    check: Any
    """The `CheckResult`: the first steps' report, with the failure's findings first when the job failed."""
    failed: bool
    summary: str
    verdicts: list[HangVerdict] = field(default_factory=list)


def watch(
    namespace: dict[str, Any],
    *,
    steps: int,
    run_dir: Path,
    hang_after: float | None,
    on_hang: str,
    fresh: bool,
    reported: Callable[[Any], None],
    hung: Callable[[HangVerdict], None],
    resumed: Callable[[float], None],
    warn: Callable[[str], None],
) -> WatchResult:
    """Run the whole job (torchrun's parsed `namespace`) with its ranks' records in `run_dir`.

    `reported` gets the first steps' `CheckResult` as soon as the ranks wrote it; `hung` each hang's verdict;
    `resumed` the seconds the ranks stood still, when they move again after a verdict.
    """
    from ddp_doctor.launch.config import RankConfig
    from ddp_doctor.launch.outcome import collect
    from ddp_doctor.launch.supervise import run_check
    from ddp_doctor.launch.warm import FRESH_VAR

    first: list[Any] = []

    def on_report(folder: Path) -> None:
        try:
            reason = json.loads((folder / "report.json").read_text()).get("reason")
        except (OSError, ValueError):
            reason = None
        if reason != f"{steps} steps observed":
            return  # the job ended (a crash, the script's end) before its first steps were all observed
        result = collect(folder, timed_out=False, torchrun_rc=None)
        first.append(result)
        # From here on the joint report is the first steps' own: a later failure is read against it.
        os.replace(folder / "report.json", folder / "report.steps.json")
        reported(result)

    loop = WatchLoop(hang_after=hang_after, on_hang=on_hang, reported=on_report, hung=hung, resumed=resumed, warn=warn)
    config = RankConfig(
        target=namespace["training_script"],
        module=bool(namespace["module"]),
        steps=steps,
        follow_epochs=0,
        whole_run=True,
    )
    env = {FRESH_VAR: "1"} if fresh else None
    started = time.time()
    result = run_check(namespace, config, timeout=None, outdir=run_dir, env=env, wait=loop)
    states = beacons(run_dir)
    stepped = max((s.step for s in states.values()), default=-1)
    rc = _torchrun_rc(run_dir)
    seconds = time.time() - started
    if result.interrupted is not None:
        summary, failed = f"the job was stopped by {signal.Signals(result.interrupted).name}", True
    elif result.timed_out:
        summary, failed = "the job was stopped after the hang (--on-hang stop)", True
    elif rc == 0 and first:
        summary, failed = f"the job finished on every rank after {stepped} optimizer steps, in {seconds:.0f} s", False
        result = first[0]
    elif first and (aborted := aborted_at_exit(run_dir)) is not None:
        summary, failed = (
            f"the script ran to its end after {stepped} optimizer steps, in {seconds:.0f} s; {aborted}",
            False,
        )
        result = first[0]
    elif first:
        summary, failed = "the job failed after the first steps", True
    elif rc == 0:
        summary, failed = f"the job ended before {steps} optimizer steps were observed", result.error is not None
    else:
        summary, failed = f"the job failed before {steps} optimizer steps were observed", True
    write_json(
        run_dir / "watch.json",
        {
            "summary": summary,
            "failed": failed,
            "steps": stepped,
            "seconds": round(seconds, 1),
            "result": result.to_dict(),
        },
    )
    return WatchResult(check=result, failed=failed, summary=summary, verdicts=loop.verdicts)


def aborted_at_exit(folder: Path) -> tuple[str, bool] | None:
    """When the only failure is a rank that aborted (SIGABRT) after its script had ended with status 0 (its end
    record says so), and torchrun's SIGTERM to the others: what happened, in words, and whether torchrun stopped a
    rank before its script had ended (its last work after training, a save, was cut short); else None. torch 2.13's gloo can
    abort a process at interpreter exit ("terminate called without an active exception", docs/check.md)."""
    from ddp_doctor.core.rankfiles import Outcome, read_ends

    try:
        failures = json.loads((folder / "torchrun.json").read_text()).get("failures", {})
    except (OSError, ValueError):
        return None
    ends = read_ends(folder)
    ended = {r for r, e in ends.items() if e.outcome is Outcome.EXITED and e.status == 0}
    aborted = sorted(int(r) for r, f in failures.items() if f.get("exitcode") == -6 and int(r) in ended)
    stopped = sorted(int(r) for r, f in failures.items() if f.get("exitcode") == -15)
    if not aborted or len(aborted) + len(stopped) != len(failures):
        return None
    from ddp_doctor.core.ranks import rank_list

    text = (
        f"then {rank_list(aborted)} aborted at interpreter exit (SIGABRT, after the script's last line: torch's gloo "
        "quirk at exit, docs/check.md), which is not a failure of the training"
    )
    unfinished = [r for r in stopped if r not in ended]
    if unfinished:
        text += f"; torchrun then stopped {rank_list(unfinished)} before its script had ended"
    return text, bool(unfinished)


def _torchrun_rc(folder: Path) -> int:
    """0 when no worker failed (torchrun writes `torchrun.json` only for failed workers)."""
    return 1 if (folder / "torchrun.json").exists() else 0
