"""An FSDP2 job (or, with `--replicate`, the FSDP2-based `replicate`) where rank 1 runs an expensive augmentation
of each batch that the other ranks skip (`--same-work`: no rank does): every other rank waits for it in the sharded
model's collectives. Prints each rank's median step, its median time from the forward's start to the backward's
end, and the median time of its augmentation, measured by the script itself."""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard


def augment(x: torch.Tensor) -> torch.Tensor:
    """About 30-60 ms of matrix products on one core."""
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    for _ in range(60):
        a = torch.tanh(a @ a)
    return x + a[: x.shape[0], : x.shape[1]] * 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    if "--replicate" in sys.argv:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        replicate(model)
    else:
        for block in (model[0], model[2]):
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    steps, passes, extras, last = [], [], [], time.perf_counter()
    for step in range(30):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 2, (8,), generator=g)
        began = time.perf_counter()
        if rank == 1 and "--same-work" not in sys.argv:
            x = augment(x)
        forward = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        backward = time.perf_counter()
        opt.step()
        opt.zero_grad()
        now = time.perf_counter()
        if step:
            steps.append(now - last)
            passes.append(backward - forward)
            extras.append(forward - began)
        last = now
    ms = [statistics.median(v) * 1e3 for v in (steps, passes, extras)]
    print(f"rank {rank}: median step {ms[0]:.1f} ms, forward+backward {ms[1]:.1f} ms, augmentation {ms[2]:.1f} ms")
    dist.destroy_process_group()
