"""Rank 0 evaluates every 3 steps. `--grad` runs the evaluation through the DDP wrapper in grad mode (DDP then
prepares a reduction that no backward finishes, on rank 0 only); the default is the correct way: under
torch.no_grad() through ddp.module."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from _train import setup, train

GRAD = "--grad" in sys.argv


def main() -> None:
    ddp = setup()

    def before_step(rank: int, step: int) -> None:
        if rank != 0 or step % 3 != 2:
            return
        x = torch.randn(4, 8)
        if GRAD:
            ddp(x).sum().item()  # the evaluation goes through DDP's forward with autograd on
        else:
            with torch.no_grad():
                ddp.module(x).sum().item()

    train(ddp, before_step=before_step)
    dist.barrier()


if __name__ == "__main__":
    main()
