"""`ddp-doctor watch` against plain `torchrun`: the time of a training step after the first steps, when watch only
watches (each rank's step in its beacon, the script's collectives, the watchdog's sample of the main thread's line
every half second).

benchmarks/scripts/steady_steps.py trains 400 steps of an MLP (280 parameter tensors) on 2 ranks and records the
wall time of steps 100 to 400. Plain torchrun and watch run as subprocesses, interleaved in rounds (the order
rotates every round). Reported: per round, the ratio of the median steady step under watch to plain torchrun's;
their median and IQR, and the median steady step of each. The goal: at most 1% (a ratio of 1.01). PyTorch's
Flight Recorder keeps its ring under both (on by default: 2,000 entries on torch 2.13 and 2.15).

    python benchmarks/watch_overhead.py [--rounds 7] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _shared import quartiles

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "scripts" / "steady_steps.py"


def _steady(cmd: list[str], folder: Path) -> float:
    """The median steady step (seconds) over both ranks of one run of `cmd`."""
    for old in folder.glob("rank*.json"):
        old.unlink()
    env = {**os.environ, "STEP_TIMES_DIR": str(folder)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    times = [t for p in sorted(folder.glob("rank*.json")) for t in json.loads(p.read_text())]
    return statistics.median(times)


def measure(rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        commands = {
            "plain": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(SCRIPT)],
            "watch": [sys.executable, "-m", "ddp_doctor.cli", "watch", "--run-dir", str(folder / "run")]
            + ["--nproc-per-node", "2", str(SCRIPT)],
        }
        steady: dict[str, list[float]] = {n: [] for n in commands}
        names = list(commands)
        for r in range(rounds):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                if name == "watch":
                    subprocess.run(["rm", "-rf", str(folder / "run")], check=True)
                steady[name].append(_steady(commands[name], folder))
    out: dict = {
        "rounds": rounds,
        "steady_step_ms": {n: round(statistics.median(v) * 1000, 3) for n, v in steady.items()},
    }
    ratios = [w / p for w, p in zip(steady["watch"], steady["plain"])]
    median = statistics.median(ratios)
    out["watch_vs_plain"] = {"median": round(median, 4), "iqr": [round(v, 4) for v in quartiles(ratios)]}
    out["goal"] = "<= 1.01 " + ("(met)" if median <= 1.01 else "(MISSED)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    text = json.dumps(measure(args.rounds), indent=2)
    if args.json:
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
