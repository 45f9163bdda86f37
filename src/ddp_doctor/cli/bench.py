"""`ddp-doctor bench`: which DDP configuration is fastest on this script, among those that are correct."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.syntax import Syntax
from rich.table import Table

from ddp_doctor.cli.check import add_check_arguments, validate
from ddp_doctor.cli.torchrun_options import torchrun_subparser

if TYPE_CHECKING:
    from ddp_doctor.bench import BenchResult
    from ddp_doctor.bench.run import Candidate

__all__ = ["CANDIDATE_NAMES", "register", "render"]

CANDIDATE_NAMES = (
    "user",
    "recommended",
    "defaults",
    "find_unused",
    "static_graph",
    "recommended+bucket_view",
    "recommended+bucket_10mb",
    "recommended+bucket_50mb",
)

EXAMPLES = """\
  ddp-doctor bench --nproc-per-node 2 train.py
  ddp-doctor bench --nproc-per-node 2 --rounds 5 --html bench.html --json bench.json train.py
  ddp-doctor bench --nproc-per-node 2 --configs user,recommended,static_graph train.py
"""

EPILOG = """\
The script starts once where it can: after `check`'s --steps observed steps, the ranks rebuild the script's DDP
wrapper in place for each candidate, put the model and optimizer back to their state before the first step,
observe --steps steps (the correctness check), then time --steps more with every hook removed. Candidates run
interleaved in rounds (A B C, B C A, ...). A candidate that fails or desyncs is marked incorrect and never wins.
A new launch starts only when the previous one cannot go on (a crash, the script's loop ended); the output says why.

candidate names: user (the script's flags), recommended (the check's recommendation), defaults (both flags off),
find_unused (find_unused_parameters=True), static_graph (static_graph=True), recommended+bucket_view
(gradient_as_bucket_view flipped), recommended+bucket_10mb, recommended+bucket_50mb (bucket_cap_mb). Flag
combinations that the check proves cannot work are not built; the rest must prove themselves in the runs.
"""


def _add_bench_arguments(group: argparse._ArgumentGroup) -> None:
    add_check_arguments(group, bench=True)
    group.add_argument(
        "--rounds",
        type=int,
        default=6,
        metavar="R",
        help="the most runs per candidate; rounds stop once the verdict is settled (default: 6)",
    )
    group.add_argument(
        "--budget", type=float, default=None, metavar="S", help="start no new round after S seconds (default: no limit)"
    )
    group.add_argument("--configs", metavar="NAMES", help="comma-separated candidate names to run (default: all)")
    group.add_argument(
        "--html",
        metavar="FILE",
        help="write a self-contained HTML page with the table, a chart and the check report with its figures",
    )


def register(sub: argparse._SubParsersAction, *, with_torchrun: bool = True) -> None:
    # Our options first, with the examples; torchrun's launcher options in their own group after them.
    torchrun_subparser(
        sub,
        "bench",
        help="time the candidate DDP configurations on a script and pick the fastest correct one",
        description="Check SCRIPT, build the DDP configurations that could be correct for what it does, run each "
        "one several times interleaved, and report which is fastest among those that stayed correct.",
        epilog=EPILOG,
        examples=EXAMPLES,
        add_ours=_add_bench_arguments,
        with_torchrun=with_torchrun,
    ).set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    namespace, _, _ = validate(args)
    if args.rounds < 1:
        args._parser.error(f"--rounds must be at least 1, got {args.rounds}.")
    if args.budget is not None and args.budget <= 0:
        args._parser.error(f"--budget must be a positive number of seconds, got {args.budget}.")
    only = [n.strip() for n in args.configs.split(",")] if args.configs else None
    unknown = [n for n in only or [] if n not in CANDIDATE_NAMES]
    if unknown:
        args._parser.error(
            f"--configs has unknown candidate name(s) {unknown}; the names are: {', '.join(CANDIDATE_NAMES)}."
        )
    if args.html:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            args._parser.error("--html needs matplotlib: pip install 'ddp-doctor[html]'.")
    if args.fresh_interpreters:
        from ddp_doctor.launch.warm import FRESH_VAR

        os.environ[FRESH_VAR] = "1"  # every launch's ranks start fresh (run_check passes our environment on)
    from ddp_doctor.bench import run_bench
    from ddp_doctor.core.findings import finite

    console = Console()
    with tempfile.TemporaryDirectory(prefix="ddp-doctor-bench-") as tmp:
        progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed} launches"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        with progress:
            task = progress.add_task("check", total=None)

            def on_progress(text: str) -> None:
                progress.advance(task)
                progress.update(task, description=text)

            result = run_bench(
                namespace,
                steps=args.steps,
                rounds=args.rounds,
                timeout=args.timeout,
                log_dir=Path(tmp),
                only=only,
                budget=args.budget,
                on_progress=on_progress,
            )
    built = {c.name for c in result.candidates}
    for name in only or []:
        if name not in built:
            console.print(
                f"[yellow]{name}[/] was not run: what the check saw rules it out, or it is the same "
                "configuration as another candidate.",
                highlight=False,
            )
    render(result, console)
    if args.json:
        Path(args.json).write_text(json.dumps(finite(result.to_dict()), indent=2))
    if args.html:
        from ddp_doctor.bench.page import write_html

        write_html(result, Path(args.html))
        console.print(f"wrote {args.html}")
    return 0 if result.winner is not None else 1


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def _interval(result: BenchResult, c: Candidate) -> str:
    cmp = result.comparison(c)
    if result.decision is not None and c.name == result.decision.reference:
        return "reference"
    if cmp is None or cmp.ratio is None:
        return "-"
    return f"{cmp.ratio:.2f}" + (f" ({cmp.low:.2f}-{cmp.high:.2f})" if cmp.low is not None else " (too few rounds)")


def table(result: BenchResult) -> Table:
    """One row per candidate, fastest correct first."""
    t = Table(title="ddp-doctor bench", title_justify="left")
    ref = result.decision.reference if result.decision is not None else "reference"
    for name, justify in (
        ("config", "left"),
        ("correct", "left"),
        ("median step", "right"),
        ("spread", "right"),
        (f"vs {ref} (95% interval)", "right"),
        ("vs user", "right"),
    ):
        t.add_column(name, justify=justify)  # type: ignore[arg-type]
    order = sorted(result.candidates, key=lambda c: (not c.correct, c.median_step_s or 0.0))
    for c in order:
        label = c.name
        mark = "[green]yes[/]" if c.correct else f"[red]no[/] ({c.reason.split(' (')[0][:60]})"
        if result.winner is c:
            label = f"[bold]{label} (winner)[/]"
        t.add_row(
            label,
            mark,
            _fmt(c.median_step_s and c.median_step_s * 1e3, ".2f", " ms"),
            _fmt(c.spread and c.spread * 100, ".0f", "%"),
            _interval(result, c),
            _fmt(result.ratio_to(c, result.user), ".2f"),
        )
    return t


def launches(result: BenchResult) -> list[str]:
    """What the script's start-up cost: the launches, and why each one after the first was needed."""
    startup = result.startup_s
    n = len(result.launches)
    lines = [
        (
            f"Start-up (launch to the first optimizer step): {_fmt(startup, '.1f', ' s')}, paid {n} time(s) for "
            f"{result.blocks} block(s) (one per candidate and round)."
        )
    ]
    for launch in result.launches[1:]:
        lines.append(f"  launch {launch.index} ({', '.join(launch.blocks) or 'no block'}): {launch.why}")
    return lines


def render(result: BenchResult, console: Console) -> None:
    console.print(table(result))
    for line in launches(result):
        console.print(line, highlight=False)
    for c in result.candidates:
        if not c.correct:
            console.print(f"[red]{c.name}[/] is incorrect: {c.reason}", highlight=False)
    rec = result.verdict()
    if rec is None:
        console.print("[bold red]No candidate ran correctly.[/] See the reasons above and `ddp-doctor check`.")
        return
    framework = result.check.framework if result.check.framework in rec.render else "torch"
    order = [framework, *(k for k in ("torch", "transformers", "accelerate", "lightning") if k != framework)]
    parts = [
        Syntax(f"# {k}\n{rec.render[k]}", "python", theme="ansi_dark", background_color="default", word_wrap=True)
        for k in order
    ]
    console.print(Panel.fit(rec.reason, title="Verdict", border_style="green"))
    for part in parts:
        console.print(part)
