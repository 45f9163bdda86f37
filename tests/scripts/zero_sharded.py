"""ZeroRedundancyOptimizer around a DDP model, with an LR scheduler on every rank: each rank's inner optimizer holds a
different shard of the parameters, so its param groups differ by rank by design. Correct; nothing to report."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)]
    model = DistributedDataParallel(nn.Sequential(*layers))
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(20):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    dist.destroy_process_group()
