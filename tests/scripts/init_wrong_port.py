"""Rank 1 alone is given a wrong MASTER_PORT: its `init_process_group` never reaches the job's store, and rank 0
waits for it there until the process group's timeout (10 s).

    torchrun --nproc-per-node 2 tests/scripts/init_wrong_port.py
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch import nn

if int(os.environ["RANK"]) == 1:
    os.environ["MASTER_PORT"] = "1"  # a port nothing listens on
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(10):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
