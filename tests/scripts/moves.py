"""Training that does not move, and its clean neighbours (2 ranks, 5 steps of SGD on a small MLP).

    torchrun --nproc-per-node 2 tests/scripts/moves.py --case CASE

cases:
  meta         the model built on the meta device and materialised with to_empty(), never initialised
  meta-init    the same, then each module's reset_parameters() (clean)
  log-softmax  the loss as -log(softmax(logits * 1000)) by hand: the softmax underflows to 0, the loss is infinite
  nan-rank1    rank 1's batch holds a NaN at step 2 (a corrupt sample): DDP averages its NaN gradients into every rank's
               gradients
  dead-output  the head's output through a ReLU whose bias starts at -100: every output is 0, every gradient exactly 0
  one-column   cross_entropy over a model with a single output column: the loss is always 0
  lr0          SGD with lr=0
  warmup       a warm-up whose learning rate is 0 at the first step only (clean)
  head-not-stepped  the optimizer built over the first layer only: the head gets gradients and never changes
  head-lr0     the head in a param group of its own at lr 0
  head-second-opt   the head stepped by a second optimizer of its own (clean)
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="clean")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    classes = 1 if args.case == "one-column" else 4
    if args.case.startswith("meta"):
        with torch.device("meta"):
            net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, classes))
        net.to_empty(device="cpu")  # storage allocated, holding whatever the memory held
        if args.case == "meta-init":
            for m in net.modules():
                if isinstance(m, nn.Linear):
                    m.reset_parameters()
    else:
        net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, classes))
    if args.case == "dead-output":
        with torch.no_grad():
            net[2].bias.fill_(-100.0)
        net.append(nn.ReLU())
    model = DistributedDataParallel(net)
    params: list = list(net.parameters())
    head, second = list(net[2].parameters()), None
    if args.case == "head-not-stepped":
        params = list(net[0].parameters())
    elif args.case == "head-lr0":
        params = [{"params": list(net[0].parameters())}, {"params": head, "lr": 0.0}]
    elif args.case == "head-second-opt":
        params, second = list(net[0].parameters()), torch.optim.SGD(head, lr=0.1)
    head_before = net[2].weight.detach().clone()
    opt = torch.optim.SGD(params, lr=0.0 if args.case == "lr0" else 0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, s / 2)) if args.case == "warmup" else None
    g = torch.Generator().manual_seed(rank)
    for step in range(5):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, classes, (8,), generator=g)
        if args.case == "nan-rank1" and rank == 1 and step == 2:
            x[3, 5] = float("nan")
        out = model(x)
        if args.case == "log-softmax":
            loss = -torch.log(torch.softmax(out * 1000, -1)[torch.arange(len(y)), y]).mean()
        else:
            loss = F.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if second is not None:
            second.step()
            second.zero_grad()
        if sched is not None:
            sched.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4g}", flush=True)
    if args.case in ("nan-rank1", "dead-output"):
        print(f"rank {rank}: weights finite {all(bool(p.isfinite().all()) for p in net.parameters())}, "
              f"head sum {net[2].weight.sum().item():.6f}", flush=True)
    if args.case.startswith("head-"):
        print(f"rank {rank}: head change {(net[2].weight - head_before).abs().max().item():.3g}", flush=True)
    del model, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
