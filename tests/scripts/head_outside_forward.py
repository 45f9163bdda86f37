"""find_unused_parameters=True with a parameter used outside DDP's forward: the loss calls `ddp.module.head(...)`
on the features DDP's forward returned. DDP's autograd walk from the forward's outputs does not reach `head`, so it
marks head's parameters ready at the end of forward as unused, then their gradients arrive in backward and DDP
fails on every rank the same way ("mark a variable ready only once")."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ddp = DistributedDataParallel(Net(), find_unused_parameters=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _step in range(20):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
        loss = F.cross_entropy(ddp.module.head(ddp(x)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    del ddp, opt
    dist.destroy_process_group()
