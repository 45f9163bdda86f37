"""Run the tests that start processes several times beside busy loops that keep every core full, and print how
often each test failed: the suite must pass every time, under any load.

    python tests/flakiness.py [--runs 3] [--busy 2] [--workers 2] [TEST PATH ...]

By default: the fault suite, the framework integrations, the timing findings, FSDP2, the epoch following and
`watch` (the tests whose processes, waits and timeouts a loaded machine stresses most). `--busy N` starts N busy loops (default:
one per core) for the whole time; each run is one pytest (on `--workers` xdist workers, then its serial tests
alone, as `make test` runs them). Exit code 1 when any test failed in any run.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT = [
    "tests/failures/test_faults.py",
    "tests/launch/test_cli_start.py",
    "tests/launch/test_warm_launch.py",
    "tests/integrations",
    "tests/timing/test_step_time.py",
    "tests/fsdp2/test_check_fsdp2.py",
    "tests/fsdp2/test_check_fsdp2_some_ranks.py",
    "tests/fsdp2/test_check_fsdp2_epochs.py",
    "tests/timing/test_check_fsdp2_steps.py",
    "tests/sync/test_check_fsdp2_inputs.py",
    "tests/causes/test_check_fsdp2_clip.py",
    "tests/sync/test_check_fsdp2_state.py",
    "tests/fsdp2/test_check_replicate.py",
    "tests/watch/test_watch_light.py",
    "tests/exchange/test_sharded_exchange.py",
    "tests/causes/test_check_fsdp2_moves.py",
    "tests/causes/test_check_moves.py",
    "tests/lockstep/test_follow.py",
    "tests/failures/test_check_failures.py",
    "tests/watch/test_watch.py",
    "tests/watch/test_watch_windows.py",
    "tests/watch/test_watch_drift.py",
    "tests/watch/test_watch_hangs.py",
    "tests/failures/test_abort_at_exit.py",
    "tests/failures/test_init_failures.py",
]


def _failures(junit: Path) -> tuple[int, list[str]]:
    """(tests run, the ids of those that failed or errored) from one junit file."""
    if not junit.exists():
        return 0, ["<pytest wrote no result>"]
    root = ET.parse(junit).getroot()
    ran, failed = 0, []
    for case in root.iter("testcase"):
        ran += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    return ran, failed


def _pytest(paths: list[str], marker: str, junit: Path, workers: int) -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", marker, f"--junitxml={junit}"]
    if workers > 1 and marker == "not serial":
        cmd += ["-n", str(workers)]
    subprocess.run([*cmd, *paths], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=DEFAULT)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdout=subprocess.DEVNULL)
        for _ in range(args.busy)
    ]
    counts: collections.Counter[str] = collections.Counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for run in range(1, args.runs + 1):
                started = time.monotonic()
                ran, failed = 0, []
                for marker in ("not serial", "serial"):
                    junit = Path(tmp) / f"run{run}-{marker.replace(' ', '-')}.xml"
                    _pytest(args.paths, marker, junit, args.workers)
                    n, f = _failures(junit)
                    ran, failed = ran + n, failed + f
                counts.update(failed)
                print(
                    f"run {run}: {ran} tests, {len(failed)} failed, {time.monotonic() - started:.0f} s beside "
                    f"{args.busy} busy loops",
                    flush=True,
                )
                for test in failed:
                    print(f"  failed: {test}", flush=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    print(
        f"\nfailures per test over {args.runs} loaded runs:" if counts else f"\nno failure in {args.runs} loaded runs"
    )
    for test, n in counts.most_common():
        print(f"  {n}/{args.runs}  {test}")
    return 1 if counts else 0


if __name__ == "__main__":
    sys.exit(main())
