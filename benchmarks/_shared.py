"""Helpers shared by the guard / refreeze / sync_gradients benchmarks: the model, interleaved timing, ratios."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["interleave", "mlp", "parser", "quartiles", "ratio", "timed", "timed_command", "write"]


def mlp(depth: int = 70, width: int = 128) -> nn.Sequential:
    """`depth` blocks of Linear + LayerNorm + GELU: 4 parameter tensors per block (280 for the default)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    return nn.Sequential(*layers)


def parser(rounds: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--depth", type=int, default=70, help="blocks of Linear+LayerNorm (4 tensors each)")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--json", default=None)
    return p


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleave(variants: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Time one call of each variant per round, in an order that rotates every round, so drift hits all alike.

    Every rank runs the same order: the variants may contain collectives.
    """
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            times[n].append(timed(variants[n]))
    return times


def ratio(numerator: list[float], denominator: list[float], *, vs: str, goal: str) -> dict:
    """Median and interquartile range of the per-round ratios, plus the ratio of the totals (includes outliers
    such as the periodic guard comparison, which the median ignores)."""
    ratios = [a / b for a, b in zip(numerator, denominator)]
    q1, med, q3 = statistics.quantiles(ratios, n=4)[0], statistics.median(ratios), statistics.quantiles(ratios, n=4)[2]
    return {
        "median_ratio": round(med, 3),
        "iqr": [round(q1, 3), round(q3, 3)],
        "mean_ratio": round(sum(numerator) / sum(denominator), 3),
        "vs": vs,
        "goal": goal,
    }


def write(result: dict, path: str | None) -> None:
    if dist.get_rank() == 0:
        print(json.dumps(result))
        if path:
            with open(path, "w") as f:
                json.dump(result, f, indent=2)


def timed_command(cmd: list[str], cwd: str) -> float:
    """Wall-clock seconds of one run of `cmd` (raises, with its output's tail, when it fails)."""
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed with exit code {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return time.perf_counter() - start


def quartiles(values: list[float]) -> tuple[float, float]:
    """First and third quartiles (both the value itself for a single value)."""
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], q[2]
