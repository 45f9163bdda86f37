"""torch.compile around the model inside DDP (default) or around DDP (--outside), with an unused head, on the
"eager" backend (dynamo's tracing without code generation, so no compiler is needed here)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        self.aux = nn.Linear(16, 2)      # never used

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    if "--outside" in sys.argv:
        model = torch.compile(DistributedDataParallel(Net(), static_graph=True), backend="eager")
    else:
        model = DistributedDataParallel(torch.compile(Net(), backend="eager"), static_graph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(20):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
