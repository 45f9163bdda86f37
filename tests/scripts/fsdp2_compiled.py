"""FSDP2 under `torch.compile` (dynamo's `eager` backend: no C compiler needed): the blocks sharded, the root too
unless `--root-unsharded`, then the whole model compiled, so its parameters are named under `_orig_mod.`."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

if __name__ == "__main__":
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(16, 64), nn.ReLU()), nn.Sequential(nn.Linear(64, 64), nn.ReLU()), nn.Linear(64, 4)
    )
    for block in model[:2]:
        fully_shard(block)
    if "--root-unsharded" not in sys.argv:
        fully_shard(model)
    model = torch.compile(model, backend="eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(12):
        model(torch.randn(8, 16, generator=generator)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    head = model._orig_mod[2].weight.detach()
    head = head.full_tensor() if hasattr(head, "full_tensor") else head
    print(f"rank {dist.get_rank()}: head weight sum {float(head.sum()):.6f}", flush=True)
    dist.destroy_process_group()
