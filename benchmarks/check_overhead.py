"""`ddp-doctor check` against plain `torchrun` on examples/clean.py, for the same number of steps.

The goal: the default check takes at most the wall time of plain torchrun at 8 steps (its ranks are born warm, so
the doctor pays for itself by starting them faster), and a rank's first line runs within 0.5 s of the rank's birth.
Four commands run as subprocesses, interleaved in rounds (the order rotates every round) so that machine drift hits
them alike: plain torchrun; the default check (ranks forked from a preloaded interpreter, following the script to
one epoch end after the observed steps); the same check with `--fresh-interpreters` (one interpreter per rank, the
launch before the warm one); and the check with `--follow-epochs 0`, so the cost of following is measured too.
Reported per step count: the median of the per-round ratios against plain torchrun with their IQR, the median
extra seconds, and, from benchmarks/scripts/first_line.py (clean.py that writes when its first line ran), how long
each launch takes from the command's start and from the rank's birth to the script's first line. Also: `ddp-doctor
--help`'s wall time.

    python benchmarks/check_overhead.py [--rounds 5] [--steps 8 64] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _shared import quartiles

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "scripts" / "first_line.py"


def _run(cmd: list[str], folder: Path) -> tuple[float, list[dict]]:
    """Wall seconds of `cmd`, and what each rank wrote about its first line."""
    for old in folder.glob("rank*.json"):
        old.unlink()
    start = time.time()
    env = {**os.environ, "FIRST_LINE_DIR": str(folder), "LAUNCHED_AT": repr(start)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    wall = time.time() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return wall, [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]


def _summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "iqr": [round(v, 3) for v in quartiles(values)]}


def measure(steps: int, rounds: int) -> dict:
    epochs = steps // 16 + 1  # 16 steps per epoch per rank with 2 ranks
    script = [str(SCRIPT), "--epochs", str(epochs), "--max-steps", str(steps)]
    check = [sys.executable, "-m", "ddp_doctor.cli", "check", "--nproc-per-node", "2", "--steps", str(steps)]
    commands = {
        "plain": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *script],
        "check": [*check, *script],
        "fresh": [*check, "--fresh-interpreters", *script],
        "steps_only": [*check, "--follow-epochs", "0", *script],
    }
    names = list(commands)
    wall: dict[str, list[float]] = {n: [] for n in names}
    to_first: dict[str, list[float]] = {n: [] for n in names}
    birth_to_first: dict[str, list[float]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        _run(commands["plain"], folder)  # the file cache
        for r in range(rounds):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                seconds, ranks = _run(commands[name], folder)
                wall[name].append(seconds)
                to_first[name].append(max(x["first_line"] - x["launched"] for x in ranks))
                birth_to_first[name].append(max(x["first_line"] - x["born"] for x in ranks))
    ratio = {n: [c / p for c, p in zip(wall[n], wall["plain"])] for n in names if n != "plain"}
    following = [c - o for c, o in zip(wall["check"], wall["steps_only"])]
    return {
        "steps": steps,
        "rounds": rounds,
        "wall_s": {n: round(statistics.median(v), 2) for n, v in wall.items()},
        "median_ratio": round(statistics.median(ratio["check"]), 3),
        "iqr": [round(v, 3) for v in quartiles(ratio["check"])],
        "fresh_vs_plain": _summary(ratio["fresh"]),
        "warm_vs_fresh": _summary([w / f for w, f in zip(wall["check"], wall["fresh"])]),
        "median_extra_s": round(statistics.median([c - p for c, p in zip(wall["check"], wall["plain"])]), 2),
        "command_to_first_line_s": {n: _summary(v) for n, v in to_first.items()},
        "birth_to_first_line_s": {n: _summary(v) for n, v in birth_to_first.items()},
        "following_s": _summary(following),
        "meets_goal": statistics.median(ratio["check"]) <= 1.0 and statistics.median(birth_to_first["check"]) <= 0.5,
    }


def cli_help(rounds: int) -> dict:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ddp_doctor.cli", "--help"], capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return _summary(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results: dict = {"param_tensors": 8, "cli_help_s": cli_help(args.rounds)}
    for k in args.steps:
        r = measure(k, args.rounds)
        results[f"check, {k} steps"] = {
            **r,
            "vs": "plain torchrun, same steps",
            "goal": "<= 1.0x, first line <= 0.5 s after birth " + ("(met)" if r["meets_goal"] else "(MISSED)"),
        }
    text = json.dumps(results, indent=2)
    if args.json:
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
