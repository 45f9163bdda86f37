"""Two models FSDP2 cannot train, as a script builds them by mistake.

--mistake ddp-around  a block sharded with fully_shard, then the whole model wrapped in DistributedDataParallel
--mistake meta        built under torch.device("meta"), sharded, and never materialized (no to_empty, no init)
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--mistake", required=True, choices=["ddp-around", "meta"])
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    if args.mistake == "meta":
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        fully_shard(model[0])
        fully_shard(model)
    else:
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
        fully_shard(model[0])
        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _step in range(3):
        F.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
        opt.step()
        opt.zero_grad()
    dist.destroy_process_group()
