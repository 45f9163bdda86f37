"""Rank 0 waits at a barrier "before saving" at step 3; the other ranks never call it, so rank 0's barrier is
paired with their next gradient all-reduce."""

from __future__ import annotations

import torch.distributed as dist
from _train import setup, train


def before_step(rank: int, step: int) -> None:
    if rank == 0 and step == 3:
        dist.barrier()  # "make sure everyone is done before rank 0 saves": only rank 0 gets here


if __name__ == "__main__":
    train(setup(), before_step=before_step)
