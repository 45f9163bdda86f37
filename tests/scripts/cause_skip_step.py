""""Skip the update when the loss spikes", decided from each rank's own loss: rank 1 skips optimizer.step() in
iteration 2 while rank 0 steps. DDP's all-reduces stay in lockstep; the replicas diverge.

`--extra-pass`: instead, rank 1 runs a second backward in step 2 through an auxiliary objective (for its logs),
then steps: one synced pass more than the other ranks in that step. `--accumulate`: rank 0 accumulates two
micro-batches per step, both with sync on, the others one (micro-batches sized from each rank's own free memory)."""

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
    g = torch.Generator().manual_seed(rank)
    for step in range(10):
        opt.zero_grad()
        for _micro in range(2 if rank == 0 and "--accumulate" in sys.argv else 1):
            x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
        # stands for `loss.item() > 3 * running_mean` on this rank's own loss
        spike = rank == 1 and step == 2 and "--accumulate" not in sys.argv
        if spike and "--extra-pass" in sys.argv:
            ddp(x).pow(2).mean().backward()  # the auxiliary objective's gradient norm, for the logs
            spike = False
        if not spike:
            opt.step()
