"""ReduceLROnPlateau stepped on every rank with the rank's own loss: each rank cuts its learning rate when its
own loss stops improving, so the ranks' rates part, and the same all-reduced gradients give different updates.
`--reduced`: the loss is averaged across the ranks first (clean).

Ground truth (plain torchrun, 2 ranks, 16 steps): exit 0, nothing printed; the rates end at 0.0016 and 0.00078 and
the replicas' weights differ by 0.010. With `--reduced`: the same rate on both ranks, the weights equal.
"""

from __future__ import annotations

import sys

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
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1, factor=0.5)
    g = torch.Generator().manual_seed(rank)
    for _step in range(16):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 2, (8,), generator=g)
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        metric = loss.detach().clone()
        if "--reduced" in sys.argv:
            dist.all_reduce(metric)
            metric /= dist.get_world_size()
        sched.step(metric.item())
    dist.destroy_process_group()
