"""`ddp-doctor explain RUN_DIR`: the verdict on a watched job again, after the fact, from its run folder.

What `watch` wrote at the end (`watch.json`), at a hang (`hang.json`), when the replicas' parameters first
differed (`replicas.json`) and at each change in a window of steps (`windows.json`) is printed again. When `watch`
itself did not get to write its end (the scheduler killed the job, the node rebooted), the ranks' own records (beacons,
the watchdog's samples, end records, stacks) are read as `check` reads a failed run's, and the ranks that left no
record in the folder are named."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.rule import Rule

from ddp_doctor.core.rankfiles import read_json

__all__ = ["explain", "register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "explain",
        help="explain a watched job again from its run folder (after it ended, or was killed)",
        description="Print the verdict of `ddp-doctor watch` again from its run folder: the first steps' report, "
        "the hang, how the job ended; for a job whose watcher was killed too, what the ranks' own records say.",
        epilog="example:\n  ddp-doctor explain ddp-doctor-runs/train-20261127-101500",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run folder `watch` printed (its --run-dir)")
    p.add_argument("--json", metavar="FILE", help="write the result as JSON (schema ddp-doctor/report@2)")
    p.set_defaults(func=run, _parser=p)


def run(args: argparse.Namespace) -> int:
    folder = Path(args.run_dir)
    if not folder.is_dir():
        args._parser.error(f"{args.run_dir!r} is not a folder. Pass the run folder `ddp-doctor watch` printed.")
    console = Console()
    if not any(folder.glob("rank*.beacon")) and not (folder / "watch.json").exists():
        from ddp_doctor.core.fr_dumps import read_dumps

        dumps, problems = read_dumps(folder)
        if not dumps:
            args._parser.error(
                f"{args.run_dir!r} holds no ddp-doctor records (no rank*.beacon, no watch.json) and no Flight "
                "Recorder dumps"
                + (f" that can be read ({'; '.join(problems)})" if problems else "")
                + ". Pass the run folder `ddp-doctor watch` printed, or the folder of a job's Flight Recorder dumps."
            )
        result, code = explain_flight_recorder(dumps, problems, console)
    else:
        result, code = explain(folder, console)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return code


def explain(folder: Path, console: Console) -> tuple[dict[str, Any], int]:
    """Print what the run folder says; returns (the result's JSON, the exit code `watch` would have had)."""
    from ddp_doctor.cli.watch import render_divergence, render_verdict, render_window, verdict_from_dict
    from ddp_doctor.launch.watch_replicas import ReplicaDivergence
    from ddp_doctor.launch.watch_windows import replay

    hang = read_json(folder / "hang.json")
    if hang is not None:
        render_verdict(verdict_from_dict(hang), console)
    replicas = read_json(folder / "replicas.json") or {}
    if (diverged := replicas.get("divergence")) is not None:
        render_divergence(ReplicaDivergence(**diverged), console)
    for event in replay(read_json(folder / "windows.json") or {}):
        render_window(event, console)
    ended = read_json(folder / "watch.json")
    if ended is not None:
        # The last hang's verdict travels with the job's report: a job stopped at its hang may leave ranks whose
        # own records no longer tell where they waited (stopped mid-write), and the verdict is what was seen then.
        result = {**ended["result"], **({"hang": hang} if hang is not None else {})}
        _render(ended["result"], console, failed=ended["failed"])
        console.print(f"ddp-doctor: {ended['summary']}.", highlight=False, soft_wrap=True)
        return result, int(bool(ended["failed"]) or _has_errors(result) or diverged is not None)
    # The watcher did not write its end: read the ranks' own records.
    from ddp_doctor.cli.check import render_result
    from ddp_doctor.core.rankstate import read_rank_states
    from ddp_doctor.launch.outcome import collect

    states = read_rank_states(folder, end_time=_last_write(folder))
    check = collect(folder, timed_out=True, torchrun_rc=None, watched=True)
    console.print(Rule("what the ranks' records say (the watcher wrote no end)"))
    render_result(check, console)
    world = max([s.world_size for s in states.values()] + [len(states)])
    silent = sorted(set(range(world)) - set(states))
    if silent:
        console.print(
            f"ranks {', '.join(map(str, silent))} left no record in this folder (another node's folder, or they "
            "never started).",
            highlight=False,
        )
    last = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(_last_write(folder)))
    console.print(f"ddp-doctor: the last record was written at {last}.", highlight=False)
    return {**check.to_dict(), "ranks_without_records": silent}, 1


def explain_flight_recorder(dumps: list[Any], problems: list[str], console: Console) -> tuple[dict[str, Any], int]:
    """The first collective where the ranks parted, from PyTorch's Flight Recorder dumps (`analyze/flight_recorder`)."""
    from ddp_doctor.launch.watch_run import parted

    console.print(Rule(f"Flight Recorder dumps of {len(dumps)} rank(s)"))
    for problem in problems:
        console.print(f"ddp-doctor: warning: {problem}", highlight=False, soft_wrap=True)
    findings = parted(dumps)
    for f in findings:
        console.print(f"[bold]{f.code}[/bold]: {f.title}", soft_wrap=True)
        console.print(f"  {f.detail}", highlight=False, soft_wrap=True)
        console.print(f"  fix: {f.fix}", highlight=False, soft_wrap=True)
    if not findings:
        last = max((e.seq for d in dumps for e in d.entries), default=0)
        console.print(
            f"The dumps agree: every rank issued the same collectives, in the same order (up to #{last}).",
            highlight=False,
        )
    result = {"schema": "ddp-doctor/flight-recorder@1", "ranks": sorted(d.rank for d in dumps), "problems": problems}
    result["findings"] = [f.to_dict() for f in findings]
    return result, int(bool(findings))


def _last_write(folder: Path) -> float:
    return max((p.stat().st_mtime for p in folder.iterdir() if p.is_file()), default=time.time())


def _has_errors(result: dict[str, Any]) -> bool:
    return any(f.get("severity") == "error" for f in result.get("findings", []))


def _render(result: dict[str, Any], console: Console, *, failed: bool) -> None:
    from ddp_doctor.report.model import Report

    if result.get("error"):
        console.print(f"ddp-doctor: error: {result['error']}", highlight=False, soft_wrap=True)
        return
    if failed:
        console.print(Rule("the job failed"))
    console.print(Report.from_dict(result))
    for other in result.get("other_models", []):
        console.print(Report.from_dict(other))
