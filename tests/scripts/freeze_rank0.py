"""Rank 0 freezes the first layer before wrapping, from a rank-local decision: DDP's constructor refuses the model,
whose trainable parameters differ by rank."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
if rank == 0:
    model[0].requires_grad_(False)  # a freeze decided on rank 0 alone
model = DistributedDataParallel(model)
opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
for _ in range(4):
    opt.zero_grad()
    F.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
    opt.step()
dist.destroy_process_group()
