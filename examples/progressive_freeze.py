"""Gradual layer freezing after DDP is built.

Every few steps the next lowest layer gets requires_grad=False. DDP fixed its set of gradients when it was built,
so with default flags it waits for the frozen layer's gradients and the next step fails with "Expected to have
finished reduction"; with find_unused_parameters=True it keeps all-reducing zeros for the frozen layers.
Run: torchrun --nproc-per-node 2 examples/progressive_freeze.py [--find-unused]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import device_ids, setup, synthetic_loader, teardown
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class Tower(nn.Module):
    def __init__(self, depth: int = 4, width: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32 if i == 0 else width, width) for i in range(depth))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--find-unused", action="store_true", help="find_unused_parameters=True")
    parser.add_argument("--freeze-every", type=int, default=3, help="freeze the next layer every N steps")
    args = parser.parse_args()
    rank, device = setup()

    torch.manual_seed(0)
    tower = Tower().to(device)
    model = DistributedDataParallel(tower, device_ids=device_ids(device), find_unused_parameters=args.find_unused)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    for step, (x, y) in enumerate(synthetic_loader()):
        if step and step % args.freeze_every == 0:
            frozen = step // args.freeze_every - 1
            if frozen < len(tower.layers) - 1:
                tower.layers[frozen].requires_grad_(False)   # after wrap: DDP does not know
                if rank == 0:
                    print(f"step {step}: froze layers.{frozen}")
        loss = F.cross_entropy(model(x.to(device)), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    del model, tower, opt   # see common.teardown
    teardown()


if __name__ == "__main__":
    main()
