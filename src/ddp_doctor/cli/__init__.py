"""The `ddp-doctor` command. One module per subcommand; each registers itself with the parser.

No import of torch here: the subcommand modules import what they run only when they run it, torchrun's options
come from a cache (`torchrun_options.py`), added only to the subcommand being run, and a check's result is read
and drawn without torch when the ranks wrote their joint report (the analysis of a failed run imports it). So
`--help`, `codes` and argument errors answer at once, and Ctrl-C or SIGTERM are ours from the first statement on.
"""

from __future__ import annotations

from ddp_doctor.launch.interrupt import Interrupted, install_signal_handlers

install_signal_handlers()  # first: SIGINT / SIGTERM / SIGHUP while the CLI starts exit 128 + the signal, no traceback

import signal  # noqa: E402
import sys  # noqa: E402


def _interrupted(exc: Interrupted) -> int:
    sys.stderr.write(f"\nddp-doctor: interrupted by {signal.Signals(exc.signum).name}; nothing was left running.\n")
    return exc.exit_code


try:  # a signal while the subcommands are imported is one line too, not a traceback out of an import
    import argparse

    from ddp_doctor import __version__
    from ddp_doctor.cli import bench, check, demo, explain, list_codes, watch
except Interrupted as exc:
    sys.exit(_interrupted(exc))

__all__ = ["build_parser", "main"]

_TORCHRUN_COMMANDS = ("check", "bench", "watch")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole parser; torchrun's options go to `command`'s subparser only (None: to both that take them)."""
    parser = argparse.ArgumentParser(
        prog="ddp-doctor", description="Find, explain and fix misconfigured PyTorch DistributedDataParallel training."
    )
    parser.add_argument("--version", action="version", version=f"ddp-doctor {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)
    check.register(sub, with_torchrun=command in (None, "check"))
    bench.register(sub, with_torchrun=command in (None, "bench"))
    watch.register(sub, with_torchrun=command in (None, "watch"))
    explain.register(sub)
    demo.register(sub)
    list_codes.register(sub)
    return parser


def _command(argv: list[str]) -> str | None:
    """The subcommand on the command line (the top level takes no option with a value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    install_signal_handlers()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(_command(argv)).parse_args(argv)
        code = int(args.func(args) or 0)
    except Interrupted as exc:
        code = _interrupted(exc)
    return code
