"""`ddp-doctor demo`: `check` every bundled example (CPU, gloo, 2 ranks) and sum them up on one screen."""

from __future__ import annotations

import argparse
import ast
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ddp_doctor.cli.check import check, check_page, render_result
from ddp_doctor.core.codes import Code

if TYPE_CHECKING:
    from ddp_doctor.launch.outcome import CheckResult
    from ddp_doctor.report.model import Report

__all__ = ["DEMO_ORDER", "register"]

DEMO_ORDER = (
    "clean.py",
    "unused_head.py",
    "find_unused_all_used.py",
    "curriculum_through_module.py",
    "progressive_freeze.py",
    "dynamic_graph.py",
    "rank_dependent_head.py",
    "fsdp2_optimizer_before_shard.py",
)
"""The examples, from the healthy script to an unused head, find_unused_parameters left on for nothing, a loss
computed through `ddp.module`, layers frozen after wrapping, a changing graph and a rank-dependent one; then past
DDP, an FSDP2 job whose optimizer was built before `fully_shard`."""

_EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}

EPILOG = """\
examples:
  ddp-doctor demo                     # every example, then the summary
  ddp-doctor demo --full              # and each example's whole report
  ddp-doctor demo --only unused_head  # one example
  ddp-doctor demo --html demo-pages   # and one HTML page per example, with an index.html
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="run check on every bundled example and sum up the findings",
        description="Run `ddp-doctor check` on each bundled example script (2 ranks, gloo, CPU): "
        "one per failure in the seed reports, plus a clean one.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--examples",
        type=Path,
        default=_EXAMPLES,
        metavar="DIR",
        help="folder of the example scripts (default: the source checkout's examples/)",
    )
    p.add_argument("--only", action="append", metavar="NAME", help="run only this example (repeatable)")
    p.add_argument("--full", action="store_true", help="print every example's full report too")
    p.add_argument("--steps", type=int, default=8, metavar="K", help="steps to observe (default: 8)")
    p.add_argument(
        "--html",
        type=Path,
        metavar="DIR",
        help="write one HTML page per example (findings, usage map, divergence curve) and DIR/index.html",
    )
    p.set_defaults(func=run, _parser=p)


def _summary_line(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.splitlines()[0] if doc else ""


def run(args: argparse.Namespace) -> int:
    parser: argparse.ArgumentParser = args._parser
    folder: Path = args.examples
    names = [n if n.endswith(".py") else f"{n}.py" for n in (args.only or DEMO_ORDER)]
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        parser.error(
            f"example(s) {missing} not found in {folder}. The examples ship with the source checkout; "
            "pass --examples DIR to point at them."
        )
    if args.html is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--html needs matplotlib: pip install 'ddp-doctor[html]'.")
        if args.html.exists() and not args.html.is_dir():
            parser.error(f"--html takes a folder, and {str(args.html)!r} is a file.")
    console = Console()
    results: list[tuple[str, CheckResult]] = []
    with tempfile.TemporaryDirectory(prefix="ddp-doctor-demo-") as tmp:
        progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
        )
        with progress:
            task = progress.add_task("", total=len(names))
            for name in names:
                progress.update(task, description=f"ddp-doctor check --nproc-per-node 2 examples/{name}")
                with open(Path(tmp) / f"{name}.log", "w") as log:
                    result = check(
                        str(folder / name),
                        torchrun=["--nproc-per-node", "2"],
                        steps=args.steps,
                        timeout=300,
                        output=log,
                    )
                results.append((name, result))
                progress.advance(task)
                worst = result.report.worst_severity() if result.report else "error"
                console.print(
                    f"  examples/{name}: {_summary_line(folder / name)} "
                    f"[{_STYLE.get(worst or '', 'green')}]{worst or 'clean'}[/]",
                    highlight=False,
                )
                if args.full:
                    render_result(result, console)
                if args.html is not None:
                    args.html.mkdir(parents=True, exist_ok=True)
                    page = check_page(result, title=f"ddp-doctor check --nproc-per-node 2 examples/{name}")
                    (args.html / f"{Path(name).stem}.html").write_text(page)
    console.print(_table(results))
    if args.html is not None:
        (args.html / "index.html").write_text(_index(folder, results))
        console.print(f"wrote {args.html / 'index.html'} and one page per example", highlight=False)
    console.print(
        "Run one yourself: [bold]ddp-doctor check --nproc-per-node 2 examples/unused_head.py[/]; "
        "apply a recommendation without editing the script: --ddp-kwargs '{\"static_graph\": true}'.",
        highlight=False,
    )
    return 2 if any(r.error for _, r in results) else 0


def _index(folder: Path, results: list[tuple[str, CheckResult]]) -> str:
    from ddp_doctor.report.html import IndexEntry, index_page

    entries = []
    for name, result in results:
        report = result.report
        entries.append(
            IndexEntry(
                name=name.removesuffix(".py"),
                href=f"{Path(name).stem}.html",
                summary=_summary_line(folder / name),
                worst=report.worst_severity() if report else None,
                codes=[f.code for f in report.findings] if report else [],
                error=result.error if report is None else None,
            )
        )
    return index_page(
        "ddp-doctor demo: 2 ranks, gloo, CPU",
        entries,
        intro="Each page is the report of: ddp-doctor check --nproc-per-node 2 examples/NAME.py",
    )


def _recommended(report: Report) -> Text:
    if report.sharding is not None:  # FSDP2: no DDP flags; the first finding's fix, whole (never cut at a colon)
        return Text(report.findings[0].fix if report.findings else "keep the sharding")
    rec, used = report.recommendation, report.ddp_config
    parts = [f"{k}={v}" for k, v in rec.ddp_kwargs.items() if bool(used.get(k, False)) != v]
    if rec.freeze_before_wrap:
        parts.append(f"freeze {len(rec.freeze_before_wrap)} params before wrap")
    text = Text("\n".join(parts) or ("keep the script's flags" if rec.flags_known else "no flags known"))
    if report.finding(Code.WRAPPER_BYPASS):
        text = Text("call the DDP wrapper, not .module", style="bold")
    elif report.finding(Code.FROZEN_AFTER_WRAP) and rec.find_unused_parameters:
        text.append("\n(or ddp_doctor.refreeze)")
    if rec.verified:
        text.append(" (verified)", style="green")
    return text


def _coverage(compared: dict | None) -> str:
    """What a clean example's report compared, in a few words (its report's coverage line says it whole)."""
    if not compared:
        return ""
    if not compared.get("parameters"):
        return " (nothing compared)"
    steps = compared.get("steps") or compared.get("state_steps") or 0
    return f" (compared {compared['parameters']} params, {steps} steps, {compared['ranks']} ranks)"


def _table(results: list[tuple[str, CheckResult]]) -> Table:
    table = Table(title="ddp-doctor demo: 2 ranks, gloo, CPU", title_justify="left")
    table.add_column("example", no_wrap=True)
    table.add_column("findings")
    table.add_column("recommended", overflow="fold")
    for name, result in results:
        if result.error is not None or result.report is None:
            table.add_row(name, Text(result.error or "no report", style="red"), "")
            continue
        report = result.report
        findings = Text()
        for i, f in enumerate(report.findings):
            findings.append(", " if i else "").append(f.code, style=_STYLE[f.severity])
        worst = report.worst_severity()
        if worst is None:
            findings.append("none", style="green").append(_coverage(report.compared), style="dim")
        else:
            findings.append(f" ({worst})")
        table.add_row(name.removesuffix(".py"), findings, _recommended(report))
    return table
