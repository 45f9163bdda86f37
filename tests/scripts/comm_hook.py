"""A DDP model with a comm hook of the script's own (or torch's), each rank on its own batches. Rank 0 prints the
largest difference of the model's weights across ranks at the end.

    torchrun --nproc-per-node 2 tests/scripts/comm_hook.py --hook local|fixed|fp16

hooks:
  local   returns the bucket as it is: a compression hook whose all-reduce was left out
  fixed   the same hook, all-reducing the bucket and dividing by the world size (clean)
  fp16    torch's fp16_compress_hook (clean)
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel


def local_only(state, bucket):
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def averaged(state, bucket):
    world_size = dist.get_world_size()
    return dist.all_reduce(bucket.buffer().div_(world_size), async_op=True).get_future().then(lambda f: f.value()[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hook", required=True, choices=["local", "fixed", "fp16"])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    hook = {"local": local_only, "fixed": averaged, "fp16": default_hooks.fp16_compress_hook}[args.hook]
    model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(args.steps):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    got = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(got, flat)
    if rank == 0:
        print(f"largest weight difference across ranks {max((g - got[0]).abs().max().item() for g in got):.3g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
