"""Overhead of observe(): observed steps and steps after the context exited, against unobserved DDP; and the same
for a model sharded with FSDP2 (`--parallelism both`, the default; the goal: FSDP2's within 1.2x of DDP's).

Run under torchrun (``python -m benchmarks`` does that). Three identical models of each kind train side by side in
one process per rank (DDP; with FSDP2, `fully_shard` on every block and the root); every round times one step of
each, in rotating order, so machine drift hits all alike. Reports each kind's median per-round ratio observed/plain
and after_exit/plain with its interquartile range, and the per-round ratio of FSDP2's observed ratio to DDP's.
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


def _model(depth: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()) for _ in range(depth))
    )


def _build(kind: str, depth: int, width: int) -> nn.Module:
    """The same model, wrapped in DDP or sharded with FSDP2 (every block, then the root)."""
    model = _model(depth, width)
    if kind == "ddp":
        return DDP(model)
    from torch.distributed.fsdp import fully_shard

    for block in model:  # each Linear+LayerNorm+GELU block
        fully_shard(block)
    return fully_shard(model)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    F.mse_loss(model(x), x).backward()
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
    parser.add_argument("--parallelism", choices=["ddp", "fsdp2", "both"], default="both")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)

    kinds = ["ddp", "fsdp2"] if args.parallelism == "both" else [args.parallelism]
    variants = {}
    for kind in kinds:
        for name in ("plain", "observed", "after_exit"):
            model = _build(kind, args.depth, args.width)
            variants[f"{kind}_{name}"] = (model, torch.optim.SGD(model.parameters(), lr=1e-3))
    x = torch.randn(32, args.width, generator=torch.Generator().manual_seed(rank))

    for kind in kinds:
        model_c, opt_c = variants[f"{kind}_after_exit"]
        with observe(model_c, optimizer=opt_c) as doctor_c:
            for _ in range(2):
                _step(model_c, opt_c, x)
        doctor_c.report()
    for model, opt in variants.values():  # warm-up
        _step(model, opt, x)

    times: dict[str, list[float]] = {k: [] for k in variants}
    doctors = {kind: observe(*variants[f"{kind}_observed"]) for kind in kinds}
    for doctor in doctors.values():
        doctor.start()
    order = list(variants)
    for r in range(args.rounds):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            times[name].append(_step(*variants[name], x))
    for doctor in doctors.values():
        doctor.stop()
    reports = {kind: doctor.report() for kind, doctor in doctors.items()}

    if rank == 0:
        result: dict = {
            "param_tensors": sum(1 for _ in variants[f"{kinds[0]}_plain"][0].parameters()),
            "rounds": args.rounds,
            "world_size": dist.get_world_size(),
        }
        observed: dict[str, list[float]] = {}
        for kind in kinds:
            prefix = "" if kind == "ddp" else "fsdp2 "  # DDP's keys stay what they were
            result[f"{prefix}findings"] = sorted(reports[kind].codes)
            result[f"{prefix}plain_step_ms"] = round(statistics.median(times[f"{kind}_plain"]) * 1e3, 2)
            for name in ("observed", "after_exit"):
                ratios = [a / b for a, b in zip(times[f"{kind}_{name}"], times[f"{kind}_plain"])]
                if name == "observed":
                    observed[kind] = ratios
                q1, med, q3 = _quartiles(ratios)
                row = {"median_ratio": round(med, 3), "iqr": [round(q1, 3), round(q3, 3)]}
                result[f"{prefix}{name}"] = row if kind == "ddp" else {**row, "vs": "plain FSDP2"}
        if len(kinds) == 2:
            q1, med, q3 = _quartiles([f / d for d, f in zip(observed["ddp"], observed["fsdp2"])])
            result["fsdp2 overhead vs ddp overhead"] = {
                "median_ratio": round(med, 3),
                "iqr": [round(q1, 3), round(q3, 3)],
                "vs": "observe's ratio on DDP",
                "goal": "<= 1.2x",
            }
        print(json.dumps(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
