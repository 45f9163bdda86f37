"""An EMA made by copying the DDP model itself (`AveragedModel(model)` or `copy.deepcopy(model)`, not of
`model.module`), with BatchNorm; every 4 steps it is evaluated in eval mode under torch.no_grad(). The copy is a DDP
model of its own, built by no constructor: its forward broadcasts its buffers from rank 0 like the original's.

--copy averaged|deepcopy|inner   AveragedModel(model), copy.deepcopy(model), or clean: AveragedModel(model.module)
--eval rank0|every               rank 0 alone evaluates the EMA, or every rank does (clean)

The process group's timeout is 15 s, so a hang ends.
"""

from __future__ import annotations

import argparse
import copy
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--copy", choices=("averaged", "deepcopy", "inner"), default="averaged")
    parser.add_argument("--eval", choices=("rank0", "every"), default="rank0")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=15))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2)))
    if args.copy == "deepcopy":
        ema = copy.deepcopy(model)
    else:
        ema = AveragedModel(model.module if args.copy == "inner" else model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    probe = torch.randn(4, 8, generator=torch.Generator().manual_seed(100))
    for step in range(12):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 2, (8,), generator=g)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            if args.copy == "deepcopy":
                for e, p in zip(ema.parameters(), model.parameters()):
                    e.lerp_(p, 0.1)
            else:
                ema.update_parameters(model.module if args.copy == "inner" else model)
            if step % 4 == 3 and (args.eval == "every" or rank == 0):
                ema.eval()
                out = ema(probe)  # the EMA's output, logged
                ema.train()
                print(f"rank {rank} step {step}: EMA output {out.sum().item():.4f}", flush=True)
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
