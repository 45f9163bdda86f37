"""Post-local SGD as PyTorch documents it: DDP with `post_localSGD_hook` (global all-reduce for `start_localSGD_iter`
iterations, then subgroups of one rank) and a model averager after each optimizer step. Each rank writes
OUT/rank{RANK}.json: its parameters' sum after each step (`sums`, before an averaging) and at the end (`final`).

    torchrun --nproc-per-node 2 tests/scripts/local_sgd.py OUT --case CASE

cases:
  averaged      PeriodicModelAverager(period=4, warmup_steps=3) after each optimizer.step()
  optimizer     PostLocalSGDOptimizer around SGD with that averager (it averages inside optimizer.step())
  no-averager   the hook alone: nothing averages the parameters
  later         start_localSGD_iter=20: every observed step is still all-reduced over every rank
  world-group   post-local SGD whose subgroup is the whole world: every gradient is still averaged over every rank
  write-rank0   averaged, and rank 0 scales its first layer's weight at step 1, before local SGD begins (a fault)
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--case", required=True)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    start = 20 if args.case == "later" else 3
    if args.case == "world-group":
        subgroup = dist.new_group(list(range(world)))
    else:
        subgroup, _ = dist.new_subgroups(group_size=1)  # every rank on its own once local SGD begins
    state = PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=start)
    model.register_comm_hook(state, post_localSGD_hook)
    averager = PeriodicModelAverager(period=4, warmup_steps=start)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if args.case == "optimizer":
        opt = PostLocalSGDOptimizer(optim=opt, averager=averager)
    sums = []
    for step in range(args.steps):
        x = torch.randn(16, 16, generator=torch.Generator().manual_seed(rank * 100 + step))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.case == "write-rank0" and step == 1 and rank == 0:
            with torch.no_grad():
                model.module[0].weight.mul_(1.01)
        sums.append(sum(float(p.sum()) for p in model.parameters()))
        if args.case in ("averaged", "write-rank0", "later", "world-group"):
            averager.average_parameters(model.parameters())
    final = sum(float(p.sum()) for p in model.parameters())
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"sums": sums, "final": final}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
