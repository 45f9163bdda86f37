"""FSDP2 with `ignored_params`: the root sharded, its head left out on purpose (`fully_shard(model,
ignored_params=...)`), which FSDP2 neither shards nor synchronises: that is left to the script.

--sync none       nothing syncs the head: each rank trains its own copy on its own batches
--sync all-reduce the script averages the head's gradients itself before each optimizer step (the documented way)
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 64), nn.ReLU()), nn.Sequential(nn.Linear(64, 64))])
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sync", default="none")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model, ignored_params=set(model.head.parameters()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        x, y = torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)
        F.cross_entropy(model(x), y).backward()
        if args.sync == "all-reduce":
            for p in model.head.parameters():
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= dist.get_world_size()
        optimizer.step()
        optimizer.zero_grad()
    head = model.head.weight.detach().double().sum().item()
    print(f"rank {rank}: head.weight sum {head:.6f} ({type(model.head.weight).__name__})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
