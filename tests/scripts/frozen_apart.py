"""Each rank fine-tunes "its" block: a freeze decided from the rank before `DistributedDataParallel(model)`.

    torchrun --nproc-per-node 2 tests/scripts/frozen_apart.py OUT --case apart

A five-layer MLP (Linear(8, 8), Tanh, Linear(8, 8), Tanh, Linear(8, 4)). apart: rank 0 freezes the first Linear and
every other rank the second; the trainable shapes line up, so DDP's constructor (which compares shapes) accepts the
model. same: every rank freezes the first Linear (the fix). 12 SGD steps on each rank's own batches; each rank then
writes OUT/rank{R}.json: per parameter, the largest difference from rank 0's copy (`gaps`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--case", choices=["apart", "same"], required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    mine = model[2] if args.case == "apart" and rank > 0 else model[0]
    mine.requires_grad_(False)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(12):
        loss = ddp(torch.randn(16, 8, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    gaps = {}
    for name, p in model.named_parameters():
        got = [torch.zeros_like(p) for _ in range(dist.get_world_size())]
        dist.all_gather(got, p.detach().contiguous())
        gaps[name] = max(float((t - got[0]).abs().max()) for t in got)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps({"gaps": gaps}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
