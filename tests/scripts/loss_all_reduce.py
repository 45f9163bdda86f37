"""A DDP job that reduces its loss across ranks with dist.all_reduce, in one of several places. Each rank writes
OUT/rank{RANK}.json: the first weight's gradient at the first step (`grad`) and its final weights' sum (`weights`).

    torchrun --nproc-per-node 2 tests/scripts/loss_all_reduce.py OUT --case CASE

cases:
  avg-inplace    dist.all_reduce(loss), then loss /= world_size, then loss.backward()
  quarter-inplace dist.all_reduce(loss), then loss * 0.25 before backward (a factor other than 1/world_size)
  sum-inplace    dist.all_reduce(loss) and backward on the sum itself (the gradient is unchanged)
  after          loss.backward(), then dist.all_reduce(loss) to log it
  detached       a detached copy reduced to log it (the fix)
  amp-avg-inplace as avg-inplace, the backward through AMP's GradScaler (`scaler.scale(loss).backward()`)
  amp-detached   the fix, with that GradScaler
  activation     the model's output all-reduced in place before the loss (a tensor, not the loss: as tensor
                 parallelism's row-parallel layer does, whose backward rightly passes the gradient through)
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--case", required=True)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu") if args.case.startswith("amp-") else None
    first_grad = None
    for step in range(args.steps):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank * 100 + step))
        out = model(x)
        if args.case == "activation":
            dist.all_reduce(out)
        loss = out.pow(2).mean()
        if args.case in ("avg-inplace", "amp-avg-inplace"):
            dist.all_reduce(loss)
            loss = loss / world
        elif args.case == "quarter-inplace":
            dist.all_reduce(loss)
            loss = loss * 0.25
        elif args.case == "sum-inplace":
            dist.all_reduce(loss)
        elif args.case in ("detached", "amp-detached"):
            logged = loss.detach().clone()
            dist.all_reduce(logged)
        opt.zero_grad()
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if args.case == "after":
            dist.all_reduce(loss)
        if scaler is not None:
            scaler.unscale_(opt)
        if first_grad is None:
            first_grad = model.module.weight.grad[0, 0].item()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        weights = sum(p.detach().double().sum().item() for p in model.parameters())
        json.dump({"grad": first_grad, "weights": weights}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
