"""FSDP2 as HSDP (hybrid sharding): a 2-D device mesh, each block sharded over the "shard" dimension and replicated
over "replicate", as torchtitan builds it for data parallelism across nodes. 4 ranks: a [2, 2] mesh.

--mistake none           every block and the root sharded over the mesh
--mistake root-unsharded the root (its head) left out: nothing syncs the head's gradients
--mistake same-data      every rank draws its batches from the same seed
--mistake seed-rank      the model built after torch.manual_seed(rank): each rank starts from its own weights
--mistake all-reduce-off set_requires_all_reduce(False) on the root and every block (HSDP's switch for accumulating
                         across the replicas), never switched back on: the shards' gradients are reduce-scattered
                         within each replica and never all-reduced across the replicas
--drift-at N             rank 1 alone adds 0.01 to its shard of the first layer's bias after step N (its replica,
                         rank 3, holds the same shard): a long job watched past its first steps
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

p = argparse.ArgumentParser()
p.add_argument("--mistake", default="none")
p.add_argument("--steps", type=int, default=10)
p.add_argument("--drift-at", type=int, default=-1)
args = p.parse_args()

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(rank if args.mistake == "seed-rank" else 0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    if args.mistake != "root-unsharded":
        fully_shard(model, mesh=mesh)
    if args.mistake == "all-reduce-off":
        for m in (model[0], model[2], model):
            m.set_requires_all_reduce(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0 if args.mistake == "same-data" else rank)
    for step in range(args.steps):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step == args.drift_at and rank == 1:
            with torch.no_grad():
                model[0].bias.to_local().add_(0.01)
    head = model[4].weight
    print(f"rank {rank}: head sum {float(head.full_tensor().sum() if hasattr(head, 'full_tensor') else head.sum()):.6f}")
    print(f"rank {rank}: its shard of the first bias sums {float(model[0].bias.to_local().sum()):.6f}")
    dist.destroy_process_group()
