"""The `check` parent: start torchrun with the doctor injected, enforce the timeout, leave no process behind.

torchrun starts each worker in its own session, so killing torchrun's process group does not reach them. The
ranks write their pids into their progress files; whatever is still alive at the end is killed by process group
(which also takes the worker's own children, such as DataLoader workers).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from ddp_doctor.launch.config import ENV_VAR, RankConfig
from ddp_doctor.launch.outcome import CheckResult, collect

__all__ = ["check_namespace", "run_check"]

BOOTSTRAP = "ddp_doctor.launch.bootstrap"


def _grace(timeout: float) -> float:
    """Seconds between asking the ranks to stop and killing them."""
    return min(5.0, max(1.0, timeout * 0.1))


def run_check(torchrun_args: dict[str, Any], config: RankConfig, *, timeout: float,
              output: IO[str] | None = None, outdir: Path | None = None) -> CheckResult:
    """Run the script under torchrun with the doctor in every rank, and collect the result on this node.

    Args:
        torchrun_args: torchrun's parsed namespace (as a dict) for the user's script.
        config: what each rank's doctor does; `outdir` and `deadline` are filled in here.
        timeout: seconds after which every rank is stopped and the run reported as it stands.
        output: where the script's stdout and stderr go (`None`: this process's own).
        outdir: keep the ranks' files here instead of a temporary folder.

    Returns:
        The `CheckResult`.
    """
    with tempfile.TemporaryDirectory(prefix="ddp-doctor-") as tmp:
        folder = Path(outdir) if outdir is not None else Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        start = time.time()
        config = replace(config, outdir=str(folder.resolve()), deadline=start + timeout)
        args = {**torchrun_args, "module": True, "no_python": False, "run_path": False,
                "training_script": BOOTSTRAP}
        env = {**os.environ, ENV_VAR: config.to_env(), "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "ddp_doctor.launch.torchrun", json.dumps(args)], env=env,
                                stdout=output, stderr=subprocess.STDOUT if output is not None else None,
                                start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=max(0.1, timeout - _grace(timeout)))
        except subprocess.TimeoutExpired:
            timed_out = True
            _signal_all(proc, folder, signal.SIGTERM)
            try:
                proc.wait(timeout=_grace(timeout))
            except subprocess.TimeoutExpired:
                pass
        except KeyboardInterrupt:
            _signal_all(proc, folder, signal.SIGTERM)
            raise
        finally:
            _signal_all(proc, folder, signal.SIGKILL)
            proc.wait()
        return collect(folder, timed_out=timed_out, torchrun_rc=proc.returncode)


def _rank_pids(folder: Path) -> list[int]:
    pids = []
    for path in folder.glob("rank*.progress.json"):
        try:
            pids.append(int(json.loads(path.read_text())["pid"]))
        except (OSError, ValueError, KeyError):
            continue
    return pids


def _signal_all(proc: subprocess.Popen[Any], folder: Path, sig: signal.Signals) -> None:
    """Send `sig` to torchrun's process group and to every rank's (each rank leads its own)."""
    groups = [proc.pid, *_rank_pids(folder)]
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            continue


def check_namespace(namespace: dict[str, Any], *, steps: int, ddp_kwargs: dict[str, Any], freeze: list[str],
                    timeout: float, output: IO[str] | None, timed_steps: int = 0) -> CheckResult:
    """Run `check` on torchrun's parsed namespace (as a dict)."""
    config = RankConfig(target=namespace["training_script"], module=bool(namespace["module"]), steps=steps,
                        ddp_kwargs=ddp_kwargs, freeze_before_wrap=freeze, timed_steps=timed_steps)
    return run_check(namespace, config, timeout=timeout, output=output)
