"""FSDP2 trained by a class, as many training codes are written: the loop's frames hold the trainer (`self`), never
the model, which only `self.model` reaches.

--mistake none              every block and the root sharded, the optimizer built after sharding
--mistake root-unsharded    the blocks sharded, the root (with its head) not
--mistake optimizer-before  the optimizer built before fully_shard: it holds the replaced parameters
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard


class Trainer:
    def __init__(self, mistake: str) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(
            nn.Sequential(nn.Linear(16, 64), nn.ReLU()), nn.Sequential(nn.Linear(64, 64), nn.ReLU()), nn.Linear(64, 4)
        )
        if mistake == "optimizer-before":
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        for block in self.model[:2]:
            fully_shard(block)
        if mistake != "root-unsharded":
            fully_shard(self.model)
        if mistake != "optimizer-before":
            self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def train(self, steps: int) -> None:
        generator = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(steps):
            x = torch.randn(8, 16, generator=generator)
            self.model(x).square().mean().backward()
            self.optimizer.step()
            self.optimizer.zero_grad()


def head_weight(trainer: Trainer) -> torch.Tensor:
    weight = trainer.model[2].weight.detach()
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight  # a DTensor when the root is sharded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mistake", default="none")
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    trainer = Trainer(args.mistake)
    first = head_weight(trainer).clone()
    trainer.train(args.steps)
    last = head_weight(trainer)
    moved = float((last - first).abs().max())
    print(f"rank {dist.get_rank()}: head weight sum {float(last.sum()):.6f}, largest change {moved:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
