"""Gradient accumulation done right: no_sync() on every micro-batch but the last, whose backward DDP reduces, so
every rank steps on the same accumulated gradients (the clean neighbour of nosync_every_micro.py)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _train import model
from torch.nn.parallel import DistributedDataParallel

ACCUMULATE = 3

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ddp = DistributedDataParallel(model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _step in range(10):
        opt.zero_grad()
        for micro in range(ACCUMULATE):
            x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
            last = micro == ACCUMULATE - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = F.cross_entropy(ddp(x), y) / ACCUMULATE
                loss.backward()
        opt.step()
    w = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    print(f"rank {rank}: sum of squared weights {float(w.square().sum()):.6f}", flush=True)
