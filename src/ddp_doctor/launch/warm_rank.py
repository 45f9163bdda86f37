"""A warm rank's first code after its fork from the server (`warm.py`): the process is made what a fresh interpreter
under torchrun would be, then runs `python -m ENTRY ARGV` (`rank_main`).

The agent's environment for that worker exactly, a new session, the kernel's death signal tied to the server,
multiprocessing's state of a main process (so the script may call `set_start_method` and start DataLoader workers
with fork, spawn or forkserver), numpy's and torch's unseeded generators seeded anew, torch's intra-op threads as
`OMP_NUM_THREADS` says.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import traceback
from typing import Any

__all__ = ["LAUNCH_VAR", "die_with", "rank_main"]

LAUNCH_VAR = "DDP_DOCTOR_LAUNCH"
"""In each rank's environment: `warm` (forked from the preloaded server) or absent (a fresh interpreter)."""
_TORCH_FIXED_SEED = 67280421310721
"""The seed torch's CPU generator started from before torch seeded it from the OS at import."""


def rank_main(
    entry: str, argv: list[str], env: dict[str, str], out: str | None, err: str | None, server: int | None
) -> None:
    """The worker's first code after the fork: become a fresh interpreter's rank, then run `python -m entry ARGV`."""
    os.setsid()
    die_with(server)
    os.environ.clear()
    os.environ.update(env)
    os.environ[LAUNCH_VAR] = "warm"
    if server is not None:
        # The rank's parent is the server, not torchrun's agent: die_with_parent() checks against it.
        from ddp_doctor.launch.config import LAUNCHER_PID_VAR

        os.environ[LAUNCHER_PID_VAR] = str(server)
    _redirect(out, 1)
    _redirect(err, 2)
    _fresh_multiprocessing()
    _fresh_numerics()
    code = 0
    try:
        import runpy

        _set_argv(entry, argv)
        runpy.run_module(entry, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            sys.stderr.write(f"{exc.code}\n")
    except BaseException:  # noqa: BLE001  (what python -m would print, then its status)
        traceback.print_exc()
        code = 1
    _finalize()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _finalize() -> None:
    """What an interpreter does at its end before it exits: wait for the script's non-daemon threads, then run the
    atexit handlers (a script that ran to its end under `watch` flushes its loggers and closes its files there)."""
    import atexit
    import threading

    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001  (a thread's own error is already printed by threading)
        pass
    atexit._run_exitfuncs()


def _set_argv(entry: str, argv: list[str]) -> None:
    """`sys.argv` as `python -m entry ARGV` sets it: the module's file first."""
    import importlib.util

    spec = importlib.util.find_spec(entry)
    sys.argv = [spec.origin if spec is not None and spec.origin else entry, *argv]


def die_with(server: int | None) -> None:
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if server is not None and os.getppid() != server:
        os._exit(1)  # the server died before the call: so did the launcher


def _redirect(path: str | None, fd: int) -> None:
    """torchrun's `--redirects` / `--tee`: the file torch's handler opened for this stream."""
    if not path:
        return
    target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(target, fd)
    os.close(target)


def _fresh_multiprocessing() -> None:
    """multiprocessing's state of a main process: no start method chosen, no parent, a new authentication key.

    The fork carried the server's state (and the launcher's start method, through the child's preparation): the
    script's `mp.set_start_method(...)` would fail with "context has already been set", DataLoader workers would
    count as children of a daemon, and processes would be named after the server's.
    """
    import multiprocessing.context
    import multiprocessing.process

    multiprocessing.process._current_process = _main_process()
    multiprocessing.process._parent_process = None
    multiprocessing.process._children = set()
    multiprocessing.process._process_counter = itertools.count(1)
    multiprocessing.context._default_context._actual_context = None
    try:
        from multiprocessing import resource_tracker

        resource_tracker._resource_tracker = resource_tracker.ResourceTracker()
    except (ImportError, AttributeError):
        pass


def _main_process() -> Any:
    """What `multiprocessing.current_process()` is in a fresh interpreter (the stdlib's `_MainProcess`, which it
    deletes after making its one instance): named MainProcess, no parent, not a daemon, a new authentication key."""
    from multiprocessing import process

    class MainProcess(process.BaseProcess):
        def __init__(self) -> None:
            self._identity = ()
            self._name = "MainProcess"
            self._parent_pid = None
            self._popen = None
            self._closed = False
            self._config = {"authkey": process.AuthenticationString(os.urandom(32)), "semprefix": "/mp"}

        def _check_closed(self) -> None:
            pass

    return MainProcess()


def _fresh_numerics() -> None:
    """What a fresh interpreter would draw or read at import: numpy's global random state and torch's CPU generator
    (each seeded from the OS at import on this torch, so every forked rank would draw the same numbers; a torch
    whose generator starts from its fixed default seed is left so), and torch's intra-op threads from
    `OMP_NUM_THREADS` (OpenMP read the server's environment when torch loaded). Python's `random` reseeds itself
    after a fork."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if torch.initial_seed() != _TORCH_FIXED_SEED:
        torch.default_generator.seed()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
