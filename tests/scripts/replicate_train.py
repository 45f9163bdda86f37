"""A small model trained with the FSDP2-based `replicate` (torch.distributed._composable.replicate_with_fsdp), clean
or with one of its silent mistakes. `replicate` keeps a full copy of every parameter on every rank (a DTensor with a
Replicate placement) and all-reduces gradients, like DDP, on FSDP2's machinery.

--mistake none               every block and the root replicated, optimizer built after
--mistake optimizer-before   the optimizer is built before replicate: it holds the replaced parameters
--mistake root-unreplicated  the blocks are replicated, the root (with its head) is not
--mistake sync-off           set_requires_gradient_sync(False) on every micro-batch, never switched back on
--mistake same-data          every rank draws its batches from the same seed: the ranks train on the same samples
--mistake eval-rank0         clean: rank 0 alone runs an evaluation forward after the third step
--mistake skip-rank1         rank 1 alone skips optimizer.step() at the third step (a skip decided from its own loss)
--mistake seed-rank          the model built after torch.manual_seed(rank): each rank starts from its own weights
--mistake final-eval         clean: after the last step every rank evaluates once under no_grad (the root's
                             parameters stay unsharded after a forward no backward follows)
--mistake clamp-rank0        after each step rank 0 alone clamps the head's weights to [-0.1, 0.1] (a constraint
                             applied in a rank-0-only logging branch)
--mistake buffer-rank        a constant buffer scaling the head's input, drawn from each rank's own seed (replicate
                             takes parameters only and never broadcasts a buffer)
--mistake buffer-same        clean: that buffer drawn from the same seed on every rank
--mistake lr-rank0           rank 0's optimizer at twice the others' learning rate (a per-rank config)
--drift-at N                 rank 1 alone adds 0.01 to the head's bias after step N, outside any sync (a long job
                             watched past its first steps)
--save rank0                 clean: rank 0 alone torch.save's the state dict after the third step (every value, as
                             DTensors)
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 64), nn.ReLU()) for _ in range(2)])
        self.blocks[1][0] = nn.Linear(64, 64)
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x * self.mix if hasattr(self, "mix") else x)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--mistake", default="none")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save", default="")
    parser.add_argument("--save-dir", default=".")
    parser.add_argument("--drift-at", type=int, default=-1)
    args = parser.parse_args()
    mistakes = set(args.mistake.split(","))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank if "seed-rank" in mistakes else 0)
    model = Net()
    if mistakes & {"buffer-rank", "buffer-same"}:
        seed = rank if "buffer-rank" in mistakes else 0
        model.register_buffer("mix", torch.rand(64, generator=torch.Generator().manual_seed(seed)), persistent=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    if "optimizer-before" in mistakes:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for block in model.blocks:
        replicate(block)
    if "root-unreplicated" not in mistakes:
        replicate(model)
    if "optimizer-before" not in mistakes:
        opt = torch.optim.AdamW(model.parameters(), lr=2e-2 if "lr-rank0" in mistakes and rank == 0 else 1e-2)
    g = torch.Generator().manual_seed(0 if args.mistake == "same-data" else rank)
    for _step in range(args.steps):
        for _micro in range(2):
            if "sync-off" in mistakes:
                model.set_requires_gradient_sync(False)
            x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
            F.cross_entropy(model(x), y).backward()
        if not ("skip-rank1" in mistakes and rank == 1 and _step == 2):
            opt.step()
        opt.zero_grad()
        if "clamp-rank0" in mistakes and rank == 0:
            with torch.no_grad():
                weight = model.head.weight
                (weight.to_local() if hasattr(weight, "to_local") else weight).clamp_(-0.1, 0.1)
        if _step == args.drift_at and rank == 1:
            with torch.no_grad():
                bias = model.head.bias
                (bias.to_local() if hasattr(bias, "to_local") else bias).add_(0.01)
        if _step == 2 and args.save == "rank0" and rank == 0:
            torch.save(model.state_dict(), os.path.join(args.save_dir, "ck.pt"))
        if _step == 2 and "eval-rank0" in mistakes and rank == 0:
            with torch.no_grad():
                model(torch.randn(4, 16, generator=g))
    if "final-eval" in mistakes:
        with torch.no_grad():
            model(torch.randn(4, 16, generator=g))
    # The ground truth, printed by each rank: how far each parameter moved, and its head's sum (compare across ranks).
    moved = max(
        (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().sub(before[n]).abs().max().item()
        for n, p in model.named_parameters()
    )
    head = model.head.weight
    head_sum = (head.full_tensor() if hasattr(head, "full_tensor") else head).detach().double().sum().item()
    bias = model.head.bias
    bias_sum = (bias.to_local() if hasattr(bias, "to_local") else bias).detach().double().sum().item()
    mix = f", mix sum {model.mix.sum().item():.6f}" if hasattr(model, "mix") else ""
    print(
        f"rank {rank}: largest weight change {moved:.3g}, head.weight sum {head_sum:.6f}, "
        f"this rank's head.bias sum {bias_sum:.6f}{mix}",
        flush=True,
    )
    dist.destroy_process_group()
