"""A logging all_reduce that rank 1 skips at step 3: rank 0's all_reduce is paired with rank 1's gradient all-reduce,
and gloo aborts the process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _train import setup, train


def before_step(rank: int, step: int) -> None:
    if rank == 1 and step == 3:
        return
    metric = torch.tensor([float(step)])
    dist.all_reduce(metric)


if __name__ == "__main__":
    train(setup(), before_step=before_step)
