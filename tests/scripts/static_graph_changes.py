"""static_graph=True on a graph that changes between steps: an auxiliary head joins the loss on even steps only
(examples/dynamic_graph.py's pattern on a small model). static_graph=True promises DDP the same used set on every
step; DDP fails on every rank the same way ("Your training graph has changed")."""

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
        self.aux = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor, aux: bool) -> torch.Tensor:
        h = self.body(x)
        return self.head(h) + self.aux(h) if aux else self.head(h)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ddp = DistributedDataParallel(Net(), static_graph=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(20):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
        loss = F.cross_entropy(ddp(x, aux=step % 2 == 0), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    del ddp, opt
    dist.destroy_process_group()
