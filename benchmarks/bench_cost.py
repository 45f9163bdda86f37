"""What `ddp-doctor bench` costs, against one `ddp-doctor check` of the same script, on a script whose start-up is slow.

Issue 18: a script that sleeps 20 s before it builds DDP, 4 candidates, 3 rounds. When every candidate and round
relaunched the script, bench took 503 s against 27 s for one check (18.4x). The goal: under 3x. Both commands run
as subprocesses, interleaved in rounds (check, bench, check, bench, ...) so that machine drift hits both alike.
Reported: the median of the per-round ratios bench/check with its IQR, both medians in seconds, and how many
launches bench needed (from its JSON).

    python benchmarks/bench_cost.py [--rounds 3] [--startup-s 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from _shared import quartiles, timed_command

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "scripts" / "slow_start.py"
CONFIGS = "user,recommended,static_graph,recommended+bucket_view"
GOAL = 3.0


def measure(rounds: int, startup_s: float, steps: int) -> dict:
    script = [str(SCRIPT), "--startup-s", str(startup_s)]
    check = [sys.executable, "-m", "ddp_doctor.cli", "check", "--nproc-per-node", "2", "--steps", str(steps), *script]
    times: dict[str, list[float]] = {"check": [], "bench": []}
    launches: list[int] = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        bench = [
            sys.executable,
            "-m",
            "ddp_doctor.cli",
            "bench",
            "--nproc-per-node",
            "2",
            "--steps",
            str(steps),
            "--rounds",
            "3",
            "--configs",
            CONFIGS,
            "--json",
            str(out),
            *script,
        ]
        for _ in range(rounds):
            times["check"].append(timed_command(check, str(REPO)))
            times["bench"].append(timed_command(bench, str(REPO)))
            result = json.loads(out.read_text())
            launches.append(len(result["launches"]))
    ratios = [b / c for c, b in zip(times["check"], times["bench"])]
    return {
        "rounds": rounds,
        "startup_s": startup_s,
        "steps": steps,
        "candidates": CONFIGS,
        "bench_rounds": 3,
        "check_s": statistics.median(times["check"]),
        "bench_s": statistics.median(times["bench"]),
        "median_ratio": statistics.median(ratios),
        "iqr": quartiles(ratios),
        "ratios": ratios,
        "launches": launches,
        "meets_goal": statistics.median(ratios) < GOAL,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--startup-s", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    r = measure(args.rounds, args.startup_s, args.steps)
    results = {
        "param_tensors": 34,
        "bench, 4 candidates x 3 rounds": {
            **r,
            "vs": f"one check, {args.startup_s:g} s start-up",
            "goal": f"< {GOAL:g}x (met)" if r["meets_goal"] else f"< {GOAL:g}x (MISSED)",
        },
    }
    text = json.dumps(results, indent=2)
    if args.json:
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
