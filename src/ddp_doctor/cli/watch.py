"""`ddp-doctor watch`: run the whole job under torchrun; diagnose its first steps as `check` does, then watch the
rest lightly and explain a hang while it happens. The run folder survives the job (`ddp-doctor explain DIR`)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.rule import Rule

from ddp_doctor.cli.check import validate_launch
from ddp_doctor.cli.torchrun_options import torchrun_subparser
from ddp_doctor.core.codes import Code
from ddp_doctor.core.ranks import rank_list

if TYPE_CHECKING:
    from ddp_doctor.launch.outcome import CheckResult
    from ddp_doctor.launch.watch_run import HangVerdict

__all__ = ["default_run_dir", "register", "render_verdict", "verdict_from_dict"]

EXAMPLES = """\
  # a long job, watched: the first steps diagnosed, a hang explained while it happens
  ddp-doctor watch --nproc-per-node 8 train.py --epochs 90

  # call a hang after 2 minutes without progress, and stop the job then
  ddp-doctor watch --nproc-per-node 8 --hang-after 120 --on-hang stop train.py

  # afterwards (the job ended, or the scheduler killed it): the verdict again, from the run folder
  ddp-doctor explain ddp-doctor-runs/train-20261127-101500
"""

EPILOG = """\
Everything torchrun accepts before SCRIPT works the same way. The script runs to its own end: nothing it computes
changes, and ddp-doctor's exit code is the job's (1 when it failed or hung, or findings at or above --fail-on).
"""

_OURS = ("steps", "json", "fail_on", "hang_after", "on_hang", "run_dir", "fresh_interpreters", "func")


def register(sub: argparse._SubParsersAction, *, with_torchrun: bool = True) -> None:
    torchrun_subparser(
        sub,
        "watch",
        help="run a whole training job under torchrun, diagnose its first steps and explain a hang as it happens",
        description="Run SCRIPT under torchrun with ddp-doctor in every rank, to the job's own end. The first "
        "--steps optimizer steps are diagnosed as `check` diagnoses them, and the report is printed while the job "
        "goes on; after them only light watching stays on (each rank's step, the script's collectives, the line "
        "its main thread runs). When no rank moves for --hang-after seconds, every rank's stacks are taken and "
        "the hang is explained: which ranks wait in which collective at which line, which rank is elsewhere.",
        epilog=EPILOG,
        examples=EXAMPLES,
        add_ours=_add_arguments,
        with_torchrun=with_torchrun,
    ).set_defaults(func=run)


def _add_arguments(group: Any) -> None:
    group.add_argument(
        "--steps", type=int, default=8, metavar="K", help="optimizer steps diagnosed at the start (default: 8)"
    )
    group.add_argument(
        "--hang-after",
        type=float,
        default=None,
        metavar="S",
        help="call a hang when no rank has moved for S seconds (default: half the process group's timeout, "
        "300 s until a rank has built its model)",
    )
    group.add_argument(
        "--on-hang",
        choices=("wait", "stop"),
        default="wait",
        help="after a hang is explained: wait (the job stays as it is, for a debugger; Ctrl-C ends it) or stop "
        "every rank (default: wait)",
    )
    group.add_argument(
        "--run-dir",
        metavar="DIR",
        default=None,
        help="the run folder the ranks' records go to and that outlives the job "
        "(default: ./ddp-doctor-runs/SCRIPT-DATE-TIME)",
    )
    group.add_argument("--json", metavar="FILE", help="write the final result as JSON (schema ddp-doctor/report@2)")
    group.add_argument(
        "--fail-on",
        choices=("error", "warning", "never"),
        default="error",
        help="lowest severity of a first-steps finding that makes the exit code 1 (default: error)",
    )
    group.add_argument(
        "--fresh-interpreters",
        action="store_true",
        help="start every rank in a fresh Python interpreter instead of forking it from one that has torch imported",
    )


def default_run_dir(script: str) -> Path:
    """`./ddp-doctor-runs/<script>-<date>-<time>`: under the working directory, never /tmp (it must outlive the
    machine's cleaning and be found next to the job)."""
    name = Path(script).stem or "run"
    return Path.cwd() / "ddp-doctor-runs" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _validate(args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    parser: argparse.ArgumentParser = args._parser
    validate_launch(args, "watch")
    if args.hang_after is not None and args.hang_after <= 0:
        parser.error(f"--hang-after must be a positive number of seconds, got {args.hang_after:g}.")
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.training_script)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".writable"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        parser.error(
            f"the run folder {str(run_dir)!r} cannot be written ({exc.strerror or exc}). Pass --run-dir with a "
            "folder you can write to."
        )
    if any(run_dir.glob("rank*.beacon")):
        parser.error(f"the run folder {str(run_dir)!r} holds another run's records; pass a new --run-dir.")
    namespace = {k: v for k, v in vars(args).items() if k not in (*_OURS, "_parser")}
    return namespace, run_dir


def run(args: argparse.Namespace) -> int:
    namespace, run_dir = _validate(args)
    from ddp_doctor.launch.whole_run import watch

    console = Console()
    result = watch(
        namespace,
        steps=args.steps,
        run_dir=run_dir,
        hang_after=args.hang_after,
        on_hang=args.on_hang,
        fresh=args.fresh_interpreters,
        reported=lambda report, why: _print_first_report(console, report, run_dir, args.hang_after, why),
        hung=lambda verdict: render_verdict(verdict, console),
        resumed=lambda waited: console.print(
            f"ddp-doctor: the ranks move again, after {waited:.0f} s; watching on.", highlight=False
        ),
        diverged=lambda divergence: render_divergence(divergence, console),
        window=lambda event: render_window(event, console),
        warn=lambda text: console.print(f"ddp-doctor: warning: {text}", highlight=False, soft_wrap=True),
    )
    return _finish(result, args, console, run_dir)


def _ms_span(lo: float, hi: float) -> str:
    """`12.3 ms`, or `12.3-14.0 ms` over the ranks."""
    low, high = f"{lo * 1e3:.1f}", f"{hi * 1e3:.1f}"
    return f"{low} ms" if low == high else f"{low}-{high} ms"


def render_window(e: Any, console: Console) -> None:
    """A change in a window of steps past the first ones (`watch_windows.WindowEvent`)."""
    span = f"steps {e.first}-{e.last}"
    step_lo = e.step_s[0]
    steps, waits = _ms_span(*e.step_s), _ms_span(*e.wait_s)
    if e.kind == Code.INPUT_BOUND.value:
        loader = e.loader or {}
        named = f"the DataLoader over {loader.get('dataset_type') or 'its dataset'}" + (
            f" created at {loader['site']}" if loader.get("site") else ""
        )
        workers = f", num_workers={loader['num_workers']}" if "num_workers" in loader else ""
        console.print(Rule(f"input-bound from {span}"))
        console.print(
            f"[bold]input-bound[/bold] ({rank_list(e.ranks)}): in {span} these ranks waited a median {waits} per "
            f"step between the optimizer step and the next forward, of a median step of {steps} (the first steps' "
            f"rule, applied to this window). The input comes from {named}{workers}. The job goes on, watched; more "
            "GPUs will not make it faster until the wait shrinks (more DataLoader workers, pin_memory, a faster "
            "read).",
            soft_wrap=True,
        )
    elif e.kind == Code.STRAGGLER_RANK.value and e.lag == "work":
        console.print(Rule(f"straggler-rank from {span}"))
        one = len(e.ranks) == 1
        who, its = ("this rank", "its") if one else ("these ranks", "their")
        console.print(
            f"[bold]straggler-rank[/bold] ({rank_list(e.ranks)}): in {span} {who} took a median "
            f"{_ms_span(*e.own_s)} per step from {its} optimizer step to {its} next backward (the wait for the "
            f"batch, the forward, the loss and what the loop does before backward()), the other ranks at most "
            f"{e.others_own_s * 1e3:.1f} ms; the others spend at least {e.others_waited_s * 1e3:.1f} ms longer in "
            f"the rest of their step, waiting for {'it' if one else 'them'} in DDP's all-reduce, so every rank's "
            f"step is {steps}. Look at what runs on {who} alone (other processes on {its} device or CPU, a slower "
            f"device, work the script does there only). The job goes on, watched.",
            soft_wrap=True,
        )
    elif e.kind == Code.STRAGGLER_RANK.value:
        loader = e.loader or {}
        where = f" from the DataLoader created at {loader['site']}" if loader.get("site") else ""
        console.print(Rule(f"straggler-rank from {span}"))
        one = len(e.ranks) == 1
        who, its, them = ("this rank", "its", "it") if one else ("these ranks", "their", "them")
        console.print(
            f"[bold]straggler-rank[/bold] ({rank_list(e.ranks)}): in {span} {who} waited a median {waits} per step "
            f"for {its} data{where}, the other ranks at most {e.others_wait_s * 1e3:.1f} ms; the others wait for "
            f"{them} in their next collective, so every rank's step is {steps}. Look at what {who} read"
            f"{'s' if one else ''} from ({its} node's disk or network, {its} shard of the data) or give {its} "
            "DataLoader more workers. The job goes on, watched.",
            soft_wrap=True,
        )
    elif e.kind == "straggler-ok":
        console.print(
            f"ddp-doctor: {span}: no rank lags behind the others any more, in its data or its own work (a median "
            f"{waits} of a {steps} step waiting for data).",
            highlight=False,
            soft_wrap=True,
        )
    elif e.kind == "input-ok":
        console.print(
            f"ddp-doctor: {span}: the ranks no longer wait for data (a median {waits} of a {steps} step).",
            highlight=False,
            soft_wrap=True,
        )
    else:
        console.print(
            f"ddp-doctor: {span}: the median step is {steps}, {step_lo / e.baseline_step_s:.1f}x the first watched "
            f"window's {e.baseline_step_s * 1e3:.1f} ms (the wait for data: {waits}).",
            highlight=False,
            soft_wrap=True,
        )


def render_divergence(d: Any, console: Console) -> None:
    """The first step at which the ranks' parameters differ (`watch_replicas.ReplicaDivergence`)."""
    console.print(Rule(f"replicas differ at step {d.step}"))
    since = (
        f"they agreed at step {d.agreed_step}, the last one compared before"
        if d.agreed_step is not None
        else ("the first step compared past the first steps")
    )
    held = ", ".join(
        f"{rank_list(g)} {'hold' if len(g) > 1 else 'holds'} one value" if i == 0 else f"{rank_list(g)} another"
        for i, g in enumerate(d.groups)
    )
    more = f" and {d.differing - len(d.params)} more" if d.differing > len(d.params) else ""
    console.print(
        f"[bold]replica-divergence[/bold] ({rank_list(d.ranks)}): {d.differing} parameter(s) differ across the "
        f"ranks at step {d.step} ({since}): {', '.join(d.params)}{more}. Of {d.params[0]}, {held}.",
        soft_wrap=True,
    )
    console.print(
        "  Each rank now trains its own model: something between those steps changed the parameters on some ranks "
        "only (an update outside DDP's gradient sync: a rank-dependent step, a parameter written or replaced on one "
        "rank, a load on rank 0 alone). The job goes on, watched.",
        highlight=False,
        soft_wrap=True,
    )


def _print_first_report(
    console: Console, result: CheckResult, run_dir: Path, hang_after: float | None, why: str
) -> None:
    from ddp_doctor.cli.check import render_result
    from ddp_doctor.launch.config import DESTROYED, SCRIPT_ENDED

    render_result(result, console)
    if why == SCRIPT_ENDED:
        return  # the script ended before its first steps were all observed: the end's own line follows
    when = f"{hang_after:g} s" if hang_after else "half the process group's timeout"
    console.print(
        "ddp-doctor: "
        + (
            "its steps are diagnosed (the script destroyed its process group)"
            if why == DESTROYED
            else "the first steps are diagnosed"
        )
        + f"; the job goes on, watched (a hang is called after {when} without progress). Run folder: {run_dir}",
        highlight=False,
        soft_wrap=True,
    )


def _finish(result: Any, args: argparse.Namespace, console: Console, run_dir: Path) -> int:
    from ddp_doctor.cli.check import render_result
    from ddp_doctor.launch.outcome import exit_code

    if result.failed:
        stopped = result.check.interrupted is not None or result.check.timed_out
        console.print(Rule("the job was stopped" if stopped else "the job failed"))
        render_result(result.check, console)
    code = exit_code(result.check, args.fail_on)
    if code == 0 and (result.failed or (_diverged(result) and args.fail_on != "never")):
        code = 1
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(result.check.to_json())
    console.print(
        f"ddp-doctor: {result.summary}. Run folder: {run_dir} (ddp-doctor explain {run_dir})",
        highlight=False,
        soft_wrap=True,
    )
    return code


def _diverged(result: Any) -> bool:
    return bool(result.replicas and result.replicas.get("divergence"))


def verdict_from_dict(d: dict[str, Any]) -> HangVerdict:
    """A verdict read back from `hang.json`."""
    from ddp_doctor.core.findings import Finding
    from ddp_doctor.launch.watch_run import HangVerdict

    return HangVerdict(
        stalled_s=d["stalled_s"],
        hang_after_s=d["hang_after_s"],
        group_timeout_s=d.get("group_timeout_s"),
        at=d["at"],
        positions=d["positions"],
        findings=[Finding.from_dict(f) for f in d["findings"]],
        sequences=[Finding.from_dict(f) for f in d.get("sequences", [])],
        sequences_compared=d.get("sequences_compared", 0),
    )


def render_verdict(verdict: HangVerdict, console: Console) -> None:
    """The hang: how long nothing moved, where every rank is, the cause and the fix, where the stacks are."""
    when = time.strftime("%H:%M:%S", time.localtime(verdict.at))
    console.print(Rule(f"hang at {when}: no rank moved for {verdict.stalled_s:.0f} s"))
    if verdict.group_timeout_s:
        left = verdict.group_timeout_s - verdict.stalled_s
        console.print(
            f"The process group's timeout ({verdict.group_timeout_s:g} s) ends the job in about {max(left, 0):.0f} s "
            "if nothing moves.",
            highlight=False,
        )
    for p in verdict.positions:
        where = p.get("line") or p.get("innermost") or "no Python line known"
        c = p.get("collective")
        inside = f"; inside {c['op']} from {c['line']}" if c and c.get("inside") else ""
        last = f"; last collective {c['op']} at {c['line']}" if c and not c.get("inside") else ""
        ended = f"; ended ({p['ended']})" if p.get("ended") else ""
        console.print(
            f"  rank {p['rank']}: step {p['step']}, {p['phase']}, at {where}{inside}{last}{ended}",
            highlight=False,
            soft_wrap=True,
        )
    for i, f in enumerate(verdict.findings):
        ranks = f" ({rank_list(f.ranks)})" if f.ranks else ""
        console.print(f"{'cause' if i == 0 else 'also'}: [bold]{f.code}[/bold]{ranks}: {f.title}", soft_wrap=True)
        if i == 0:
            console.print(f"  {f.detail}", highlight=False, soft_wrap=True)
            if f.fix:
                console.print(f"  fix: {f.fix}", highlight=False, soft_wrap=True)
    if not verdict.findings:
        console.print("No cause could be read from the ranks' positions; their stacks below say where each is.")
    for f in verdict.sequences:
        console.print(f"collective sequences (Flight Recorder): {f.title}", highlight=False, soft_wrap=True)
    if verdict.sequences_compared > 1 and not verdict.sequences:
        console.print(
            f"collective sequences (Flight Recorder, {verdict.sequences_compared} ranks): the same on every rank, "
            "in the same order.",
            highlight=False,
        )
    stacks = [p["stacks"] for p in verdict.positions if p.get("stacks")]
    if stacks:
        console.print("every thread's stack: " + ", ".join(stacks), highlight=False, soft_wrap=True)
    sys.stdout.flush()
