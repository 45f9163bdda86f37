"""Rank 1 runs an expensive augmentation of each batch that the other ranks skip: every other rank waits for it in
DDP's gradient all-reduce (`straggler-rank` naming rank 1)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def augment(x: torch.Tensor) -> torch.Tensor:
    """About 30-60 ms of matrix products on one core."""
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    for _ in range(60):
        a = torch.tanh(a @ a)
    return x + a[: x.shape[0], : x.shape[1]] * 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(30):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 2, (8,), generator=g)
        if rank == 1:
            x = augment(x)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
