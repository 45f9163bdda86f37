"""A learning-rate scheduler stepped on rank 0 only, inside the logging block: from step 1 on, rank 0's learning
rate differs from rank 1's, so the same all-reduced gradients give different updates and the replicas diverge."""

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
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    g = torch.Generator().manual_seed(rank)
    for step in range(10):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.3f}")
            sched.step()
