"""Distillation with FSDP2: a frozen teacher (4 blocks) and a student (2 blocks), both sharded; the optimizer steps
the student only. The teacher has more sharded modules: the check must follow the model the optimizer trains."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

dist.init_process_group("gloo")
torch.manual_seed(0)


def net(depth: int) -> nn.Sequential:
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(depth)], nn.Linear(16, 4))


teacher, student = net(4), net(2)
for m in (teacher, student):
    for block in list(m)[:-1]:
        fully_shard(block)
    fully_shard(m)
teacher.requires_grad_(False)
opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(dist.get_rank())
for _ in range(12):
    x = torch.randn(8, 16, generator=g)
    with torch.no_grad():
        target = teacher(x).softmax(-1)
    F.cross_entropy(student(x), target).backward()
    opt.step()
    opt.zero_grad()
w = student[-1].weight.detach().full_tensor()
print(f"rank {dist.get_rank()}: student head sum {float(w.sum()):.6f}")
dist.destroy_process_group()
