"""An FSDP2 (`fully_shard`) loop over a DataLoader with epoch ends: what `check` follows after its observed steps.

At each epoch end, every rank evaluates on its part of a validation loader and the model is saved with
torch.distributed.checkpoint on every rank, unless:
--eval-rank0        rank 0 alone evaluates (its forwards all-gather the sharded parameters on rank 0 only)
--gather-rank0      rank 0 alone gathers a full state dict (get_model_state_dict(full_state_dict=True)) to save it
--save-rank0        rank 0 alone saves torch.save(model.state_dict()) (its own shards only)
--no-set-epoch      the shuffling DistributedSampler never gets set_epoch
--no-eval           no evaluation at the epoch end
--cuda              NCCL and cuda:LOCAL_RANK (one rank per GPU) instead of gloo on the CPU
--uneven            no DistributedSampler: each rank reads its own slice, rank 0's 8 batches longer
--next-loop         the loop counts len(loader) steps and takes each batch with next() on the loader's iterator
                    (in a generator expression: its StopIteration reaches the loop as RuntimeError)
--samples-rank0 S   at each epoch end rank 0 alone writes samples: 400 batches of a loader, S seconds each, no
                    sharded model in it (the others go on to the checkpoint's collectives and wait there)
--pg-timeout T      the process group's timeout in seconds (torch's default otherwise)
"""

from __future__ import annotations

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--out", default=".")
p.add_argument("--eval-rank0", action="store_true")
p.add_argument("--gather-rank0", action="store_true")
p.add_argument("--save-rank0", action="store_true")
p.add_argument("--no-set-epoch", action="store_true")
p.add_argument("--no-eval", action="store_true")
p.add_argument("--cuda", action="store_true")
p.add_argument("--uneven", action="store_true")
p.add_argument("--next-loop", action="store_true")
p.add_argument("--samples-rank0", type=float, default=0.0)
p.add_argument("--pg-timeout", type=float, default=None)
args = p.parse_args()


def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> float:
    total = 0.0
    with torch.no_grad():
        for x, y in loader:
            total += float(F.cross_entropy(model(x.to(device)), y.to(device)))
    return total


def save(model: nn.Module, rank: int, epoch: int) -> None:
    if args.save_rank0:
        if rank == 0:
            torch.save(model.state_dict(), os.path.join(args.out, f"model-{epoch}.pt"))
        return
    if args.gather_rank0:
        if rank == 0:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            torch.save(full, os.path.join(args.out, f"model-{epoch}.pt"))
        return
    import torch.distributed.checkpoint as dcp

    dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(args.out, f"dcp-{epoch}"))


if __name__ == "__main__":
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if args.cuda else torch.device("cpu")
    if args.cuda:
        torch.cuda.set_device(device)
    timeout = {"timeout": datetime.timedelta(seconds=args.pg_timeout)} if args.pg_timeout else {}
    dist.init_process_group("nccl" if args.cuda else "gloo", **timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g))
    held_out = TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g))
    if args.uneven:  # rank 0 reads 64 more samples: 8 more batches of 8
        share = (256 - 64) // world
        start = rank * share + (0 if rank == 0 else 64)
        train = DataLoader(Subset(data, range(start, start + share + (64 if rank == 0 else 0))), batch_size=8)
    else:
        train = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, shuffle=True))
    val = DataLoader(held_out, batch_size=8, sampler=DistributedSampler(held_out, shuffle=False))
    samples = DataLoader(TensorDataset(torch.zeros(400, 1)), batch_size=1)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)).to(device)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for epoch in range(args.epochs):
        if not args.no_set_epoch and not args.uneven:
            train.sampler.set_epoch(epoch)
        it = iter(train)
        for x, y in (next(it) for _ in range(len(train))) if args.next_loop else train:
            F.cross_entropy(model(x.to(device)), y.to(device)).backward()
            opt.step()
            opt.zero_grad()
        if not args.no_eval and (not args.eval_rank0 or rank == 0):
            loss = evaluate(model, val, device)
            print(f"rank {rank} epoch {epoch}: validation loss {loss:.4f}", flush=True)
        if args.samples_rank0 and rank == 0:
            for _ in samples:
                time.sleep(args.samples_rank0)  # drawing a sample grid, say
        save(model, rank, epoch)
    print(f"rank {rank}: done", flush=True)
    dist.destroy_process_group()
