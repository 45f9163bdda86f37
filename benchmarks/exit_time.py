"""Time to exit: how long `ddp-doctor check` takes to end every process after SIGTERM reaches it, after one rank
leaves early (sys.exit(0) at step 3 while the other trains), and after one rank raises there (the other then waits
for it in DDP's all-reduce). Several runs each, interleaved, median and range.

Goals (issue "Every run ends fast and clean"): under 10 s after SIGTERM, under 15 s after an early exit or a crash.
Self-launched: it starts `ddp-doctor check` itself, like a user or a CI runner would.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "scripts" / "exit_at_step3.py"


def _start(tmp: Path, *extra: str, how: str = "exit") -> subprocess.Popen[str]:
    env = {**os.environ, "EXIT_STAMP": str(tmp / "exit.stamp"), "EXIT_HOW": how}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ddp_doctor.cli",
            "check",
            "--nproc-per-node",
            "2",
            "--timeout",
            "120",
            *extra,
            str(SCRIPT),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp,
    )


def after_sigterm(tmp: Path) -> float:
    proc = _start(tmp, "--steps", "1000")
    for line in proc.stdout:  # wait until training runs
        if line.startswith("step 2"):
            break
    proc.send_signal(signal.SIGTERM)
    t0 = time.time()
    proc.communicate()
    assert proc.returncode == 143, proc.returncode
    return time.time() - t0


def after_early_exit(tmp: Path) -> float:
    proc = _start(tmp, "--steps", "1000")
    proc.communicate()
    end = time.time()
    return end - float((tmp / "exit.stamp").read_text())


def after_crash(tmp: Path) -> float:
    proc = _start(tmp, "--steps", "1000", how="raise")
    proc.communicate()
    assert proc.returncode == 1, proc.returncode
    return time.time() - float((tmp / "exit.stamp").read_text())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    times: dict[str, list[float]] = {"after SIGTERM": [], "after an early rank exit": [], "after a rank's crash": []}
    for _ in range(args.runs):  # interleaved, so load drift hits both alike
        with tempfile.TemporaryDirectory() as d:
            times["after SIGTERM"].append(after_sigterm(Path(d)))
        with tempfile.TemporaryDirectory() as d:
            times["after an early rank exit"].append(after_early_exit(Path(d)))
        with tempfile.TemporaryDirectory() as d:
            times["after a rank's crash"].append(after_crash(Path(d)))
    goals = {"after SIGTERM": 10.0, "after an early rank exit": 15.0, "after a rank's crash": 15.0}
    result = {
        name: {
            "median_s": round(statistics.median(v), 2),
            "min_s": round(min(v), 2),
            "max_s": round(max(v), 2),
            "runs": len(v),
            "goal_s": goals[name],
        }
        for name, v in times.items()
    }
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
