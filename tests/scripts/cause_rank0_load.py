"""A resume where rank 0 alone loads the checkpoint into the wrapped module after DDP was built: DDP synced the
replicas at wrap time, so rank 1 keeps its fresh weights and the replicas differ before any update."""

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
    if rank == 0:
        state = {k: v + 0.5 for k, v in ddp.module.state_dict().items()}  # stands for torch.load(checkpoint)
        ddp.module.load_state_dict(state)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _step in range(10):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
