"""nanoGPT's accumulation flag gone wrong: require_backward_grad_sync is set to False once and never back to True, so
DDP never reduces, each rank steps on its own gradients and the replicas drift apart silently."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _train import model
from torch.nn.parallel import DistributedDataParallel

ACCUMULATE = 2

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ddp = DistributedDataParallel(model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    ddp.require_backward_grad_sync = False
    for _step in range(10):
        opt.zero_grad()
        for _micro in range(ACCUMULATE):
            x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
            loss = F.cross_entropy(ddp(x), y) / ACCUMULATE
            loss.backward()
        opt.step()
    w = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    print(f"rank {rank}: sum of squared weights {float(w.square().sum()):.6f}", flush=True)
