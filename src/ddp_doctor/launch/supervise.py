"""The `check` parent: start torchrun with the doctor injected, enforce the timeout, leave no process behind.

Every process of a run (torchrun, each rank, a rank's own children such as DataLoader workers) carries the run's
id in its environment (`RUN_MARKER_VAR`), so the parent finds all of them by scanning /proc, from the first
millisecond, without waiting for any file a rank writes. torchrun and the ranks also ask the kernel to kill them
when their parent dies (`die_with_parent`), which covers a parent that is itself killed outright.

The run ends early, without waiting for `--timeout`, when a rank has ended (crashed or exited) and the others have
not followed within `RankConfig.crash_wait_s` plus a margin: under NCCL nothing else would stop them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from ddp_doctor.core.rankfiles import Outcome, end_path, read_ends
from ddp_doctor.launch.config import CLI_PID_VAR, ENV_VAR, RUN_MARKER_VAR, RankConfig
from ddp_doctor.launch.interrupt import Interrupted, install_signal_handlers
from ddp_doctor.launch.warm import FRESH_VAR

if TYPE_CHECKING:
    from ddp_doctor.launch.outcome import CheckResult

__all__ = ["BOOTSTRAP", "Interrupted", "check_namespace", "install_signal_handlers", "run_check", "run_processes"]

BOOTSTRAP = "ddp_doctor.launch.bootstrap"
"""The module torchrun starts in every rank under `check` (`run_check(bootstrap=...)` names another)."""
_POLL_S = 0.1
_LOG_DIR = Path(tempfile.gettempdir()) / "ddp-doctor-logs"


def _user() -> str:
    try:
        import getpass

        return getpass.getuser()
    except (ImportError, KeyError, OSError):
        return "user"


def _grace(timeout: float) -> float:
    """Seconds between asking the ranks to stop and killing them."""
    return min(5.0, max(1.0, timeout * 0.1))


def run_processes(marker: str) -> list[int]:
    """Live processes (not zombies) whose environment carries `RUN_MARKER_VAR=marker`."""
    needle = f"{RUN_MARKER_VAR}={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (
                needle in (entry / "environ").read_bytes().split(b"\0")
                and (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
            ):
                pids.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return pids


def _signal_run(marker: str, sig: signal.Signals) -> None:
    for pid in run_processes(marker):
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            continue


def _stop_run(proc: subprocess.Popen[Any], marker: str, grace: float) -> None:
    """SIGTERM every process of the run, wait up to `grace` seconds, then SIGKILL what is left."""
    _signal_run(marker, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and run_processes(marker):
        time.sleep(_POLL_S)
    _signal_run(marker, signal.SIGKILL)
    _reap(proc)
    deadline = time.monotonic() + 5.0
    while run_processes(marker) and time.monotonic() < deadline:
        _signal_run(marker, signal.SIGKILL)
        time.sleep(_POLL_S)


def _reap(proc: subprocess.Popen[Any]) -> None:
    """Wait for the killed launcher. Not `proc.wait()` alone: a signal whose handler raised inside an earlier
    `poll()` right after it took Popen's internal lock can leave that lock held for good (the with-statement is not
    safe against an exception a signal handler raises there), and a `wait()` without a timeout then blocks on it
    forever (seen once under load: Ctrl-C 1.5 s into a check). With a timeout it only tries the lock; after that the
    child is reaped directly."""
    try:
        proc.wait(timeout=2.0)
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        _, status = os.waitpid(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    except ChildProcessError:  # reaped already
        if proc.returncode is None:
            proc.returncode = -signal.SIGKILL


class _Forward(threading.Thread):
    """Copy the run's output to ours, remembering whether the last byte ended a line (the report must start on a
    clean line even after a progress bar's carriage returns)."""

    clean_line = True
    _TAIL = 65536

    def __init__(self, source: IO[bytes], sink: IO[str]) -> None:
        super().__init__(daemon=True)
        self.source, self.sink = source, sink
        self.tail = bytearray()
        """The last 64 KiB, where gloo's and NCCL's own abort messages are found."""

    def run(self) -> None:
        out = getattr(self.sink, "buffer", None)
        for chunk in iter(lambda: self.source.read1(65536), b""):
            try:
                if out is not None:
                    out.write(chunk)
                    out.flush()
                else:
                    self.sink.write(chunk.decode(errors="replace"))
                    self.sink.flush()
            except (OSError, ValueError):
                pass
            _Forward.clean_line = chunk.endswith(b"\n")
            self.tail += chunk
            del self.tail[: max(0, len(self.tail) - self._TAIL)]


_NATIVE = (
    re.compile(r"enforce fail at [^\n]*"),
    re.compile(r"NCCL error[^\n]*"),
    re.compile(r"nccl(?:InternalError|SystemError|UnhandledCudaError|InvalidUsage|RemoteError)[^\n]*"),
    re.compile(r"Watchdog caught collective operation timeout[^\n]*"),
    re.compile(r"Some NCCL operations have failed or timed out[^\n]*"),
)


def native_messages(text: str, limit: int = 3) -> list[str]:
    """gloo's and NCCL's own error lines in the job's output (they come from C++, not as Python exceptions)."""
    found: list[str] = []
    for pattern in _NATIVE:
        for match in pattern.finditer(text):
            line = match.group(0).strip()[:300]
            if line not in found:
                found.append(line)
    return found[:limit]


def _ended_ranks(folder: Path) -> dict[int, float]:
    """rank -> when it wrote its end record, for ranks that ended without a report (crashed or exited)."""
    out = {}
    for rank, end in read_ends(folder).items():
        if end.outcome in (Outcome.CRASHED, Outcome.CRASHED_AFTER_REPORT, Outcome.EXITED, Outcome.NO_EXCHANGE):
            try:
                out[rank] = end_path(folder, rank).stat().st_mtime
            except OSError:
                continue
    return out


def run_check(
    torchrun_args: dict[str, Any],
    config: RankConfig,
    *,
    timeout: float | None,
    hang_after: float | None = None,
    output: IO[str] | None = None,
    outdir: Path | None = None,
    bootstrap: str = BOOTSTRAP,
    env: dict[str, str] | None = None,
    wait: Callable[[subprocess.Popen[Any], Path], bool] | None = None,
) -> CheckResult:
    """Run the script under torchrun with the doctor in every rank, and collect the result on this node.

    Args:
        torchrun_args: torchrun's parsed namespace (as a dict) for the user's script.
        config: what each rank's doctor does; `outdir` and `deadline` are filled in here.
        timeout: seconds after which every rank is stopped and the run reported as it stands (None: no limit;
            `wait` decides when the run ends).
        hang_after: also stop the run, as at the timeout, when no live rank has moved for this many seconds
            (`watch_run.last_progress`); None: only the timeout ends a hang.
        output: where the script's stdout and stderr go (`None`: this process's own).
        outdir: keep the ranks' files here instead of a temporary folder.
        bootstrap: the module torchrun starts in every rank (a later stage's entry point, with its own policy).
        env: more environment variables for the ranks (a later stage's own settings).
        wait: waits for torchrun to end instead of the check's wait (`watch`'s, which watches the whole run); True
            when the run had to be stopped (the result is then reported as timed out).

    Returns:
        The `CheckResult`; `interrupted` is set (and the result partial) when `Interrupted` stopped the run.
    """
    marker = uuid.uuid4().hex
    with tempfile.TemporaryDirectory(prefix="ddp-doctor-") as tmp:
        folder = Path(outdir) if outdir is not None else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        start = time.time()
        config = replace(config, outdir=str(folder.resolve()), deadline=start + timeout if timeout else 0.0)
        args = {**torchrun_args, "module": True, "no_python": False, "run_path": False, "training_script": bootstrap}
        # torchrun and the ranks make their temporary files (torchelastic_*, the script's own) inside the run's
        # folder, so they go with it even when a process had to be killed. torch's compile cache stays where
        # torch would put it, so it survives between runs.
        run_tmp = Path(tmp) / "tmp"
        run_tmp.mkdir()
        cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(
            Path(tempfile.gettempdir()) / f"torchinductor_{_user()}"
        )
        environ = {
            **os.environ,
            **(env or {}),
            ENV_VAR: config.to_env(),
            "PYTHONUNBUFFERED": "1",
            RUN_MARKER_VAR: marker,
            CLI_PID_VAR: str(os.getpid()),
            "TMPDIR": str(run_tmp),
            "TORCHINDUCTOR_CACHE_DIR": cache,
        }
        proc = None
        forwards: list[_Forward] = []
        timed_out = False
        interrupted: Interrupted | None = None
        try:
            _Forward.clean_line = True
            pipe = subprocess.PIPE if output is None else output
            proc = subprocess.Popen(
                [sys.executable, "-m", "ddp_doctor.launch.torchrun", json.dumps(args)],
                env=environ,
                stdout=pipe,
                stderr=subprocess.PIPE if output is None else subprocess.STDOUT,
                start_new_session=True,
            )
            if output is None:
                forwards = [_Forward(proc.stdout, sys.stdout), _Forward(proc.stderr, sys.stderr)]
                for f in forwards:
                    f.start()
            if wait is not None:
                timed_out = wait(proc, folder)
            else:
                timed_out = _wait(
                    proc, folder, timeout=timeout or float("inf"), crash_wait=config.crash_wait_s, hang_after=hang_after
                )
        except Interrupted as exc:
            interrupted = exc
        finally:
            if proc is not None:
                _stop_run(proc, marker, grace=_grace(timeout or 50.0) if interrupted is None else 2.0)
            else:
                _signal_run(marker, signal.SIGKILL)
            for f in forwards:
                f.join(timeout=2.0)
        native = native_messages("".join(f.tail.decode(errors="replace") for f in forwards))
        if output is not None and hasattr(output, "name") and Path(str(output.name)).is_file():
            output.flush()
            native = native_messages(Path(output.name).read_text(errors="replace")[-65536:])
        from ddp_doctor.launch.outcome import collect
        from ddp_doctor.launch.warm import read_launch

        result = collect(
            folder,
            timed_out=timed_out,
            torchrun_rc=proc.returncode if proc is not None else None,
            interrupted=interrupted.signum if interrupted is not None else None,
            native=native,
            watched=config.whole_run,
        )
        result.clean_line = _Forward.clean_line
        log = folder / "torchrun.log"
        kept = outdir is not None and log.exists() and log.stat().st_size > 0  # the user's run folder: it stays
        result.torchrun_log = str(log) if kept else _keep_log(log, marker)
        result.launch = read_launch(folder)
        result.torchrun_rc = proc.returncode if proc is not None else None
        return result


def _wait(
    proc: subprocess.Popen[Any], folder: Path, *, timeout: float, crash_wait: float, hang_after: float | None = None
) -> bool:
    """Wait for torchrun to end; True when the run had to be stopped at the timeout, or at `hang_after` seconds
    without progress on any live rank.

    Also stops waiting when a rank ended on its own (crash or exit) and the others did not follow within
    `crash_wait` seconds plus a margin: they are waiting for it in a collective that may never fail (NCCL).
    """
    from ddp_doctor.launch.watch_run import beacons, last_progress

    deadline = time.monotonic() + max(0.1, timeout - _grace(timeout))
    while proc.poll() is None:
        if time.monotonic() > deadline:
            return True
        ended = _ended_ranks(folder)
        if ended and time.time() - min(ended.values()) > crash_wait + 3.0:
            return False
        if hang_after is not None:
            moved = last_progress(folder, beacons(folder))
            if moved is not None and time.time() - moved > hang_after:
                return True
        time.sleep(_POLL_S)
    return False


def _keep_log(path: Path, marker: str) -> str | None:
    """Move torchrun's own log out of the temporary folder (when it said anything) and return its path."""
    try:
        if not path.exists() or path.stat().st_size == 0:
            return None
        _LOG_DIR.mkdir(parents=True, exist_ok=True)
        kept = _LOG_DIR / f"torchrun-{time.strftime('%Y%m%d-%H%M%S')}-{marker[:8]}.log"
        kept.write_bytes(path.read_bytes())
        return str(kept)
    except OSError:
        return None


def check_namespace(
    namespace: dict[str, Any],
    *,
    steps: int,
    ddp_kwargs: dict[str, Any],
    freeze: list[str],
    timeout: float,
    output: IO[str] | None,
    hang_after: float | None = None,
    follow_epochs: int = 1,
    limit_batches: int = 2,
    verify: bool = True,
    fresh: bool = False,
) -> CheckResult:
    """Run `check` on torchrun's parsed namespace (as a dict); when the observed steps ended early, verify the
    recommendation in a second run (`verify.py`) unless `verify` is false or the job spans several nodes (each
    node's `check` would have to start its second run in step with the others'). `fresh` starts every rank in a
    fresh interpreter instead of forking it from a preloaded one (`warm.py`)."""
    config = RankConfig(
        target=namespace["training_script"],
        module=bool(namespace["module"]),
        steps=steps,
        ddp_kwargs=ddp_kwargs,
        freeze_before_wrap=freeze,
        follow_epochs=follow_epochs,
        limit_batches=limit_batches,
    )
    env = {FRESH_VAR: "1"} if fresh else None
    result = run_check(namespace, config, timeout=timeout, hang_after=hang_after, output=output, env=env)
    from ddp_doctor.launch.verify import (
        needs_reshard_verification,
        needs_verification,
        verify_recommendation,
        verify_reshard,
    )

    again = {"timeout": timeout, "hang_after": hang_after, "env": env}
    one_node = str(namespace.get("nnodes", "1")) in ("1", "1:1")
    if verify and one_node and needs_verification(result, steps):
        # The second run's prints are not the user's to read twice: they go to a file that is removed after.
        with tempfile.NamedTemporaryFile("w", prefix="ddp-doctor-verify-", suffix=".log") as sink:
            verify_recommendation(result, config, partial(run_check, namespace, output=sink, **again))
    elif verify and one_node and needs_reshard_verification(result):
        with tempfile.NamedTemporaryFile("w", prefix="ddp-doctor-verify-", suffix=".log") as sink:
            verify_reshard(result, config, partial(run_check, namespace, output=sink, **again))
    return result
