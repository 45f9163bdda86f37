"""Ranks with different numbers of batches: each rank reads its own shard of a file list with a plain sampler.

Rank 0's shard has 13 batches, rank 1's has 12. At the end of the first epoch rank 1 stops calling DDP's all-reduce
while rank 0 waits in it: the job hangs (or crashes) there. `ddp-doctor check` names it from the first steps.
Fix: DistributedSampler (equal shares), drop_last, or torch.distributed.algorithms.Join.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    samples = 100
    mine = list(range(rank, samples, world))[: 52 - 4 * rank]     # hand-made shards of unequal size
    data = TensorDataset(torch.randn(samples, 8)[mine], torch.randint(0, 2, (samples,))[mine])
    loader = DataLoader(data, batch_size=4, shuffle=True)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _epoch in range(2):
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    dist.destroy_process_group()
