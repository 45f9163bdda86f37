"""Ranks born warm: torchrun's workers forked from a server that has already imported torch and ddp-doctor.

A rank under `check` used to be a fresh `python -u -m ddp_doctor.launch.bootstrap SCRIPT` that paid for importing
torch (2-3 s of CPU) before the script's first line. Here the launcher imports torch first thing (it needs it for
torchrun anyway), then forks a multiprocessing forkserver from itself, which imports the entry module's
`WARM_IMPORTS` while the launcher imports torchrun: each node pays for one torch import, and the server has nothing
but imports done (no torch op, no CUDA call, no thread of torch's started). torchrun's elastic agent then starts each
worker through `WarmHandler`, torch's own `SubprocessHandler` whose process comes from the server instead of
`Popen`. The agent sees a process with a pid, an exit status (negative for a signal), its own session and process
group: everything else in torchrun (rendezvous, restarts, signals, the failure it reports) is unchanged.

In the rank (`warm_rank.py`), before the entry module runs, the process is made what a fresh interpreter under torchrun
would be: the agent's environment for that worker exactly, a new session, the kernel's death signal tied to the
server, multiprocessing's state of a main process (so the script may call `set_start_method` and start DataLoader
workers with fork, spawn or forkserver), numpy's and torch's unseeded generators seeded anew, torch's intra-op
threads as `OMP_NUM_THREADS` says. What cannot be made fresh after a fork: the ranks share Python's string-hash seed (a set of
strings iterates in the same order on every rank, where separate interpreters may differ) and stdin is /dev/null.
`--fresh-interpreters` (or `DDP_DOCTOR_FRESH_INTERPRETERS=1`) keeps one plain interpreter per rank.

A worker whose command is not the one the server was warmed for (`PYTHON_EXEC` naming another interpreter, NUMA
binding wrapping the command) starts fresh, as torchrun would start it; `launch.json` in the run's folder says
which launch each local rank got.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from ddp_doctor.launch.warm_rank import LAUNCH_VAR, die_with, rank_main

__all__ = [
    "FRESH_VAR",
    "LAUNCH_VAR",
    "fresh_requested",
    "install",
    "read_launch",
    "record_fresh",
    "start_forkserver",
    "torchrun_omp_threads",
    "warm_imports",
]

FRESH_VAR = "DDP_DOCTOR_FRESH_INTERPRETERS"
"""Set to 1 (by `--fresh-interpreters`, or by the user) to start every rank in a fresh interpreter."""
_LAUNCH_FILE = "launch.json"
TORCH_IMPORTS = ("torch._dynamo", "torch.nn.parallel", "torch.distributed.fsdp", "torch.distributed.tensor")
"""What every data-parallel rank imports after torch: DDP's constructor imports `torch._dynamo` (with sympy, about 1 s
of CPU), FSDP2 and `replicate` import DTensor. The server imports them once per node instead of once per rank. None
of them starts a thread, reads a rank's environment variable or touches CUDA when imported."""


def fresh_requested(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    return environ.get(FRESH_VAR, "").strip().lower() not in ("", "0", "false", "no")


def torchrun_omp_threads(nproc_per_node: Any) -> str | None:
    """The `OMP_NUM_THREADS` torchrun will give the workers when the user set none: 1 for several processes per
    node (torch.distributed.run's rule), None where torchrun leaves it unset or the count is not a number yet."""
    if "OMP_NUM_THREADS" in os.environ:
        return None
    text = str(nproc_per_node)
    return "1" if text.isdigit() and int(text) > 1 else None


def start_forkserver(entry: str, *, omp_threads: str | None) -> bool:
    """Import torch here, then fork the server from this process; the server imports what the ranks of `entry` need
    (its `WARM_IMPORTS`) while this process imports torchrun. False where there is no forkserver.

    The launcher needs torch itself, so the server is forked from it instead of starting a second interpreter that
    imports torch again: one torch import per node instead of two. Nothing has started a thread or touched a tensor
    when it forks. `omp_threads` is set in the environment before torch loads: OpenMP reads it once, then.
    """
    import importlib
    import multiprocessing
    from multiprocessing import forkserver, util

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    if omp_threads is not None:
        # The launcher's environment is torchrun's to change, and torchrun sets OMP_NUM_THREADS the same way.
        os.environ["OMP_NUM_THREADS"] = omp_threads
    importlib.import_module("torch")
    importlib.import_module("torch.distributed")
    multiprocessing.get_context("forkserver").set_forkserver_preload(warm_imports(entry))
    _short_socket_dir()
    launcher = os.getpid()
    spawn = util.spawnv_passfds
    util.spawnv_passfds = lambda path, args, fds: _fork_server(args, fds, launcher, spawn)
    try:
        forkserver.ensure_running()
    finally:
        util.spawnv_passfds = spawn
    return True


def warm_imports(entry: str) -> list[str]:
    """What the server imports beside torch before it forks a rank of `entry`: `TORCH_IMPORTS`, then the modules
    `entry` lists in `WARM_IMPORTS`. Importing is all the server does: no tensor is made, CUDA is never asked about, no thread pool of
    torch's starts. A module that fails to import is left for the rank to meet (and report) as it would in a fresh
    interpreter."""
    import importlib

    try:
        module = importlib.import_module(entry)
    except Exception:  # noqa: BLE001  (see above)
        return list(TORCH_IMPORTS)
    # The rank runs the entry module as __main__ (runpy), which warns when it is imported already.
    sys.modules.pop(entry, None)
    return [*TORCH_IMPORTS, *getattr(module, "WARM_IMPORTS", ())]


def _fork_server(args: list[str], keep: list[int], launcher: int, spawn: Any) -> int:
    """What `multiprocessing.util.spawnv_passfds` (`spawn`) does for the forkserver (run `python -c CODE` with the
    fds `keep` open), by a fork of this process: CODE runs in the child, which has every module of the launcher
    imported."""
    from multiprocessing import forkserver, util

    code = args[args.index("-c") + 1]
    pid = os.fork()
    if pid:
        return pid
    try:
        # The child is forked inside `ensure_running`: the client's lock is held and the spawn patched. The ranks'
        # own forkservers and spawns (a DataLoader's workers) must find them as a fresh interpreter has them.
        forkserver._forkserver.__init__()  # type: ignore[attr-defined, misc]
        util.spawnv_passfds = spawn
        die_with(launcher)
        _close_fds_except({0, 1, 2, *keep})
        exec(code, {"__name__": "__ddp_doctor_forkserver__"})  # noqa: S102  (multiprocessing's own server code)
    except BaseException:  # noqa: BLE001  (the server ends: at its clients' exit, or at a signal)
        pass
    os._exit(0)


def _close_fds_except(keep: set[int]) -> None:
    """What exec with `close_fds` would do: the launcher's pipes and sockets stay out of the server (its own end of
    the server's alive pipe above all, or the server would never see its last client leave)."""
    try:
        open_fds = sorted(int(name) for name in os.listdir("/proc/self/fd"))
    except OSError:
        open_fds = list(range(3, 1024))
    for fd in open_fds:
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _short_socket_dir() -> None:
    """The server listens on a Unix socket in multiprocessing's temporary folder, whose path may hold 107 bytes:
    the run's own temporary folder where its path is short enough, else the system's."""
    import tempfile
    from multiprocessing import util

    if len(tempfile.gettempdir()) <= 60:
        return
    saved = tempfile.tempdir
    tempfile.tempdir = "/tmp" if os.path.isdir("/tmp") else saved
    try:
        util.get_temp_dir()  # made now, under the short folder, and removed when the launcher exits
    finally:
        tempfile.tempdir = saved


def install(entry: str, outdir: Path) -> bool:
    """Have torchrun's agent start the workers whose command runs `entry` from the server. False where this torch
    has no subprocess handler to replace (the workers then start fresh)."""
    from torch.distributed.elastic.multiprocessing import api

    if not hasattr(api, "get_subprocess_handler"):
        return False
    handler_class = _handler_class(entry, outdir)

    def get_subprocess_handler(**kwargs: Any) -> Any:
        return handler_class(**kwargs)

    api.get_subprocess_handler = get_subprocess_handler
    return True


def read_launch(outdir: Path) -> str | None:
    """`warm`, `fresh` or `mixed`: how this node's ranks were started (None: no rank was started)."""
    try:
        ranks = json.loads((Path(outdir) / _LAUNCH_FILE).read_text())
    except (OSError, ValueError):
        return None
    kinds = set(ranks.values())
    return kinds.pop() if len(kinds) == 1 else "mixed" if kinds else None


def record_fresh(outdir: Path) -> None:
    """Every rank of this node starts in a fresh interpreter (asked for, or no server could be used)."""
    _record(outdir, "*", "fresh")


def _record(outdir: Path, local_rank: int | str, kind: str) -> None:
    path = Path(outdir) / _LAUNCH_FILE
    try:
        ranks = json.loads(path.read_text())
    except (OSError, ValueError):
        ranks = {}
    ranks[str(local_rank)] = kind
    try:
        path.write_text(json.dumps(ranks))
    except OSError:
        pass


def _handler_class(entry: str, outdir: Path) -> type:
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    warm_command = (sys.executable, "-u", "-m", entry)

    class WarmHandler(SubprocessHandler):
        """torch's handler, with the worker forked from the server when its command is the one it was warmed for."""

        def _popen(self, args: tuple, env: dict[str, str]) -> Any:
            local_rank = getattr(self, "local_rank_id", 0)
            if tuple(args[:4]) != warm_command:
                _record(outdir, local_rank, "fresh")
                return super()._popen(args, env)
            out = getattr(self, "_stdout", None)
            err = getattr(self, "_stderr", None)
            proc = WarmProcess(
                list(args), entry, [str(a) for a in args[4:]], env, out.name if out else None, err.name if err else None
            )
            _record(outdir, local_rank, "warm")
            return proc

        def close(self, death_sig: signal.Signals | None = None) -> None:
            if not isinstance(self.proc, WarmProcess):
                super().close(death_sig)
                return
            self.proc.signal_group(death_sig or signal.SIGTERM)
            for stream in (getattr(self, "_stdout", None), getattr(self, "_stderr", None)):
                if stream:
                    stream.close()

    return WarmHandler


class WarmProcess:
    """A worker forked from the server, with the part of `subprocess.Popen` torchrun's agent uses."""

    def __init__(
        self, args: list[str], entry: str, argv: list[str], env: dict[str, str], out: str | None, err: str | None
    ) -> None:
        import multiprocessing
        from multiprocessing import forkserver

        self.args = args
        server = getattr(forkserver._forkserver, "_forkserver_pid", None)
        self._process = multiprocessing.get_context("forkserver").Process(
            target=rank_main, args=(entry, argv, env, out, err, server), daemon=True, name="ddp-doctor-rank"
        )
        self._process.start()
        self.pid: int = self._process.pid  # type: ignore[assignment]

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def signal_group(self, sig: int) -> None:
        """Signal the worker's process group (it leads one, as with `start_new_session`), or the worker alone while
        it has not made its session yet."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            self.send_signal(sig)
