"""Rank 1 leaves with sys.exit(0) at step 3 (or raises there, with EXIT_HOW=raise) and writes the time it left to
$EXIT_STAMP (for benchmarks/exit_time.py)."""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(1000):
        if rank == 0:
            print(f"step {step}", flush=True)
        if rank == 1 and step == 3:
            with open(os.environ["EXIT_STAMP"], "w") as f:
                f.write(repr(time.time()))
            if os.environ.get("EXIT_HOW") == "raise":
                raise ValueError("corrupt sample on rank 1")
            sys.exit(0)
        x = torch.randn(4, 8)
        F.cross_entropy(ddp(x), torch.zeros(4, dtype=torch.long)).backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.2)
