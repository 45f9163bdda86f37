"""A small model trained by DDP or FSDP2 (`--wrap ddp|fsdp2`) on a 512-sample dataset, 2 or 4 ranks, whose training
loader's DistributedSampler is built one of three ways (`--sampler`):

  seed-per-rank  DistributedSampler(ds, seed=rank): each rank shuffles its own way, the shares overlap
  one-replica    DistributedSampler(ds, num_replicas=1, rank=0): every rank reads the whole dataset, in one order
  same           clean: DistributedSampler(ds, seed=1234) on every rank
  whole          no DistributedSampler: DataLoader(ds, shuffle=True) after torch.manual_seed(100 + rank), every rank
                 reads all 512 samples in its own order
  split-per-rank torch.manual_seed(rank), then random_split(ds, [0.8, 0.2]): each rank samples its own train split
  split-seeded   clean: the same split drawn from a generator seeded alike on every rank
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset, random_split

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--wrap", choices=["ddp", "fsdp2"], default="ddp")
    parser.add_argument(
        "--sampler",
        choices=["seed-per-rank", "one-replica", "same", "whole", "split-per-rank", "split-seeded"],
        default="same",
    )
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
    kwargs = {"seed-per-rank": {"seed": rank}, "one-replica": {"num_replicas": 1, "rank": 0}, "same": {"seed": 1234}}
    if args.sampler.startswith("split-"):
        torch.manual_seed(rank)  # a per-rank seed, for augmentation
        seeded = torch.Generator().manual_seed(0) if args.sampler == "split-seeded" else None
        data, _ = random_split(data, [0.8, 0.2], generator=seeded) if seeded else random_split(data, [0.8, 0.2])
    sampler = DistributedSampler(data, shuffle=True, **kwargs.get(args.sampler, {}))
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    if args.sampler == "whole":
        torch.manual_seed(100 + rank)
        loader = DataLoader(data, batch_size=16, shuffle=True)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    if args.wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[2]):
            fully_shard(layer)
        model = fully_shard(model)
    else:
        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for epoch in range(2):
        sampler.set_epoch(epoch)  # (unused by the "whole" loader)
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    del model, opt
    dist.destroy_process_group()
