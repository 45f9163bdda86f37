"""A plain DDP loop over a DataLoader with an epoch end: what `check` follows after its observed steps.

--save-every-rank: every rank saves the checkpoint to one file at each epoch end (no rank guard).
--eval-rank0 S: rank 0 alone evaluates 400 batches at S seconds each at each epoch end; the process group's timeout
is 20 s (--pg-timeout), so with S=0.1 the others time out in their next collective (the plain run dies at the start of epoch 2).
--eval-ddp: rank 0 alone evaluates a few batches through the DDP wrapper (eval mode, no_grad); with --bn the model
has BatchNorm, so that forward broadcasts rank 0's buffers on rank 0 alone.
--no-set-epoch: the shuffling DistributedSampler never gets set_epoch.
--peek: read the batch size from next(iter(loader)) before set_epoch, as PyTorch's DDP tutorial does.
--next-loop: a step-based loop that calls next() on the loader's iterator itself (StopIteration is not expected).
--iterable / --no-len / --workers N / --persistent / --recreate: the loader's kind (an iterable dataset, one without
len(), worker processes, kept between epochs, a loader created anew each epoch).
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--out", default=None)
p.add_argument("--save-every-rank", action="store_true")
p.add_argument("--eval-rank0", type=float, default=0.0)
p.add_argument("--iterable", action="store_true")
p.add_argument("--no-len", action="store_true")
p.add_argument("--workers", type=int, default=0)
p.add_argument("--persistent", action="store_true")
p.add_argument("--recreate", action="store_true")
p.add_argument("--eval-ddp", action="store_true")
p.add_argument("--bn", action="store_true")
p.add_argument("--no-set-epoch", action="store_true")
p.add_argument("--next-loop", action="store_true")
p.add_argument("--peek", action="store_true")
p.add_argument("--pg-timeout", type=float, default=20.0)
args = p.parse_args()


class Stream(IterableDataset):
    """This rank's share of 256 samples, streamed (with a length unless --no-len)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def __iter__(self):
        g = torch.Generator().manual_seed(self.rank)
        for _ in range(256 // self.world):
            yield torch.randn(8, generator=g), torch.randint(0, 2, (), generator=g)


class SizedStream(Stream):
    def __len__(self) -> int:
        return 256 // self.world


def make_loader(rank: int, world: int) -> DataLoader:
    if args.iterable or args.no_len:
        stream = Stream(rank, world) if args.no_len else SizedStream(rank, world)
        return DataLoader(stream, batch_size=4, num_workers=args.workers)
    data = TensorDataset(torch.randn(256, 8, generator=torch.Generator().manual_seed(0)), torch.randint(0, 2, (256,)))
    kwargs = {"num_workers": args.workers, "persistent_workers": args.persistent}
    return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=True), **kwargs)


def evaluate(model: nn.Module, loader: DataLoader) -> float:
    total = 0.0
    with torch.no_grad():
        for (x,) in loader:
            time.sleep(args.eval_rank0)
            total += float(model(x).sum())
    return total


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(16) if args.bn else nn.Identity()
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), norm, nn.Tanh(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    eval_loader = DataLoader(TensorDataset(torch.randn(1600, 8)), batch_size=4)
    loader = make_loader(rank, world)
    if args.next_loop:
        batches = iter(loader)
        for _ in range(len(loader)):
            x, y = next(batches)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    for epoch in range(0 if args.next_loop else args.epochs):
        if args.recreate and epoch:
            loader = make_loader(rank, world)
        if args.peek:
            print(f"epoch {epoch}: batch size {len(next(iter(loader))[0])}", flush=True)
        if isinstance(loader.sampler, DistributedSampler) and not args.no_set_epoch:
            loader.sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if args.eval_rank0 and rank == 0:
            print(f"epoch {epoch}: eval {evaluate(model.module, eval_loader):.3f}", flush=True)
        if args.eval_ddp and rank == 0:
            model.eval()
            print(f"epoch {epoch}: eval {evaluate(model, eval_loader):.3f}", flush=True)
            model.train()
        if args.save_every_rank:
            torch.save(model.state_dict(), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
