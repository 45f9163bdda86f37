"""A tiny plain-torch DDP training loop that the check test scripts share (gloo, CPU)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def train(ddp: nn.Module, steps: int = 20, before_step: Callable[[int, int], None] | None = None) -> None:
    rank = dist.get_rank()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for step in range(steps):
        if before_step is not None:
            before_step(rank, step)
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def setup() -> DistributedDataParallel:
    dist.init_process_group("gloo")
    return DistributedDataParallel(model())
