"""User code that inspects and copies the model while ddp-doctor observes it: all of it must keep working."""

from __future__ import annotations

import copy
import io
import pickle

import torch
from _train import setup, train
from torch.nn.parallel import DistributedDataParallel


def before_step(rank: int, step: int) -> None:
    if step != 1:
        return
    assert isinstance(ddp, DistributedDataParallel), type(ddp)
    assert type(ddp) is DistributedDataParallel, type(ddp)
    ema = copy.deepcopy(ddp.module)                      # an EMA copy, made mid-training
    clone = pickle.loads(pickle.dumps(ddp.module))
    buffer = io.BytesIO()
    torch.save(ddp.module, buffer)                        # a whole-module checkpoint
    torch.save(ddp.state_dict(), io.BytesIO())
    for copied in (ema, clone):
        copied(torch.randn(2, 8)).sum().backward()        # copies train on their own, unobserved


if __name__ == "__main__":
    ddp = setup()
    train(ddp, before_step=before_step)
