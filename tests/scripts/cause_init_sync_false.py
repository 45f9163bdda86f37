"""DDP(model, init_sync=False) with a per-rank seed: the replicas differ before the first step."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)), init_sync=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _step in range(10):
        x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
