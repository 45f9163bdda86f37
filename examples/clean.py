"""A correct DDP training script: every parameter trains, each rank reads its own shard, default DDP flags.

ddp-doctor must find nothing here. Run: torchrun --nproc-per-node 2 examples/clean.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from common import device_ids, setup, synthetic_loader, teardown
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many optimizer steps")
    args = parser.parse_args()
    rank, device = setup()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 128), nn.GELU(),
                          nn.Linear(128, 10)).to(device)
    model = DistributedDataParallel(model, device_ids=device_ids(device))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    done = 0
    for epoch in range(args.epochs):
        for step, (x, y) in enumerate(synthetic_loader(epoch=epoch)):
            if done == args.max_steps:
                break
            done += 1
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if rank == 0 and step % 8 == 0:
                print(f"epoch {epoch} step {step:3d} loss {loss.item():.3f}")
    del model, opt   # see common.teardown
    teardown()


if __name__ == "__main__":
    main()
