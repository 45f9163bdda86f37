"""A broadcast of per-rank sized data at step 3: rank 0 sends 4 values, rank 1 expects 3."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _train import setup, train


def before_step(rank: int, step: int) -> None:
    if step == 3:
        tokens = torch.zeros(4 - rank)  # the shape depends on the rank's data
        dist.broadcast(tokens, src=0)


if __name__ == "__main__":
    train(setup(), before_step=before_step)
