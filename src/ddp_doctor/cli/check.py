"""`ddp-doctor check`: run an unmodified training script under torchrun, observe its first steps, report."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import signal
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from rich.console import Console
from rich.rule import Rule

from ddp_doctor.cli.torchrun_options import torchrun_parser, torchrun_subparser
from ddp_doctor.core.codes import Code
from ddp_doctor.launch.supervise import check_namespace

if TYPE_CHECKING:
    from ddp_doctor.launch.outcome import CheckResult

__all__ = [
    "add_check_arguments",
    "check",
    "check_page",
    "parse_ddp_kwargs",
    "register",
    "render_result",
    "validate",
    "validate_launch",
]

EXAMPLES = """\
  # the two-rank CPU check of a script you normally start with torchrun
  ddp-doctor check --nproc-per-node 2 train.py --lr 3e-4

  # JSON for CI, and exit code 1 on warnings too
  ddp-doctor check --nproc-per-node 2 --json report.json --fail-on warning train.py

  # a page to look at: findings, usage map, divergence curve, the fix for four frameworks
  ddp-doctor check --nproc-per-node 2 --html report.html train.py

  # try the recommended flags without editing the script
  ddp-doctor check --nproc-per-node 2 --ddp-kwargs '{"static_graph": true}' train.py

  # a module, like python -m
  ddp-doctor check --nproc-per-node 2 -m mypkg.train --epochs 1

  # two nodes, one process each (run one command per node)
  ddp-doctor check --nnodes 2 --nproc-per-node 1 --node-rank 0 \\
      --rdzv-backend c10d --rdzv-endpoint node0.example:29400 --rdzv-id job1 train.py
"""

EPILOG = """\
Everything torchrun accepts before SCRIPT works the same way (--nnodes, --node-rank, --rdzv-backend,
--rdzv-endpoint, ...). The script's own arguments go after SCRIPT, unchanged.

exit codes: 0 nothing at or above --fail-on; 1 findings at or above it; 2 the tool could not run the script.
"""

_RUN_FAILURES = (Code.RANK_CRASHED, Code.RANK_HUNG, Code.RANK_EXITED, Code.COLLECTIVE_MISMATCH)
_OURS = (
    "steps",
    "json",
    "html",
    "fail_on",
    "timeout",
    "hang_after",
    "ddp_kwargs",
    "follow_epochs",
    "limit_batches",
    "no_verify",
    "fresh_interpreters",
    "func",
)
_BENCH = ("rounds", "configs", "html")
_LAUNCH_WORDS = {
    "warm": "launch: ranks forked from an interpreter with torch imported (--fresh-interpreters: one interpreter each)",
    "fresh": "launch: one fresh interpreter per rank",
    "mixed": "launch: some ranks forked from an interpreter with torch imported, the others fresh (a worker command "
    "other than the check's, such as PYTHON_EXEC or NUMA binding)",
}


def register(sub: argparse._SubParsersAction, *, with_torchrun: bool = True) -> None:
    torchrun_subparser(
        sub,
        "check",
        help="run a training script under torchrun and diagnose its DDP setup",
        description="Run SCRIPT under torchrun with ddp-doctor in every rank. Every DistributedDataParallel "
        "model the script builds (directly, or inside HF Trainer, Accelerate or Lightning) is observed "
        "for --steps optimizer steps; then all ranks stop together and one report is printed.",
        epilog=EPILOG,
        examples=EXAMPLES,
        add_ours=add_check_arguments,
        with_torchrun=with_torchrun,
    ).set_defaults(func=run)


def add_check_arguments(group: Any, *, bench: bool = False) -> None:
    """The options `check` (and, without --fail-on and --ddp-kwargs, `bench`) add to torchrun's."""
    group.add_argument(
        "--steps",
        type=int,
        default=8,
        metavar="K",
        help="optimizer steps to observe per DDP model before stopping (default: 8)"
        if not bench
        else "optimizer steps observed for correctness, then as many timed, per candidate (default: 8)",
    )
    group.add_argument(
        "--json",
        metavar="FILE",
        help=f"write the result as JSON (schema ddp-doctor/{'bench@1' if bench else 'report@2'})",
    )
    if not bench:
        group.add_argument(
            "--html",
            metavar="FILE",
            help="write the report as one self-contained HTML page: the findings, a usage map, a "
            "divergence curve and the fix for four frameworks (needs matplotlib)",
        )
    group.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="stop every rank after S seconds and report what happened (default: 600)"
        + (", per launch of the script (candidates that share a launch share it)" if bench else ""),
    )
    group.add_argument(
        "--fresh-interpreters",
        action="store_true",
        help="start every rank in a fresh Python interpreter, as plain torchrun does, instead of forking it from "
        "one that has torch imported (also: DDP_DOCTOR_FRESH_INTERPRETERS=1); slower, for a script that needs it",
    )
    if bench:
        return
    group.add_argument(
        "--hang-after",
        type=float,
        default=None,
        metavar="S",
        help="end the check early when no rank has moved for S seconds (no step, no collective entered or left, "
        "no new line run) and report where each rank is; a rank busy on one long line (a big load, a compile) "
        "does not move, so keep S above that (default: only --timeout ends a hang)",
    )
    group.add_argument(
        "--follow-epochs",
        type=int,
        default=1,
        metavar="N",
        help="after the observed steps, follow the script through N epoch ends (its evaluation, checkpoints, "
        "collectives) with every later DataLoader pass capped at --limit-batches; 0 stops right after the "
        "observed steps (default: 1)",
    )
    group.add_argument(
        "--limit-batches",
        type=int,
        default=2,
        metavar="M",
        help="while following, each DataLoader pass (training or evaluation) hands out at most M batches; "
        "len() still returns the real length (default: 2)",
    )
    group.add_argument(
        "--fail-on",
        choices=("error", "warning", "never"),
        default="error",
        help="lowest severity that makes the exit code 1 (default: error)",
    )
    group.add_argument(
        "--ddp-kwargs",
        metavar="JSON",
        default=None,
        help="override the script's DDP constructor arguments, e.g. '{\"static_graph\": true}'; "
        'the key "freeze_before_wrap" takes a list of parameter names to freeze before wrapping',
    )
    group.add_argument(
        "--no-verify",
        action="store_true",
        help="when the observed steps end early (a crash, or a script shorter than --steps), do not run the "
        "script a second time with the recommended flags to verify them; for an FSDP2 model, do not run it again "
        "with the advised reshard_after_forward",
    )


def parse_ddp_kwargs(text: str | None) -> tuple[dict[str, Any], list[str]]:
    """Validate `--ddp-kwargs`: returns (constructor overrides, freeze_before_wrap names).

    Raises:
        TypeError: not a JSON object.
        ValueError: not JSON, an unknown argument, or a bad freeze_before_wrap list; the message names it.
    """
    if not text:
        return {}, []
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"--ddp-kwargs is not valid JSON ({exc.msg} at character {exc.pos}): {text!r}. "
            "Example: '{\"static_graph\": true}'"
        ) from None
    if not isinstance(value, dict):
        raise TypeError(f"--ddp-kwargs must be a JSON object, got {text!r}. Example: '{{\"static_graph\": true}}'")
    from torch.nn.parallel import DistributedDataParallel

    accepted = [
        n for n in inspect.signature(DistributedDataParallel.__init__).parameters if n not in ("self", "module")
    ]
    freeze = value.pop("freeze_before_wrap", [])
    if not isinstance(freeze, list) or not all(isinstance(n, str) for n in freeze):
        raise ValueError(f"--ddp-kwargs freeze_before_wrap must be a list of parameter names, got {freeze!r}.")
    unknown = [k for k in value if k not in accepted]
    if unknown:
        raise ValueError(
            f"--ddp-kwargs has {unknown}, which DistributedDataParallel does not accept. It accepts: "
            f"{', '.join(accepted)} (and freeze_before_wrap)."
        )
    return value, freeze


def check(
    script: str,
    script_args: list[str] = (),
    *,
    torchrun: list[str] = (),
    module: bool = False,
    steps: int = 8,
    ddp_kwargs: dict[str, Any] | None = None,
    freeze_before_wrap: list[str] = (),
    timeout: float = 600.0,
    hang_after: float | None = None,
    follow_epochs: int = 1,
    limit_batches: int = 2,
    output: IO[str] | None = None,
    verify: bool = True,
    fresh: bool = False,
) -> CheckResult:
    """Run `check` from Python: `torchrun` holds torchrun's own options, e.g. `["--nproc-per-node", "2"]`."""
    argv = [*torchrun, *(["-m"] if module else []), script, *script_args]
    return check_namespace(
        vars(torchrun_parser().parse_args(argv)),
        steps=steps,
        ddp_kwargs=dict(ddp_kwargs or {}),
        freeze=list(freeze_before_wrap),
        timeout=timeout,
        hang_after=hang_after,
        follow_epochs=follow_epochs,
        limit_batches=limit_batches,
        output=output,
        verify=verify,
        fresh=fresh,
    )


def validate_launch(args: argparse.Namespace, command: str) -> None:
    """What every command that launches the script checks (`check`, `bench`, `watch`): --no-python, the script,
    --nproc-per-node, --steps; a bad value is an argument error that names it."""
    parser: argparse.ArgumentParser = args._parser
    if args.no_python:
        parser.error(
            f"--no-python cannot be used with {command}: the doctor runs inside the Python process of each rank."
        )
    if not args.module and not Path(args.training_script).is_file():
        parser.error(
            f"script {args.training_script!r} does not exist (from {os.getcwd()}). Pass the path of the "
            "training script, or -m MODULE for a module."
        )
    nproc = str(args.nproc_per_node)
    if (nproc.isdigit() and int(nproc) < 1) or (not nproc.isdigit() and nproc not in ("auto", "cpu", "gpu", "xpu")):
        parser.error(
            f"--nproc-per-node must be a positive number of processes (or auto, cpu, gpu, xpu), got "
            f"{nproc!r}. Example: --nproc-per-node 2"
        )
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}.")


def validate(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """Check the arguments `check` and `bench` share; returns (torchrun namespace, DDP overrides, freeze names)."""
    parser: argparse.ArgumentParser = args._parser
    validate_launch(args, "check")
    if args.timeout <= 0:
        parser.error(f"--timeout must be positive, got {args.timeout}.")
    hang_after = getattr(args, "hang_after", None)
    if hang_after is not None and not 0 < hang_after < args.timeout:
        parser.error(
            f"--hang-after must be a positive number of seconds below --timeout ({args.timeout:g}), got {hang_after:g}."
        )
    if getattr(args, "follow_epochs", 0) < 0:
        parser.error(f"--follow-epochs must be 0 (off) or more, got {args.follow_epochs}.")
    if getattr(args, "limit_batches", 1) < 1:
        parser.error(f"--limit-batches must be at least 1, got {args.limit_batches}.")
    try:
        ddp_kwargs, freeze = parse_ddp_kwargs(getattr(args, "ddp_kwargs", None))
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    namespace = {k: v for k, v in vars(args).items() if k not in (*_OURS, *_BENCH, "_parser")}
    return namespace, ddp_kwargs, freeze


def run(args: argparse.Namespace) -> int:
    namespace, ddp_kwargs, freeze = validate(args)
    if args.html:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            args._parser.error("--html needs matplotlib: pip install 'ddp-doctor[html]'.")
    result = check_namespace(
        namespace,
        steps=args.steps,
        ddp_kwargs=ddp_kwargs,
        freeze=freeze,
        timeout=args.timeout,
        hang_after=args.hang_after,
        follow_epochs=args.follow_epochs,
        limit_batches=args.limit_batches,
        output=None,
        verify=not args.no_verify,
        fresh=args.fresh_interpreters,
    )
    from ddp_doctor.launch.outcome import exit_code

    console = Console()
    render_result(result, console)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(result.to_json())
    if args.html:
        path = Path(args.html)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(check_page(result, title=f"ddp-doctor check {Path(args.training_script).name}"))
        console.print(f"wrote {args.html}", highlight=False)
    return exit_code(result, args.fail_on)


def check_page(result: CheckResult, *, title: str = "ddp-doctor check") -> str:
    """The whole result as one HTML page (`check --html`, `demo --html`): every model's report, each in its own
    section, or the reason there is none.

    Args:
        result: what `check` produced.
        title: the page's title and heading.
    """
    from html import escape

    from ddp_doctor.report.html import check_section, page

    parts = [f"<h1>{escape(title)}</h1>"]
    if result.interrupted is not None:
        parts.append(
            f"<p class='crash'>Interrupted by {signal.Signals(result.interrupted).name}: a partial report.</p>"
        )
    if result.error is not None and result.interrupted is None:
        # As in the terminal: the tool could not run the script, and that is all there is to say.
        parts.append(f"<p class='crash'>ddp-doctor could not run the script:</p><pre>{escape(result.error)}</pre>")
        return page(title, "\n".join(parts))
    for i, model in enumerate(result.models):
        heading = f"DDP model {i + 1} of {len(result.models)}: {model.module}" if len(result.models) > 1 else None
        parts.append(check_section(model.report, key=f"m{i}", heading=heading))
    return page(title, "\n".join(parts))


def render_result(result: CheckResult, console: Console) -> None:
    """Print the report(s), or the reason there is none."""
    if not result.clean_line:
        # The script's last output did not end its line (a progress bar): start the report on a fresh one.
        sys.stdout.write("\n")
        sys.stdout.flush()
    if result.interrupted is not None:
        name = signal.Signals(result.interrupted).name
        sys.stderr.write(
            f"ddp-doctor: interrupted by {name}; every process of the run was stopped"
            + (", partial report below" if result.models else ", nothing was recorded yet")
            + ".\n"
        )
        sys.stderr.flush()
    if result.error is not None and result.interrupted is None:
        # Plain stderr, not rich: the message may carry a traceback and must not be re-wrapped.
        sys.stderr.write(f"ddp-doctor: error: {result.error}\n")
        return
    for i, model in enumerate(result.models):
        if len(result.models) > 1:
            console.print(Rule(f"DDP model {i + 1} of {len(result.models)}: {model.module}"))
        console.print(model.report)
    if result.launch in _LAUNCH_WORDS:
        console.print(_LAUNCH_WORDS[result.launch], style="dim", highlight=False)
    failed = (
        result.error is not None
        or result.timed_out
        or any(f.code in _RUN_FAILURES for m in result.models for f in m.report.findings)
    )
    if result.torchrun_log and failed:
        console.print(f"torchrun's own log: {result.torchrun_log}", highlight=False, soft_wrap=True)
