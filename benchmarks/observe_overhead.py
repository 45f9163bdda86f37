"""Overhead of observe(): observed steps and steps after the context exited, against unobserved DDP.

Run under torchrun (``python -m benchmarks`` does that). Three identical DDP models train side by side in one
process per rank; every round times one step of each, in rotating order, so machine drift hits all alike. Reports
the median per-round ratio and its interquartile range.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_doctor import observe


def _model(depth: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    return nn.Sequential(*layers)


def _step(ddp: DDP, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    F.mse_loss(ddp(x), x).backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=150)
    parser.add_argument("--depth", type=int, default=70, help="blocks of Linear+LayerNorm (4 tensors each)")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)

    variants = {}
    for name in ("plain", "observed", "after_exit"):
        ddp = DDP(_model(args.depth, args.width))
        variants[name] = (ddp, torch.optim.SGD(ddp.parameters(), lr=1e-3))
    x = torch.randn(32, args.width, generator=torch.Generator().manual_seed(rank))

    ddp_c, opt_c = variants["after_exit"]
    with observe(ddp_c, optimizer=opt_c):
        for _ in range(2):
            _step(ddp_c, opt_c, x)
    for ddp, opt in variants.values():  # warm-up
        _step(ddp, opt, x)

    times: dict[str, list[float]] = {k: [] for k in variants}
    ddp_b, opt_b = variants["observed"]
    doctor = observe(ddp_b, optimizer=opt_b)
    with doctor:
        order = list(variants)
        for r in range(args.rounds):
            for name in order[r % 3 :] + order[: r % 3]:
                times[name].append(_step(*variants[name], x))
    report = doctor.report()

    if rank == 0:
        n_tensors = sum(1 for _ in ddp_b.parameters())
        result = {
            "param_tensors": n_tensors,
            "rounds": args.rounds,
            "world_size": dist.get_world_size(),
            "findings": sorted(report.codes),
        }
        for name in ("observed", "after_exit"):
            ratios = [a / b for a, b in zip(times[name], times["plain"])]
            q1, med, q3 = _quartiles(ratios)
            result[name] = {"median_ratio": round(med, 3), "iqr": [round(q1, 3), round(q3, 3)]}
        result["plain_step_ms"] = round(statistics.median(times["plain"]) * 1e3, 2)
        print(json.dumps(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
