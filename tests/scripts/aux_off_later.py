"""An auxiliary head trained for the first 10 steps of the script's loop, then switched off (a warm-up loss).

DDP's default flags work while it is used and fail with the reduction error once it is not: `check` with 4 steps
sees nothing wrong, and in a shared `bench` launch the candidate whose block runs past step 10 crashes there.
"""

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
        self.aux = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor, aux: bool) -> torch.Tensor:
        h = self.body(x)
        out = self.head(h)
        return out + self.aux(h) if aux else out


if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ddp = DistributedDataParallel(Net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(200):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
        loss = F.cross_entropy(ddp(x, aux=step < 10), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    del ddp, opt
    dist.destroy_process_group()
