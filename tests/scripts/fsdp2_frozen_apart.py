"""FSDP2 on every Linear of a five-layer MLP, with a freeze decided from the rank before `fully_shard`.

    torchrun --nproc-per-node 2 tests/scripts/fsdp2_frozen_apart.py --case apart

apart: rank 0 freezes the first Linear(8, 8), every other rank the second. same: every rank freezes the first (the
fix). 12 SGD steps on each rank's own batches; rank 0 then prints the sum of each gathered parameter.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=["apart", "same"], required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    (model[2] if args.case == "apart" and rank > 0 else model[0]).requires_grad_(False)
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(12):
        loss = model(torch.randn(16, 8, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    sums = {name: round(float(p.full_tensor().sum()), 5) for name, p in model.named_parameters()}
    if rank == 0:
        print(f"sums {sums}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
