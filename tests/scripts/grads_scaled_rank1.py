"""Rank 1 alone doubles the last layer's gradients in place after DDP averaged them (a per-rank loss-scale fix-up):
rank 1 steps on different gradients than rank 0, and the replicas drift apart silently."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _train import model
from torch.nn.parallel import DistributedDataParallel

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ddp = DistributedDataParallel(model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _step in range(10):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        if rank == 1:
            for p in ddp.module[2].parameters():
                p.grad.mul_(2)
        opt.step()
    w = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    print(f"rank {rank}: sum of squared weights {float(w.square().sum()):.6f}", flush=True)
