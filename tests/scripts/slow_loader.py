"""A map-style dataset that decodes each sample in about 5 ms, read by a DataLoader with `--workers N` workers
(default 0): with none, every step waits for its batch (`input-bound`); with enough, it does not."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class SlowDecode(Dataset):
    def __len__(self) -> int:
        return 1024

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(0.005)  # decoding an image, say
        return torch.full((8,), float(i % 7)), i % 2


if __name__ == "__main__":
    workers = int(sys.argv[sys.argv.index("--workers") + 1]) if "--workers" in sys.argv else 0
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
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader.sampler.set_epoch(0)
    for x, y in loader:
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
