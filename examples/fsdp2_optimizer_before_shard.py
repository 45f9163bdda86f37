"""FSDP2: the optimizer is built before fully_shard, so it steps tensors the model no longer uses; nothing learns.

fully_shard replaces each parameter of the modules it shards with a new DTensor parameter. An optimizer built
before that holds the old tensors: the loss is computed, backward runs, the optimizer steps, and not one weight of
the model changes. Plain torchrun runs it to the end without a word. Run: torchrun --nproc-per-node 2
examples/fsdp2_optimizer_before_shard.py (add --fixed to build the optimizer after sharding).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import setup, synthetic_loader, teardown
from torch import nn
from torch.distributed.fsdp import fully_shard


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            [nn.Sequential(nn.Linear(32, 128), nn.GELU()), nn.Sequential(nn.Linear(128, 128), nn.GELU())])
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fixed", action="store_true", help="build the optimizer after fully_shard")
    args = parser.parse_args()
    rank, device = setup()

    torch.manual_seed(0)
    model = Net().to(device)
    if not args.fixed:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)  # too early: fully_shard replaces these parameters
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    if args.fixed:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    for step, (x, y) in enumerate(synthetic_loader()):
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0 and step % 8 == 0:
            print(f"step {step:3d} loss {loss.item():.3f}")
    del model, opt  # see common.teardown
    teardown()


if __name__ == "__main__":
    main()
