"""Memory-saving reentrant checkpointing of the first layer, whose input (the batch) does not require grad: the
layer gets no gradient at all. With --fixed, use_reentrant=False."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.stem, x, use_reentrant="--fixed" not in sys.argv)
        return self.head(h)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ddp = DistributedDataParallel(Net(), static_graph=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(20):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
