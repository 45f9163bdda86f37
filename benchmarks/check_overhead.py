"""`ddp-doctor check` against plain `torchrun` on examples/clean.py, for the same number of steps.

The goal (issue 3): check takes at most 2x plain torchrun's wall time plus a fixed start-up of at most 3 s. check
runs its default path, which follows the script through one epoch end after the observed steps (issue 27); a third
command, `check --follow-epochs 0`, stops right after them, so the cost of following is measured too. All commands
run as subprocesses, interleaved in rounds (plain, check, check without following, plain, ...) so that machine drift
hits them alike. Reported per step count: the median of the per-round ratios check/plain with its IQR, the median of
the per-round differences check - plain (the extra seconds) with its IQR, whether the median round met the goal,
and the median per-round cost of following (check - check without following) with its IQR.

    python benchmarks/check_overhead.py [--rounds 5] [--steps 8 64] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from _shared import quartiles, timed_command

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "clean.py"


def measure(steps: int, rounds: int) -> dict:
    epochs = steps // 16 + 1  # 16 steps per epoch per rank with 2 ranks
    plain = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(SCRIPT),
        "--epochs",
        str(epochs),
        "--max-steps",
        str(steps),
    ]
    check = [
        sys.executable,
        "-m",
        "ddp_doctor.cli",
        "check",
        "--nproc-per-node",
        "2",
        "--steps",
        str(steps),
        str(SCRIPT),
        "--epochs",
        str(epochs),
        "--max-steps",
        str(steps),
    ]
    steps_only = [*check[:4], "--follow-epochs", "0", *check[4:]]
    timed_command(plain, str(REPO))  # warm the file cache
    times: dict[str, list[float]] = {"plain": [], "check": [], "steps_only": []}
    for _ in range(rounds):
        times["plain"].append(timed_command(plain, str(REPO)))
        times["check"].append(timed_command(check, str(REPO)))
        times["steps_only"].append(timed_command(steps_only, str(REPO)))
    following = [c - o for c, o in zip(times["check"], times["steps_only"])]
    ratios = [c / p for p, c in zip(times["plain"], times["check"])]
    extra = [c - p for p, c in zip(times["plain"], times["check"])]
    over_goal = [c - (2 * p + 3.0) for p, c in zip(times["plain"], times["check"])]
    return {
        "steps": steps,
        "rounds": rounds,
        "plain_s": statistics.median(times["plain"]),
        "check_s": statistics.median(times["check"]),
        "median_ratio": statistics.median(ratios),
        "iqr": quartiles(ratios),
        "median_extra_s": statistics.median(extra),
        "iqr_extra_s": quartiles(extra),
        "meets_goal": statistics.median(over_goal) <= 0.0,
        "check_steps_only_s": statistics.median(times["steps_only"]),
        "median_following_s": statistics.median(following),
        "iqr_following_s": quartiles(following),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results: dict = {"param_tensors": 8}
    for k in args.steps:
        r = measure(k, args.rounds)
        results[f"check, {k} steps"] = {
            **r,
            "vs": "plain torchrun, same steps",
            "goal": "<= 2x + 3 s (met)" if r["meets_goal"] else "<= 2x + 3 s (MISSED)",
        }
    text = json.dumps(results, indent=2)
    if args.json:
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
