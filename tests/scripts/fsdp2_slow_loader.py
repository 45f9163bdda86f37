"""An FSDP2 job fed by a slow DataLoader: a map-style dataset that decodes each sample in about 10 ms, read with
`--workers N` workers (default 0): with none, every step waits for its batch (`input-bound`); with enough, it does
not. Prints each rank's median wait for the next batch and median step, measured by the script itself."""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class SlowDecode(Dataset):
    def __len__(self) -> int:
        return 1024

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(0.010)  # decoding an image, say
        return torch.full((8,), float(i % 7)), i % 2


if __name__ == "__main__":
    workers = int(sys.argv[sys.argv.index("--workers") + 1]) if "--workers" in sys.argv else 0
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 24
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    data = SlowDecode()
    loader = DataLoader(
        data,
        batch_size=8,
        sampler=DistributedSampler(data),
        num_workers=workers,
        prefetch_factor=4 if workers else None,
    )
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    fully_shard(model[0])
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader.sampler.set_epoch(0)
    waits, times, last = [], [], time.perf_counter()
    for step, (x, y) in enumerate(loader):
        got = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        now = time.perf_counter()
        if step:
            waits.append(got - last)
            times.append(now - last)
        last = now
        if step + 1 == steps:
            break
    wait, step_s = statistics.median(waits) * 1e3, statistics.median(times) * 1e3
    print(f"rank {dist.get_rank()}: median wait {wait:.1f} ms of a median step {step_s:.1f} ms", flush=True)
    dist.destroy_process_group()
