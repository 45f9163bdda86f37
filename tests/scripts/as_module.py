"""A self-contained training module, run as `ddp-doctor check -m tests.scripts.as_module --steps-total 12`."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps-total", type=int, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2), nn.Linear(2, 2)),
                                    find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(args.steps_total):
        loss = F.cross_entropy(model(torch.randn(4, 8, generator=g)), torch.randint(0, 2, (4,), generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()
