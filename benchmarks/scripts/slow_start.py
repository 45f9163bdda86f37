"""A training script whose start-up is slow (it sleeps, as a script loading a model and a dataset would, before it
builds DDP), with `find_unused_parameters=True` left on and every parameter used (seed 001). For
benchmarks/bench_cost.py and the bench tests.

    torchrun --nproc-per-node 2 benchmarks/scripts/slow_start.py [--startup-s 20] [--max-steps 2000]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--startup-s", type=float, default=20.0, help="seconds of start-up before DDP is built")
    parser.add_argument("--max-steps", type=int, default=2000)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    time.sleep(args.startup_s)  # loading a checkpoint and a dataset
    torch.manual_seed(0)
    model = nn.Sequential(
        *[m for _ in range(8) for m in (nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU())], nn.Linear(64, 10)
    )
    ddp = DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for step in range(args.max_steps):
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0 and step % 100 == 0:
            print(f"step {step} loss {loss.item():.3f}", flush=True)
    del ddp, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
