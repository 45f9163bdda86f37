"""`ddp-doctor watch`'s run: the whole job under `check`'s launch with `RankConfig.whole_run`, watched by
`WatchLoop` (`watch_run.py`), and how it ended, in one sentence (`watch.json` in the run folder)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_doctor.core.phase import Phase
from ddp_doctor.core.rankfiles import write_json
from ddp_doctor.core.ranks import rank_list
from ddp_doctor.launch.watch_run import HangVerdict, WatchLoop, beacons

__all__ = ["WatchResult", "aborted_at_exit", "watch"]


@dataclass(kw_only=True)
class WatchResult:
    """What `watch` ends with: the result to report, whether the job failed, one sentence on how it ended."""

    check: Any
    """The `CheckResult`: the first steps' report, with the failure's findings first when the job failed."""
    failed: bool
    summary: str
    verdicts: list[HangVerdict] = field(default_factory=list)
    replicas: dict[str, Any] | None = None
    """`ReplicaWatch.to_dict()`: the steps at which the ranks' parameters were compared past the first steps, and
    the first at which they differed (None: the job ended before its first steps were reported)."""
    windows: dict[str, Any] | None = None
    """`WindowWatch.to_dict()`: the windows of steps past the first ones, each judged (None: as for `replicas`)."""


def watch(
    namespace: dict[str, Any],
    *,
    steps: int,
    run_dir: Path,
    hang_after: float | None,
    on_hang: str,
    fresh: bool,
    reported: Callable[[Any, str], None],
    hung: Callable[[HangVerdict], None],
    resumed: Callable[[float], None],
    diverged: Callable[[Any], None],
    warn: Callable[[str], None],
    window: Callable[[Any], None] = lambda _: None,
) -> WatchResult:
    """Run the whole job (torchrun's parsed `namespace`) with its ranks' records in `run_dir`.

    `reported` gets the first steps' `CheckResult` as soon as the ranks wrote it, and why they wrote it then (the
    reasons of `launch/config.py`: the script runs on after all but `SCRIPT_ENDED`); `hung` each hang's verdict;
    `resumed` the seconds the ranks stood still, when they move again after a verdict; `diverged` the first step at
    which the ranks' parameters differ (`watch_replicas.ReplicaDivergence`); `window` each change in a window of
    steps (`watch_windows.WindowEvent`).
    """
    from ddp_doctor.launch.config import DESTROYED, SCRIPT_ENDED, RankConfig, steps_reason
    from ddp_doctor.launch.outcome import collect
    from ddp_doctor.launch.supervise import run_check
    from ddp_doctor.launch.warm import FRESH_VAR

    first: list[Any] = []

    def on_report(folder: Path) -> None:
        try:
            reason = json.loads((folder / "report.json").read_text()).get("reason")
        except (OSError, ValueError):
            reason = None
        runs_on = reason in (steps_reason(steps), DESTROYED)
        if not runs_on and reason != SCRIPT_ENDED:
            return  # a rank crashed or exited with a status before the first steps were all observed: a failure
        result = collect(folder, timed_out=False, torchrun_rc=None)
        first.append(result)
        if runs_on:
            # From here on the joint report is the first steps' own: a later failure is read against it.
            os.replace(folder / "report.json", folder / "report.steps.json")
        reported(result, reason)

    from ddp_doctor.launch.watch_nodes import NodeShare

    loop = WatchLoop(
        nodes=NodeShare(namespace),
        hang_after=hang_after,
        on_hang=on_hang,
        reported=on_report,
        hung=hung,
        resumed=resumed,
        diverged=diverged,
        window=window,
        warn=warn,
    )
    config = RankConfig(
        target=namespace["training_script"],
        module=bool(namespace["module"]),
        steps=steps,
        follow_epochs=0,
        whole_run=True,
    )
    env: dict[str, str] = {}
    if fresh:
        env[FRESH_VAR] = "1"
    started = time.time()
    result = run_check(namespace, config, timeout=None, outdir=run_dir, env=env, wait=loop)
    states = beacons(run_dir)
    stepped = max((s.step for s in states.values()), default=-1)
    replicas = windows = None
    if first and loop.windows is not None:
        # the last windows the ranks wrote before they ended (on several nodes, with the others' as last read: a
        # window one node's rows alone would judge waits)
        remote = loop.nodes.windows(run_dir) if loop.nodes is not None else None
        for event in loop.windows.poll(set(states), remote):
            window(event)
        loop.windows.save()
        windows = loop.windows.to_dict()
    if first and loop.replicas is not None:
        if loop.replicas.divergence is None:
            loop.replicas.poll(set(states))  # the last points the ranks wrote before they ended
            if loop.replicas.divergence is not None:
                diverged(loop.replicas.divergence)
        loop.replicas.save()
        replicas = loop.replicas.to_dict()
    rc = _torchrun_rc(run_dir) or (result.torchrun_rc or 0)
    seconds = time.time() - started
    if result.interrupted is not None:
        summary, failed = f"the job was stopped by {signal.Signals(result.interrupted).name}", True
    elif result.timed_out:
        summary, failed = "the job was stopped after the hang (--on-hang stop)", True
    elif rc == 0 and first:
        several = loop.nodes is not None and loop.nodes.several
        # On several nodes this node sees its own ranks' ends only: another node's may have failed.
        who = f"every rank of this node ({rank_list(sorted(states))})" if several else "every rank"
        summary, failed = f"the job finished on {who} after {stepped} optimizer steps, in {seconds:.0f} s", False
        result = first[0]
    elif first and (aborted := aborted_at_exit(run_dir)) is not None:
        summary, failed = (
            f"the script ran to its end after {stepped} optimizer steps, in {seconds:.0f} s; {aborted}",
            False,
        )
        result = first[0]
    elif first and states and all(s.phase == Phase.TORN_DOWN.value for s in states.values()):
        summary, failed = (
            f"the job failed after {stepped} optimizer steps, once its script had destroyed the process group on "
            "every rank (in the teardown, not in training)",
            True,
        )
    elif first:
        summary, failed = "the job failed after the first steps", True
    elif rc == 0:
        summary, failed = f"the job ended before {steps} optimizer steps were observed", result.error is not None
    else:
        summary, failed = f"the job failed before {steps} optimizer steps were observed", True
    if replicas is not None and not failed:
        summary += _replicas_words(replicas)
    if windows is not None and not failed:
        summary += _windows_words(windows)
    write_json(
        run_dir / "watch.json",
        {
            "summary": summary,
            "failed": failed,
            "steps": stepped,
            "ranks": sorted(states),
            "seconds": round(seconds, 1),
            "replicas": replicas,
            "windows": windows,
            "result": result.to_dict(),
        },
    )
    return WatchResult(
        check=result, failed=failed, summary=summary, verdicts=loop.verdicts, replicas=replicas, windows=windows
    )


def _windows_words(windows: dict[str, Any]) -> str:
    """The end summary's clause on the windows of steps judged past the first steps."""
    judged = windows["windows"]
    if not judged:
        return ""
    of = f"{len(judged)} windows of {windows['window']} steps"
    bound = [w for w in judged if w["input_bound"]]
    said = (
        f"; input-bound in {len(bound)} of {of}, from step {bound[0]['first']}"
        if bound
        else f"; not input-bound in {of}"
    )
    lagging = [w for w in judged if w.get("lagging")]
    if lagging:
        ranks = sorted({r for w in lagging for r in w["lagging"]})
        its = "its" if len(ranks) == 1 else "their"
        what = (
            f"waited for {its} data alone"
            if all(w.get("lagging_in", "data") == "data" for w in lagging)
            else f"lagged behind the others (in {its} data or {its} own work before the backward)"
            if any(w.get("lagging_in", "data") == "data" for w in lagging)
            else f"lagged behind the others in {its} own work before the backward"
        )
        said += f"; {rank_list(ranks)} {what} in {len(lagging)} of them, from step {lagging[0]['first']}"
    return said


def _replicas_words(replicas: dict[str, Any]) -> str:
    """The end summary's clause on the parameters compared past the first steps."""
    steps, d = replicas["compared_steps"], replicas["divergence"]
    if d is not None:
        return f"; its replicas' parameters differed from step {d['step']} on ({d['differing']} parameter(s))"
    if not steps and replicas.get("local_sgd"):
        return (
            "; no later step was compared across the ranks: under post-local SGD they are compared right after a "
            "model averaging over every rank, and none came"
        )
    if not steps:
        return "; no later step was compared across the ranks (the job ended before the first comparison)"
    span = f"step {steps[0]}" if len(steps) == 1 else f"{len(steps)} steps, {steps[0]} to {steps[-1]}"
    after = " (right after its model averagings: post-local SGD)" if replicas.get("after_averaging") else ""
    return f"; the DDP parameters of this node's {len(replicas['ranks'])} ranks agreed at {span}{after}"


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
    text = (
        f"then {rank_list(aborted)} aborted at interpreter exit (SIGABRT, after the script's last line: torch's gloo "
        "quirk at exit, docs/check.md), which is not a failure of the training"
    )
    unfinished = [r for r in stopped if r not in ended]
    if unfinished:
        text += f"; torchrun then stopped {rank_list(unfinished)} before its script had ended"
    return text, bool(unfinished)


def _torchrun_rc(folder: Path) -> int:
    """0 when no worker failed (torchrun writes `torchrun.json` only for failed workers; its own exit status, in
    `CheckResult.torchrun_rc`, says whether its agent failed)."""
    return 1 if (folder / "torchrun.json").exists() else 0
