"""An epoch end on a GPU, for `ddp-doctor check` to follow (run on a lent GPU machine; see README.md beside this file).

The model and batches live on cuda:(LOCAL_RANK modulo the GPUs there): with one GPU, two ranks share it over gloo
(which reduces CUDA tensors), and one rank runs NCCL. At each epoch end rank 0 alone evaluates --eval-batches batches
of a DataLoader on the GPU, each a --size matrix product read back with .item() (as a metric does), while the other
ranks go on to their next collective: with the defaults that evaluation lasts about 10-20 s on an H100, against a
process group timeout of --pg-timeout 20 s.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--eval-batches", type=int, default=800)
p.add_argument("--size", type=int, default=8192)
p.add_argument("--pg-timeout", type=float, default=20.0)
args = p.parse_args()


def evaluate(device: torch.device, loader: DataLoader) -> float:
    w = torch.randn(args.size, args.size, device=device)
    total = 0.0
    with torch.no_grad():
        for (x,) in loader:
            h = w @ w + x.to(device).sum()
            total += float(h.mean())
    return total


def main() -> None:
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(8, 256), nn.GELU(), nn.Linear(256, 2)).to(device), device_ids=[device.index]
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(512, 8, generator=torch.Generator().manual_seed(0)), torch.randint(0, 2, (512,)))
    sampler = DistributedSampler(data, shuffle=True)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    eval_loader = DataLoader(TensorDataset(torch.randn(4 * args.eval_batches, 8)), batch_size=4)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
        if rank == 0:
            print(f"epoch {epoch}: eval {evaluate(device, eval_loader):.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
