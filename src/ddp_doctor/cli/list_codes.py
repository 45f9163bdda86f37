"""`ddp-doctor codes`: the stable finding codes, for people and for scripts (`--json`)."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from ddp_doctor.core.codes import CODES

__all__ = ["register"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "codes",
        help="list the finding codes",
        epilog="examples:\n  ddp-doctor codes\n  ddp-doctor codes --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print a JSON object code -> meaning")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.json:
        print(json.dumps(CODES, indent=2))
        return 0
    table = Table("code", "meaning", box=None)
    for code, meaning in CODES.items():
        table.add_row(code, meaning)
    Console().print(table)
    return 0
