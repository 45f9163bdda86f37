"""Hybrid-parallel layout: 4 ranks, two data-parallel groups ([0, 1] and [2, 3]), each its own DDP over its group.
By default the groups hold different models (pipeline stages, say); with --same-arch the same architecture with
different weights per group. Nothing is wrong: each DDP syncs within its own group. With --unused-head, the second
group's model has a head that never reaches the loss (find_unused_parameters=True copes, at a cost)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class Stage(nn.Module):
    def __init__(self, body: nn.Module, *, extra_head: bool) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(2, 2) if extra_head else None   # registered, never called

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    stage = rank // 2
    torch.manual_seed(stage)                      # same weights within a group, different across groups
    if stage == 0 or "--same-arch" in sys.argv:
        body: nn.Module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    else:
        body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))
    unused = stage == 1 and "--unused-head" in sys.argv
    model = DistributedDataParallel(Stage(body, extra_head=unused), process_group=groups[stage],
                                    find_unused_parameters=unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(20):
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
