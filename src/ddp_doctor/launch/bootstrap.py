"""Entry point of every rank under `ddp-doctor check`: `python -m ddp_doctor.launch.bootstrap SCRIPT_ARGS...`.

torchrun starts this module instead of the user's script. It ties the rank's life to torchrun's, installs the
doctor, then runs the script (or module) the way `python script.py` / `python -m module` would: as `__main__`, with
`sys.argv[0]` and `sys.path[0]` set to the script's, so `if __name__ == "__main__":` blocks, relative imports of
sibling files and argparse all behave as usual.
"""

from __future__ import annotations

import os
import runpy
import sys

from ddp_doctor.launch.config import RankConfig, die_with_parent


def main() -> None:
    die_with_parent()
    from ddp_doctor.launch.session import Session

    config = RankConfig.from_env()
    session = Session(config)
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


if __name__ == "__main__":
    main()
