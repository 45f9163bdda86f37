"""Rank 1 skips one batch with `continue` (a rank-local "bad sample" check): it draws two batches for one optimizer
step, and so takes one step fewer per epoch than rank 0. `--wrap ddp|fsdp2`; `--skip every-rank` skips the batch on
every rank (clean)."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--wrap", choices=["ddp", "fsdp2"], default="ddp")
    parser.add_argument("--skip", choices=["rank1", "every-rank"], default="rank1")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
    sampler = DistributedSampler(data)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    if args.wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(model)
    else:
        model = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for batch, (x, y) in enumerate(loader):
            if batch == 3 and (rank == 1 or args.skip == "every-rank"):
                continue  # "a bad sample"
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    del model, opt
    dist.destroy_process_group()
