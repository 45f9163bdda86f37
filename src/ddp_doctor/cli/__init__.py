"""The `ddp-doctor` command. One module per subcommand; each registers itself with the parser."""

from __future__ import annotations

import argparse
import signal
import sys

from ddp_doctor import __version__
from ddp_doctor.cli import bench, check, demo, list_codes

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddp-doctor", description="Find, explain and fix misconfigured PyTorch DistributedDataParallel training."
    )
    parser.add_argument("--version", action="version", version=f"ddp-doctor {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    check.register(sub)
    bench.register(sub)
    demo.register(sub)
    list_codes.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # First thing: SIGINT, SIGTERM and SIGHUP stop the run cleanly (every process it started, its temp folder)
    # and exit 128 + the signal, from the first millisecond on.
    from ddp_doctor.launch.supervise import Interrupted, install_signal_handlers

    install_signal_handlers()
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args) or 0)
    except Interrupted as exc:
        sys.stderr.write(
            f"\nddp-doctor: interrupted by {signal.Signals(exc.signum).name} before the run started; "
            "nothing was left running.\n"
        )
        return exc.exit_code
