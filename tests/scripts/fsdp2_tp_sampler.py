"""FSDP2 over tensor parallelism on a [2, 2] mesh ("dp", "tp"), 4 ranks: the training loader's DistributedSampler
is built with the data-parallel rank and degree (torchtitan's way: the two ranks of a tensor-parallel pair read the
same batches), not the world's. Clean. With `--sampler world` it is built from the world's rank and size instead:
the two ranks of each tensor-parallel pair read different batches."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

if __name__ == "__main__":
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=dp)
    data = TensorDataset(torch.randn(512, 16), torch.randint(0, 4, (512,)))
    if "--sampler" in sys.argv and sys.argv[sys.argv.index("--sampler") + 1] == "world":
        sampler = DistributedSampler(data, seed=0)  # the world's rank and size: each rank its own batches
    else:
        sampler = DistributedSampler(data, num_replicas=dp.size(), rank=dp.get_local_rank(), seed=0)
    loader = DataLoader(data, batch_size=16, sampler=sampler)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    del model, opt
    dist.destroy_process_group()
