"""A subcommand that takes torchrun's options (`check` and `bench`): ours first with the examples, then torchrun's
own, which parse exactly as torchrun parses them."""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable
from typing import Any

__all__ = ["torchrun_parser", "torchrun_subparser"]


def torchrun_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    return get_args_parser()


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Raw descriptions, without the indent argparse puts on their blank lines."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line if line.strip() else line for line in text.splitlines(keepends=True))


def torchrun_subparser(
    sub: argparse._SubParsersAction,
    name: str,
    *,
    help: str,
    description: str,
    epilog: str,
    examples: str,
    add_ours: Callable[[Any], None],
) -> argparse.ArgumentParser:
    """A subcommand that takes torchrun's options: ours first with the examples, then torchrun's in their own group.

    torchrun's own actions are moved into a titled group (as argparse's `parents=` does internally), so that they
    parse exactly as torchrun parses them; only where `--help` shows them changes.
    """
    p = sub.add_parser(
        name,
        help=help,
        description=textwrap.fill(description, 100),
        epilog=epilog,
        add_help=False,
        usage=f"%(prog)s [{name} options] [torchrun options] SCRIPT [SCRIPT ARGS ...]",
        formatter_class=_Formatter,
    )
    ours = p.add_argument_group(f"{name} options")
    ours.add_argument("-h", "--help", action="help", help="show this help and exit")
    add_ours(ours)
    p.add_argument_group("examples", examples)
    script = p.add_argument_group("the script")
    launcher = p.add_argument_group(
        "torchrun options", "PyTorch's launcher options, passed to torchrun unchanged (torchrun --help)"
    )
    for action in torchrun_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if action.dest == "training_script":
            action.metavar, action.help = "SCRIPT", "the training script (a module with -m), as torchrun takes it"
        elif action.dest == "training_script_args":
            action.metavar, action.help = "SCRIPT ARGS", "the script's own arguments"
        (launcher if action.option_strings else script)._add_action(action)
    p.set_defaults(_parser=p)
    return p
