"""`python -m ddp_doctor.launch.torchrun ARGS_JSON`: PyTorch's own launcher, run on a parsed torchrun namespace.

The `check` parent parses the command line with torchrun's own parser (so every rendezvous flag works as it does
for torchrun) and hands the namespace over as JSON. A worker failure is the doctor's to report: torchrun's
`ChildFailedError` dump would only repeat it, so each failed worker's exit status goes to `torchrun.json` in the
output folder (the rank files cannot say "killed by SIGKILL"), and torchrun's own log lines go to `torchrun.log`.

Unless fresh interpreters were asked for, the workers are born warm (`warm.py`): this process imports torch, then
forks the server that forks the ranks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from ddp_doctor.launch import warm
from ddp_doctor.launch.config import LAUNCHER_PID_VAR, RankConfig, die_with_parent


def _failures(exc: BaseException) -> dict[str, dict[str, object]]:
    out = {}
    for rank, failure in getattr(exc, "failures", {}).items():
        code = int(failure.exitcode)
        out[str(rank)] = {
            "exitcode": code,
            "signal": signal.Signals(-code).name if code < 0 else None,
            "pid": int(failure.pid),
        }
    return out


def _torch_types(namespace: dict[str, object]) -> dict[str, object]:
    """The values the CLI's cached options kept as strings (`cli/torchrun_options.py`), converted by torchrun's own
    parser's types (a comma-separated list, say)."""
    from torch.distributed.run import get_args_parser

    out = dict(namespace)
    for action in get_args_parser()._actions:
        value = out.get(action.dest)
        if isinstance(value, str) and callable(action.type) and action.type not in (str, int, float):
            out[action.dest] = action.type(value)
    return out


def main() -> None:
    die_with_parent()
    outdir = Path(RankConfig.from_env().outdir)
    namespace = json.loads(sys.argv[1])
    os.environ[LAUNCHER_PID_VAR] = str(os.getpid())
    entry = str(namespace["training_script"])
    born_warm = not warm.fresh_requested() and warm.start_forkserver(
        entry, omp_threads=warm.torchrun_omp_threads(namespace.get("nproc_per_node"))
    )
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    # torchrun's own messages (a SIGTERM it forwards, a worker it restarts) go to a log file the report names;
    # what the user sees is the script's output and the doctor's report.
    handler = logging.FileHandler(outdir / "torchrun.log", delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for name in ("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher"):
        log = logging.getLogger(name)
        log.handlers[:] = [handler]
        log.propagate = False
    if not (born_warm and warm.install(entry, outdir)):
        warm.record_fresh(outdir)
    _stops_never_printed(SignalException)
    try:
        run(argparse.Namespace(**_torch_types(namespace)))
    except ChildFailedError as exc:
        _ignore_stop_signals()
        (outdir / "torchrun.json").write_text(json.dumps({"failures": _failures(exc)}))
        sys.exit(1)
    except SignalException as exc:
        _ignore_stop_signals()
        logging.getLogger("torch.distributed.run").warning("torchrun stopped by %s", exc.sigval.name)
        sys.exit(128 + int(exc.sigval))
    finally:
        _ignore_stop_signals()


def _stops_never_printed(signal_exception: type[BaseException]) -> None:
    """torch's stop-signal handler raises `SignalException` wherever the main thread is. Where that is a garbage
    collector's callback or a finalizer (`weakref.finalize`), Python prints the exception as ignored (to the
    user's terminal: the launcher's stderr is the CLI's) and the agent never sees the signal. Seen when
    `ddp-doctor` stopped the run while this process collected garbage or exited. Such an exception is logged to
    torchrun.log instead, and the signal sent again, to reach the agent where it waits (once the agent is done, it
    is ignored: `_ignore_stop_signals`)."""
    log = logging.getLogger("torch.distributed.run")

    def swallowed(exc: BaseException | None) -> bool:
        if not isinstance(exc, signal_exception):
            return False
        sigval = getattr(exc, "sigval", signal.SIGTERM)
        log.warning("%s arrived inside a callback; sent again", signal.Signals(sigval).name)
        resend = threading.Timer(0.05, os.kill, (os.getpid(), int(sigval)))
        resend.daemon = True
        resend.start()
        return True

    excepthook, unraisablehook = sys.excepthook, sys.unraisablehook

    def on_exception(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        if not swallowed(exc):
            excepthook(kind, exc, tb)

    def on_unraisable(unraisable: Any) -> None:
        if not swallowed(unraisable.exc_value):
            unraisablehook(unraisable)

    sys.excepthook, sys.unraisablehook = on_exception, on_unraisable


def _ignore_stop_signals() -> None:
    """Once torchrun's agent is done, a stop signal has nothing left to stop: torch's handler (still installed)
    would raise `SignalException` wherever the interpreter is, its exit's finalizers included, and print a traceback
    into the user's terminal (seen when `ddp-doctor` was interrupted as the run ended and stopped every process of
    it). The CLI SIGKILLs what outlives its grace."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_IGN)


if __name__ == "__main__":
    main()
