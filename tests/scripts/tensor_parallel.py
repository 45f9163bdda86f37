"""A two-layer MLP split across the ranks by tensor parallelism (`parallelize_module`: the first Linear column-wise,
the second row-wise), no DDP and no FSDP: every parameter is a DTensor, and every rank feeds the same batch."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

if __name__ == "__main__":
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)  # the same batches on every rank, as tensor parallelism needs
    for _ in range(12):
        model(torch.randn(8, 16, generator=generator)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    bias = model[2].bias.detach().full_tensor()
    print(f"rank {dist.get_rank()}: head bias sum {float(bias.sum()):.6f}")
    dist.destroy_process_group()
