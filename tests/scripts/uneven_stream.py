"""An IterableDataset that shards its records by rank (no len(), no sampler), the way a streamed data set of shard
files is split: rank r reads shards r, r + world, ... Shards of different sizes give ranks different numbers of
batches per epoch, and nothing in the loader says so.

--shards 20,16: shard sizes in records (batch size 4): rank 0 gets 5 batches per epoch, rank 1 gets 4.
--grow N: each epoch, shard i holds N more records per epoch number on odd ranks' shards (the counts of later
epochs differ, the first's do not).
--eval: an evaluation loader, built by the same helper (one line) as the training loader, runs at each epoch end.
--snapshot PATH: rank 0 saves a snapshot there at each epoch end and resumes from it when it exists (minGPT-ddp's
pattern); --log-file PATH: rank 0 appends a line per epoch to a log file.
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, IterableDataset

p = argparse.ArgumentParser()
p.add_argument("--shards", default="20,16")
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--grow", type=int, default=0)
p.add_argument("--eval", action="store_true")
p.add_argument("--snapshot", default=None)
p.add_argument("--log-file", default=None)
p.add_argument("--pg-timeout", type=float, default=20.0)
args = p.parse_args()


class Shards(IterableDataset):
    """This rank's shards of records, streamed."""

    def __init__(self, sizes: list[int], rank: int, world: int) -> None:
        self.sizes, self.rank, self.world, self.epoch = sizes, rank, world, 0

    def __iter__(self):
        g = torch.Generator().manual_seed(self.rank)
        for size in self.sizes[self.rank :: self.world]:
            extra = args.grow * self.epoch if self.rank % 2 else 0
            for _ in range(size + extra):
                yield torch.randn(8, generator=g), torch.randint(0, 2, (), generator=g)


def make_loader(data: IterableDataset) -> DataLoader:
    return DataLoader(data, batch_size=4)


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = 0
    if args.snapshot and os.path.exists(args.snapshot):
        snapshot = torch.load(args.snapshot)
        model.module.load_state_dict(snapshot["model"])
        first = snapshot["epoch"] + 1
        print(f"rank {rank}: resumed from {args.snapshot} at epoch {first}", flush=True)
    sizes = [int(s) for s in args.shards.split(",")]
    train, held_out = Shards(sizes, rank, world), Shards([8] * world, rank, world)
    loader, eval_loader = (make_loader(d) for d in (train, held_out))
    for epoch in range(first, args.epochs):
        train.epoch = epoch
        steps = 0
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
        print(f"rank {rank}: epoch {epoch}: {steps} steps", flush=True)
        if args.eval:
            with torch.no_grad():
                total = sum(float(F.cross_entropy(model.module(x), y)) for x, y in eval_loader)
            print(f"rank {rank}: epoch {epoch}: eval {total:.3f}", flush=True)
        if rank == 0 and args.snapshot:
            torch.save({"model": model.module.state_dict(), "epoch": epoch}, args.snapshot)
        if rank == 0 and args.log_file:
            with open(args.log_file, "a") as f:
                f.write(f"epoch {epoch} done\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
