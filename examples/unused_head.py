"""A multi-task model whose second head is never trained in this run.

The regression head never reaches the loss. With DDP's default flags its gradients are never all-reduced: step 0
silently skips the sync, and step 1 fails with "Expected to have finished reduction in the prior iteration".
Run: torchrun --nproc-per-node 2 examples/unused_head.py [--find-unused]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import device_ids, setup, synthetic_loader, teardown
from torch import nn
from torch.nn.parallel import DistributedDataParallel


class MultiTask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU())
        self.classify = nn.Linear(128, 10)
        self.regress = nn.Sequential(nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor, task: str = "classify") -> torch.Tensor:
        h = self.encoder(x)
        return self.classify(h) if task == "classify" else self.regress(h)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--find-unused", action="store_true", help="find_unused_parameters=True (the slow fix)")
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    rank, device = setup()

    torch.manual_seed(0)
    model = DistributedDataParallel(MultiTask().to(device), device_ids=device_ids(device),
                                    find_unused_parameters=args.find_unused)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    for epoch in range(args.epochs):
        for step, (x, y) in enumerate(synthetic_loader(epoch=epoch)):
            loss = F.cross_entropy(model(x.to(device), task="classify"), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and step % 8 == 0:
                print(f"epoch {epoch} step {step:3d} loss {loss.item():.3f}")
    del model, opt   # see common.teardown
    teardown()


if __name__ == "__main__":
    main()
