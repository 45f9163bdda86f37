"""Entry point of every rank under `ddp-doctor check`: `python -m ddp_doctor.launch.bootstrap SCRIPT_ARGS...`.

torchrun starts this module instead of the user's script. It ties the rank's life to torchrun's, installs the
doctor, then runs the script (or module) the way `python script.py` / `python -m module` would: as `__main__`, with
`sys.argv[0]` and `sys.path[0]` set to the script's, so `if __name__ == "__main__":` blocks, relative imports of
sibling files and argparse all behave as usual. Another entry point (`ddp-doctor bench`'s) calls `run_rank` with
its own policy.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import TYPE_CHECKING

from ddp_doctor.launch.config import RankConfig, die_with_parent

if TYPE_CHECKING:
    from ddp_doctor.launch.session import PolicyFactory

__all__ = ["WARM_IMPORTS", "main", "run_rank"]

WARM_IMPORTS = ("ddp_doctor.launch.session", "ddp_doctor.launch.watch_rank")
"""What the warm launch's server imports before it forks a rank of this entry point (`warm.py`)."""


def run_rank(config: RankConfig, policy: PolicyFactory | None = None) -> None:
    """Install the doctor with `policy` (default: the check's), run the script, and end the rank (never returns).

    Call `die_with_parent()` first, before the heavy imports.
    """
    from ddp_doctor.launch.session import Session

    session = Session(config, policy)
    session.install()
    args = sys.argv[1:]
    try:
        if config.module:
            sys.argv = [config.target, *args]
            runpy.run_module(config.target, run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(config.target)
            sys.argv = [script, *args]
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        session.on_exit(exc)
    except KeyboardInterrupt:
        os._exit(130)
    except BaseException as exc:  # noqa: BLE001  (whatever the script raised is reported, not re-raised)
        session.on_crash(exc)
    session.on_exit(None)


def main() -> None:
    die_with_parent()
    config = RankConfig.from_env()
    if config.whole_run:
        from ddp_doctor.launch.watch_rank import WatchPolicy

        run_rank(config, WatchPolicy)
    else:
        run_rank(config)


if __name__ == "__main__":
    main()
