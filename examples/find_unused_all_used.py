"""find_unused_parameters=True left on "just in case", while every parameter is used on every step.

Correct, but DDP walks the autograd graph after every forward for nothing, and PyTorch warns about it.
Run: torchrun --nproc-per-node 2 examples/find_unused_all_used.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import device_ids, setup, synthetic_loader, teardown
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.norm(h))


class ResidualMLP(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(32, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    rank, device = setup()

    torch.manual_seed(0)
    # "In case some branch skips a module": nothing here does.
    model = DistributedDataParallel(ResidualMLP().to(device), device_ids=device_ids(device),
                                    find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    for epoch in range(args.epochs):
        for step, (x, y) in enumerate(synthetic_loader(epoch=epoch)):
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and step % 8 == 0:
                print(f"epoch {epoch} step {step:3d} loss {loss.item():.3f}")
    del model, opt   # see common.teardown
    teardown()


if __name__ == "__main__":
    main()
