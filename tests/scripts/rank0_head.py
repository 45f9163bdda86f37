"""A head that only rank 0 trains (a branch on the rank), with default DDP flags: rank 1's reduction never finishes
in step 0, so DDP fails on rank 1 at step 1 while rank 0 waits in DDP's all-reduce. The report must say the graph
depends on the rank, and never advise freezing a head that rank 0 trains."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 16)
        self.main = nn.Linear(16, 2)
        self.aux = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor, aux: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.main(h) + (self.aux(h) if aux else 0)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(TwoHeads())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _step in range(10):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
        F.cross_entropy(model(x, aux=rank == 0), y).backward()
        opt.step()
        opt.zero_grad()
