"""What `ddp-doctor check` costs an FSDP2 job, against what it costs a DDP job (the goal: within 1.2x).

Four commands, interleaved in rounds so that machine drift hits them alike: plain `torchrun` and `check` on
examples/clean.py (DDP), and plain `torchrun` and `check` on tests/scripts/fsdp2_train.py (FSDP2, every block and
the root sharded, two micro-batches per step), each for the same number of optimizer steps. `check` stops right
after them (`--follow-epochs 0`) and makes no second run (`--no-verify`: on the FSDP2 job the check verifies its
`reshard_after_forward` advice by running the script again, which doubles the time and is not the watch's cost;
the DDP job's flags are already right, so it gets no second run either way). Reported: each job's per-round ratio
check/plain and extra seconds (median, IQR), and the per-round ratio of the FSDP2 ratio to the DDP one. Wall time,
start-up included, as in check_overhead.py.

    python benchmarks/sharded_overhead.py [--rounds 5] [--steps 64] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from _shared import quartiles, timed_command

REPO = Path(__file__).resolve().parents[1]


def commands(steps: int) -> dict[str, list[str]]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    check = [sys.executable, "-m", "ddp_doctor.cli", "check", "--nproc-per-node", "2", "--steps", str(steps)]
    check += ["--follow-epochs", "0", "--no-verify"]
    ddp = [str(REPO / "examples" / "clean.py"), "--epochs", str(steps // 16 + 1), "--max-steps", str(steps)]
    fsdp2 = [str(REPO / "tests" / "scripts" / "fsdp2_train.py"), "--steps", str(steps)]
    return {
        "ddp_plain": [*torchrun, *ddp],
        "ddp_check": [*check, *ddp],
        "fsdp2_plain": [*torchrun, *fsdp2],
        "fsdp2_check": [*check, *fsdp2],
    }


def measure(steps: int, rounds: int) -> dict:
    runs = commands(steps)
    for command in runs.values():  # warm the file cache
        timed_command(command, str(REPO))
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        names = list(runs)
        for name in names[r % 4 :] + names[: r % 4]:
            times[name].append(timed_command(runs[name], str(REPO)))
    out: dict = {"steps": steps, "rounds": rounds, "param_tensors": 6}  # fsdp2_train.py's model
    ratios = {}
    for job in ("ddp", "fsdp2"):
        plain, check = times[f"{job}_plain"], times[f"{job}_check"]
        ratios[job] = [c / p for p, c in zip(plain, check)]
        extra = [c - p for p, c in zip(plain, check)]
        out[f"{job}: check vs plain torchrun"] = {
            "median_ratio": statistics.median(ratios[job]),
            "iqr": quartiles(ratios[job]),
            "median_extra_s": statistics.median(extra),
            "iqr_extra_s": quartiles(extra),
            "plain_s": statistics.median(plain),
            "vs": "plain torchrun, same steps",
        }
    relative = [f / d for f, d in zip(ratios["fsdp2"], ratios["ddp"])]
    out["fsdp2 overhead vs ddp overhead"] = {
        "median_ratio": statistics.median(relative),
        "iqr": quartiles(relative),
        "vs": "the DDP job's check/plain ratio, same round",
        "goal": "<= 1.2x (met)" if statistics.median(relative) <= 1.2 else "<= 1.2x (MISSED)",
    }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    text = json.dumps(measure(args.steps, args.rounds), indent=2)
    if args.json:
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
