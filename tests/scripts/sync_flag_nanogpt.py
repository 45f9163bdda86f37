"""nanoGPT's gradient accumulation: require_backward_grad_sync is True on the last micro-step only, so DDP reduces
the accumulated gradients once per optimizer step and every rank steps on the same ones (clean)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _train import model
from torch.nn.parallel import DistributedDataParallel

ACCUMULATE = 3

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model_ = DistributedDataParallel(model())
    opt = torch.optim.SGD(model_.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _step in range(10):
        opt.zero_grad()
        for micro_step in range(ACCUMULATE):
            x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
            model_.require_backward_grad_sync = micro_step == ACCUMULATE - 1
            loss = F.cross_entropy(model_(x), y) / ACCUMULATE
            loss.backward()
        opt.step()
    w = torch.cat([p.detach().reshape(-1) for p in model_.parameters()])
    print(f"rank {rank}: sum of squared weights {float(w.square().sum()):.6f}", flush=True)
