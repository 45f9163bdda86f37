"""The script's own error at the start of one step (a corrupt sample, a check of the loss), on every rank or on
one, under DDP, FSDP2's fully_shard or its replicate.

--wrap ddp|fsdp2|replicate   how the model is made data-parallel
--at N                       the step that raises (0: before any optimizer step)
--rank R                     only rank R raises (default: every rank)
--exit N                     sys.exit(N) there instead of raising (a stop decided by the script's own check)
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def wrapped(how: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    if how == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    if how == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        return fully_shard(model)
    from torch.distributed._composable.replicate_with_fsdp import replicate

    return replicate(model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--wrap", choices=("ddp", "fsdp2", "replicate"), default="ddp")
    parser.add_argument("--at", type=int, default=3)
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--exit", type=int, default=None)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    model = wrapped(args.wrap)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(12):
        if step == args.at and args.rank in (None, dist.get_rank()):
            if args.exit is not None:
                sys.exit(args.exit)
            raise ValueError(f"corrupt sample 77 in the shared shard at step {step}")
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 2, (4,), generator=g)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
