"""Rank 0 evaluates every 3 steps, in eval mode under torch.no_grad(), a model with BatchNorm (buffers that DDP
broadcasts). The default runs the evaluation through the DDP wrapper, whose forward then broadcasts rank 0's
buffers on rank 0 alone; `--module` is the right way, through ddp.module."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from _train import train
from torch import nn
from torch.nn.parallel import DistributedDataParallel

MODULE = "--module" in sys.argv


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 2)))

    def before_step(rank: int, step: int) -> None:
        if rank != 0 or step % 3 != 2:
            return
        x = torch.randn(4, 8)
        ddp.eval()
        with torch.no_grad():
            model = ddp.module if MODULE else ddp
            model(x).sum().item()  # through DDP's forward, that broadcasts the buffers, unless --module
        ddp.train()

    train(ddp, before_step=before_step)
    dist.barrier()


if __name__ == "__main__":
    main()
