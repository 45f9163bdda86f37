"""Initializes a process group but trains a plain module: there is nothing for ddp-doctor to observe."""

from __future__ import annotations

import torch.distributed as dist
from _train import model, train

if __name__ == "__main__":
    dist.init_process_group("gloo")
    train(model(), steps=3)
    dist.destroy_process_group()
