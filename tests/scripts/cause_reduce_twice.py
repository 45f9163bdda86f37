"""DDP plus a leftover hand-written loop that all-reduces (SUM) every .grad after backward(): the gradients are
reduced twice, so every update is world-size times too large, on every rank alike. Nothing diverges."""

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
        for p in ddp.parameters():
            dist.all_reduce(p.grad)
        opt.step()
