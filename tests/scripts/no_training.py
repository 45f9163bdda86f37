"""Initializes a process group but never trains (no optimizer step): there is nothing for ddp-doctor to observe."""

from __future__ import annotations

import torch.distributed as dist
from _train import model

if __name__ == "__main__":
    dist.init_process_group("gloo")
    model()(__import__("torch").randn(2, 8))
    dist.destroy_process_group()
