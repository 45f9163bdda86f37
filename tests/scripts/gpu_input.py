"""Where a GPU job's step time goes, from the script's own clocks: a model on `cuda:LOCAL_RANK` (modulo the GPUs
there) wrapped in DDP (`device_ids`) or sharded with FSDP2, fed by a DataLoader, logging `loss.item()` after every
optimizer step (which makes the host wait for the GPU there). For the GPU-only tests (tests/timing/test_check_gpu_steps.py).

--api ddp | fsdp2
--loader slow: a dataset that decodes each sample in about 5 ms, no worker process, a small model: the GPU waits for
    every batch.
--loader fast: batches already in memory, a model of 12 4096-wide layers: the GPU is busy, and the host's wait
    between steps is its wait for the GPU in `loss.item()`.
--backend nccl | gloo

Prints rank 0's medians over the steps after the first: the host's time from `optimizer.step()` returning to the
next forward (what a host clock calls the wait for data), the time in the loader's `__next__` alone, and the GPU's
step and its idle time before each forward (CUDA events).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class SlowDecode(Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(0.005)  # decoding an image, say
        return torch.full((16,), float(i % 7)), i % 2


class InMemory(Dataset):
    def __init__(self) -> None:
        self.x = torch.randn(65536, 16, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], i % 2


def build(slow: bool) -> nn.Module:
    if slow:
        return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))
    layers: list[nn.Module] = [nn.Linear(16, 4096), nn.ReLU()]
    for _ in range(12):
        layers += [nn.Linear(4096, 4096), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(4096, 2))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", default="ddp", choices=("ddp", "fsdp2"))
    parser.add_argument("--loader", default="slow", choices=("slow", "fast"))
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    torch.manual_seed(0)
    slow = args.loader == "slow"
    data = SlowDecode() if slow else InMemory()
    loader = DataLoader(data, batch_size=8 if slow else 1024, sampler=DistributedSampler(data))
    model = build(slow).to(device)
    if args.api == "ddp":
        model = DDP(model, device_ids=[device.index])
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    host_waits, fetches, gpu_steps, gpu_idle = [], [], [], []
    ended, ended_event = None, None
    it = iter(loader)
    for _step in range(args.steps):
        t0 = time.perf_counter()
        x, y = next(it)
        fetched = time.perf_counter() - t0
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        if ended is not None:
            host_waits.append(time.perf_counter() - ended)
            fetches.append(fetched)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ended = time.perf_counter()
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        loss.item()  # logging: the host waits here for the GPU to finish the step
        if ended_event is not None:
            gpu_steps.append(ended_event.elapsed_time(end))
            gpu_idle.append(ended_event.elapsed_time(start))
        ended_event = end
    if dist.get_rank() == 0:
        med = statistics.median
        print(
            f"rank 0 ({args.api}, {args.loader}): host wait between steps {med(host_waits) * 1e3:.1f} ms, "
            f"loader __next__ {med(fetches) * 1e3:.1f} ms, GPU step {med(gpu_steps):.1f} ms, GPU idle before the "
            f"forward {med(gpu_idle):.1f} ms",
            flush=True,
        )
    dist.destroy_process_group()
